"""The lab's child processes, and stopping all of them on a signal (README, "Exit codes").

Every engine worker runs in its own process group (``start_new_session``) and is registered
here by :class:`vllm_repro.engine.host.WorkerHandle`. :func:`install_signal_handlers` (called first
thing by :func:`vllm_repro.cli.main`) turns SIGINT and SIGTERM into :class:`Interrupted` in
the main thread, after killing every registered worker's whole process group and every other
descendant of the lab (environment builds, search processes, their children). On Linux the lab
is also a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): a grandchild whose parent died
is re-parented to the lab, not to PID 1, so it is found and killed too. The CLI then prints
``aborted`` and exits 130 (SIGINT) or 143 (SIGTERM). No worker is started once an abort began.
A warm parent (:mod:`vllm_repro.engine.warm`) is shared by every run of its environment and is
never swept; a worker it forked for this run is registered here like a cold one (its own
process group, pid = group id) and killed with its group.
Standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

_workers: set[subprocess.Popen] = set()
_lock = threading.Lock()
_aborting = False
_raised = False


class Interrupted(BaseException):
    """A SIGINT or SIGTERM reached the lab (a BaseException: no ``except Exception`` of the
    lab swallows it). ``signum`` is the signal; the exit code is ``128 + signum``."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def aborting() -> bool:
    """Whether an abort began (no new worker may start)."""
    return _aborting


def register(proc: subprocess.Popen) -> None:
    """Track a worker process (the leader of its own process group). Killed at once when an
    abort already began (a worker started by a thread while the signal was handled)."""
    with _lock:
        _workers.add(proc)
    if _aborting:
        kill_group(proc)


