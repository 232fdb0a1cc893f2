"""The watchdog: a step (or an engine's start-up) that does not return ends the run as ``hang``.

A livelock in vLLM's code (``schedule()`` looping on a request it can never place), or a patch
with a loop, would otherwise run forever with no verdict. The step loop arms the watchdog
before each step and before the engine is built (:meth:`Watchdog.arm`) and disarms it when the
call returns. When an armed call has run ``limit_s`` seconds (``VLLM_REPRO_STEP_TIMEOUT_S``, or
the scenario's ``limits.step_timeout_s``), the watchdog's thread:

1. dumps the Python stacks of every thread of the worker with :mod:`faulthandler` and reads the
   run's own thread (``sys._current_frames``) for the innermost vLLM frame it sits in: the
   :class:`~vllm_repro.records.Hang` record;
2. raises :class:`StepTimeout` in the run's thread (``PyThreadState_SetAsyncExc``), which the
   step loop catches: the run ends as ``hang`` and the worker lives on (``stopped:
   interrupted``);
3. where the thread does not let go within ``grace_s`` (it sits in C code that never returns
   to the interpreter), calls :data:`LAST_RESORT` with the record (the worker sends the
   ``hang`` result and exits: ``stopped: exited``; the host starts a new worker for later runs).

Standard library only (runs inside release environments).
"""

from __future__ import annotations

import ctypes
import faulthandler
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from ..records import Frame, Hang

#: the last of the threads' stacks kept in :attr:`Hang.stacks` (characters)
MAX_STACKS_CHARS = 20_000
#: what the worker does when the run's thread does not let go: ``fn(hang)``, never returns
LAST_RESORT: Callable[[Hang], None] | None = None


class StepTimeout(BaseException):
    """Raised into the run's thread by the watchdog: the armed call ran out of time. A
    ``BaseException``, so that vLLM's and the lab's ``except Exception`` let it through."""


def thread_frames(ident: int, vllm_root: Path) -> list[Frame]:
    """The vLLM frames thread ``ident`` is in now, outermost first (``file`` as
    ``vllm/...py``); empty when it has none or is gone."""
    frame = sys._current_frames().get(ident)
    root = str(vllm_root.resolve())
    out: list[Frame] = []
    while frame is not None:
        code = frame.f_code
        try:
            path = str(Path(code.co_filename).resolve())
        except OSError:
            path = code.co_filename
        if path.startswith(root + "/"):
            out.append(Frame("vllm/" + path[len(root) + 1:], code.co_name, frame.f_lineno))
        frame = frame.f_back
    out.reverse()
    return out


def all_stacks() -> str:
    """Every thread's Python stack as :func:`faulthandler.dump_traceback` writes it (most recent
    call first), the last :data:`MAX_STACKS_CHARS` characters."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()[-MAX_STACKS_CHARS:]


def _raise_in(ident: int, exc_type: type[BaseException]) -> bool:
    """Raise ``exc_type`` in thread ``ident`` at its next bytecode; whether a thread took it."""
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc_type))
    if n > 1:  # never expected: undo rather than hit several threads
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
        return False
    return n == 1


class Watchdog:
    """Times the armed call of the run's thread (see the module docstring). ``limit_s``:
    seconds; ``vllm_root``: the release's ``vllm`` package folder; ``phase_of()``: the vLLM
    call the run is in now (``schedule``, ``step``...), read when the time runs out;
    ``grace_s``: how long the interrupted thread has to let go.

    Arming and disarming are two attribute writes (no lock, no wake-up: a step costs the run
    nothing more); the watchdog's thread looks every :attr:`tick` seconds (a quarter of the
    limit, at most one second), so a call is ended at most a tick after its limit."""

    def __init__(self, limit_s: float, vllm_root: Path, phase_of: Callable[[], str | None] = None,
                 grace_s: float = 10.0):
        self.limit_s = float(limit_s)
        self.vllm_root = vllm_root
        self.phase_of = phase_of or (lambda: None)
        self.grace_s = grace_s
        self.tick = max(0.01, min(1.0, self.limit_s / 4))
        #: the record of the call that ran out of time (set by the watchdog's thread)
        self.hang: Hang | None = None
        self._deadline: float | None = None
        self._generation = 0
        self._step = 0
        self._phase = "step"
        self._target = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vllm-repro-watchdog",
                                        daemon=True)
        self._thread.start()

    def arm(self, step: int, phase: str) -> None:
        """Start timing a call of the calling thread: ``step`` (0: start-up) in ``phase``."""
        self._step, self._phase = step, phase
        self._target = threading.get_ident()
        self._generation += 1
        self._deadline = time.monotonic() + self.limit_s

    def disarm(self) -> None:
        """The armed call returned (or raised)."""
        self._deadline = None
        self._generation += 1

    def close(self) -> None:
        """Stop the watchdog's thread."""
        self._deadline = None
        self._closed.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._closed.wait(self.tick):
            generation, deadline = self._generation, self._deadline
            if deadline is not None and time.monotonic() >= deadline \
                    and generation == self._generation:
                self._fire(generation)

    def _fire(self, generation: int) -> None:
        """The armed call ran out of time: record, interrupt, and where the thread does not
        let go within ``grace_s``, the last resort."""
        frames = thread_frames(self._target, self.vllm_root)
        try:
            phase = self.phase_of() or self._phase
        except Exception:  # noqa: BLE001 - the loop's state is not the watchdog's to trust
            phase = self._phase
        self.hang = Hang(self._step, self.limit_s, phase, frames[-1] if frames else None,
                         frames[-8:] or None, all_stacks(), "interrupted")
        if generation != self._generation:  # it returned meanwhile: not a hang after all
            self.hang = None
            return
        if not _raise_in(self._target, StepTimeout):
            self._last_resort()
            return
        end = time.monotonic() + self.grace_s
        while self._generation == generation and not self._closed.is_set():
            if time.monotonic() >= end:
                self._last_resort()
                return
            time.sleep(0.02)

    def _last_resort(self) -> None:
        self.hang.stopped = "exited"
        if LAST_RESORT is not None:
            LAST_RESORT(self.hang)


__all__ = ["Watchdog", "StepTimeout", "LAST_RESORT", "thread_frames", "all_stacks"]
