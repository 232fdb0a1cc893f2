"""Running one scenario on the release the worker imported: the level table and the run's
frame (trace file, watchdog, emulated devices, errors to a :class:`~vllm_repro.records.RunResult`).

:data:`LEVELS` maps each scenario ``level`` to its driver
(:class:`~vllm_repro.engine.interfaces.LevelDriver`): it builds
the level's loop (:class:`~vllm_repro.engine.loop.StepLoop`,
:class:`~vllm_repro.engine.core_loop.EngineCoreLoop`,
:class:`~vllm_repro.engine.v0.V0EngineLoop`) in the scope that level needs and hands it to
``start``. Adding a level: a loop class (a ``StepLoop`` subclass) in its own module, a driver
here, its name in the schema's ``level`` (docs/architecture.md, "Adding a level").

Runs inside the release environment (standard library + vLLM only).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable

from ..records import Crash, ReportDir, RunResult, TraceLine
from .adapter import AdapterError, LevelMissing, RefusedByRelease, V1Adapter, platform
from .core_proc import loop_class
from .interfaces import LevelDriver
from .loop import OverLimit, StepLoop, describe_exception
from .spec import LabLimits, ScenarioLimits
from .topology import topology
from .v0 import V0Adapter, V0EngineLoop
from .watchdog import Watchdog


def v0_adapter(adapter):
    """The V0 adapter for ``level: v0-engine``: ``adapter`` itself on a release without the V1
    engine, else one built once on top of the worker's V1 adapter. Raises
    :class:`LevelMissing` when the release has no V0 engine."""
    if getattr(adapter, "generation", "v1") == "v0":
        return adapter
    if not adapter.caps.v0_engine:
        raise LevelMissing("v0-engine", adapter.caps.refusal("v0-engine"))
    v0 = getattr(adapter, "_v0_adapter", None)
    if v0 is None:
        v0 = adapter._v0_adapter = V0Adapter(adapter.model_dir, base=adapter)
    return v0


def _slice_runtime():
    """A slice tree's run-time module in this process (``_vllm_slice``, whose ``EVENTS`` lists
    each import of a module the slice leaves out and each use of a stubbed package), or None on
    a full tree."""
    return sys.modules.get("_vllm_slice")


def slice_gap(events: list, version: str, crash: Crash | None = None) -> str | None:
    """The lab-failure message for a run on a slice of ``version`` that met ``events``
    (``_vllm_slice.EVENTS`` entries, oldest first), or ended in ``crash`` with an
    ``ImportError`` (a distribution the slice's environment does not hold: it holds only the
    traced ones), else ``None``. Such a run left the paths the slice was traced and proven on,
    so whatever it did (a crash of vLLM included, or a fallback vLLM took on an ``ImportError``)
    is the slice's doing, not the release's."""
    unique = list({(e["kind"], e["name"]): e for e in events}.values())
    if unique:
        first = unique[0]
        what = (f"it imported {first['name']}, which the slice leaves out"
                if first["kind"] == "missing"
                else f"it used {first['name']} of {first.get('package')!r}, a stub in the slice")
        more = f" (and {len(unique) - 1} more)" if len(unique) > 1 else ""
    elif crash is not None and crash.type in ("ModuleNotFoundError", "ImportError"):
        what = (f"it raised {crash.type}: {crash.message}, and the slice's environment holds only "
                f"the distributions its traced runs loaded")
        more = ""
    else:
        return None
    return (f"the run left the slice of vLLM {version}: {what}{more}; its outcome would be the "
            f"slice's, not vLLM's. Run it on the full tree (--tree full; VLLM_REPRO_TREE=full "
            f"for commands without --tree, such as verify), or re-slice with a trace that covers "
            f"this path (vllm-repro slice {version})")


def _emulate_devices(scenario: dict) -> int | None:
    """Make the emulated platform report the devices the scenario's topology needs
    (:func:`~vllm_repro.engine.topology.topology`); returns the count before, or None where the
    scenario asks for one device (nothing changed). Raises :class:`RefusedByRelease` for sizes
    the lab refuses."""
    try:
        topo = topology(scenario.get("config") or {})
    except ValueError as exc:
        raise RefusedByRelease(str(exc)) from None
    if topo.devices == 1:
        return None
    return platform.set_device_count(topo.devices)


def run_scenario(adapter: V1Adapter, scenario: dict, out_dir: Path | None, observer=None,
                 limits: LabLimits | Mapping[str, Any] | None = None) -> RunResult:
    """Run one scenario; write ``trace.jsonl`` into ``out_dir`` (if given), one
    :class:`~vllm_repro.records.TraceLine` a step. ``result.json`` is not written here: the
    host writes it, with the verdict (:class:`~vllm_repro.records.ReportDir`).

    ``limits`` (:class:`~vllm_repro.engine.spec.LabLimits`, or
    :class:`vllm_repro.limits.RunLimits` as the mapping the worker receives, made a
    ``LabLimits`` here): ``max_trace_mb`` stops a run whose trace reaches it, ``max_kv_blocks``
    refuses an engine-core pool larger than it (both :class:`OverLimit`: outcome ``error``,
    kind ``input``).

    The result's ``outcome`` is ``clean``, ``crash``, ``violation``, ``stall`` or ``error``;
    ``error`` means the lab or the input failed (``error.kind``: ``input`` or ``lab``). On a
    slice tree, a run that imported a module the slice leaves out or used a stubbed package
    (:func:`slice_gap`) is a ``lab`` error whatever vLLM did, its crash's traceback kept.
    """
    events_before = len(getattr(_slice_runtime(), "EVENTS", ()))
    trace_f = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        trace_f = open(out_dir / ReportDir.TRACE, "w")

    limits = LabLimits.from_mapping(limits)
    cap = int(float(limits.max_trace_mb or 0) * (1 << 20))
    written = 0

    def write(line: TraceLine) -> None:
        nonlocal written
        if trace_f is not None:
            text = line.to_json() + "\n"
            written += len(text)
            if cap and written > cap:
                raise OverLimit(f"trace.jsonl reached {limits.max_trace_mb} MB at step "
                                f"{line.step} (VLLM_REPRO_MAX_TRACE_MB): the run was stopped there; "
                                "fewer requests or steps, or raise VLLM_REPRO_MAX_TRACE_MB")
            trace_f.write(text)

    devices_before = None
    timeout = ScenarioLimits.from_mapping(scenario.get("limits")).step_timeout_s \
        or limits.step_timeout_s
    current: list[StepLoop] = []
    watchdog = Watchdog(float(timeout), adapter.vllm_file,
                        lambda: getattr(current[0], "_phase", None) if current else None) \
        if timeout else None
    try:
        level = scenario.get("level") or "scheduler"
        devices_before = _emulate_devices(scenario)

        def start(loop: StepLoop) -> RunResult:
            loop.lab_limits, loop.watchdog = limits, watchdog
            current.append(loop)
            return loop.run()

        driver = LEVELS.get(level, LEVELS["scheduler"])
        result = driver(adapter, level, scenario, write, observer, start)
    except LevelMissing as exc:
        result = RunResult.failed("input", str(exc), lacks_level=exc.level)
    except RefusedByRelease as exc:
        result = RunResult.failed("input", str(exc))
        if exc.vllm_exc is not None:  # vLLM's own refusal: what `outcome: refused` is judged on
            result.refusal = describe_exception(exc.vllm_exc, adapter.vllm_file, 0, exc.phase)
            # the whole text, not its first line: a ValidationError's reason is on its second
            result.refusal.message = " ".join(str(exc.vllm_exc).split())[:800]
    except MemoryError:
        mb = limits.worker_memory_mb
        result = RunResult.failed("input", f"out of memory (limit {mb} MB, VLLM_REPRO_WORKER_MEMORY_MB): "
                                  "the run needs more than the worker may map; a smaller "
                                  "scenario, or raise VLLM_REPRO_WORKER_MEMORY_MB")
    except AdapterError as exc:
        cause = exc.__cause__ or exc
        result = RunResult.failed("lab", str(exc), traceback="".join(traceback.format_exception(
            type(cause), cause, cause.__traceback__))[-4000:])
    except Exception as exc:  # noqa: BLE001 - a bug in the lab itself: never a reproduction
        result = RunResult.failed("lab", f"{type(exc).__name__}: {exc}",
                                  traceback=traceback.format_exc()[-4000:])
    finally:
        if watchdog is not None:
            watchdog.close()
        if trace_f is not None:
            trace_f.close()
        if devices_before is not None:
            platform.set_device_count(devices_before)
    runtime = _slice_runtime()
    gap = None if runtime is None else \
        slice_gap(getattr(runtime, "EVENTS", [])[events_before:], adapter.version, result.crash)
    if gap is not None and not (result.error is not None and result.error.kind == "lab"):
        tb = result.crash.traceback if result.crash is not None else (
            result.error.traceback if result.error is not None else None)
        result = RunResult.failed("lab", gap, traceback=tb)
    result.scenario = scenario["name"]
    result.level = result.level or scenario.get("level", "scheduler")
    result.vllm = adapter.version
    result.python = sys.version.split()[0]
    return result


def _v1_level(loop_class: Callable[[dict], type[StepLoop]]) -> LevelDriver:
    """The driver of a V1 level whose loop is ``loop_class(scenario)``: refused on a release
    without the V1 engine."""
    def drive(adapter, level, scenario, write, observer, start) -> RunResult:
        if getattr(adapter, "generation", "v1") == "v0":
            raise LevelMissing(level, adapter.caps.refusal("v1-engine"))
        return start(loop_class(scenario)(adapter, scenario, write, observer))

    return drive


def _v0_level(adapter, level, scenario, write, observer, start) -> RunResult:
    """``level: v0-engine``: the V0 adapter (:func:`v0_adapter`), its platform scope."""
    v0 = v0_adapter(adapter)
    with v0.platform_scope():
        return start(V0EngineLoop(v0, scenario, write, observer))


#: scenario ``level`` -> its driver (an unknown name runs as ``scheduler``; the schema refuses it)
LEVELS: dict[str, LevelDriver] = {
    "scheduler": _v1_level(lambda scenario: StepLoop),
    # in-process, or the release's EngineCoreProc behind its client (config.multiprocess_mode)
    "engine-core": _v1_level(loop_class),
    "v0-engine": _v0_level,
}

__all__ = ["LEVELS", "run_scenario", "slice_gap", "v0_adapter"]
