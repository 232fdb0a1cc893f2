"""Host side of warm runs (docs/warm-runs.md): find or start the warm parent of a release
environment (:mod:`vllm_repro.engine.warm`) and have it fork a run's engine worker.

A parent is keyed by the environment's identity (its python, the stamps of its ``pyvenv.cfg``,
``.ready.json`` and ``site-packages``: a rebuilt environment gets a new parent), the lab's
package (its path and the modules the parent imports), the worker's environment variables
(volatile ones such as ``PWD`` aside) and its import path (:func:`path_identity`: the mode, a
release's tree or an installed vLLM, and the parent's own ``PYTHONPATH``, which names a slice's
tree). Its folder is ``<cache>/warm/<key>/``: ``sock`` (mode
0700 folder; ``<tmp>/vllm-repro-<uid>/warm`` where the cache is not this user's own and
writable, as in the images), ``lock`` (``flock``: one client starts a parent, a retiring parent waits for no
client), ``parent.json``, ``parent.log``. What a worker imported is recorded once per
environment in ``<cache>/warm/modules/<env>.json`` (the parent's list); an environment where
forking is not safe is marked in ``<cache>/warm/unsafe/<env>.txt`` and runs cold.

Settings: ``VLLM_REPRO_WARM`` (``on`` default, ``off``: every run cold, as ``--cold``),
``VLLM_REPRO_WARM_IDLE_S`` (a parent exits after this many idle seconds, default 300),
``VLLM_REPRO_WARM_MAX`` (parents alive at once, default 4: the least recently used idle one
is asked to exit to make room). Standard library only (the host's ``errors`` and ``settings``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from .. import procs
from ..errors import InputError
from ..settings import cache_dir

SETTING, IDLE_SETTING, MAX_SETTING = "VLLM_REPRO_WARM", "VLLM_REPRO_WARM_IDLE_S", "VLLM_REPRO_WARM_MAX"
DEFAULT_IDLE_S, DEFAULT_MAX = 300.0, 4
#: the worker records the modules it imported here (warm.third_party_modules), once per env
MODULES_OUT = "VLLM_REPRO_WARM_MODULES_OUT"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
#: the lab's files a parent has imported (a change to one of them needs a new parent)
_PARENT_FILES = ("__init__.py", "engine/__init__.py", "engine/warm.py")
#: environment variables that change between shells or calls and that no import reads
#: (``PYTHONPATH``: the lab sets the parent's, and keys it with the mode, :func:`path_identity`)
_VOLATILE = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "COLUMNS", "LINES", "PYTHONPATH",
                       "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKE_TERMOUT", "MAKE_TERMERR",
                       # the lab's own settings for building environments (Makefile exports)
                       "TORCH_VERSION", "TORCH_INDEX_URL", "TORCH_WHEEL_DIR"})
#: ``RAY_``: what a Ray worker process carries (its session, job, raylet: new every cluster), so
#: that a campaign's tasks on Ray share their parents with each other and the next campaign
_VOLATILE_PREFIXES = ("PYTEST_", "SSH_", "TERM", "COLORTERM", "WINDOW", "TMUX", "STY", "RAY_")
#: how long a starting parent may take to import (a loaded two-core machine: tens of seconds)
START_TIMEOUT_S = 300.0
#: how often a client waiting for a parent (its start, the lock) looks whether the run is being
#: aborted (:func:`vllm_repro.procs.aborting`): a thread's wait is not ended by the signal
POLL_S = 0.05
#: how long a serving parent may take to answer a run with its worker's pid (a fork: a
#: millisecond as a rule; longer means the parent is stopped or hung, and a retry would wait
#: as long again)
REPLY_TIMEOUT_S = 15.0
_SOCK_MAX = 100  # sun_path is 104-108 bytes
#: a key's folder with no live parent and no run for this long is removed when a parent starts
#: (one folder per checkout, environment and set of variables: they pile up otherwise)
STALE_S = 7 * 24 * 3600.0

_parents: list[subprocess.Popen] = []  # started here: kept (and reaped) so none is a zombie long
_noted: set[str] = set()
_note_lock = threading.Lock()


class WarmUnavailable(Exception):
    """No warm parent for this run (the reason is the message); the run starts cold."""


class WarmAborted(WarmUnavailable):
    """The run is being aborted (SIGINT / SIGTERM): no parent was waited for, none started."""


def _check_abort() -> None:
    if procs.aborting():
        raise WarmAborted("the run is being aborted")


def enabled() -> bool:
    """``VLLM_REPRO_WARM``: on unless ``0``/``off``/``false``/``no``/``cold``. Raises
    :class:`InputError` (exit 2) for any other value."""
    raw = os.environ.get(SETTING, "").strip().lower()
    if raw in ("", "1", "on", "true", "yes", "warm"):
        return True
    if raw in ("0", "off", "false", "no", "cold"):
        return False
    raise InputError(f"{SETTING}={os.environ[SETTING]!r}: expected on or off (off: every run "
                     "starts cold, as --cold does); set it to one, or unset it")


#: the longest a warm parent may idle (a day) and the most parents (one per environment)
MAX_IDLE_S = 86_400.0
MAX_MAX_PARENTS = 64


def idle_seconds() -> float:
    """``VLLM_REPRO_WARM_IDLE_S`` (seconds, above 0 and at most :data:`MAX_IDLE_S`; default
    300). :class:`InputError` otherwise."""
    return _positive(IDLE_SETTING, DEFAULT_IDLE_S, float, MAX_IDLE_S)


def max_parents() -> int:
    """``VLLM_REPRO_WARM_MAX`` (a whole number from 1 to :data:`MAX_MAX_PARENTS`; default 4)."""
    return int(_positive(MAX_SETTING, DEFAULT_MAX, int, MAX_MAX_PARENTS))


def _positive(name: str, default, kind, ceiling):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw) if len(raw) <= 40 else 0
    except ValueError:
        value = 0
    if not 0 < value <= ceiling:
        what = "a whole number above 0" if kind is int else "a positive number"
        raise InputError(f"{name}={raw[:40]!r}: expected {what}, at most {ceiling:g} (default "
                         f"{default}); set it to one, or unset it")
    return value


def note(key: str, message: str) -> None:
    """Say ``message`` on stderr once per process and ``key`` (the one-line fallback note)."""
    with _note_lock:
        if key in _noted:
            return
        _noted.add(key)
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def _stamp(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return f"{path}:-"
    return f"{path}:{st.st_mtime_ns}:{st.st_size}"


def _entries(folder: Path) -> str:
    """``folder``'s entries by name, ``__pycache__`` aside: a package installed, upgraded (its
    ``.dist-info`` is named with its version) or removed changes them; the bytecode folder
    that the first parent's imports create does not (the folder's mtime did, so the second run
    after an environment was built started a second parent)."""
    try:
        names = sorted(n for n in os.listdir(folder) if n != "__pycache__")
    except OSError:
        return f"{folder}:-"
    return f"{folder}:" + hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def env_identity(python: Path, root: Path) -> str:
    """A hash of the environment: its python's path, the stamps (mtime, size) of its
    ``pyvenv.cfg``, ``.ready.json`` and the python binary, and the entries of each
    ``site-packages`` folder (:func:`_entries`)."""
    parts = [str(python), _stamp(python), _stamp(root / "pyvenv.cfg"), _stamp(root / ".ready.json")]
    for lib in sorted(root.glob("lib*/python*/site-packages")):
        parts.append(_entries(lib))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def lab_identity() -> str:
    """The lab package's path and the stamps of the modules a parent imports itself (every
    other lab module is imported fresh by each forked worker)."""
    parts = [str(PACKAGE_DIR), *(_stamp(PACKAGE_DIR / f) for f in _PARENT_FILES)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:8]


def keyed_vars(env: dict[str, str]) -> dict[str, str]:
    """The variables a parent is keyed by: all that an import could read, so not
    :data:`_VOLATILE` ones, nor what ``make`` exports from its own command line (named in
    ``MAKEFLAGS`` after its ``--``: ``make cpu-repro REPORTS=...`` would otherwise key a parent
    per reports folder)."""
    flags = env.get("MAKEFLAGS", "")
    overrides = flags.split(" -- ", 1)[1] if " -- " in f" {flags}" else ""
    if flags.startswith("-- "):
        overrides = flags[3:]
    make = {w.split("=", 1)[0] for w in overrides.split() if "=" in w}
    return {k: v for k, v in sorted(env.items())
            if k not in _VOLATILE and k not in make and k != "MAKEOVERRIDES"
            and not k.startswith(_VOLATILE_PREFIXES)}


def env_vars_identity(env: dict[str, str]) -> str:
    """A hash of :func:`keyed_vars`."""
    return hashlib.sha256(json.dumps(sorted(keyed_vars(env).items())).encode()).hexdigest()[:8]


def _own_folder(path: Path) -> bool:
    """``path`` made (mode 0700) where missing, and usable by this user alone: a folder that
    is this uid's, writable and searchable. ``False`` on any ``OSError``."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.lstat()
    except OSError:
        return False
    import stat

    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and os.access(path, os.W_OK | os.X_OK))