def unregister(proc: subprocess.Popen) -> None:
    with _lock:
        _workers.discard(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (the worker and whatever it left there)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        proc.kill()
    except OSError:
        pass


def _proc_table() -> dict[int, tuple[int, str]]:
    """``{pid: (ppid, state)}`` of every process visible (``/proc``, else ``ps``)."""
    table: dict[int, tuple[int, str]] = {}
    if os.path.isdir("/proc"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    data = fh.read().decode(errors="replace")
            except OSError:
                continue
            rest = data.rsplit(")", 1)[-1].split()
            if len(rest) >= 2:
                table[int(name)] = (int(rest[1]), rest[0])
        return table
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,stat="], capture_output=True,
                             text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return table
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            table[int(parts[0])] = (int(parts[1]), parts[2][:1])
    return table


def children_of(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux's ``/proc/PID/task/*/children``, cheap enough for
    a loop; else a scan of every process)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out.extend(int(x) for x in fh.read().split())
        return out
    except (OSError, ValueError):
        pass
    return [p for p, (ppid, _) in _proc_table().items() if ppid == pid]


def is_warm_parent(pid: int) -> bool:
    """Whether ``pid`` is a warm parent (:mod:`vllm_repro.engine.warm`) or one of the workers it
    forked: shared by every client of its environment, so a signal to one run never sweeps it
    (it retires when idle); this run's own forked workers are registered and killed by group."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"vllm_repro.engine.warm\0" in fh.read()
    except OSError:
        return False


def descendants(root: int | None = None) -> list[int]:
    """The live (not zombie) processes below ``root`` (default: this one), not entering a warm
    parent (:func:`is_warm_parent`)."""
    root = os.getpid() if root is None else root
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if is_warm_parent(pid):
            continue
        out.append(pid)
        todo.extend(children.get(pid, []))
    return [p for p in out if table.get(p, (0, "Z"))[1] not in ("Z", "X")]


def kill_all(timeout: float = 2.0) -> None:
    """Stop every worker's process group and every descendant of the lab (SIGKILL), until
    none is left alive or ``timeout`` seconds passed. Marks the abort: no worker starts after."""
    global _aborting
    _aborting = True
    for proc in list(_workers):
        kill_group(proc)
    _kill_descendants(time.monotonic() + timeout)


def _kill_descendants(deadline: float) -> None:
    """SIGKILL every process below the lab (the resource tracker aside) until none is left
    alive or ``deadline`` (``time.monotonic()``) passed."""
    while True:
        alive = [p for p in descendants() if not _is_resource_tracker(p)]
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        # exited children stay zombies (not alive) until the lab exits: reaping them here
        # could take a status another thread's subprocess call waits for
        if not alive or time.monotonic() > deadline:
            return
        time.sleep(0.02)


def _is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker: left alone, it ends by itself when the lab exits
    (its pipe closes) and frees what the killed search processes held; killed, the lab's own
    exit relaunches it and prints tracebacks."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"multiprocessing.resource_tracker" in fh.read()
    except OSError:
        return False


def _handler(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    global _raised
    kill_all()
    if not _raised:  # a second signal during the clean-up only kills again
        _raised = True
        raise Interrupted(signum)


def exit_on_signal() -> None:
    """For a helper process of the lab (a fuzz search process): SIGINT and SIGTERM kill its
    workers and descendants, then end it at once with ``128 + signal`` (no traceback)."""
    def handler(signum, frame):  # noqa: ARG001
        kill_all()
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _subreaper() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


#: seconds a signal may wait for the main thread (busy in C code: libyaml composing a large
#: file, pydantic validating one, a list of a billion items) before the watchdog ends the lab
SIGNAL_GRACE_S = 0.5
#: seconds the main thread's own clean-up (after :class:`Interrupted`) may take before the
#: watchdog ends the lab anyway
CLEANUP_GRACE_S = 5.0


def _watchdog(fd: int) -> None:
    """Read the signal numbers the C-level handler writes to the wakeup fd (at once, whatever
    the main thread is doing); where the Python handler has not run within
    :data:`SIGNAL_GRACE_S` (or its clean-up not ended the lab within :data:`CLEANUP_GRACE_S`),
    kill every child and exit ``128 + signal`` from here, saying ``aborted``."""
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        # (the wakeup fd carries every signal Python handles; only these two end the lab)
        ours = [b for b in data if b in (signal.SIGINT, signal.SIGTERM)]
        if not ours:
            continue
        signum = ours[-1]
        deadline = time.monotonic() + SIGNAL_GRACE_S
        while time.monotonic() < deadline and not _raised:
            time.sleep(0.02)
        if _raised:  # the main thread has it: give its clean-up a while
            time.sleep(CLEANUP_GRACE_S)
        kill_all()
        try:
            os.write(2, b"aborted\n")
        finally:
            os._exit(128 + signum)


def _install_watchdog() -> None:
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):  # not the main thread
        os.close(r)
        os.close(w)
        return
    threading.Thread(target=_watchdog, args=(r,), name="vllm-repro-signals", daemon=True).start()


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM stop every child process and raise :class:`Interrupted` in the main
    thread (call it from the main thread, first); a watchdog thread makes sure the lab ends
    within :data:`SIGNAL_GRACE_S` even while the main thread is busy in C code. The lab becomes
    a child subreaper: whatever a worker's code starts in a new session or double-forks is
    re-parented to the lab, and :func:`sweep` at the end of the command kills it."""
    _subreaper()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)
    _install_watchdog()


def sweep(timeout: float = 2.0) -> list[int]:
    """At the end of a command: kill every process still below the lab (a helper a worker
    started in its own session or double-forked, re-parented to the lab as its subreaper),
    warm parents aside. Returns the pids that were alive."""
    left = [p for p in descendants() if not _is_resource_tracker(p)]
    if left:
        _kill_descendants(time.monotonic() + timeout)
    return left


def make_subreaper() -> None:
    """Make this process a child subreaper (Linux; elsewhere nothing): used by engine workers
    and warm parents so that what their code leaves behind is theirs to kill."""
    _subreaper()
