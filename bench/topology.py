"""Rank processes against the in-process engine core on one workload, in one worker process
(prints numbers; not a test).

    python bench/topology.py                        # vLLM 0.33.0, fcfs, prefix caching on
    python bench/topology.py --vllm 0.26.0 --repeat 3

The workload is the stress generator's (256 requests, mixed short and long prompts, aborts,
early EOS) on a 2,000-block pool, at level engine-core, the audit on, in six topologies: the
in-process executor (TP=1, the baseline), PP=3 in-process (its batch queue of 3), and the
release's own MultiprocExecutor with rank processes (``distributed_executor_backend: mp``) at
TP=2 and at PP=3, and the engine core in its own process behind the release's client
(``multiprocess_mode``: the release's EngineCoreProc started by its SyncMPClient), alone and over
TP=2 ranks. Steps/s counts the step loop only (wall clock: the ranks are other processes,
so the worker's CPU time would leave them out), best of ``--repeat`` runs each, alternating.
Start-up is the build time (with ranks: vLLM forking and readying its WorkerProcs). Goal (issue
44): multi-process steps/s >= 0.5 x the in-process engine core's.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from vllm_repro.engine.host import Worker  # noqa: E402
from vllm_repro.scenario.schema import Scenario  # noqa: E402
from vllm_repro.sources.prepare import prepare_release  # noqa: E402

TOPOLOGIES = {
    "in-process": {},
    "PP=3 in-process": {"pipeline_parallel_size": 3},
    "TP=2 mp": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    "PP=3 mp": {"pipeline_parallel_size": 3, "distributed_executor_backend": "mp"},
    "EngineCoreProc": {"multiprocess_mode": True},
    "EngineCoreProc TP=2 mp": {"multiprocess_mode": True, "tensor_parallel_size": 2,
                               "distributed_executor_backend": "mp"},
}


def workload(policy: str, caching: bool, blocks: int, name: str, config: dict) -> dict:
    """The stress generator's workload (seed 7) at level engine-core with ``config``'s fields
    added, as a worker payload."""
    spec = importlib.util.spec_from_file_location("stress_gen", ROOT / "scenarios/stress/generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    sc = gen.build(policy, caching, seed=7)
    sc["name"] = name
    sc["level"] = "engine-core"
    sc["config"]["num_gpu_blocks"] = blocks
    sc["config"].update(config)
    return Scenario.model_validate(sc).child_payload()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm", default="0.33.0")
    ap.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    ap.add_argument("--no-cache", action="store_true", help="prefix caching off")
    ap.add_argument("--blocks", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    payloads = {t: workload(args.policy, not args.no_cache, args.blocks,
                            f"bench-topology-{i}", cfg) for i, (t, cfg) in enumerate(TOPOLOGIES.items())}
    env = prepare_release(args.vllm)
    best = dict.fromkeys(TOPOLOGIES, 0.0)
    build = dict.fromkeys(TOPOLOGIES, float("inf"))
    steps = dict.fromkeys(TOPOLOGIES, 0)
    with tempfile.TemporaryDirectory(prefix="bench-topology-") as tmp, \
            Worker(env, Path(tmp) / "engine.log") as worker:
        print(f"vLLM {args.vllm} imported in {worker.hello.get('import_s')} s")
        for _ in range(args.repeat):
            for t in TOPOLOGIES:
                res = worker.run(payloads[t], None, audit=True, keep_going=True)
                if res.outcome not in ("clean", "violation"):
                    sys.exit(f"{t} run failed: {res.outcome} {res.error or res.crash or res.stall}")
                steps[t] = res.steps
                best[t] = max(best[t], res.timing.steps_per_s)
                build[t] = min(build[t], res.timing.build_s)
    print(f"vLLM {args.vllm}, {args.policy}, prefix caching {'off' if args.no_cache else 'on'}, "
          f"256 requests, {args.blocks} blocks, level engine-core, audit on, best of {args.repeat}:")
    print("                          steps   wall clock     start-up   vs in-process")
    base = best["in-process"]
    for t in TOPOLOGIES:
        print(f"  {t:<22} {steps[t]:6d} {best[t]:8.1f} steps/s {build[t]:8.3f} s   "
              f"{best[t] / base:5.2f}x")
    worst = min(best[t] for t in TOPOLOGIES if "mp" in t or "Proc" in t) / base
    print(f"  slowest multi-process / in-process: {worst:.2f}   (goal >= 0.5)")


if __name__ == "__main__":
    main()
