"""`vllm-repro campaign` over 6 releases x 2 seeds, on local worker processes and on a local Ray
cluster started on 127.0.0.1 (`--ray auto`), finds the same things; a finding's YAML replays
with `vllm-repro run`; running the campaign again resumes it (nothing is run twice).

Cheap on purpose: scheduler level, the fuzzer's `concurrent` feature set with priorities (where
the 0.10/0.11 schedulers crash within a few examples), 12 examples per task, no shrinking (the
shrinker is `fuzz`'s, tested in test_fuzz.py); about a minute a campaign once the releases
are prepared.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow

RANGE = ">=0.10.0,<=0.11.1"  # 0.10.0 0.10.1 0.10.1.1 0.10.2 0.11.0 0.11.1
ARGS = ("campaign", "--releases", RANGE, "--seeds", "2", "--policy", "priority", "--features",
        "concurrent", "--examples", "12", "--no-shrink", "--jobs", "2", "--json")


def _findings(report: dict) -> list:
    """What must agree between back ends: per task its status, examples and every finding's
    signature, example number and scenario."""
    return sorted((t["release"], t["seed"], t["status"], t["examples"],
                   [(f["signature"], f.get("first_example"), json.dumps(f["scenario"], sort_keys=True))
                    for f in t.get("findings", [])]) for t in report["tasks"])


@pytest.fixture(scope="module")
def campaigns(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("campaign")
    local = run_cli(*ARGS, "--out", str(tmp / "local"), timeout=1200)
    ray = run_cli(*ARGS, "--ray", "auto", "--out", str(tmp / "ray"), timeout=1200)
    return tmp, local, ray


def test_ray_and_local_find_the_same(campaigns):
    tmp, local, ray = campaigns
    assert local.returncode in (0, 1), local.stderr[-3000:]
    assert ray.returncode == local.returncode, ray.stderr[-3000:]
    a, b = json.loads(local.stdout), json.loads(ray.stdout)
    assert "local worker process" in a["backend"]
    assert "local Ray cluster on 127.0.0.1" in b["backend"], b["backend"]
    assert len(a["releases"]) == 6 and a["seeds"] == [0, 1]
    assert len(a["tasks"]) == 12 and all(t["status"] == "done" for t in a["tasks"]), a["tasks"]
    assert all(t["bound"] == "examples" for t in a["tasks"])
    assert a["table"], "the campaign found nothing: the comparison would compare nothing"
    assert _findings(a) == _findings(b)
    assert a["table"] == b["table"] and a["spans"] == b["spans"]
    for sp in a["spans"]:  # first / last release are the table's
        found = [r for r in a["releases"] if a["table"][sp["signature"]].get(r)]
        assert (sp["first"], sp["last"]) == (found[0], found[-1])
    assert (tmp / "local" / "heatmap.png").stat().st_size > 1000


def test_a_finding_replays_with_run(campaigns, tmp_path):
    tmp, local, _ = campaigns
    report = json.loads(local.stdout)
    sig, by_release = sorted(report["scenarios"].items())[0]
    release, rel = sorted(by_release.items())[0]
    proc = run_cli("run", str(tmp / "local" / rel), "--vllm", release, "--json",
                   "--reports", str(tmp_path))
    verdicts = json.loads(proc.stdout)
    assert verdicts and verdicts[0]["ok"] is True, proc.stdout + proc.stderr[-2000:]


def test_running_again_resumes(campaigns):
    tmp, local, _ = campaigns
    tasks = tmp / "local" / "tasks"
    before = {p.name: p.stat().st_mtime_ns for p in tasks.glob("*.json")}
    (tasks / "0.10.2-seed1.json").unlink()  # as if interrupted before that task ended
    again = run_cli(*ARGS, "--out", str(tmp / "local"), timeout=600)
    assert again.returncode == local.returncode, again.stderr[-3000:]
    after = {p.name: p.stat().st_mtime_ns for p in tasks.glob("*.json")}
    assert after.keys() == before.keys()
    rerun = [n for n in after if after[n] != before[n]]
    assert rerun == ["0.10.2-seed1.json"], rerun
    assert _findings(json.loads(again.stdout)) == _findings(json.loads(local.stdout))
