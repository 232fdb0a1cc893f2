"""Time for `vllm-repro fuzz` to find each catalog entry from scratch (prints numbers; not a test).

For every catalog entry with an expectation, run ``fuzz --first --target SIGNATURE --level
LEVEL`` on the entry's first ``reproduces_on`` release over N seeds, each without the example
database (``--db none``: from scratch), and print the time to find it, the first failing example
with the entry's signature (median over the N seeds, a seed that did not find it counted as over
the budget; goal median <= 60 s on a 2-core machine), the time to the shrunk finding written
(median, min, max the same way), the examples it took and the shrunk size. Then
(unless ``--no-fixed``) the same search, seed 1, on the entry's first concrete ``clean_on``
release: nothing with the signature may be found there (``fixed clean``). The workload family
given to the fuzzer is the entry's level, its policy and whether it uses spec decode; the
signature (``exception@frame`` or violation code, and the expectation's ``message`` regex where
it has one: ``--target`` and ``--target-message``) is only the stop condition, what counts as
found, never a draw.
``--only`` takes a catalog name or a substring of it (``45856``). The 1-minute load average is
printed with each run (the machine is shared).

The shrinker is bounded (``--shrink-runs 150``, fuzz's own default is unbounded), so the time to
the shrunk finding is to a usable reproducer. ``--seeds 0`` runs only the searches on the fixed
releases.

    python bench/fuzz.py [--seeds 5] [--time 120] [--workers 2] [--only NAME] [--no-fixed]
        [--shrink-runs 150]
"""

from __future__ import annotations

import argparse
import os
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


def fuzz_cmd(version: str, sc, target: str, seed: int, args, out: Path) -> list[str]:
    """The ``vllm-repro fuzz`` command line of one timed search."""
    cmd = [sys.executable, "-m", "vllm_repro.cli", "fuzz", "--vllm", version, "--first",
           "--target", target, "--seed", str(seed), "--time", f"{args.time}s",
           "--out", str(out), "--reports", str(out / "reports"),
           "--policy", sc.config.policy, "--level", sc.level, "--db", "none",
           "--workers", str(args.workers)]
    if sc.config.num_speculative_tokens:
        cmd.append("--spec")
    if sc.expect.message:  # part of the catalog signature: two bugs may share exception@frame
        cmd += ["--target-message", sc.expect.message]
    cmd += ["--shrink-runs", str(args.shrink_runs)]
    return cmd


def concrete(versions) -> list[str]:
    return [v for v in versions if re.fullmatch(r"[0-9.a-z]+", v)]


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5, help="N: seeds per entry (1..N)")
    ap.add_argument("--time", type=int, default=120, help="search budget per seed, seconds")
    ap.add_argument("--workers", type=int, default=2, help="search processes per campaign")
    ap.add_argument("--only", action="append", default=[],
                    help="a catalog name or a part of it (repeatable)")
    ap.add_argument("--shrink-runs", type=int, default=150,
                    help="fuzz --shrink-runs: the shrinker's scenario runs per finding (default "
                         "150; 0: hypothesis's own limits, fuzz's default)")
    ap.add_argument("--no-fixed", dest="fixed", action="store_false",
                    help="skip the search on the fixed release")
    args = ap.parse_args()
    rows = []
    for path in catalog_files(ROOT / "scenarios"):
        sc = load_scenario(path)
        if args.only and not any(o in sc.name for o in args.only):
            continue
        target = target_of(sc)
        versions = concrete(sc.vllm.reproduces_on)
        if target is None or not versions:
            print(f"{sc.name}: no expectation or no concrete buggy release to fuzz")
            continue
        version = versions[0]
        times, sizes, examples, firsts, misses = [], [], [], [], 0
        for seed in range(1, args.seeds + 1):
            out = Path(tempfile.mkdtemp(prefix="bench-fuzz-"))
            load0 = load()
            proc = subprocess.run(fuzz_cmd(version, sc, target, seed, args, out),
                                  capture_output=True, text=True, cwd=ROOT)
            m = re.search(r"(\d+) requests after shrinking, found after (\d+)s / (\d+) examples"
                          r"(?: \(first failing example at (\d+)s\))?", proc.stdout)
            print(f"  {sc.name} on {version} seed {seed}: "
                  + (f"found after {m.group(2)} s (first failing example at {m.group(4)} s)"
                     if m else f"not found (exit {proc.returncode})")
                  + f"; load {load0} -> {load()}", flush=True)
            if not m:
                misses += 1
                continue
            times.append(int(m.group(2)))
            examples.append(int(m.group(3)))
            if m.group(4) is not None:
                firsts.append(int(m.group(4)))
            found = next(out.glob("*.yaml"))
            sizes.append(len(yaml.safe_load(found.read_text())["requests"]))
        fixed, clean = (concrete(sc.vllm.clean_on) or [None])[0], None
        if args.fixed and fixed is not None:
            out = Path(tempfile.mkdtemp(prefix="bench-fuzz-fixed-"))
            load0 = load()
            proc = subprocess.run(fuzz_cmd(fixed, sc, target, 1, args, out),
                                  capture_output=True, text=True, cwd=ROOT)
            # exit 0: searched and found nothing with the signature; 1: found it; else no run
            clean = {0: "y", 1: "n"}.get(proc.returncode, f"no run (exit {proc.returncode})")
            print(f"  {sc.name} on fixed {fixed} seed 1: "
                  + {"y": "nothing found", "n": "FOUND"}.get(clean, clean)
                  + f"; load {load0} -> {load()}", flush=True)
        med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
        # over every seed: a seed that did not find it counts as over the budget (inf), so
        # 2 of 5 found is a median of "> budget", not the median of the two that found it
        over = [float("inf")] * misses
        find_s, shrunk_s = med(firsts + over), med(times + over)
        rows.append((sc.name, version, target, len(times), args.seeds, find_s, shrunk_s,
                     min(times, default=None), max(times, default=None),
                     med(examples), med(sizes), fixed, clean))
        print(f"{sc.name} on {version} ({target}): found {len(times)}/{args.seeds}"
              + (f", median {secs(find_s, args.time)} to find it (first failing example), "
                 f"{secs(shrunk_s, args.time)} to the shrunk finding (min {min(times)}, max "
                 f"{max(times)}); median {med(examples):.0f} examples; shrunk to median "
                 f"{med(sizes):.0f} requests" if times else "")
              + (f"; fixed {fixed}: clean {clean}" if clean is not None else ""), flush=True)
    if rows:
        print(f"\nentry | buggy release | found | median s to find (first failing example; "
              f"goal <= 60) | median s to shrunk finding | min | max | median examples | "
              f"shrunk requests | fixed release | fixed clean   (--time {args.time}, "
              f"--workers {args.workers}, --shrink-runs {args.shrink_runs}, misses counted as "
              f"over the budget)")
        for r in rows:
            def n(x):
                return "-" if x is None or x != x else secs(x, args.time).removesuffix(" s")
            print(f"{r[0]} | {r[1]} | {r[3]}/{r[4]} | {n(r[5])} | {n(r[6])} | {n(r[7])} | "
                  f"{n(r[8])} | {n(r[9])} | {n(r[10])} | {r[11] or '-'} | {r[12] or '-'}")


def secs(x: float, budget: int) -> str:
    """``x`` seconds as printed: ``> budget s`` for a median that is a miss (inf)."""
    return f"> {budget} s" if x == float("inf") else f"{x:.0f} s"


if __name__ == "__main__":
    main()