def warm_root() -> Path:
    """The folder of warm parents: ``<cache>/warm``, or, where that is not this user's own
    writable folder (an image's cache baked by root and read-only at run time, a cache shared
    between users), ``<tmp>/vllm-repro-<uid>/warm``. Raises :class:`WarmUnavailable` when
    neither can be used (the run starts cold)."""
    import tempfile

    try:
        candidates = [cache_dir() / "warm"]
    except InputError:
        candidates = []
    own_tmp = Path(tempfile.gettempdir()) / f"vllm-repro-{os.getuid()}"
    candidates.append(own_tmp / "warm")
    for root in candidates:
        # in a shared tmp, the folder above must be this user's too (another user could have
        # made it first, and so own what is put in it)
        if (root.parent != own_tmp or _own_folder(own_tmp)) and _own_folder(root):
            return root
    raise WarmUnavailable("no folder for warm parents is writable by this user ("
                          + ", ".join(map(str, candidates)) + ")")


def path_identity(env: dict[str, str], mode: str) -> str:
    """A hash of what decides the import path of the parent and its workers beyond the
    environment: ``mode``, how the worker finds vLLM (the run's ``tree_kind``: ``full`` or
    ``slice``, a release's tree on its ``PYTHONPATH``; ``installed``, the interpreter's own),
    and the parent's ``PYTHONPATH`` (``env``'s: the lab, and a slice's tree, whose stubs and
    ``_vllm_slice`` the parent imports and its workers inherit). Each shapes the parent's
    ``sys.path``, and so what it preloads from where: a parent started for a release tree's runs
    (the tree at the front of the path) never serves an installed vLLM's (the same interpreter,
    the tree a ``.pth`` adds last), nor a slice's tree's runs another slice tree's. A full
    tree's runs share one parent: the parent never has their tree on its path, and each worker
    puts its own in front (:func:`vllm_repro.engine.warm.child_sys_path`), as a cold one does."""
    return hashlib.sha256(json.dumps([mode, env.get("PYTHONPATH", "")]).encode()).hexdigest()[:8]


