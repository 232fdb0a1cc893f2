"""Host side of the engine: start a worker process in a release environment and talk to it.

The worker (:mod:`vllm_repro.engine.worker`) runs with ``PYTHONPATH`` = the lab's package (alone,
through a folder holding only a link to it, so the lab's own dependencies never leak in) and the
release's extracted tree. vLLM's log goes to a file; replies come back over a pipe.

Each worker leads its own process group (a new session) and is registered with
:mod:`vllm_repro.procs`, which kills the whole group on SIGINT / SIGTERM; no worker starts once
an abort began.

Warm runs (docs/warm-runs.md): unless ``--cold`` / ``VLLM_REPRO_WARM=off``, the worker is forked
by the environment's warm parent (:mod:`vllm_repro.engine.warm_client`), which has imported the
release's third-party dependencies already; the worker then imports vLLM from the tree and runs
exactly as a cold one (same arguments, environment, limits, pipes, its own process group). Where
no parent can serve, one line says why and the worker starts cold.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

from .. import procs
from . import warm_client
from ..errors import EnvError, InputError
from ..limits import run_limits
from ..records import RecordError, RunResult
from ..settings import cache_dir
from ..sources.env import ReleaseEnv

PACKAGE_DIR = Path(__file__).resolve().parent.parent
#: what an import that ran out of the worker's address space says (RLIMIT_AS)
_MEMORY = re.compile(r"MemoryError|failed to map segment|[Cc]annot allocate memory|std::bad_alloc")
# a failed import that peaked this close to RLIMIT_AS (MB) may be the limit's doing: the next
# mapping (a shared library of torch's: hundreds of MB) is what failed
_IMPORT_HEADROOM_MB = 2048
MODELS_DIR = PACKAGE_DIR / "models"
DEFAULT_MODEL = MODELS_DIR / "opt"


def lab_path() -> Path:
    """A folder whose only entry is a link named ``vllm_repro`` to this package."""
    key = hashlib.sha256(str(PACKAGE_DIR).encode()).hexdigest()[:12]
    d = cache_dir() / "labpath" / key
    link = d / "vllm_repro"
    if not (link.is_symlink() and link.resolve() == PACKAGE_DIR):
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".vllm_repro.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(PACKAGE_DIR, target_is_directory=True)
        os.replace(tmp, link)
    return d


def child_environment(env: ReleaseEnv, extra_path: tuple[str, ...] = (),
                      extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables for a worker: CPU platform, V1 engine, no hub, no usage stats.

    ``extra_path`` goes on ``PYTHONPATH`` before the lab and the tree (the slicer's tracer and
    pytest overlay); ``extra_env`` is applied last.
    """
    child = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYTHON", "VIRTUAL_ENV", "VLLM_"))}
    child.update({
        # an installed vLLM (no tree) is found by the interpreter itself
        "PYTHONPATH": os.pathsep.join([*extra_path, str(lab_path())]
                                      + ([str(env.tree)] if env.tree else [])),
        "PYTHONNOUSERSITE": "1",
        "PYTHONUNBUFFERED": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_USE_V1": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # one per environment: vLLM's model-info cache (modelinfos/<module>-<class>.json) is
        # named without the release, so a shared root lets one release overwrite another's
        # entries, and lets a slice lean on what its full tree cached
        "VLLM_CACHE_ROOT": str(cache_dir() / "vllm-cache" / (env.root.name if env.root else env.version)),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        # torch.compile decorators run at import in some releases; the scheduler never compiles,
        # and without triton (not installed) inductor's import would fail on torch 2.13
        "TORCHDYNAMO_DISABLE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # the packaged OPT config.json (2048 positions) only stands in for the real model: a
        # scenario's max_model_len (32k contexts from real crash logs) must be accepted as given
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
    })
    for k in ("VLLM_LOGGING_LEVEL", "VLLM_REPRO_WORKER_STATE"):
        if k in os.environ:
            child[k] = os.environ[k]
    child.update(extra_env or {})
    return child


