"""Warm runs (docs/warm-runs.md): the patch-and-retry loop's wall time, in one run (prints
numbers; not a test).

    python bench/warm.py                     # vLLM 0.10.1.1, the flagship, 5 warm runs
    python bench/warm.py --repeat 7 --no-make --no-audit

Prints, each as ``vllm-repro run`` sees it from the command line (a new CLI process a run):

- cold: ``--cold`` (a new worker process imports torch, transformers, ... and vLLM);
- warm: median of ``--repeat`` runs with the environment's warm parent already up (the first
  warm run, which starts it when none serves, is printed apart);
- warm after a one-line edit of the release's ``scheduler.py``: in a copy of the tree (the
  cached tree is never touched), through the real CLI with the release's preparation pointed
  at the copy; each run edits the line again, so vLLM's module is recompiled every time;
- ``make cpu-repro`` (native) warm: median of 3;
- the audit's overhead on the 256-request stress workload (bench/overhead.py, same release).

The machine's load average is printed before and after: on a shared machine wall times
follow the load. Goals (issue 21): warm re-run < 3 s, ``make cpu-repro`` warm < 6 s.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGSHIP = ROOT / "scenarios/vllm-23347-priority-preempt-scheduled.yaml"
sys.path.insert(0, str(ROOT / "src"))

# the CLI with the release's preparation replaced by the edited copy of its tree
DRIVER = textwrap.dedent("""\
    import sys
    from pathlib import Path
    import vllm_repro.lab as lab
    from vllm_repro.sources.env import ReleaseEnv

    tree, root = Path(sys.argv[1]), Path(sys.argv[2])
    lab.prepare_release = lambda version, say, tree_kind=None, **_: ReleaseEnv(version, tree, root)
    from vllm_repro.cli import main
    main(sys.argv[3:])
    """)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min), {os.cpu_count()} CPUs"


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True)
    dt = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return dt, proc.stderr


def run_cmd(version: str, reports: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vllm_repro.cli", "run", str(FLAGSHIP), "--vllm", version,
            "--reports", reports, *extra]


def imported(stderr: str) -> str:
    m = re.search(r"imported in ([0-9.]+) ?s( \(warm\))?", stderr)
    return f"vLLM imported in {m.group(1)} s{' (warm)' if m.group(2) else ' (cold)'}" if m else "?"


def stats(times: list[float]) -> str:
    return (f"median {statistics.median(times):.2f} s, min {min(times):.2f} s, "
            f"max {max(times):.2f} s over {len(times)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm", default="0.10.1.1")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-make", action="store_true", help="skip make cpu-repro")
    ap.add_argument("--no-audit", action="store_true", help="skip the audit's overhead")
    args = ap.parse_args()
    from vllm_repro.engine.warm_client import SETTING
    from vllm_repro.sources.prepare import prepare_release

    env = prepare_release(args.vllm, lambda s: None, tree="full")
    print(f"vLLM {args.vllm}, {FLAGSHIP.name}; {load()}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    warm_env = {SETTING: "on"}
    try:
        dt, err = timed(run_cmd(args.vllm, str(tmp / "cold"), "--cold"))
        print(f"  cold run:                    {dt:6.2f} s   ({imported(err)})")
        dt, err = timed(run_cmd(args.vllm, str(tmp / "w0")), warm_env)
        print(f"  first warm run:              {dt:6.2f} s   ({imported(err)}; starts the "
              "parent if none serves)")
        times, last = [], ""
        for i in range(args.repeat):
            dt, last = timed(run_cmd(args.vllm, str(tmp / f"w{i + 1}")), warm_env)
            times.append(dt)
        print(f"  warm re-run:                 {stats(times)}   ({imported(last)}; goal < 3 s)")

        tree = tmp / "tree"  # a copy: the cached tree is never edited
        shutil.copytree(env.tree, tree, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "tests"))
        (tmp / "driver.py").write_text(DRIVER)
        sched = tree / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
        original = sched.read_text()
        edited = []
        for i in range(args.repeat):
            sched.write_text(original + f"_bench_warm_edit = {i}  # one edited line\n")
            dt, last = timed([sys.executable, str(tmp / "driver.py"), str(tree), str(env.root),
                              "run", str(FLAGSHIP), "--vllm", args.vllm, "--reports",
                              str(tmp / f"e{i}")], warm_env)
            edited.append(dt)
        print(f"  warm run after an edit:      {stats(edited)}   ({imported(last)}; scheduler.py "
              "edited before each)")

        if not args.no_make:
            make = []
            for i in range(3):
                dt, _ = timed(["make", "--no-print-directory", "cpu-repro", "RUNNER=native",
                               f"REPORTS={tmp / f'm{i}'}"], warm_env)
                make.append(dt)
            print(f"  make cpu-repro (native) warm: {stats(make)}   (goal < 6 s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not args.no_audit:
        print("  audit overhead (bench/overhead.py):")
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--vllm",
                              args.vllm], cwd=ROOT, capture_output=True, text=True)
        print(textwrap.indent(out.stdout.strip() or out.stderr[-1500:], "    "))
    print(f"  after: {load()}")


if __name__ == "__main__":
    main()
