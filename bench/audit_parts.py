"""What each part of the audit costs: the audited run of bench/overhead.py's workload with one
part of the audit left out at a time (prints numbers; not a test).

    python bench/audit_parts.py                      # vLLM 0.10.1.1, CPU time, best of 7
    python bench/audit_parts.py --vllm 0.33.0 --callgrind    # instruction counts (valgrind)

Each part's cost is what the audited run saves without it, in one worker process of the
release, against the run without the audit and the whole audit. CPU time (``process_time``
of the step loop, best of ``--repeat``, every variant once per round, objects made before the
runs frozen out of the garbage collector's full collections) moves with the machine's load;
``--callgrind`` counts the instructions of one run of each variant instead (valgrind's
callgrind, collecting only around the runs, the garbage collector frozen and off): the same
count whatever else the machine does, though an instruction is not a nanosecond (walks over
thousands of blocks cost more time per instruction than the interpreter's own work).

The parts (a part left out is a no-op for the run; the findings are then not the audit's):

- ``requests``: ``RequestChecks.check`` (REQ_STATE and BATCH_LIMIT after both calls), of which
  ``output`` is the scheduler output's check (``_check_output``);
- ``kv``: ``Auditor._kv_checks`` (KV books after both calls), of which ``free-queue`` is the
  free-queue walk (``check_free_queue``, every 16th check), ``map-walk`` the prefix-cache map
  walk (``PrefixMapCheck._full``, every 64th), ``moved`` the map check of blocks whose hash
  changed, ``hashes`` the request-hash check, ``leaks`` ``check_leaks``;
- ``hooks``: the block pool's hooks (``free_blocks``, ``touch``, ``get_new_blocks``);
- ``trace``: the trace line's audit figures (``Auditor.annotate``); ``starvation``;
- ``all``: every part above left out (what is left is the block mirror and the observer calls).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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

PARTS = ("requests", "output", "kv", "free-queue", "map-walk", "moved", "hashes", "leaks",
         "hooks", "trace", "starvation", "all")

# runs in the release's environment, like vllm_repro.engine.worker
CHILD = r'''
import gc, json, os, subprocess, sys, time
from pathlib import Path
from vllm_repro.engine.adapter import V1Adapter
from vllm_repro.engine.run import run_scenario
from vllm_repro.audit import Auditor
import vllm_repro.audit.auditor as A
import vllm_repro.audit.checks as C
import vllm_repro.audit.hooks as H

payload = json.loads(Path(sys.argv[1]).read_text())
adapter = V1Adapter(Path(sys.argv[2]))
repeat, callgrind, parts = int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5].split(",")

def nothing(*a, **k):
    return []

def no_requests(self, phase, so=None, scheduled=None):
    self.preempted_now = set()
    return []

# part -> [(owner, attribute, stand-in)]
OFF = {
    "requests": [(C.RequestChecks, "check", no_requests)],
    "output": [(C.RequestChecks, "_check_output", nothing)],
    "kv": [(A.Auditor, "_kv_checks", nothing)],
    "free-queue": [(A, "check_free_queue", lambda b, refs: ([], []))],
    "map-walk": [(C.PrefixMapCheck, "_full", nothing)],
    "moved": [(C.PrefixMapCheck, "check_moved", nothing)],
    "hashes": [(C.RequestHashCheck, "check", nothing)],
    "leaks": [(A, "check_leaks", nothing)],
    "hooks": [(H.PoolHooks, "install", lambda self: [])],
    "trace": [(A.Auditor, "annotate", lambda self, line: None)],
    "starvation": [(C.StarvationCheck, "check", nothing)],
}
OFF["all"] = [x for k in ("requests", "kv", "hooks", "trace", "starvation") for x in OFF[k]]

def run(variant):
    if variant == "plain":
        return run_scenario(adapter, payload, None)
    saved = [(o, a, getattr(o, a)) for o, a, _ in OFF.get(variant, ())]
    for o, a, f in OFF.get(variant, ()):
        setattr(o, a, f)
    try:
        return run_scenario(adapter, payload, None, observer=Auditor(adapter, keep_going=True))
    finally:
        for o, a, f in saved:
            setattr(o, a, f)

variants = ["plain", "audit"] + parts
run("plain"); run("audit")  # imports, caches
# a full collection walks every object of torch and vLLM (about 0.2 s here) and lands in
# whichever run crosses its threshold: frozen, what the runs allocate is still collected
gc.collect(); gc.freeze()
if callgrind:
    gc.disable()
    pid = str(os.getpid())
    def ctl(*a):
        subprocess.run(["callgrind_control", *a, pid], capture_output=True, check=False)
    for v in variants:
        ctl("-z"); ctl("-i", "on")
        res = run(v)
        ctl("-i", "off"); ctl("-d", v)
    print(json.dumps({"steps": res.steps}))
else:
    best = {v: float("inf") for v in variants}
    for _ in range(repeat):
        for v in variants:
            res = run(v)
            best[v] = min(best[v], res.timing.run_cpu_s)
    print(json.dumps({"steps": res.steps, "cost": best}))
'''


def callgrind_counts(folder: Path) -> dict[str, int]:
    """variant -> instructions, from callgrind's dumps (one per ``callgrind_control -d NAME``)."""
    out = {}
    for f in folder.glob("cg.out*"):
        text = f.read_text(errors="replace")
        trig = re.search(r"^desc: Trigger: (?:Client Request: )?(?:dump )?(.*)$", text, re.M)
        tot = re.search(r"^totals: (\d+)", text, re.M)
        if trig and tot:
            out[trig.group(1).strip()] = int(tot.group(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    workload_args(ap, "0.10.1.1")
    ap.add_argument("--repeat", type=int, default=7, help="rounds (CPU time; best of)")
    ap.add_argument("--callgrind", action="store_true",
                    help="count instructions under valgrind instead of CPU time (minutes)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        sys.exit(f"--parts: unknown {bad}; expected some of {', '.join(PARTS)}")
    if args.callgrind and not shutil.which("valgrind"):
        sys.exit("--callgrind needs valgrind (Debian: apt-get install valgrind)")
    env = prepare_release(args.vllm)
    payload = workload(args.policy, not args.no_cache, args.blocks, name="bench-audit-parts")
    with tempfile.TemporaryDirectory(prefix="bench-audit-parts-") as tmp:
        tmpd = Path(tmp)
        (tmpd / "payload.json").write_text(json.dumps(payload))
        (tmpd / "child.py").write_text(CHILD)
        cmd = [str(env.python), str(tmpd / "child.py"), str(tmpd / "payload.json"),
               str(DEFAULT_MODEL), str(args.repeat), "1" if args.callgrind else "0", ",".join(parts)]
        if args.callgrind:
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={tmpd / 'cg.out'}", *cmd]
        proc = subprocess.run(cmd, env={**child_environment(env), "PYTHONHASHSEED": "0"},
                              cwd=str(env.tree or tmp), capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the run failed ({proc.returncode}): {proc.stderr[-3000:]}")
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        if args.callgrind:
            cost = {k: float(v) for k, v in callgrind_counts(tmpd).items()}
            unit, scale = "M instructions", 1e-6
        else:
            cost = info["cost"]
            unit, scale = "ms CPU", 1e3
    plain, audit = cost["plain"], cost["audit"]
    load = os.getloadavg()[0]
    print(f"vLLM {args.vllm}, {args.policy}, prefix caching {'off' if args.no_cache else 'on'}, "
          f"256 requests, {args.blocks} blocks, {info['steps']} steps; "
          f"{'callgrind' if args.callgrind else f'best of {args.repeat}'}, load {load:.2f}")
    print(f"  without audit {plain * scale:9.1f} {unit}")
    print(f"  with audit    {audit * scale:9.1f} {unit}   ratio {plain / audit:.3f}")
    print(f"  the audit     {(audit - plain) * scale:9.1f} {unit}")
    for p in parts:
        saved = audit - cost[p]
        print(f"    {p:12s} {saved * scale:9.1f} {unit}  {100 * saved / (audit - plain):5.1f} %"
              f"   (ratio without it {plain / cost[p]:.3f})")


if __name__ == "__main__":
    main()