def parent_key(python: Path, root: Path, env: dict[str, str], mode: str) -> str:
    """The key of the parent serving the runs of the interpreter ``python`` of the environment
    ``root`` started with ``env`` (the parent's variables) in ``mode`` (:func:`path_identity`)."""
    return (f"{env_identity(python, root)}-{lab_identity()}-{env_vars_identity(env)}"
            f"-{path_identity(env, mode)}")


def modules_file(python: Path, root: Path) -> Path:
    """Where the environment's module list is (its folder made). Raises
    :class:`WarmUnavailable` where no warm folder is this user's own."""
    d = warm_root() / "modules"
    if not _own_folder(d):
        raise WarmUnavailable(f"the folder {d} is not this user's own")
    return d / f"{env_identity(python, root)}.json"


def unsafe_file(python: Path, root: Path) -> Path:
    return warm_root() / "unsafe" / f"{env_identity(python, root)}.txt"


@contextmanager
def _locked(path: Path):
    """``flock`` on ``path``, waited for in steps of :data:`POLL_S` (raises
    :class:`WarmAborted` once the run is being aborted)."""
    with open(path, "a") as fh:
        while True:
            _check_abort()
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _connect(sock: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock))
    except OSError:  # no socket file, or nobody listening (a parent that died or retired)
        s.close()
        return None
    return s


