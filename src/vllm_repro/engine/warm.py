"""The warm parent: a process in one release environment that has imported the release's
third-party dependencies (torch, transformers, fastapi, openai, pydantic, ...; never vLLM, never
the lab's vLLM-importing modules) and forks one engine worker per run (docs/warm-runs.md).

Each forked child imports vLLM from the run's tree, so an edited or patched tree takes effect
on the next run, and then runs :mod:`vllm_repro.engine.worker` exactly as a cold
``python -m vllm_repro.engine.worker`` would (``runpy``, same arguments, same environment).

Run as ``python -m vllm_repro.engine.warm --dir DIR --idle SECONDS --modules FILE`` by the host
(:mod:`vllm_repro.engine.warm_client`), with the worker's environment but only the lab (and a
slice's tree) on ``PYTHONPATH``. A child's ``sys.path`` is the run's folder and ``PYTHONPATH``,
then the interpreter's own path as a process with no ``PYTHONPATH`` has it (asked once at
start: :func:`interpreter_path`; :func:`child_sys_path`). ``DIR`` is this parent's folder under
the cache: ``sock`` (a unix socket), ``parent.json`` (pid, python, the interpreter's own path,
the lab package's folder), ``parent.log`` (its stderr). ``FILE`` is the list of modules
to import (a JSON list of names, written by a worker; absent: :data:`DEFAULT_MODULES`); a list
that appears later is imported on the next idle tick.

Protocol, one JSON object a line on a stream connection to ``sock``:

- ``{"op": "run", "argv": [...], "env": {...}, "cwd": path}`` with three file descriptors
  attached (``SCM_RIGHTS``): the worker's stdin, its log (stdout and stderr), its reply pipe.
  (``"module"``, tests only: run that module instead of the worker.) Answer ``{"pid": N}``
  (the child, leader of its own session), later ``{"exit": code}`` (its wait status as
  ``subprocess`` gives it: negative for a signal); or ``{"error": text}``.
- ``{"op": "ping"}``: ``{"pid": N, "modules": count}``.
- ``{"op": "exit"}``: exits when no child runs (``{"exiting": bool}``).

First line on stdout: ``{"ready": true, "pid": N, "modules": count, "import_s": s}``, or
``{"ready": false, "unsafe": reason}`` when forking is not safe here (a thread already started
by an imported module, no ``os.fork``), ``{"ready": false, "error": reason}`` when it cannot
start (the interpreter's own path cannot be told); stdout is the log after it. The parent exits after
``--idle`` seconds with no child and no request, and when its environment's python is gone.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

#: imported when no worker has recorded its environment's list yet (each one optional)
DEFAULT_MODULES = ("torch", "transformers", "transformers.configuration_utils",
                   "transformers.tokenization_utils_base", "fastapi", "openai", "pydantic",
                   "numpy", "msgspec", "zmq", "psutil", "prometheus_client", "cloudpickle",
                   "huggingface_hub", "tokenizers", "yaml", "aiohttp", "starlette", "regex",
                   "safetensors", "sentencepiece", "cbor2", "blake3", "gguf", "partial_json_parser",
                   "lark", "xgrammar", "outlines_core", "llguidance", "mistral_common", "tiktoken")
#: the top-level names a preloaded module may never have (vLLM and what imports it)
NEVER = frozenset({"vllm", "vllm_repro", "_vllm_slice", "sitecustomize", "usercustomize",
                   "__main__"})
#: how many descriptors a run request carries: stdin, log, reply pipe
RUN_FDS = 3
#: what a child runs (a request's ``module``, tests only, names another)
WORKER = "vllm_repro.engine.worker"
_MAX_MSG = 1 << 20


def thread_count() -> int:
    """Threads of this process: the OS's count (``/proc/self/task``) where there is one, else
    Python's (``threading.active_count``); a thread a native library started counts too."""
    try:
        return max(len(os.listdir("/proc/self/task")), threading.active_count())
    except OSError:
        return threading.active_count()


