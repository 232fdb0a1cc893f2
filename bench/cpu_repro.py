"""Wall time of `make cpu-repro`'s command, cold cache vs warm (prints numbers; not a test).

    python bench/cpu_repro.py            # warm: the cache as it is
    python bench/cpu_repro.py --cold     # cold: a fresh, temporary VLLM_REPRO_CACHE

Goal (issue #2): a warm run under 30 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(env: dict) -> float:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vllm_repro.cli", "run",
                           str(ROOT / "scenarios/vllm-23347-priority-preempt-scheduled.yaml"),
                           "--reports", tempfile.mkdtemp(prefix="bench-reports-")],
                          env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"cpu-repro failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cold", action="store_true", help="also time a run on an empty cache")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ)
    if args.cold:
        env["VLLM_REPRO_CACHE"] = tempfile.mkdtemp(prefix="vllm-repro-cold-")
        print(f"cold (empty cache {env['VLLM_REPRO_CACHE']}): {run(env):.1f} s")
    warm = sorted(run(env) for _ in range(args.repeat))
    print(f"warm: median {warm[len(warm) // 2]:.1f} s, min {warm[0]:.1f} s, max {warm[-1]:.1f} s "
          f"over {args.repeat} runs (goal < 30 s)")


if __name__ == "__main__":
    main()
