"""Slice vs full tree, per release with a committed slice (``slices/<version>.json``).

Prints, per release: vLLM files and MB of the slice vs the package; third-party distributions of
the slice vs the full environment; environment size on disk; import time of the scheduler path
(``import vllm.v1.core.sched.scheduler``; with ``--worker`` also the lab's whole worker
start-up, the adapter building vLLM's objects) in fresh processes, median of N (default 5), sliced vs full, and the
ratio (goal: <= 0.25).

    .venv/bin/python bench/slice.py [VERSION ...] [--runs 5]

Builds the slice environment if needed (uv, from the cache). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from vllm_repro.engine.host import DEFAULT_MODEL, child_environment  # noqa: E402
from vllm_repro.sources.prepare import prepare_release  # noqa: E402
from vllm_repro.slicing.spec import load_spec, slices_dir  # noqa: E402

SCHEDULER = "import vllm.v1.core.sched.scheduler"
WORKER = ("from vllm_repro.engine.adapter import V1Adapter; "
          f"V1Adapter(__import__('pathlib').Path({str(DEFAULT_MODEL)!r}))")


def du(path: Path) -> int:
    """Bytes under ``path`` (its own ``du``: hardlinks shared with uv's cache counted once)."""
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def time_import(env, code: str, runs: int) -> tuple[float, int]:
    """Median wall seconds of ``python -c code`` in ``runs`` fresh processes, and the number of
    modules loaded."""
    child = child_environment(env)
    times, mods = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.run([str(env.python), "-c", code + "; import sys; print(len(sys.modules))"],
                           env=child, cwd=str(env.tree), capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        if p.returncode != 0:
            raise SystemExit(f"{env.version}: {code!r} failed: {p.stderr.strip()[-500:]}")
        mods = int(p.stdout.split()[-1])
    return statistics.median(times), mods


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("versions", nargs="*")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--worker", action="store_true",
                    help="also time the lab's whole worker start-up (the adapter)")
    args = ap.parse_args()
    versions = args.versions or sorted(p.stem for p in slices_dir().glob("*.json"))
    rows = []
    for v in versions:
        spec = load_spec(v)
        full = prepare_release(v, tree="full")
        sl = prepare_release(v, tree="slice")
        s_files = [f for f in spec["files"] if f.startswith("vllm/")]
        s_bytes = sum((sl.tree / f).stat().st_size for f in s_files)
        row = {
            "vllm": v,
            "files": f"{len(s_files)}/{spec['package']['vllm_files']}",
            "MB": f"{s_bytes / 1e6:.1f}/{spec['package']['vllm_bytes'] / 1e6:.1f}",
            "dists": f"{len(spec['requirements'])}/{len(full.freeze())}",
            "stubs": len(spec["stubs"]),
            "env_MB": f"{du(sl.root) / 1e6:.0f}/{du(full.root) / 1e6:.0f}",
        }
        paths = [("sched", SCHEDULER)] + ([("worker", WORKER)] if args.worker else [])
        for label, code in paths:
            tf, mf = time_import(full, code, args.runs)
            ts, ms = time_import(sl, code, args.runs)
            row[f"{label}_s"] = f"{ts:.2f}/{tf:.2f}"
            row[f"{label}_ratio"] = f"{ts / tf:.2f}"
            row[f"{label}_modules"] = f"{ms}/{mf}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = list(rows[0]) if rows else []
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("\nslice/full per release (median of %d fresh processes)" % args.runs)
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))


if __name__ == "__main__":
    main()
