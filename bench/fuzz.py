"""Time for `vllm-repro fuzz` to find each catalog entry from scratch (prints numbers; not a test).

For every catalog entry with an expectation, run ``fuzz --first --target SIGNATURE --level
LEVEL`` on the entry's first ``reproduces_on`` release over N seeds, each without the example
database (``--db none``: from scratch), and print the time to the first shrunk finding (median,
min, max over the seeds that found it; goal median <= 60 s on a 2-core machine), the examples
it took and the shrunk size. ``--only`` takes a catalog name or a substring of it (``45856``).

    python bench/fuzz.py [--seeds 5] [--time 180] [--workers 2] [--only NAME]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from vllm_repro.catalog import catalog_files  # noqa: E402
from vllm_repro.scenario import load_scenario  # noqa: E402


def target_of(sc) -> str | None:
    """The fuzz signature an entry's expectation names, or None when fuzz cannot reach it."""
    exp = sc.expect
    if exp is None:
        return None
    if exp.outcome == "crash":
        return f"crash:{exp.exception or ''}@{exp.where or ''}" if exp.where else f"crash:{exp.exception}"
    if exp.outcome == "violation":
        return f"violation:{exp.code}"
    return exp.outcome


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5, help="N: seeds per entry (1..N)")
    ap.add_argument("--time", type=int, default=180, help="search budget per seed, seconds")
    ap.add_argument("--workers", type=int, default=2, help="search processes per campaign")
    ap.add_argument("--only", action="append", default=[],
                    help="a catalog name or a part of it (repeatable)")
    args = ap.parse_args()
    rows = []
    for path in catalog_files(ROOT / "scenarios"):
        sc = load_scenario(path)
        if args.only and not any(o in sc.name for o in args.only):
            continue
        target = target_of(sc)
        versions = [v for v in sc.vllm.reproduces_on if re.fullmatch(r"[0-9.a-z]+", v)]
        if target is None or not versions:
            print(f"{sc.name}: no expectation or no concrete buggy release to fuzz")
            continue
        version = versions[0]
        times, sizes, examples, firsts, misses = [], [], [], [], 0
        for seed in range(1, args.seeds + 1):
            out = Path(tempfile.mkdtemp(prefix="bench-fuzz-"))
            cmd = [sys.executable, "-m", "vllm_repro.cli", "fuzz", "--vllm", version, "--first",
                   "--target", target, "--seed", str(seed), "--time", f"{args.time}s",
                   "--out", str(out), "--reports", str(out / "reports"),
                   "--policy", sc.config.policy, "--level", sc.level, "--db", "none",
                   "--workers", str(args.workers)]
            if sc.config.num_speculative_tokens:
                cmd.append("--spec")
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            m = re.search(r"(\d+) requests after shrinking, found after (\d+)s / (\d+) examples"
                          r"(?: \(first failing example at (\d+)s\))?", proc.stdout)
            if not m:
                misses += 1
                continue
            times.append(int(m.group(2)))
            examples.append(int(m.group(3)))
            if m.group(4) is not None:
                firsts.append(int(m.group(4)))
            found = next(out.glob("*.yaml"))
            sizes.append(len(yaml.safe_load(found.read_text())["requests"]))
        if times:
            rows.append((sc.name, version, target, statistics.median(times), min(times), max(times),
                         statistics.median(sizes), misses,
                         statistics.median(firsts) if firsts else float("nan")))
            print(f"{sc.name} on {version} ({target}): found in median {statistics.median(times):.0f} s "
                  f"(min {min(times)}, max {max(times)}; median {statistics.median(examples):.0f} "
                  f"examples; first failing example at median "
                  f"{statistics.median(firsts) if firsts else float('nan'):.0f} s, before "
                  f"shrinking) over {len(times)}/{args.seeds} seeds; "
                  f"shrunk to median {statistics.median(sizes):.0f} requests"
                  + (f"; not found within {args.time} s for {misses} seed(s)" if misses else ""))
        else:
            print(f"{sc.name} on {version} ({target}): not found within {args.time} s for any seed")
    if rows:
        print("\nentry | release | median s (shrunk) | min | max | median s to first failure | "
              "shrunk requests | misses")
        for r in rows:
            print(f"{r[0]} | {r[1]} | {r[3]:.0f} | {r[4]} | {r[5]} | {r[8]:.0f} | {r[6]:.0f} | {r[7]}")


if __name__ == "__main__":
    main()