class _Lines:
    """Lines of a stream socket, with a timeout per line."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.buf = b""
        self.eof = False

    def fill(self) -> None:
        try:
            data = self.conn.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self.eof = True
        self.buf += data

    def pop(self) -> dict | None:
        if b"\n" not in self.buf:
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {}

    def read(self, timeout: float | None, abortable: bool = False) -> dict | None:
        """The next message, ``None`` at EOF. Raises ``TimeoutError``; ``abortable``: looks
        every :data:`POLL_S` whether the run is being aborted (raises :class:`WarmAborted`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self.pop()
            if msg is not None:
                return msg
            if self.eof:
                return None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = left
            if abortable:
                _check_abort()
                wait = POLL_S if left is None else min(left, POLL_S)
            ready, _, _ = select.select([self.conn], [], [], wait)
            if ready:
                self.fill()
            elif left is not None and (not abortable or time.monotonic() >= deadline):
                raise TimeoutError


class WarmProc:
    """A forked engine worker, as much of :class:`subprocess.Popen` as the host and
    :mod:`vllm_repro.procs` use: ``pid`` (the leader of its own process group), ``stdin``,
    ``returncode``, ``poll``, ``wait``, ``kill``. Its exit status comes from the parent over
    ``conn``; ``lost`` says why there is none (the parent died). ``parent_start_s``: the seconds
    this spawn spent starting the parent (its imports), None when one was already serving."""

    def __init__(self, conn: socket.socket, pid: int, parent_pid: int, parent_log: Path,
                 stdin, parent_start_s: float | None = None):
        self.parent_start_s = parent_start_s
        self.conn = conn
        self._lines = _Lines(conn)
        self.pid = pid
        self.parent_pid = parent_pid
        self.parent_log = parent_log
        self.stdin = stdin
        self.returncode: int | None = None
        self.lost: str | None = None
        self._reply_buf = b""

    def _message(self, timeout: float | None) -> None:
        msg = self._lines.read(timeout)
        if msg is None:
            if self.returncode is None:
                self.lost = f"its warm parent (pid {self.parent_pid}) died"
                self._kill_group()
                self.returncode = -signal.SIGKILL
            return
        if "exit" in msg:
            self.returncode = int(msg["exit"])

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._message(0)
            except TimeoutError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                if left is not None and left <= 0:
                    raise TimeoutError
                self._message(left)
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"warm worker {self.pid}", timeout) from None
        return self.returncode

    def _kill_group(self) -> None:
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except OSError:
                pass

    def kill(self) -> None:
        if self.returncode is None:
            self._kill_group()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except OSError:
                pass

    def readline(self, fd: int) -> bytes:
        """One line from the worker's reply pipe ``fd`` (``b""`` at its end), watching the
        parent meanwhile: if the parent dies, the worker's group is killed (its replies end)."""
        while True:
            if b"\n" in self._reply_buf:
                line, self._reply_buf = self._reply_buf.split(b"\n", 1)
                return line + b"\n"
            watch = [fd] if self._lines.eof or self.returncode is not None else [fd, self.conn]
            ready, _, _ = select.select(watch, [], [])
            if fd in ready:
                data = os.read(fd, 1 << 16)
                if not data:
                    line, self._reply_buf = self._reply_buf, b""
                    return line
                self._reply_buf += data
            elif self.conn in ready:
                self._message(0)

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _live_parents(root: Path) -> list[tuple[float, Path, int]]:
    """(last used, folder, pid) of every parent that says it is alive."""
    out = []
    for info in root.glob("*/parent.json"):
        pid = _parent_pid(info.parent)
        if pid > 0 and _alive(pid):
            used = info.parent / "used"
            try:
                when = used.stat().st_mtime
            except OSError:
                when = 0.0
            out.append((when, info.parent, pid))
    return sorted(out)


