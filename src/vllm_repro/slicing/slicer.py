"""``vllm-repro slice VERSION``: trace, choose stubs, verify, write ``slices/<version>.json``.

Per release, three runs of the same two workloads (:mod:`vllm_repro.slicing.runs`: the
scenarios and vLLM's own core CPU tests):

A. **full**: the full tree in the full environment, traced with call profiling. Gives the files,
   the distributions, the stub candidates, and the reference results.
B. **stubbed**: the materialised slice tree (traced files + stubs) in the full environment,
   traced. Any stub that something used (it fails loudly and logs) is dropped and B runs again;
   the distributions this run loads become the slice's requirements (packages that only the
   stubbed ones imported fall away).
C. **slice**: the slice tree in the slice environment (only those requirements). Its results
   must equal A's: same passing tests, same scenario verdicts and step traces.

The spec records A's reference results and C's comparison (``equivalence``), so a test can check
the committed slice without rerunning the heavy part.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ..errors import EnvError, InputError
from ..sources.prepare import prepare_release, release_lock
from ..settings import cache_dir
from ..sources.env import ReleaseEnv
from ..sources.sdist import fetch_sdist
from . import runs
from .spec import (SPEC_FORMAT, Trace, analyse, canon, file_hashes, lab_commit, lab_sources_sha256,
                   materialise, package_inventory, slice_env, spec_path)

Say = Callable[[str], None]
MAX_STUB_ROUNDS = 4


def work_dir(version: str) -> Path:
    return cache_dir() / "slicing" / "work" / version


def run_both(env: ReleaseEnv, scenarios: list[Path], work: Path, traced: bool, calls: bool,
             say: Say, log: Path | None = None, tests: bool = True) -> dict:
    """Scenarios and core tests on ``env``; returns ``{"scenarios", "tests", "test_selection",
    "test_wall_s"}`` (and traces into ``work/trace`` when ``traced``)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    trace = work / "trace" if traced else None
    # a cold vLLM cache for every run: what vLLM otherwise reads from its model-info cache (the
    # model-inspection subprocess and the modules it imports) must be traced and must work
    extra = {"VLLM_CACHE_ROOT": str(work / "vllm-cache")}
    if log:
        extra["VLLM_REPRO_SLICE_LOG"] = str(log)
    t0 = time.perf_counter()
    try:
        scen = runs.run_scenarios(env, scenarios, work / "scenarios", trace_dir=trace,
                                  calls=calls, say=say, extra_env=extra)
    except EnvError as exc:  # the worker could not start: every scenario differs
        say(f"vLLM {env.version}: {exc}")
        scen = {"<worker>": {"load_error": str(exc)}}
    out = {"scenarios": scen, "scenario_wall_s": round(time.perf_counter() - t0, 1)}
    if tests:
        tr = runs.run_core_tests(env, work / "tests", trace_dir=trace, calls=calls, say=say,
                                 extra_env=extra)
        out.update({"tests": tr.outcomes, "test_selection": tr.selection, "test_wall_s": tr.wall_s})
    (work / "results.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def compare(full: dict, other: dict) -> dict:
    """Equivalence of two :func:`run_both` results: passing tests on each side and the
    difference, and scenario results/traces that differ."""
    fp = sorted(k for k, v in full.get("tests", {}).items() if v == "passed")
    op = sorted(k for k, v in other.get("tests", {}).items() if v == "passed")
    diff_sc = []
    for name, a in full["scenarios"].items():
        b = other["scenarios"].get(name)
        a, b = _renormalise(a), _renormalise(b)
        if b is None or a.get("result") != b.get("result") or a.get("trace") != b.get("trace") \
                or a.get("load_error") != b.get("load_error"):
            diff_sc.append(name)
    diff_sc += [n for n in other["scenarios"] if n not in full["scenarios"]]
    return {
        "tests_passed_full": len(fp), "tests_passed_slice": len(op),
        "passed_full": fp, "passed_slice": op,
        "only_full": sorted(set(fp) - set(op)), "only_slice": sorted(set(op) - set(fp)),
        "tests_run_full": len(full.get("tests", {})), "tests_run_slice": len(other.get("tests", {})),
        "scenarios": len(full["scenarios"]), "scenarios_differing": sorted(diff_sc),
        "equal": set(fp) == set(op) and not diff_sc,
    }


def recheck(full: dict, other: dict, full_env: ReleaseEnv, other_env: ReleaseEnv, work: Path,
            say: Say) -> dict:
    """Rerun, untraced and on both sides, the core tests whose outcome differs between ``full``
    and ``other`` (a test that timed out under a traced, loaded run, e.g. 0.33.0's
    test_is_kv_cache_spec_uniform starting a subprocess with a 60 s limit). Where the rerun
    agrees on both sides the difference did not repeat: both results take the rerun's outcome
    and the test is listed as flaky. Returns ``{nodeid: {"first": [full, other],
    "rerun": [full, other]}}``; an empty dict when nothing differed."""
    ft, ot = full.get("tests", {}), other.get("tests", {})
    differing = sorted(n for n in set(ft) | set(ot)
                       if (ft.get(n) == "passed") != (ot.get(n) == "passed"))
    if not differing:
        return {}
    say(f"vLLM {full_env.version}: rerunning {len(differing)} test(s) whose outcome differs: "
        f"{differing[:3]}")
    again_f = runs.run_core_tests(full_env, work / "recheck-full", say=say, nodeids=differing).outcomes
    again_o = runs.run_core_tests(other_env, work / "recheck-other", say=say, nodeids=differing).outcomes
    flaky = {}
    for n in differing:
        a, b = again_f.get(n), again_o.get(n)
        if a is not None and a == b:
            flaky[n] = {"first": [ft.get(n), ot.get(n)], "rerun": [a, b]}
            ft[n] = ot[n] = a
    return flaky


def _renormalise(rec: dict | None) -> dict | None:
    if not rec or "result" not in rec:
        return rec
    return {**rec, "result": runs.normalise_result(rec["result"], Path("/nonexistent")),
            "trace": runs.normalise_trace(rec.get("trace") or [])}


def read_log(log: Path) -> list[dict]:
    if not log.is_file():
        return []
    return [json.loads(x) for x in log.read_text().splitlines() if x.strip()]


def scenario_records(files: list[Path], base: Path) -> list[dict]:
    out = []
    for f in files:
        try:
            rel = str(f.relative_to(base.resolve()))
        except ValueError:
            rel = str(f)
        out.append({"file": rel, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()})
    return out


def slim(results: dict) -> dict:
    """Reference results as recorded in the spec: scenario verdict summaries and a hash of each
    step trace, and the passing test ids."""
    sc = {}
    for name, r in sorted(results["scenarios"].items()):
        res = r.get("result") or {}
        sc[name] = {"outcome": res.get("outcome", "load_error" if "load_error" in r else None),
                    "result_sha256": hashlib.sha256(json.dumps(res, sort_keys=True).encode()).hexdigest(),
                    "trace_sha256": hashlib.sha256(json.dumps(r.get("trace"), sort_keys=True).encode()).hexdigest(),
                    "steps": len(r.get("trace") or [])}
    return {"scenarios": sc,
            "tests_passed": sorted(k for k, v in results.get("tests", {}).items() if v == "passed"),
            "tests_run": len(results.get("tests", {}))}


def make_slice(version: str, base: Path, include: tuple[str, ...] = (),
               globs: tuple[str, ...] = runs.SCENARIO_GLOBS, out: Path | None = None,
               say: Say = lambda s: None, reuse_full: bool = True) -> tuple[Path, dict]:
    """Trace, stub, verify and write the slice spec of ``version``; returns ``(path, spec)``.

    ``base``: the lab checkout whose scenario files are traced. ``reuse_full``: reuse run A when
    its inputs (scenario files, sdist, tracer format, test selection, the lab's own sources)
    are unchanged. Raises :class:`EnvError` when a
    run cannot be made; a slice that is not equivalent is still written, with
    ``equivalence.equal = false``, and the CLI exits 1.
    """
    t_start = time.perf_counter()
    # checked before the release is prepared (minutes): --base (default: the working folder)
    # outside a lab checkout is the user's input, exit 2, not a lab failure
    scenarios = runs.scenario_files(base, globs)
    if not scenarios:
        raise InputError(f"--base {base}: no scenario files under it ({', '.join(globs)}); run "
                         "slice in the lab's checkout or give --base that checkout")
    full_env = prepare_release(version, say, tree="full")
    release = fetch_sdist(version)
    work = work_dir(version)
    work.mkdir(parents=True, exist_ok=True)
    from .tracer import TRACE_FORMAT

    inputs = {"sdist": release.sha256, "scenarios": scenario_records(scenarios, base),
              "trace_format": TRACE_FORMAT, "tests": runs.core_test_selection(full_env.tree)[1],
              "lab": lab_sources_sha256()}
    a_dir = work / "A-full"
    stamp = a_dir / "inputs.json"
    if reuse_full and stamp.is_file() and json.loads(stamp.read_text()) == inputs \
            and (a_dir / "results.json").is_file():
        say(f"vLLM {version}: reusing the traced full run ({a_dir})")
        full = json.loads((a_dir / "results.json").read_text())
    else:
        say(f"vLLM {version}: A. tracing the full tree ({len(scenarios)} scenarios + core tests)")
        full = run_both(full_env, scenarios, a_dir, traced=True, calls=True, say=say)
        stamp.write_text(json.dumps(inputs))
    trace_a = Trace.load(a_dir / "trace")
    package_files, pkg_files_n, pkg_bytes = package_inventory(release)
    an = analyse(trace_a, full_env.tree, full_env.root, package_files, include)
    stubs = dict(an.candidates)
    dropped: dict[str, str] = {}
    spec = _spec(version, release, an, stubs, {}, include, inputs, full, full_env,
                 (pkg_files_n, pkg_bytes), trace_a, dropped)
    stubbed = None
    missing_without_effect: list[str] = []
    flaky: dict[str, dict] = {}
    for round_no in range(1, MAX_STUB_ROUNDS + 1):
        tree = materialise(spec, release)
        b_env = ReleaseEnv(version, tree, full_env.root)
        log = work / f"B-stub-log.{round_no}.jsonl"
        log.unlink(missing_ok=True)
        say(f"vLLM {version}: B{round_no}. slice tree in the full environment, "
            f"stubs: {', '.join(sorted(stubs)) or 'none'}")
        stubbed = run_both(b_env, scenarios, work / "B-stubbed", traced=True, calls=False,
                           say=say, log=log)
        events = read_log(log)
        flaky.update(recheck(full, stubbed, full_env, b_env, work, say))
        used = sorted({e["name"].split(".")[0] for e in events if e["kind"] == "stub"}
                      | {top for top, s in stubs.items()
                         for e in events if e["kind"] == "stub" and e.get("package") == s["distribution"]})
        used = [u for u in used if u in stubs]
        missing = sorted({e["name"] for e in events if e["kind"] == "missing"})
        if missing and not used and compare(full, stubbed)["equal"]:
            # e.g. collecting a test module the full tree fails to collect as well (0.33.0's
            # test_hybrid_prefix_cache_hit_rate.py imports the OpenAI server through
            # tests/utils.py): same passing tests, same scenario results, so the slice does not
            # need them; a module chain found one per round would never end
            say(f"vLLM {version}: modules missing in run B change no outcome (same tests and "
                f"scenarios as the full tree), left out: {missing[:5]}")
            missing_without_effect = missing
            break
        if missing:
            say(f"vLLM {version}: modules missing from the slice in run B: {missing[:5]}")
            include = tuple(sorted(set(include) | set(missing)))
            an = analyse(trace_a, full_env.tree, full_env.root, package_files, include)
        if not used and not missing:
            break
        for u in used:
            dropped[u] = "used in run B: " + next(
                e["name"] for e in events if e["kind"] == "stub"
                and (e["name"].startswith(u) or e.get("package") == stubs[u]["distribution"]))
            stubs.pop(u, None)
        spec = _spec(version, release, an, stubs, {}, include, inputs, full, full_env,
                     (pkg_files_n, pkg_bytes), trace_a, dropped)
    else:
        raise EnvError(f"vLLM {version}: stubs still used after {MAX_STUB_ROUNDS} rounds")
    # requirements: what run B (stubs in place) loaded from the environment
    trace_b = Trace.load(work / "B-stubbed" / "trace")
    an_b = analyse(trace_b, tree, full_env.root, set(spec["files"]) | package_files, include)
    stub_dists = {canon(s["distribution"]) for s in stubs.values()}
    reqs = {d: {k: v for k, v in info.items() if k in ("name", "version", "bytes", "modules", "why")}
            for d, info in an_b.dists.items() if d not in stub_dists}
    spec = _spec(version, release, an, stubs, reqs, include, inputs, full, full_env,
                 (pkg_files_n, pkg_bytes), trace_a, dropped)
    spec["equivalence"] = {"stubbed_in_full_env": compare(full, stubbed),
                           "missing_without_effect": missing_without_effect}
    # C: the slice in its own environment
    tree = materialise(spec, release)
    with release_lock(version):
        s_env = slice_env(spec, tree, say)
    say(f"vLLM {version}: C. slice tree in the slice environment ({len(reqs)} distributions)")
    sliced = run_both(s_env, scenarios, work / "C-slice", traced=False, calls=False, say=say,
                      log=work / "C-slice.log")
    flaky.update(recheck(full, sliced, full_env, s_env, work, say))
    eq = compare(full, sliced)
    spec["equivalence"].update(eq)
    spec["equivalence"]["flaky_rechecked"] = flaky
    spec["equivalence"]["slice_env_events"] = read_log(work / "C-slice.log")[:20]
    spec["equivalence"]["verified_at"] = _now()
    spec["traced"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    path = (out or spec_path(version).parent) / f"{version}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=1, sort_keys=False) + "\n")
    return path, spec


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec(version, release, an, stubs, reqs, include, inputs, full, full_env, pkg, trace_a,
          dropped) -> dict:
    freeze = full_env.freeze()
    return {
        "format": SPEC_FORMAT,
        "vllm": version,
        "sdist": {"file": release.sdist.name, "sha256": release.sha256},
        "package": {"vllm_files": pkg[0], "vllm_bytes": pkg[1]},
        "summary": {
            "vllm_files": sum(1 for f in an.files if f.startswith("vllm/")),
            "vllm_modules": an.vllm_modules,
            "test_files": sum(1 for f in an.files if f.startswith("tests/")),
            "requirements": len(reqs), "full_environment_distributions": len(freeze),
            "stubs": sorted(stubs),
        },
        "files": file_hashes(release, sorted(set(an.files) | set(_extra_files(release)))),
        "requirements": reqs,
        "stubs": stubs,
        "stub_candidates_dropped": dropped,
        "include": sorted(include),
        "listed_dirs": an.listed_dirs,
        "traced": {
            "date": _now(), "lab_commit": lab_commit(), "python": sys.version.split()[0],
            "how": ("tracer (sys.meta_path recorder, audit hook for open/listdir/dlopen, "
                    "profile of calls into third-party packages) over the scenarios and vLLM's "
                    "core CPU tests, on the full tree in the full environment"),
            "scenarios": inputs["scenarios"],
            # what resolve_tree gives the slice to: runs at these levels (the scenarios above
            # hold runs of each)
            "levels": runs.served_levels(full["scenarios"]),
            # the levels whose scenarios ran: one of these missing from "levels" is a level
            # the release has no engine for (re-slicing would not add it)
            "levels_tried": list(runs.SLICE_LEVELS),
            "tests": full.get("test_selection"),
            "model_standins": runs.hub_status(version),
            "processes": trace_a.processes,
            "full_environment": {"root": str(full_env.root), "distributions": len(freeze)},
        },
        "reference": slim(full),
    }


def _extra_files(release) -> list[str]:
    """Files the tests need beyond what they import: the pytest configuration."""
    members, _, _ = package_inventory(release)
    return [f for f in ("pyproject.toml",) if f in members]
