"""Where the audit's time goes: cProfile of one audited run of the 256-request stress workload
(bench/overhead.py's) inside a worker of the release's environment (prints numbers; not a test).

    python bench/profile_audit.py                         # vLLM 0.33.0, fcfs, prefix caching on
    python bench/profile_audit.py --vllm 0.10.2 --top 30 --sort tottime

One unaudited run first (imports, caches), then the audited run under ``cProfile``; prints the
top ``--top`` functions by ``--sort`` (``cumulative`` or ``tottime``) among the audit's own
(``vllm_repro/audit/``) and the step loop's total.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import workload, workload_args  # noqa: E402
from vllm_repro.engine.host import DEFAULT_MODEL, child_environment  # noqa: E402
from vllm_repro.sources.prepare import prepare_release  # noqa: E402

# runs in the release's environment, like vllm_repro.engine.worker
CHILD = """\
import cProfile, io, json, pstats, sys
from pathlib import Path
from vllm_repro.engine.adapter import V1Adapter
from vllm_repro.engine.run import run_scenario
from vllm_repro.audit import Auditor
payload, sort, top = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2], int(sys.argv[3])
adapter = V1Adapter(Path(sys.argv[4]))
plain = run_scenario(adapter, payload, None)
prof = cProfile.Profile()
prof.enable()
auditor = Auditor(adapter, keep_going=True)
res = run_scenario(adapter, payload, None, observer=auditor)
prof.disable()
print("block mirror:", "on" if auditor.mirror_off is None else f"off ({auditor.mirror_off})")
print(f"steps {res.steps}, outcome {res.outcome}, findings {len(res.violations or [])}; loop CPU "
      f"without audit {plain.timing.run_cpu_s:.3f} s, with audit under cProfile "
      f"{res.timing.run_cpu_s:.3f} s")
buf = io.StringIO()
st = pstats.Stats(prof, stream=buf)
st.sort_stats(sort).print_stats("vllm_repro/audit/|__setattr__", top)
print(buf.getvalue().split("ncalls", 1)[-1].join(["ncalls", ""]) if "ncalls" in buf.getvalue()
      else buf.getvalue())
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    workload_args(ap, "0.33.0")
    ap.add_argument("--sort", default="cumulative", choices=["cumulative", "tottime"])
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    env = prepare_release(args.vllm)
    payload = workload(args.policy, not args.no_cache, args.blocks, name="bench-profile")
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        p = Path(tmp) / "payload.json"
        p.write_text(json.dumps(payload))
        proc = subprocess.run(
            [str(env.python), "-c", CHILD, str(p), args.sort, str(args.top), str(DEFAULT_MODEL)],
            env={**child_environment(env), "PYTHONHASHSEED": "0"}, cwd=str(env.tree or tmp),
            capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"profile run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    print(f"vLLM {args.vllm}, {args.policy}, prefix caching {'off' if args.no_cache else 'on'}, "
          f"256 requests, {args.blocks} blocks; audit functions by {args.sort}:")
    print("\n".join(line for line in proc.stdout.splitlines()
                    if not line.startswith(("INFO", "WARNING", "DEBUG"))))


if __name__ == "__main__":
    main()
