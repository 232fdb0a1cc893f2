"""The engine worker: a process inside a release environment that imports vLLM once and runs
scenarios sent to it.

Protocol: one JSON object a line on stdin, ``{"id": ..., "scenario": {...}, "out_dir": path or
null, "options": {"audit": bool, "keep_going": bool}}`` (tests only: ``"plant"``, ``"plant_args"``,
see :mod:`vllm_repro.audit.plant`); one JSON reply a line on the file
descriptor given by ``--reply-fd`` (stdout and stderr are vLLM's log). The first reply, id
``"hello"``, reports the release, the import time and the release's capabilities record, or an
``error`` if vLLM cannot be imported. Every later reply is ``{"id": ..., "result": {...}}``, a
:class:`~vllm_repro.records.RunResult` as JSON. The worker writes a run's ``trace.jsonl`` into
``out_dir``; ``result.json`` is the host's (:class:`~vllm_repro.records.ReportDir`).

Run as ``python -m vllm_repro.engine.worker --model-dir DIR --reply-fd N`` with the release tree
and the lab's package on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path


def _reply(fd_file, obj: dict) -> None:
    fd_file.write(json.dumps(obj, default=str) + "\n")
    fd_file.flush()


def limit_memory(mb: int) -> int | None:
    """``RLIMIT_AS`` of this process to ``mb`` MB (``VLLM_REPRO_WORKER_MEMORY_MB``), before vLLM is
    imported: a run that would exhaust the machine gets ``MemoryError`` (reported as ``out of
    memory``) instead. Not lowered below what the process already maps: then nothing is set and
    the MB it maps are returned (a warm worker, forked from a parent that preloaded torch, maps
    gigabytes before it imports anything; under a limit below that, every allocation fails, as
    anything or as a crash). None otherwise; a no-op where the platform has no ``resource``
    module."""
    if mb <= 0:
        return None
    try:
        import resource
    except ImportError:
        return None
    mapped = status_mb("VmSize")
    if mapped is not None and mapped >= mb:
        return mapped
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = mb << 20
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (ValueError, OSError):
        pass
    return None


def status_mb(field: str) -> int | None:
    """One ``kB`` field of ``/proc/self/status`` (``VmPeak``: the peak address space, what the
    host compares with ``RLIMIT_AS`` when an import failed; ``VmSize``: what is mapped now), in
    MB. ``None`` where there is no such file or field."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) >> 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def make_adapter(model_dir: Path):
    """The adapter of the release on ``sys.path``, by probing its tree: the V1 adapter where the
    release has the V1 engine (its V0 engine, where it also has one, is reached through it at
    ``level: v0-engine``), else the V0 adapter (releases before the V1 engine). Raises what the
    V1 adapter raised when the tree has neither."""
    import importlib.util

    # by file, without importing vllm: the V1 adapter sets its variables before that import
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or ()) if spec is not None else []
    v1 = not roots or any((Path(r) / "v1" / "core" / "kv_cache_manager.py").is_file()
                          for r in roots)
    if v1:
        from .adapter import V1Adapter

        return V1Adapter(model_dir)
    from .v0 import V0Adapter

    return V0Adapter(model_dir)


#: whether this process ran a scenario (then the next run's collection is of its garbage)
_RAN = False


def _held(*_args, **_kwargs) -> None:
    """``gc.freeze`` / ``gc.unfreeze`` while a run holds the heap frozen: nothing."""


@contextmanager
def heap_kept_frozen():
    """Hold the process's heap (torch, vLLM's modules, the lab: about 570,000 objects) frozen out
    of the garbage collector for one run; collections still run, over what the run makes.

    vLLM assumes one engine per process: ``EngineCore.__init__`` ends with
    ``vllm/utils/gc_utils.py:freeze_gc_heap`` (collect every generation, then ``gc.freeze()``)
    and ``EngineCore.shutdown`` (0.24.0 ``vllm/v1/engine/core.py``) calls ``gc.unfreeze()`` and
    then ``cleanup_dist_env_and_memory`` (``vllm/distributed/parallel_state.py``), which
    collects again, so that an engine deleted in-process is freed. A worker runs one EngineCore
    per scenario, and that unfreeze put the whole heap back under a full collection at every
    run's end: 0.32 of a 0.37 s engine-core run of #46066's scenario on 0.24.0 (CPU time,
    median of 6, load 3). Here the heap alive before the run is frozen (the last run's garbage
    collected first: only objects made since the last freeze are walked), and ``gc.freeze`` /
    ``gc.unfreeze`` do nothing while the run lasts, so the engine's own objects are never
    frozen, and vLLM's collections walk only them (the same run: 0.045 s) and free them as
    its shutdown means to. The calls are the process's garbage collection, not engine logic:
    no scheduling or KV decision reads them. Mirrors nothing; restores both on exit. The first
    run of a process collects nothing first (a forked warm worker's one run would walk the whole
    heap for nothing)."""
    global _RAN
    if _RAN:  # a run before this one: its garbage, not the heap, is walked
        gc.collect()
    # (not gc.get_freeze_count(): it counts the frozen heap by walking it, 31 ms a call here)
    _RAN = True
    gc.freeze()
    held = gc.freeze, gc.unfreeze
    gc.freeze = gc.unfreeze = _held
    try:
        yield
    finally:
        gc.freeze, gc.unfreeze = held


