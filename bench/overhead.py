"""The audit's cost: one workload run with and without the audit in one worker process.

    python bench/overhead.py                    # vLLM 0.33.0, fcfs and prefix caching on
    python bench/overhead.py --vllm 0.11.0 --no-cache --repeat 5

The workload is the stress generator's (256 requests, mixed short and long prompts, aborts,
early EOS) on a 2,000-block pool. Steps/s counts the step loop only (schedule, the fake model,
update_from_output, and the audit when on), best of ``--repeat`` runs each, alternating;
by wall clock and by the worker's CPU time in the loop (steady when other processes load the
machine). Prints steps/s with and without the audit and their ratio, and whether the CPU-time
ratio meets the goal (issue 21: >= 0.6 on this workload; issue 3 asked >= 0.5).
"""

from __future__ import annotations

import argparse
import math
import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from vllm_repro.engine.host import Worker  # noqa: E402
from vllm_repro.sources.prepare import prepare_release  # noqa: E402
from vllm_repro.scenario.schema import Scenario  # noqa: E402


GOAL = 0.6  # issue 21: steps/s with the audit / without, by CPU time


def workload_args(ap, vllm: str) -> None:
    """The stress workload's options on ``ap`` (the audit and engine-core benches share them):
    ``--vllm`` (default ``vllm``), ``--policy``, ``--no-cache``, ``--blocks``; read them back with
    :func:`workload`'s arguments ``args.policy, not args.no_cache, args.blocks``."""
    ap.add_argument("--vllm", default=vllm)
    ap.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    ap.add_argument("--no-cache", action="store_true", help="prefix caching off")
    ap.add_argument("--blocks", type=int, default=2000)


def workload(policy: str, caching: bool, blocks: int, name: str = "bench-overhead",
             **extra) -> dict:
    """The stress generator's workload (seed 7) on ``blocks`` blocks, as a worker payload;
    ``extra``: top-level scenario keys (``level``) or, for ``async_scheduling``, config."""
    spec = importlib.util.spec_from_file_location("stress_gen", ROOT / "scenarios/stress/generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    sc = gen.build(policy, caching, seed=7)
    sc["name"] = name
    sc["config"]["num_gpu_blocks"] = blocks
    if "async_scheduling" in extra:
        sc["config"]["async_scheduling"] = extra.pop("async_scheduling")
    sc.update(extra)
    return Scenario.model_validate(sc).child_payload()


def main() -> None:
    ap = argparse.ArgumentParser()
    workload_args(ap, "0.33.0")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    payload = workload(args.policy, not args.no_cache, args.blocks)
    env = prepare_release(args.vllm)
    best = {False: 0.0, True: 0.0}
    best_cpu = {False: 0.0, True: 0.0}
    steps = None
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp, \
            Worker(env, Path(tmp) / "engine.log") as worker:
        for _ in range(args.repeat):
            for audit in (False, True):
                res = worker.run(payload, None, audit=audit, keep_going=True)
                if res.outcome not in ("clean", "violation"):
                    sys.exit(f"run failed: {res.outcome} {res.error or res.crash}")
                steps = res.steps
                best[audit] = max(best[audit], res.timing.steps_per_s)
                cpu = res.timing.run_cpu_s
                if cpu:
                    best_cpu[audit] = max(best_cpu[audit], steps / cpu)
                if audit and res.violations:
                    print(f"  (audit findings: {res.audit.by_code})")
    print(f"vLLM {args.vllm}, {args.policy}, prefix caching {'off' if args.no_cache else 'on'}, "
          f"256 requests, {args.blocks} blocks, {steps} steps, best of {args.repeat}:")
    print("                    wall clock     CPU time")
    print(f"  without audit: {best[False]:8.1f} steps/s {best_cpu[False]:8.1f} steps/s")
    print(f"  with audit:    {best[True]:8.1f} steps/s {best_cpu[True]:8.1f} steps/s")
    ratio, ratio_cpu = best[True] / best[False], (best_cpu[True] / best_cpu[False]
                                                  if best_cpu[False] else float("nan"))
    print(f"  ratio:         {ratio:8.3f}         {ratio_cpu:8.3f}")
    met = "met" if ratio_cpu >= GOAL else "NOT met"
    # (cut, not rounded, to three decimals: 0.5996 is not met, and must not print as 0.600)
    shown = math.floor(ratio_cpu * 1000) / 1000
    print(f"  audit overhead ratio (CPU time, same run) {shown:.3f}: goal >= {GOAL} {met}")


if __name__ == "__main__":
    main()