def _make_room(root: Path, folder: Path) -> None:
    """At :func:`max_parents`, ask the least recently used idle parent to exit."""
    live = [p for p in _live_parents(root) if p[1] != folder]
    limit = max_parents()
    while len(live) >= limit:
        for i, (_, other, _pid) in enumerate(live):
            conn = _connect(other / "sock")
            if conn is None:
                continue
            try:
                conn.sendall(b'{"op": "exit"}\n')
                reply = _Lines(conn).read(5)
            except (OSError, TimeoutError):
                reply = None
            finally:
                conn.close()
            if reply and reply.get("exiting"):
                del live[i]
                break
        else:
            raise WarmUnavailable(f"{len(live)} warm parents are busy ({MAX_SETTING}={limit})")


def _prune(root: Path, keep: Path, now: float | None = None) -> int:
    """Remove the key folders below ``root`` (not ``keep``) that no live parent serves and no
    run used for :data:`STALE_S` (``used``, else the folder's own mtime), each under its own
    lock taken without waiting (a client starting a parent there keeps it). Returns how many."""
    now = time.time() if now is None else now
    served = {folder for _, folder, _ in _live_parents(root)}
    removed = 0
    for folder in root.iterdir():
        if folder == keep or folder in served or folder.name in ("modules", "unsafe") \
                or not folder.is_dir() or folder.is_symlink():
            continue
        try:
            last = (folder / "used").stat().st_mtime if (folder / "used").exists() \
                else folder.stat().st_mtime
            if now - last < STALE_S:
                continue
            with open(folder / "lock", "a") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                shutil.rmtree(folder, ignore_errors=True)
            removed += 1
        except OSError:
            continue
    return removed