def _last_resort_for(reply, job: dict, adapter) -> None:
    """What the watchdog does when a step it interrupted does not let go (the run's thread sits
    in C code): send this job's ``hang`` result and exit the worker (``engine/watchdog.py``);
    the host sees the worker gone at its next job and starts a new one."""
    from ..records import RunResult
    from . import watchdog

    def last_resort(hang) -> None:
        result = RunResult("hang", hang=hang, scenario=job["scenario"].get("name"),
                           vllm=adapter.version, level=job["scenario"].get("level") or "scheduler",
                           platform=adapter.platform, steps=hang.step)
        try:
            _reply(reply, {"id": job.get("id"), "result": result.to_dict()})
        finally:
            os._exit(0)

    watchdog.LAST_RESORT = last_resort


def _die_with_starter(interval_s: float = 0.5) -> None:
    """A daemon thread that kills this worker's whole process group (vLLM's rank and engine
    core processes with it) once the process that started it is gone: the CLI of a cold
    worker killed with ``SIGKILL`` runs no handler, and the worker may be blocked for minutes
    in a step (a rank that hangs). A warm-forked worker dies with its warm parent already
    (``PR_SET_PDEATHSIG``), and its parent kills it when its client goes away."""
    import signal
    import threading

    starter = os.getppid()

    def watch() -> None:
        while os.getppid() == starter:
            time.sleep(interval_s)
        try:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        except OSError:
            os._exit(3)

    threading.Thread(target=watch, name="vllm-repro-starter-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """The worker: a child subreaper (a process vLLM's code or a patch under test starts in
    its own session, or double-forks, is re-parented to it), which kills every process left
    below it when it ends (:func:`vllm_repro.procs.sweep`), cold or forked by a warm parent."""
    from .. import procs

    procs.make_subreaper()
    _die_with_starter()
    try:
        return _main(argv)
    finally:
        procs.sweep()


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm_repro.engine.worker")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--reply-fd", type=int, required=True)
    ap.add_argument("--memory-limit-mb", type=int, default=0)
    args = ap.parse_args(argv)
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    mapped = limit_memory(args.memory_limit_mb)
    if mapped is not None:  # the host says: out of memory while importing vLLM (exit 2)
        _reply(reply, {"id": "hello", "ok": False, "limit_below_mapped": True,
                       "error": f"the address-space limit, {args.memory_limit_mb} MB, is below "
                                f"the {mapped} MB this worker maps before importing vLLM",
                       "vm_peak_mb": status_mb("VmPeak")})
        return 3
    t0 = time.perf_counter()
    try:  # on a slice tree: its finder ("vllm.x.y is not in the slice ...") and stubs
        import _vllm_slice  # noqa: F401  (normally already imported by the slice's sitecustomize)
    except ImportError:
        pass
    try:
        adapter = make_adapter(Path(args.model_dir))
    except Exception as exc:  # noqa: BLE001 - reported to the host as an environment error
        _reply(reply, {"id": "hello", "ok": False,
                       "error": f"importing vLLM failed: {type(exc).__name__}"
                                f"{f': {exc}' if str(exc) else ''}",
                       "traceback": traceback.format_exc()[-4000:],
                       "vm_peak_mb": status_mb("VmPeak")})
        return 3
    if os.environ.get("VLLM_REPRO_WARM_MODULES_OUT"):  # what a warm parent should import
        from .warm import record_modules

        record_modules(os.environ["VLLM_REPRO_WARM_MODULES_OUT"])
    _reply(reply, {"id": "hello", "ok": True, "vllm": adapter.version,
                   "vllm_path": str(adapter.vllm_file), "import_s": round(time.perf_counter() - t0, 3),
                   "python": sys.version.split()[0], "platform": adapter.platform,
                   "capabilities": adapter.caps.to_dict()})
    from ..records import RunResult
    from .run import run_scenario

    for raw in sys.stdin:
        raw = raw.strip()
        if not raw:
            continue
        job = json.loads(raw)
        opts = job.get("options") or {}
        observer = None
        if opts.get("audit"):
            try:
                if job["scenario"].get("level") == "v0-engine":
                    from ..audit.v0 import V0Auditor as Auditor
                else:
                    from ..audit import Auditor

                observer = Auditor(adapter, keep_going=bool(opts.get("keep_going")))
            except ImportError:
                observer = None
        out_dir = Path(job["out_dir"]) if job.get("out_dir") else None
        ctx = None
        if opts.get("plant"):  # the audit's tests plant a fault into vLLM for this run only
            from ..audit.plant import PlantContext, WithPlant, load_plant

            ctx = PlantContext(adapter)
            try:
                load_plant(opts["plant"])(ctx, **(opts.get("plant_args") or {}))
            except Exception as exc:  # noqa: BLE001 - a broken test plug-in
                ctx.restore()
                failed = RunResult.failed("lab", f"plant: {type(exc).__name__}: {exc}",
                                          scenario=job["scenario"].get("name"), vllm=adapter.version)
                failed.planted = {"plant": opts["plant"]}
                _reply(reply, {"id": job.get("id"), "result": failed.to_dict()})
                continue
            observer = WithPlant(ctx, observer)
        _last_resort_for(reply, job, adapter)
        try:
            with heap_kept_frozen():
                result = run_scenario(adapter, job["scenario"], out_dir, observer=observer,
                                      limits=opts.get("limits"))
        finally:
            if ctx is not None:
                ctx.restore()
        result.platform = adapter.platform
        if ctx is not None:
            result.planted = {"plant": opts["plant"], "args": opts.get("plant_args") or {},
                              "notes": ctx.notes}
        _reply(reply, {"id": job.get("id"), "result": result.to_dict()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
