"""The audit of the working tree against the audit of a git revision, in one process (prints
numbers; not a test).

    python bench/audit_ab.py                          # vLLM 0.10.1.1, against HEAD, 10 rounds
    python bench/audit_ab.py --vllm 0.10.2 --base HEAD~3 --rounds 15

Each round runs bench/overhead.py's workload (256 requests, 2,000 blocks, prefix caching on)
three times in one process of the release's environment, in a rotating order: without the
audit, with the audit of ``--base`` (its ``src/vllm_repro`` from ``git archive``, imported as
``vllm_repro_base``) and with the working tree's. Prints the best CPU time of the step loop of
each, the audit's cost (audited minus plain, ms a run) of both, the overhead ratio of both
(plain / audited, issue 21's figure) and the change.

Why in one process: on a virtual machine whose speed drifts by 20 % over minutes,
bench/overhead.py's ratio for the same code swung from 0.53 to 0.63 between invocations, which
hides a change of 5 to 15 % of the audit's cost; three kinds of run taking turns in one process
share the drift, so their difference is steady to a few ms (the ratio itself still moves by
about 0.02 between invocations). Findings are not compared here: the audit tests do that.
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
from vllm_repro.errors import LabError  # noqa: E402
from vllm_repro.sources.prepare import prepare_release  # noqa: E402

# runs in the release's environment: argv = payload file, model folder, rounds
INNER = r"""
import gc, json, sys
from pathlib import Path
from vllm_repro.audit import Auditor as New
from vllm_repro.engine.adapter import V1Adapter
from vllm_repro.engine.run import run_scenario
from vllm_repro_base.audit import Auditor as Base
payload = json.loads(Path(sys.argv[1]).read_text())
adapter = V1Adapter(Path(sys.argv[2]))
run_scenario(adapter, payload, None)  # (imports and first-call costs out of the way)
gc.collect()
gc.freeze()  # as the worker does: the engine's objects out of the collector's walks
kinds = {"plain": None, "base": Base, "new": New}
order = list(kinds)
best = {k: float("inf") for k in kinds}
for i in range(int(sys.argv[3])):
    for k in order[i % 3:] + order[:i % 3]:
        cls = kinds[k]
        r = run_scenario(adapter, payload, None,
                         observer=cls(adapter, keep_going=True) if cls else None)
        if r.outcome not in ("clean", "violation"):
            sys.exit(f"{k} run: {r.outcome} {r.error or r.crash}")
        best[k] = min(best[k], r.timing.run_cpu_s)
print("RESULT " + json.dumps(best))
"""


def _rounds(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    workload_args(ap, "0.10.1.1")
    ap.add_argument("--base", default="HEAD", help="the git revision to compare with (HEAD)")
    ap.add_argument("--rounds", type=_rounds, default=10, help="rounds of three runs (10)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-audit-ab-") as tmp:
        tmp = Path(tmp)
        # the revision first: a bad one is said before minutes spent preparing the release
        archive = subprocess.run(["git", "archive", args.base, "src/vllm_repro"], cwd=ROOT,
                                 capture_output=True, check=False)
        if archive.returncode != 0:
            sys.exit(f"error: git archive {args.base}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
        if not (tmp / "src" / "vllm_repro" / "audit" / "auditor.py").is_file():
            sys.exit(f"error: {args.base} has no audit (src/vllm_repro/audit/auditor.py); "
                     "give a later revision")
        pkg = tmp / "pkg"
        pkg.mkdir()
        (tmp / "src" / "vllm_repro").rename(pkg / "vllm_repro_base")
        try:
            env = prepare_release(args.vllm)
        except LabError as exc:  # (an unknown release, no index, a failed build: one line)
            sys.exit(f"error: {exc}".splitlines()[0])
        payload = tmp / "payload.json"
        payload.write_text(json.dumps(workload(args.policy, not args.no_cache, args.blocks)))
        child = child_environment(env, extra_path=(str(pkg),))
        proc = subprocess.run([str(env.python), "-c", INNER, str(payload), str(DEFAULT_MODEL),
                               str(args.rounds)], env=child, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"the runs failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    best = json.loads(line[len("RESULT "):])
    plain = best["plain"]
    print(f"vLLM {args.vllm}, {args.policy}, prefix caching {'off' if args.no_cache else 'on'}, "
          f"{args.blocks} blocks, best of {args.rounds} round{'s' if args.rounds > 1 else ''}, "
          "CPU time of the step loop:")
    print(f"  without audit:              {plain * 1e3:7.1f} ms")
    for kind, label in (("base", f"audit of {args.base}"), ("new", "audit of the working tree")):
        cost = best[kind] - plain
        print(f"  {label + ':':27s} {best[kind] * 1e3:7.1f} ms  (audit {cost * 1e3:6.1f} ms, "
              f"ratio {plain / best[kind]:.3f})")
    base_cost, new_cost = best["base"] - plain, best["new"] - plain
    print(f"  change of the audit's cost: {(new_cost - base_cost) * 1e3:+.1f} ms "
          f"({(new_cost / base_cost - 1) * 100:+.1f} %)")


if __name__ == "__main__":
    main()
