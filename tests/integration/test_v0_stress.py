"""Issue 19's acceptance for the audit at level v0-engine: the four ``scenarios/stress/``
workloads (fcfs / priority x prefix caching off / on: 256 requests, a 600-block pool, preemption
pressure, 24 aborts mid-decode), converted to ``level: v0-engine``, through the release's own V0
``LLMEngine`` with every block table, ref count, free list and prefix hash checked after each step.

- 0.6.3.post1: all four clean (no audit finding: the V0 books hold no false positive).
- 0.8.5: the two without prefix caching clean; the two with it show vLLM's real bug #18957
  (the catalog's ``vllm-18957-v0-stale-prefix-cache-count``): the worker is told to skip fresh
  GPU blocks as a cached prefix (``KV_PREFIX_MAP``, in ``Worker.execute_model``).
- 0.9.2, the release of PR #18957's fix: the same two run clean, so the finding is the bug (the
  two without prefix caching, which the fix does not touch, are not run again there).
"""

from __future__ import annotations

import json

import pytest
import yaml

from ..conftest import ROOT

pytestmark = pytest.mark.slow

STRESS = ROOT / "scenarios" / "stress"
WORKLOADS = ("stress-fcfs-nocache", "stress-fcfs-cache", "stress-priority-nocache", "stress-priority-cache")
#: where 0.8.5 first hands a request stale blocks as its cached prefix: (step, request)
FIRST_18957 = {"stress-fcfs-cache": (90, "r041"), "stress-priority-cache": (97, "r061")}


def at_v0(tmp_path, name: str) -> str:
    """``scenarios/stress/<name>.yaml`` with ``level: v0-engine`` (its config, requests and
    events as written: every field passes through to V0's config classes)."""
    d = yaml.safe_load((STRESS / f"{name}.yaml").read_text())
    d.update(name=f"{name}-v0", level="v0-engine", vllm={})
    p = tmp_path / f"{name}-v0.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(p)


def result(reports, name: str, version: str) -> dict:
    """The run's ``result.json`` (``RunResult``), with ``violations`` (left out when empty) as a list."""
    r = json.loads((reports / f"{name}-v0" / version / "result.json").read_text())
    r.setdefault("violations", [])
    return r


def audited_to_the_end(r: dict, name: str) -> None:
    """The audit ran every step (a run with it off is clean too) and the workload did what it
    says: every request finished, none cut off by max_steps, and its 24 abort events ended
    requests (one may land on a request that has already finished: 23 on fcfs-cache)."""
    assert r["audit"] and r["audit"]["checks"] >= r["steps"] > 600, (name, r["audit"], r["steps"])
    assert len(r["finished"]) == 256 and not r["limit_reached"], name
    reasons = list(r["finished"].values())
    assert 20 <= reasons.count("aborted") <= 24 and {"length", "stop"} <= set(reasons), name


def test_stress_workloads_at_v0_clean_on_0_6_3_and_show_only_18957_on_0_8_5(cli, tmp_path):
    files = [at_v0(tmp_path, n) for n in WORKLOADS]
    reports = tmp_path / "r"
    res = cli("run", *files, "--vllm", "0.6.3.post1", "--vllm", "0.8.5", "--reports", str(reports))
    # scenarios that expect nothing: a finding is exit 1, which the 0.8.5 cache runs give
    assert res.returncode in (0, 1), res.stdout + res.stderr
    for name in WORKLOADS:
        old = result(reports, name, "0.6.3.post1")
        assert (old["outcome"], old["violations"]) == ("clean", []), (name, old["violations"][:2])
        audited_to_the_end(old, name)
        new = result(reports, name, "0.8.5")
        if "nocache" in name:
            assert (new["outcome"], new["violations"]) == ("clean", []), (name, new["violations"][:2])
            audited_to_the_end(new, name)
        else:
            codes = {v["code"] for v in new["violations"]}
            assert codes == {"KV_PREFIX_MAP"}, (name, new["violations"][:2])
            v = new["violations"][0]
            assert (v["step"], v["requests"], v["phase"]) == (*FIRST_18957[name][:1], [FIRST_18957[name][1]],
                                                              "in Worker.execute_model"), v
            assert "as a cached prefix" in v["message"] and "holds no KV of those tokens" in v["message"], v


def test_stress_prefix_caching_workloads_at_v0_clean_on_0_9_2_the_fix_of_18957(cli, tmp_path):
    files = [at_v0(tmp_path, n) for n in WORKLOADS if "nocache" not in n]
    reports = tmp_path / "r"
    res = cli("run", *files, "--vllm", "0.9.2", "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("stress-fcfs-cache", "stress-priority-cache"):
        fixed = result(reports, name, "0.9.2")
        assert (fixed["outcome"], fixed["violations"]) == ("clean", []), (name, fixed["violations"][:2])
        audited_to_the_end(fixed, name)