class WorkerHandle:
    """The host's handle on one engine worker process (``engine/worker.py`` runs inside it) for
    one release. Use as a context manager.

    ``hello`` holds the worker's greeting (release, import time in seconds). Raises
    :class:`EnvError` if vLLM cannot be imported in the environment (the log names the cause).
    """

    def __init__(self, env: ReleaseEnv, log_path: Path, model_dir: Path = DEFAULT_MODEL,
                 extra_path: tuple[str, ...] = (), extra_env: dict[str, str] | None = None,
                 warm: bool | None = None, platform: str | None = None):
        """``warm``: fork from the environment's warm parent (default: ``VLLM_REPRO_WARM``;
        never with ``extra_path`` / ``extra_env``, which the slicer's tracer uses: a trace of
        imports needs a cold start). ``platform``: the platform the worker presents to vLLM
        (a ``Platform.key()`` JSON, ``VLLM_REPRO_PLATFORM``; none: the default, CUDA), a
        variable of the worker only: a warm parent never imports vLLM, so one serves all."""
        self.env = env
        self.platform = platform
        self.warm = (warm if warm is not None else warm_client.enabled()) and not extra_path \
            and not extra_env
        self.extra_path = extra_path
        self.extra_env = extra_env
        self.log_path = log_path
        self.model_dir = model_dir
        self.proc: subprocess.Popen | warm_client.WarmProc | None = None
        self.hello: dict = {}
        self.warm_started = False  # whether this worker was forked by a warm parent
        #: seconds this worker's start spent starting that parent (None: one was serving)
        self.parent_start_s: float | None = None

    def __enter__(self) -> "WorkerHandle":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if procs.aborting():
            raise EnvError(f"not starting the vLLM {self.env.version} worker: the run is being aborted")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        r, w = os.pipe()
        # appended, not truncated: an earlier run's result.json may point at its crash dump
        from ..inputs import open_append

        self._log = open_append(self.log_path, "worker's log")
        self._log.write(f"==== vllm-repro: a worker for vLLM {self.env.version} starts, "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
        self._log.flush()
        if not (self.warm and self._start_warm(r, w)):
            self._start_cold(r, w)
        self.hello = self._read("starting vLLM")
        if not self.hello.get("ok"):
            self.close()
            error = str(self.hello.get("error"))
            mb = run_limits().worker_memory_mb
            if (self.hello.get("limit_below_mapped")
                    or _MEMORY.search(error + str(self.hello.get("traceback", "")))
                    or self._limit_was_why(mb)):
                # the worker's address-space limit is below what importing vLLM maps
                raise InputError(f"vLLM {self.env.version}: out of memory while importing vLLM "
                                 f"(limit {mb} MB, VLLM_REPRO_WORKER_MEMORY_MB): raise "
                                 f"VLLM_REPRO_WORKER_MEMORY_MB, or unset it ({error[:160]})")
            raise EnvError(f"vLLM {self.env.version}: {error} (log: {self.log_path})")
        from .capabilities import save

        if self.env.tree is None or cache_dir() in self.env.tree.resolve().parents:
            # (a tree outside the cache, a test's edited copy, is not the release's record)
            save(cache_dir(), self.capabilities)

    def _limit_was_why(self, mb: int) -> bool:
        """Whether the worker's failed import was its address-space limit (``mb`` MB) although
        the error does not say so: under ``RLIMIT_AS`` a C extension's failed allocation may
        surface as anything (seen in CI: ``SystemError: error return without exception set``
        at 300 MB). Asked only where the worker's peak address space (``vm_peak_mb`` of its
        hello) came within :data:`_IMPORT_HEADROOM_MB` of the limit, and answered by importing
        once more without a limit (seconds): ``True`` only when that one succeeds."""
        peak = self.hello.get("vm_peak_mb")
        if not isinstance(peak, int) or mb - peak >= _IMPORT_HEADROOM_MB:
            return False
        r, w = os.pipe()
        try:
            proc = subprocess.Popen(
                self._cold_command(w, memory_limit_mb=0), stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(w,), env={k: v for k, v in self._environment().items()
                                    if k != warm_client.MODULES_OUT},
                text=True, cwd=self._cwd(), start_new_session=True)
        except OSError:
            os.close(r)
            os.close(w)
            return False
        procs.register(proc)
        os.close(w)
        try:
            with os.fdopen(r, "r") as replies:
                line = replies.readline()
        finally:
            procs.kill_group(proc)
            proc.wait()
            procs.unregister(proc)
        try:
            return bool(json.loads(line).get("ok")) if line else False
        except ValueError:
            return False

    def _argv(self, memory_limit_mb: int | None = None) -> list[str]:
        """The worker's arguments, ``--reply-fd`` aside; ``memory_limit_mb``: its address-space
        limit (default: ``VLLM_REPRO_WORKER_MEMORY_MB``'s; 0: none)."""
        mb = run_limits().worker_memory_mb if memory_limit_mb is None else memory_limit_mb
        return ["--model-dir", str(self.model_dir), "--memory-limit-mb", str(mb)]

    def _cold_command(self, reply_fd: int, memory_limit_mb: int | None = None) -> list[str]:
        """The command line of a cold worker replying on ``reply_fd``, in the order it always had
        (``--model-dir``, ``--reply-fd``, ``--memory-limit-mb``: a stand-in worker may read them
        by position, as tests/unit/test_signals.py's does)."""
        argv = self._argv(memory_limit_mb)
        return [str(self.env.python), "-m", "vllm_repro.engine.worker", *argv[:2],
                "--reply-fd", str(reply_fd), *argv[2:]]

    def _cwd(self) -> str:
        return str(self.env.tree or self.log_path.parent)

    def _start_cold(self, r: int, w: int) -> None:
        try:
            self.proc = subprocess.Popen(
                self._cold_command(w), stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                pass_fds=(w,), env=self._environment(), text=True, cwd=self._cwd(),
                start_new_session=True)  # its own process group: procs kills it whole
        except OSError as exc:
            os.close(r)
            os.close(w)
            raise EnvError(f"cannot start the worker for vLLM {self.env.version}: {exc}") from exc
        procs.register(self.proc)
        os.close(w)
        self._replies = os.fdopen(r, "r")

    def _start_warm(self, r: int, w: int) -> bool:
        """Have the warm parent fork the worker (stdin, log and reply pipe handed over);
        ``False`` after a one-line note where none can serve (``r`` / ``w`` stay open for a
        cold start)."""
        stdin_r, stdin_w = os.pipe()
        python = self.env.python
        try:
            proc = warm_client.spawn(
                python, self.env.root, self._argv(), self._environment(),
                self._parent_environment(), self._cwd(), (stdin_r, self._log.fileno(), w),
                stdin=None, mode=self.env.tree_kind)
        except (warm_client.WarmUnavailable, OSError) as exc:  # OSError: its folder or socket
            os.close(stdin_r)
            os.close(stdin_w)
            if isinstance(exc, warm_client.WarmAborted):  # SIGINT/SIGTERM: no cold start either
                os.close(r)
                os.close(w)
                self._log.close()
                raise EnvError(f"not starting the vLLM {self.env.version} worker: the run is "
                               "being aborted") from None
            warm_client.note(f"{python}:{exc}",
                             f"vLLM {self.env.version}: no warm start ({exc}); starting cold")
            return False
        os.close(stdin_r)
        proc.stdin = os.fdopen(stdin_w, "w")
        self.proc = proc
        procs.register(proc)  # killed at once if an abort began while the parent forked it
        os.close(w)
        self._reply_fd = r
        self.warm_started = True
        self.parent_start_s = proc.parent_start_s
        return True

    def _parent_environment(self) -> dict[str, str]:
        """The warm parent's variables: the worker's, with the lab on ``PYTHONPATH`` (and, for a
        slice, its tree, for the stubs; the tree is otherwise each run's: the parent never
        imports vLLM, and refuses to serve when a preloaded module did)."""
        env = {**child_environment(self.env), "PYTHONHASHSEED": "0"}
        env["PYTHONPATH"] = str(lab_path())
        tree = self.env.tree
        if self.env.tree_kind == "slice":
            # a slice environment lacks the packages its tree stubs (yaml, openai...): preloaded
            # without the stubs, huggingface_hub is left half imported ("cannot import name
            # 'logging'" in every child); every tree of a slice environment has the same stubs
            env["PYTHONPATH"] += os.pathsep + str(tree)
        return env

    @property
    def import_time(self) -> str:
        """How long the worker took to import vLLM's scheduler path, for people: ``"10.7 s"``
        (the hello's ``import_s``, seconds, rounded to a tenth), ``"?"`` before it started."""
        secs = self.hello.get("import_s")
        return f"{secs:.1f} s" if isinstance(secs, (int, float)) else "?"

    @property
    def capabilities(self):
        """The release's :class:`~vllm_repro.engine.capabilities.Capabilities`, as the worker
        probed it at start-up. Raises :class:`EnvError` before the worker has started."""
        from .capabilities import Capabilities

        raw = self.hello.get("capabilities")
        if not raw:
            raise EnvError(f"vLLM {self.env.version}: the worker sent no capabilities record")
        return Capabilities.from_dict(raw)

    def _environment(self) -> dict[str, str]:
        """:func:`child_environment` plus one string-hash seed for every run: with prefix
        caching, which cached blocks vLLM evicts (and so the prefix-cache contents) otherwise
        varies between two runs of one scenario (seen on 0.10.1.1), although what it schedules
        does not. Only the engine worker gets it: vLLM's own tests check the random seeding.
        With warm runs on, the first worker of an environment records what it imported for
        the warm parent (:data:`~vllm_repro.engine.warm_client.MODULES_OUT`)."""
        env = {**child_environment(self.env, self.extra_path, self.extra_env),
               "PYTHONHASHSEED": "0"}
        if self.platform:
            env["VLLM_REPRO_PLATFORM"] = self.platform
        if self.warm:
            try:
                mods = warm_client.modules_file(self.env.python, self.env.root)
            except warm_client.WarmUnavailable:
                mods = None  # spawn says why, once, and the run starts cold
            if mods is not None and not mods.exists():
                env[warm_client.MODULES_OUT] = str(mods)
        return env

    def _readline(self) -> str:
        if self.warm_started:
            return self.proc.readline(self._reply_fd).decode(errors="replace")
        return self._replies.readline()

    def _read(self, what: str) -> dict:
        line = self._readline()
        if not line:
            code = self.proc.wait() if self.proc else None
            tail = _tail(self.log_path)
            lost = getattr(self.proc, "lost", None)
            if lost:  # the warm parent was killed mid-run: the worker went with it
                said = [ln for ln in _tail(self.proc.parent_log, 2).split(" | ")
                        if ln and not ln.startswith("====")]
                raise EnvError(f"the vLLM {self.env.version} worker died while {what}: {lost}"
                               f"{' (' + ' | '.join(said) + ')' if said else ''}; the next run "
                               f"starts a new one (log: {self.log_path})")
            raise EnvError(f"the vLLM {self.env.version} worker died while {what} (exit {code}): "
                           f"{tail} (log: {self.log_path})")
        return json.loads(line)

    def run(self, scenario: dict, out_dir: Path | None, audit: bool = True,
            keep_going: bool = False, *, plant: str | None = None,
            plant_args: dict | None = None) -> RunResult:
        """Run one scenario payload; returns the worker's :class:`~vllm_repro.records.RunResult`
        (the worker writes ``trace.jsonl`` into ``out_dir``; ``result.json`` is the caller's,
        through :class:`~vllm_repro.records.ReportDir`). Raises :class:`EnvError` when the
        worker is gone or dies, and when its reply is not a result.

        ``plant`` (tests only): ``/abs/path/plant_*.py:function`` that patches a fault into the
        release for this run (:mod:`vllm_repro.audit.plant`); the result is marked ``planted``.
        """
        assert self.proc and self.proc.stdin
        options = {"audit": audit, "keep_going": keep_going, "limits": run_limits().as_dict()}
        if plant:
            options.update(plant=plant, plant_args=plant_args or {})
        job = {"id": scenario["name"], "scenario": scenario,
               "out_dir": str(out_dir) if out_dir else None, "options": options}
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise EnvError(f"the vLLM {self.env.version} worker is gone (log: {self.log_path})") from exc
        reply = self._read(f"running {scenario['name']}")
        try:
            return RunResult.from_dict(reply.get("result"))
        except RecordError as exc:
            raise EnvError(f"the vLLM {self.env.version} worker sent a malformed result for "
                           f"{scenario['name']}: {exc} (log: {self.log_path})") from exc

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
            self.proc.kill()
            self.proc.wait()
        finally:
            procs.kill_group(self.proc)  # helpers the worker left behind in its group
            procs.unregister(self.proc)
            if self.warm_started:
                self.proc.close()
                os.close(self._reply_fd)
                self.warm_started = False
            self.proc = None
            self._log.close()


#: the name before issue 43 (kept for branches written against it; use WorkerHandle)
Worker = WorkerHandle


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-600:]

