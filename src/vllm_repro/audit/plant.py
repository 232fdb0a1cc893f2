"""Planting faults into vLLM for one run: the audit's own tests (test-only).

A *plant* is a function in a file named ``plant_*.py``, named to the worker as
``/abs/path/plant_faults.py:double_free`` in a job's ``options.plant`` (with keyword arguments in
``options.plant_args``). The worker imports the file, calls ``fn(ctx, **args)`` before the
scheduler is built, runs the scenario, then undoes every patch. Nothing in the CLI or the lab
sets ``options.plant``: only :meth:`vllm_repro.engine.host.WorkerHandle.run`'s keyword-only ``plant``
argument does, and a result produced with a plant carries ``"planted"``, which the verdict
never accepts as an observation of a release.

Runs inside release environments (standard library only).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Callable

from ..engine import state

_MISSING = object()


class PlantError(Exception):
    """The plant could not be loaded (bad path, name, or function)."""


class PlantContext:
    """What a plant function gets: ``patch`` (undone after the run), the current ``step``,
    ``note`` (facts the test checks the audit against, e.g. the blocks it double-freed), the
    adapter, and helpers to find vLLM classes and a request's blocks by probing.

    It is also a do-nothing step-loop observer, so that ``step`` and ``scheduler`` are known.
    """

    def __init__(self, adapter):
        self.adapter = adapter
        self.loop = None
        self.notes: dict[str, Any] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    # ---- for plant functions ---------------------------------------------------------------
    @property
    def step(self) -> int:
        """The step being run (n-th ``schedule()`` call; requests/aborts of step n come first);
        0 before the first step."""
        return getattr(self.loop, "step", 0) if self.loop is not None else 0

    @property
    def scheduler(self):
        return getattr(self.loop, "scheduler", None)

    def patch(self, owner, name: str, value) -> None:
        """``setattr(owner, name, value)`` until the run ends."""
        self._undo.append((owner, name, owner.__dict__.get(name, _MISSING)
                           if hasattr(owner, "__dict__") else getattr(owner, name)))
        setattr(owner, name, value)

    def note(self, key: str, value) -> None:
        """Record a fact about the planted fault (``step``, ``blocks``, ``request``...)."""
        self.notes[key] = value

    @staticmethod
    def find(*candidates: str):
        """The first importable ``module:attr`` (classes moved between releases)."""
        for cand in candidates:
            mod_name, _, attr = cand.partition(":")
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            if hasattr(mod, attr):
                return getattr(mod, attr)
        raise PlantError("none of " + ", ".join(candidates) + " exists in this release")

    @staticmethod
    def tables(kvm) -> list[dict]:
        """The ``req_to_blocks`` tables of a ``KVCacheManager``, one per KV cache group."""
        return [m.req_to_blocks for m in state.managers_of(kvm)]

    def blocks_of(self, kvm, request_id: str) -> list:
        """The request's real (non-null) blocks across groups, in table order."""
        null = getattr(kvm.block_pool, "null_block", None)
        return [b for t in self.tables(kvm) for b in t.get(request_id, ()) if b is not null]

    # ---- undo ------------------------------------------------------------------------------
    def restore(self) -> None:
        """Undo every patch, last first."""
        while self._undo:
            owner, name, old = self._undo.pop()
            if old is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, old)

    # ---- observer protocol (no checks) -----------------------------------------------------
    def attach(self, loop) -> None:
        self.loop = loop

    def after_schedule(self, step, so, scheduled) -> bool:
        return False

    def after_update(self, step, so, line) -> bool:
        return False

    def finish(self, loop, outcome) -> bool:
        return False


class WithPlant:
    """An observer that lets the plant context see the loop first, then the auditor (if any);
    everything else (stop exception, annotations, violations, summary) is the auditor's."""

    def __init__(self, ctx: PlantContext, auditor=None):
        self.ctx = ctx
        self.auditor = auditor
        if auditor is not None:
            self.stop_exception = auditor.stop_exception

    def attach(self, loop):
        self.ctx.attach(loop)
        if self.auditor is not None:
            self.auditor.attach(loop)

    def after_schedule(self, step, so, scheduled):
        return bool(self.auditor and self.auditor.after_schedule(step, so, scheduled))

    def after_update(self, step, so, line):
        return bool(self.auditor and self.auditor.after_update(step, so, line))

    def finish(self, loop, outcome):
        return bool(self.auditor and self.auditor.finish(loop, outcome))

    def __getattr__(self, name):
        if name in ("annotate", "violations", "summary") and self.auditor is not None:
            return getattr(self.auditor, name)
        raise AttributeError(name)


def load_plant(spec: str) -> Callable:
    """``/abs/path/plant_x.py:function`` -> the function. Raises :class:`PlantError` unless the
    path is absolute, exists and the file is named ``plant_*.py`` (a deliberate marker: no
    ordinary module can be loaded this way)."""
    path, sep, func = spec.rpartition(":")
    if not sep or not func:
        raise PlantError(f"plant {spec!r}: expected /abs/path/plant_name.py:function")
    base = os.path.basename(path)
    if not os.path.isabs(path) or not base.startswith("plant_") or not base.endswith(".py"):
        raise PlantError(f"plant {spec!r}: the file must be an absolute path to plant_*.py")
    if not os.path.isfile(path):
        raise PlantError(f"plant {spec!r}: no such file")
    mod_name = "vllm_repro_plant_" + base[:-3]
    spec_obj = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec_obj)
    spec_obj.loader.exec_module(module)
    fn = getattr(module, func, None)
    if not callable(fn):
        raise PlantError(f"plant {spec!r}: {base} has no function {func}")
    return fn
