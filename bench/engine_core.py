"""Level engine-core against level scheduler on one workload, in one worker process (prints
numbers; not a test).

    python bench/engine_core.py                     # vLLM 0.33.0, fcfs, prefix caching on
    python bench/engine_core.py --vllm 0.20.2 --async-scheduling --repeat 5

The workload is the stress generator's (256 requests, mixed short and long prompts, aborts,
early EOS) on a 2,000-block pool, the audit on at both levels. Steps/s counts the step loop
only (at scheduler level: schedule, the fake model, update_from_output; at engine-core level:
EngineCoreProc._process_engine_step with the fake executor), best of ``--repeat`` runs each,
alternating, by wall clock and by the worker's CPU time in the loop. Start-up is the engine-core
run's build time: VllmConfig, the fake executor, EngineCore.__init__ (KV cache specs, free
memory, get_kv_cache_config, the scheduler) and adding the requests. Goal (issue #13):
engine-core steps/s >= 0.8 x scheduler steps/s.

    python bench/engine_core.py --worker-state      # the release's InputBatch vs PersistentBatch

``--worker-state`` compares, at ``--level`` (default engine-core), the release's own worker-side
state (V1 ``InputBatch``, :mod:`vllm_repro.engine.input_batch`; from 0.34.0 the V2 runner's
``RequestState`` + ``BlockTables``, :mod:`vllm_repro.engine.request_states`) with the lab's
``PersistentBatch`` on the same workload, each in its own worker process. Goal (issue #45):
the release's state steps/s >= 0.8 x PersistentBatch steps/s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import workload, workload_args  # noqa: E402  (the same stress workload)

from vllm_repro.engine.host import Worker  # noqa: E402
from vllm_repro.sources.prepare import prepare_release  # noqa: E402


def worker_state(args) -> None:
    """``--worker-state``: one level (``--level``), the release's own worker-side state
    (``InputBatch``: VLLM_REPRO_WORKER_STATE=vllm) against the lab's ``PersistentBatch``
    (``lab``) on the same workload, each in its own worker process, alternating. Goal (issue
    #45): vllm steps/s >= 0.8 x lab steps/s."""
    modes = ("lab", "vllm")
    payload = workload(args.policy, not args.no_cache, args.blocks, name="bench-worker-state",
                       level=args.level, async_scheduling=args.async_scheduling)
    env = prepare_release(args.vllm)
    best = dict.fromkeys(modes, 0.0)
    best_cpu = dict.fromkeys(modes, 0.0)
    steps = dict.fromkeys(modes, 0)
    kinds = dict.fromkeys(modes, "")
    with tempfile.TemporaryDirectory(prefix="bench-worker-state-") as tmp:
        workers = {m: Worker(env, Path(tmp) / f"engine-{m}.log",
                             extra_env={"VLLM_REPRO_WORKER_STATE": m}) for m in modes}
        try:
            for w in workers.values():
                w.__enter__()
            for _ in range(args.repeat):
                for m in modes:
                    res = workers[m].run(payload, None, audit=True, keep_going=True)
                    if res.outcome not in ("clean", "violation"):
                        sys.exit(f"{m} run failed: {res.outcome} "
                                 f"{res.error or res.crash or res.stall}")
                    steps[m] = res.steps
                    kinds[m] = (res.worker_state or m).split(" (")[0]
                    best[m] = max(best[m], res.timing.steps_per_s)
                    if res.timing.run_cpu_s:
                        best_cpu[m] = max(best_cpu[m], res.steps / res.timing.run_cpu_s)
        finally:
            for w in workers.values():
                w.__exit__(None, None, None)
        notes = (Path(tmp) / "engine-vllm.log").read_text(errors="replace")
    print(f"vLLM {args.vllm}, level {args.level}, {args.policy}, prefix caching "
          f"{'off' if args.no_cache else 'on'}, async scheduling "
          f"{'on' if args.async_scheduling else 'off'}, 256 requests, {args.blocks} blocks, "
          f"audit on, best of {args.repeat}:")
    for line in notes.splitlines():
        if "vllm-repro: note:" in line:
            print("  " + line.strip())
    print(f"  {'worker state':<26}  steps   wall clock        CPU time")
    for m in modes:
        print(f"  {kinds[m]:<26} {steps[m]:6d} {best[m]:8.1f} steps/s {best_cpu[m]:8.1f} steps/s")
    ratio = best["vllm"] / best["lab"]
    ratio_cpu = best_cpu["vllm"] / best_cpu["lab"] if best_cpu["lab"] else float("nan")
    print(f"  {kinds['vllm']} / {kinds['lab']}: {ratio:.2f} (wall), {ratio_cpu:.2f} (CPU)   "
          "(goal >= 0.8)")


def main() -> None:
    ap = argparse.ArgumentParser()
    workload_args(ap, "0.33.0")
    ap.add_argument("--async-scheduling", action="store_true", help="AsyncScheduler at both levels")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker-state", action="store_true",
                    help="compare the release's InputBatch with the lab's PersistentBatch "
                         "at --level instead")
    ap.add_argument("--level", choices=("scheduler", "engine-core"), default="engine-core")
    args = ap.parse_args()
    if args.worker_state:
        return worker_state(args)
    levels = ("scheduler", "engine-core")
    payloads = {lv: workload(args.policy, not args.no_cache, args.blocks, name=f"bench-{lv}",
                             level=lv, async_scheduling=args.async_scheduling)
                for lv in levels}
    env = prepare_release(args.vllm)
    best = dict.fromkeys(levels, 0.0)
    best_cpu = dict.fromkeys(levels, 0.0)
    build = dict.fromkeys(levels, float("inf"))
    steps = dict.fromkeys(levels, 0)
    with tempfile.TemporaryDirectory(prefix="bench-engine-core-") as tmp, \
            Worker(env, Path(tmp) / "engine.log") as worker:
        print(f"vLLM {args.vllm} imported in {worker.hello.get('import_s')} s")
        for _ in range(args.repeat):
            for lv in levels:
                res = worker.run(payloads[lv], None, audit=True, keep_going=True)
                if res.outcome not in ("clean", "violation"):
                    sys.exit(f"{lv} run failed: {res.outcome} {res.error or res.crash or res.stall}")
                t = res.timing
                steps[lv] = res.steps
                best[lv] = max(best[lv], t.steps_per_s)
                if t.run_cpu_s:
                    best_cpu[lv] = max(best_cpu[lv], res.steps / t.run_cpu_s)
                build[lv] = min(build[lv], t.build_s)
    print(f"vLLM {args.vllm}, {args.policy}, prefix caching {'off' if args.no_cache else 'on'}, "
          f"async scheduling {'on' if args.async_scheduling else 'off'}, 256 requests, "
          f"{args.blocks} blocks, audit on, best of {args.repeat}:")
    print("                 steps   wall clock        CPU time     start-up")
    for lv in levels:
        print(f"  {lv:<12} {steps[lv]:6d} {best[lv]:8.1f} steps/s {best_cpu[lv]:8.1f} steps/s "
              f"{build[lv]:8.3f} s")
    ratio = best["engine-core"] / best["scheduler"]
    ratio_cpu = best_cpu["engine-core"] / best_cpu["scheduler"] if best_cpu["scheduler"] else float("nan")
    print(f"  engine-core / scheduler: {ratio:.2f} (wall), {ratio_cpu:.2f} (CPU)   (goal >= 0.8)")


if __name__ == "__main__":
    main()