def _start_parent(python: Path, folder: Path, parent_env: dict[str, str], mods: Path) -> None:
    """Start the parent of ``folder`` and wait until it says it is ready. A parent that has not
    said so yet belongs to this client alone: when the wait ends any other way (the run is
    being aborted, a signal's exception, its start time out) it is killed with its session,
    so none is left importing and then idling with no client."""
    _check_abort()
    for old in list(_parents):  # reap the ones that retired
        if old.poll() is not None:
            _parents.remove(old)
    _make_room(folder.parent, folder)
    _prune(folder.parent, folder)
    log = open(folder / "parent.log", "a")
    log.write(f"==== vllm-repro: a warm parent starts, {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
    log.flush()
    try:
        proc = subprocess.Popen(
            [str(python), "-m", "vllm_repro.engine.warm", "--dir", str(folder),
             "--idle", str(idle_seconds()), "--modules", str(mods)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=parent_env,
            cwd=str(folder), start_new_session=True)
    except OSError as exc:
        raise WarmUnavailable(f"cannot start a warm parent: {exc}") from exc
    finally:
        log.close()
    _parents.append(proc)
    first = b""
    deadline = time.monotonic() + START_TIMEOUT_S
    fd = proc.stdout.fileno()
    try:
        while not first.endswith(b"\n"):
            _check_abort()
            left = deadline - time.monotonic()
            if left <= 0:
                raise WarmUnavailable(f"the warm parent did not start in {START_TIMEOUT_S:.0f}s")
            ready, _, _ = select.select([fd], [], [], min(left, POLL_S))
            if not ready:
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                break
            first += data
    except BaseException:
        _kill_starting(proc)
        raise
    proc.stdout.close()
    try:
        msg = json.loads(first)
    except ValueError:
        proc.kill()
        raise WarmUnavailable(f"the warm parent did not start (exit {proc.poll()}; log: "
                              f"{folder / 'parent.log'})") from None
    if not msg.get("ready"):
        raise WarmUnavailable(str(msg.get("unsafe") or msg.get("error")))


def _kill_starting(proc: subprocess.Popen) -> None:
    """SIGKILL a parent that has not said it is ready (the leader of its own session, so its
    process group: whatever its imports started too) and reap it."""
    for kill in (os.killpg, os.kill):
        try:
            kill(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    if proc in _parents:
        _parents.remove(proc)


def spawn(python: Path, root: Path, argv: list[str], worker_env: dict[str, str],
          parent_env: dict[str, str], cwd: str, fds: tuple[int, int, int], stdin,
          mode: str, module: str | None = None) -> WarmProc:
    """Have the environment's warm parent (started here if none serves) fork a worker with
    ``argv`` (the worker's, ``--reply-fd`` aside), ``worker_env`` and ``cwd``; ``fds``: its
    stdin, log and reply pipe; ``mode``: how the worker finds vLLM (:func:`path_identity`).
    Raises :class:`WarmUnavailable` with the reason it cannot."""
    if not hasattr(socket, "send_fds") or not hasattr(os, "fork"):
        raise WarmUnavailable(f"this platform ({sys.platform}) has no os.fork / socket.send_fds")
    unsafe = unsafe_file(python, root)
    if unsafe.is_file():
        raise WarmUnavailable(f"forking is not safe in this environment: "
                              f"{unsafe.read_text(errors='replace').strip()}")
    folder = warm_root() / parent_key(python, root, parent_env, mode)
    if not _own_folder(folder):
        raise WarmUnavailable(f"the warm parent's folder {folder} is not this user's own")
    if not (folder / "vars.json").exists():
        try:  # which variables made this key (names and a hash of each value: no secrets)
            (folder / "vars.json").write_text(json.dumps(
                {k: hashlib.sha256(v.encode()).hexdigest()[:8]
                 for k, v in keyed_vars(parent_env).items()}, indent=0))
            # and which import path (folders only)
            (folder / "path.json").write_text(json.dumps(
                {"mode": mode, "PYTHONPATH": parent_env.get("PYTHONPATH", "")}, indent=0))
        except OSError:
            pass
    sock = folder / "sock"
    if len(str(sock)) > _SOCK_MAX:
        raise WarmUnavailable(f"the socket path {sock} is longer than a unix socket allows "
                              "(a shorter VLLM_REPRO_CACHE)")
    mods = modules_file(python, root)
    msg = {"op": "run", "argv": argv, "env": worker_env, "cwd": cwd}
    if module:  # tests: a stand-in for the engine worker
        msg["module"] = module
    request = (json.dumps(msg) + "\n").encode()
    why = "the warm parent did not answer"
    started_s: float | None = None
    for _attempt in range(3):
        _check_abort()
        conn = _connect(sock)
        if conn is None:
            with _locked(folder / "lock"):
                conn = _connect(sock)
                if conn is None:
                    try:
                        t0 = time.perf_counter()
                        _start_parent(python, folder, parent_env, mods)
                        started_s = time.perf_counter() - t0
                    except WarmUnavailable as exc:
                        if "thread" in str(exc):  # not worth another try on this environment
                            unsafe.parent.mkdir(exist_ok=True)
                            unsafe.write_text(str(exc))
                        raise
                    conn = _connect(sock)
        if conn is None:
            continue
        try:
            (folder / "used").touch()
            socket.send_fds(conn, [request], list(fds))
            reply = _Lines(conn).read(REPLY_TIMEOUT_S, abortable=True)
        except TimeoutError:
            # stopped (SIGSTOP, a debugger) or hung: another try would wait as long again.
            # Closing the connection tells the parent, should it go on, not to fork this run
            conn.close()
            pid = _parent_pid(folder)
            raise WarmUnavailable(
                f"the warm parent{f' (pid {pid})' if pid > 0 else ''} did not answer in "
                f"{REPLY_TIMEOUT_S:.0f} s: stopped or hung"
                + (f"; `kill {pid}` ends it and the next run starts a new one" if pid > 0
                   else "")) from None
        except WarmAborted:
            conn.close()
            raise
        except OSError:
            reply = None
        if reply and "pid" in reply:
            return WarmProc(conn, int(reply["pid"]), _parent_pid(folder), folder / "parent.log",
                            stdin, parent_start_s=started_s)
        conn.close()
        if reply and "error" in reply:
            why = str(reply["error"])
            break
    raise WarmUnavailable(why)


def _parent_pid(folder: Path) -> int:
    """The pid ``parent.json`` of ``folder`` names; -1 when it cannot be read."""
    try:
        return int(json.loads((folder / "parent.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


__all__ = ["WarmUnavailable", "WarmAborted", "WarmProc", "enabled", "idle_seconds", "max_parents", "spawn",
           "note", "parent_key", "path_identity", "env_identity", "lab_identity", "env_vars_identity",
           "modules_file", "SETTING", "IDLE_SETTING", "MAX_SETTING", "MODULES_OUT"]