def fork_unsafe() -> str | None:
    """Why forking this process is not safe, or ``None``."""
    if not hasattr(os, "fork") or not hasattr(socket, "send_fds"):
        return f"this platform ({sys.platform}) has no os.fork / socket.send_fds"
    n = thread_count()
    if n > 1:
        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        return (f"{n} threads are running after the imports ({', '.join(names) or 'native'}): "
                "a fork would copy their locks mid-use")
    return None


def preload(names) -> tuple[int, list[str]]:
    """Import ``names`` (each optional; vLLM and the lab's own never). Returns how many are
    loaded and the ones that failed."""
    failed = []
    for name in names:
        if not isinstance(name, str) or name.split(".")[0] in NEVER:
            continue
        if name in sys.modules:
            continue
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - an optional module (SystemExit included)
            failed.append(name)
    return len(sys.modules), failed


def third_party_modules() -> list[str]:
    """The modules loaded here that live in this interpreter's own folders (its standard library
    and ``site-packages``), in import order, minus vLLM's and the lab's (:data:`NEVER`, any name
    starting ``vllm``): what a parent may import before it forks."""
    homes = tuple(os.path.join(os.path.realpath(p), "") for p in
                  {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
    out = []
    for name, mod in list(sys.modules.items()):
        top = name.split(".")[0]
        if top in NEVER or top.startswith("vllm"):
            continue
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and os.path.realpath(f).startswith(homes):
            out.append(name)
    return out


def record_modules(path: str) -> None:
    """Write :func:`third_party_modules` to ``path`` (atomically) unless it exists."""
    if not path or os.path.exists(path):
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(third_party_modules(), f)
        os.replace(tmp, path)
    except OSError:
        pass


def read_modules(path: str | None) -> list[str] | None:
    if not path:
        return None
    try:
        with open(path) as f:
            names = json.load(f)
    except (OSError, ValueError):
        return None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else None


def _send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.sendall((json.dumps(obj) + "\n").encode())
    except OSError:
        pass


def _recv_request(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """One request line and the descriptors that came with it (``None``: the peer closed)."""
    conn.settimeout(10)
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MSG, RUN_FDS)
        while data and not data.endswith(b"\n") and len(data) < _MAX_MSG:
            more = conn.recv(_MAX_MSG)
            if not more:
                break
            data += more
    except OSError:
        return None, []
    finally:
        try:
            conn.settimeout(None)
        except OSError:
            pass
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        return json.loads(data), fds
    except ValueError:
        for fd in fds:
            os.close(fd)
        return {"op": "?"}, []


def _hung_up(conn: socket.socket) -> bool:
    """Whether the client closed its end (EOF waiting after its request): it no longer waits."""
    try:
        ready, _, _ = select.select([conn], [], [], 0)
        return bool(ready) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _wait_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1


def _die_with_parent(parent: int) -> None:
    """SIGKILL this child when the parent dies (Linux ``PR_SET_PDEATHSIG``); elsewhere the host
    notices the parent's connection closing and kills the child's group itself."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # died between the fork and the prctl
        os._exit(3)


def interpreter_path() -> list[str]:
    """``sys.path`` of this interpreter started with no ``PYTHONPATH`` (``sys.path[0]`` left
    out): its standard library, ``site-packages`` and every entry a ``.pth`` file there adds.
    Asked of a new process of it (once per parent, a few hundredths of a second): an entry this
    process's ``PYTHONPATH`` also names (a release tree that an image's ``.pth`` names too) was
    skipped by ``site`` as a duplicate at start-up, so this process's own path cannot tell.
    Raises ``OSError`` / ``subprocess.SubprocessError`` / ``ValueError`` when it cannot say."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import json, sys; p = sys.path if getattr(sys.flags, 'safe_path', False) "
            "else sys.path[1:]; print(json.dumps(p))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120, check=True)
    path = json.loads(proc.stdout.strip().splitlines()[-1])
    if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
        raise ValueError(f"not a list of folders: {proc.stdout[:200]!r}")
    return path


def child_sys_path(cwd: str, pythonpath: str, parent_path: list[str], parent_pythonpath: str,
                   interpreter: list[str] | None = None) -> list[str]:
    """``sys.path`` of a cold ``python -m`` started in ``cwd`` with ``pythonpath``: the folder,
    the ``PYTHONPATH`` entries, then the interpreter's own (this parent's minus its folder and
    its ``PYTHONPATH``).

    ``interpreter`` (:func:`interpreter_path`): the interpreter's own path as a process with no
    ``PYTHONPATH`` has it. An entry of the parent's ``PYTHONPATH`` that is also on it (a ``.pth``
    names it too; ``site`` skipped that one as a duplicate) is not dropped but kept where the
    interpreter has it: a worker with another ``PYTHONPATH`` imports from it. Entries of the
    interpreter's own path that the run's ``PYTHONPATH`` names already are left out there, as
    ``site`` leaves them out of a cold worker's."""
    own = {p for p in parent_pythonpath.split(os.pathsep) if p}
    base = [p for p in parent_path[1:] if p not in own]
    if interpreter:
        # each entry of the interpreter's own path that base lacks goes in after the entry
        # before it there (where site put it), or first
        at = 0
        for entry in interpreter:
            if entry in base:
                at = base.index(entry) + 1
            else:
                base.insert(at, entry)
                at += 1
    front = [p for p in pythonpath.split(os.pathsep) if p]
    named = {os.path.abspath(p) for p in front}
    return [cwd, *front, *[p for p in base if os.path.abspath(p) not in named]]


def _run_child(req: dict, fds: list[int], owned: list[int], parent: int,
               interpreter: list[str] | None = None) -> None:
    """In the forked child: become the run's worker; never returns. ``interpreter``: the
    interpreter's own ``sys.path`` (:func:`interpreter_path`)."""
    code = 3
    try:
        os.setsid()  # its own session and process group: the host's procs kills it whole
        _die_with_parent(parent)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in owned:  # the listening socket, other clients' connections, the wake-up pipe
            try:
                os.close(fd)
            except OSError:
                pass
        stdin_fd, log_fd, reply_fd = fds
        os.dup2(stdin_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        for fd in (stdin_fd, log_fd):
            if fd > 2 and fd != reply_fd:
                os.close(fd)
        env = {str(k): str(v) for k, v in req["env"].items()}
        parent_pythonpath = os.environ.get("PYTHONPATH", "")
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = child_sys_path(os.getcwd(), env.get("PYTHONPATH", ""), list(sys.path),
                                     parent_pythonpath, interpreter)
        import importlib

        importlib.invalidate_caches()
        sys.modules.pop("sitecustomize", None)
        try:  # what the interpreter would have run at start-up from the tree (a slice's finder)
            import sitecustomize  # noqa: F401
        except ImportError:
            pass
        sys.argv = ["-m", *[str(a) for a in req["argv"]], "--reply-fd", str(reply_fd)]
        import runpy

        runpy.run_module(str(req.get("module") or WORKER), run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - reported in the run's log, exit 3
        traceback.print_exc()
        code = 3
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


class Parent:
    """The serving loop (one thread): accept, fork, reap, idle out."""

    def __init__(self, folder: str, idle_s: float, modules_file: str | None):
        self.folder = folder
        self.idle_s = idle_s
        self.modules_file = modules_file
        self.loaded_list = False
        self.children: dict[int, socket.socket] = {}
        #: children whose client went away (killed with their group, not yet reaped)
        self.abandoned: set[int] = set()
        self.conns: set[socket.socket] = set()
        self.last = time.monotonic()
        self.python = sys.executable
        #: this interpreter's own sys.path (no PYTHONPATH): what each child's path ends with
        self.interpreter: list[str] | None = None

    def start(self) -> dict:
        t0 = time.perf_counter()
        try:
            self.interpreter = interpreter_path()
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            # without it a child could lose an entry a .pth adds: no warm start at all
            return {"ready": False, "error": f"cannot tell this interpreter's own sys.path: "
                                             f"{type(exc).__name__}: {exc}"}
        names = read_modules(self.modules_file)
        self.loaded_list = names is not None
        try:  # a slice environment's parent sees its tree's stubs, as each child will
            import _vllm_slice  # noqa: F401
        except ImportError:
            pass
        count, _failed = preload(names if names is not None else DEFAULT_MODULES)
        unsafe = fork_unsafe()
        if unsafe:
            return {"ready": False, "unsafe": unsafe}
        vllm_loaded = sorted(n for n in sys.modules if n == "vllm" or n.startswith("vllm."))
        if vllm_loaded:  # a child must import vLLM from its own (perhaps patched) tree
            return {"ready": False, "unsafe": f"a preloaded module imported vLLM ({vllm_loaded[0]})"}
        self.sock_path = os.path.join(self.folder, "sock")
        tmp = os.path.join(self.folder, f".sock.{os.getpid()}")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        self.listener.bind(tmp)
        self.listener.listen(64)
        os.replace(tmp, self.sock_path)
        from .. import procs

        procs.make_subreaper()  # what a killed worker left behind comes here (_reap kills it)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        info = {"pid": os.getpid(), "python": self.python, "modules": count,
                "interpreter_path": self.interpreter,
                "lab": os.path.dirname(os.path.dirname(os.path.realpath(__file__))),
                "import_s": round(time.perf_counter() - t0, 3)}
        with open(os.path.join(self.folder, "parent.json"), "w") as f:
            json.dump(info, f)
        return {"ready": True, **info}

    def owned(self) -> list[int]:
        return [self.listener.fileno(), self.wake_r, self.wake_w, *(c.fileno() for c in self.conns),
                *(c.fileno() for c in self.children.values())]

    def serve(self) -> int:
        while True:
            busy = bool(self.children) or bool(self.conns)
            if busy:
                self.last = time.monotonic()
            elif time.monotonic() - self.last >= self.idle_s or not os.path.exists(self.python):
                if self._retire():
                    return 0
            timeout = 1.0 if busy else max(0.05, min(1.0, self.idle_s - (time.monotonic() - self.last)))
            # a running child's connection is watched too: its client going away (a CLI killed
            # with SIGKILL, which runs no handler) kills the child's whole process group
            watched = {c: pid for pid, c in self.children.items() if pid not in self.abandoned}
            rlist = [self.listener, self.wake_r, *self.conns, *watched]
            try:
                ready, _, _ = select.select(rlist, [], [], timeout)
            except InterruptedError:
                continue
            if not ready and not busy:
                self._learn()
            for r in ready:
                if r is self.listener:
                    try:
                        conn, _ = self.listener.accept()
                    except OSError:
                        continue
                    self.conns.add(conn)
                elif r == self.wake_r:
                    self._drain_wake()
                elif r in self.conns:
                    self._request(r)
                elif r in watched:
                    self._client_gone(watched[r], r)
            self._reap()

    def _client_gone(self, pid: int, conn: socket.socket) -> None:
        """``conn``, the client of running child ``pid``, became readable: a client sends
        nothing after its run request, so that is its end (EOF) or an error. The child (leader
        of its own session, with vLLM's engine core and rank processes in its group) is killed
        with its group; the reap that follows tells nobody."""
        try:
            gone = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return
        except OSError:
            gone = True
        if not gone:
            return
        self.abandoned.add(pid)
        print(f"vllm-repro warm parent: the client of worker {pid} went away; killing its "
              "process group", file=sys.stderr, flush=True)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except (BlockingIOError, OSError):
            pass

    def _reap(self) -> None:
        """Reap the workers that ended (telling each one's client its exit code), and kill
        every other child: a process a worker left behind (a helper started in its own
        session, or double-forked) is re-parented to this parent, a child subreaper, when the
        worker was killed before its own sweep."""
        from .. import procs

        for pid in procs.children_of(os.getpid()):
            if pid not in self.children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            self.abandoned.discard(pid)
            if conn is not None:
                _send(conn, {"exit": _wait_code(status)})
                conn.close()
            self.last = time.monotonic()

    def _learn(self) -> None:
        """Import a worker's recorded list once it exists (an idle tick, no client waiting)."""
        if self.loaded_list:
            return
        names = read_modules(self.modules_file)
        if names is None:
            return
        self.loaded_list = True
        preload(names)
        unsafe = fork_unsafe()
        if unsafe:  # say so in the log and stop serving: clients fall back to a cold start
            print(f"vllm-repro warm parent: {unsafe}; exiting", file=sys.stderr, flush=True)
            try:
                with open(os.path.join(self.folder, "unsafe"), "w") as f:
                    f.write(unsafe)
            except OSError:
                pass
            self._retire(force=True)
            os._exit(0)

    def _retire(self, force: bool = False) -> bool:
        """Stop listening (under the folder's lock, so no client starts a parent meanwhile)."""
        import fcntl

        try:
            lock = open(os.path.join(self.folder, "lock"), "a")
        except OSError:
            lock = None
        try:
            if lock is not None and not force:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return False  # a client is starting or checking: look again next tick
            for path in (self.sock_path, os.path.join(self.folder, "parent.json")):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            self.listener.close()
            return True
        finally:
            if lock is not None:
                lock.close()

    def _request(self, conn: socket.socket) -> None:
        req, fds = _recv_request(conn)
        if req is None:
            self.conns.discard(conn)
            conn.close()
            return
        op = req.get("op")
        if op == "ping":
            _send(conn, {"pid": os.getpid(), "modules": len(sys.modules)})
            return
        if op == "exit":
            idle = not self.children
            _send(conn, {"exiting": idle})
            if idle:
                self.conns.discard(conn)
                conn.close()
                self._retire(force=True)
                os._exit(0)
            return
        if op != "run" or len(fds) != RUN_FDS or not isinstance(req.get("env"), dict):
            for fd in fds:
                os.close(fd)
            _send(conn, {"error": f"bad request {op!r} with {len(fds)} descriptors"})
            self.conns.discard(conn)
            conn.close()
            return
        self.conns.discard(conn)
        if _hung_up(conn):
            # the client gave up waiting for this answer (this parent was stopped or busy past
            # its wait) and runs cold: a worker forked now would run for no one, into its log
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        owned = self.owned() + [conn.fileno()]
        me = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            _send(conn, {"error": f"fork failed: {exc}"})
            conn.close()
            return
        if pid == 0:
            _run_child(req, fds, owned, me, self.interpreter)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        _send(conn, {"pid": pid})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm_repro.engine.warm")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--idle", type=float, required=True)
    ap.add_argument("--modules", default=None)
    args = ap.parse_args(argv)
    parent = Parent(args.dir, args.idle, args.modules)
    # what the preloaded modules print goes to the log, never before the first line: a slice's
    # environment lacks the packages its tree stubs, and huggingface_hub says "Error importing
    # huggingface_hub.hf_api: No module named 'yaml'" on stdout (the client read that as the
    # parent's answer and ran every slice run cold)
    protocol = os.dup(1)
    os.dup2(2, 1)
    try:
        first = parent.start()
    except BaseException as exc:  # noqa: BLE001 - told to the client, which runs cold
        first = {"ready": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        sys.stdout.flush()
        os.dup2(protocol, 1)
        os.close(protocol)
    sys.stdout.write(json.dumps(first) + "\n")
    sys.stdout.flush()
    # stdout is the log from here on: the client stops reading after the first line
    os.dup2(2, 1)
    if not first.get("ready"):
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its own session: a terminal's ^C is not for it
    return parent.serve()


if __name__ == "__main__":
    sys.exit(main())
