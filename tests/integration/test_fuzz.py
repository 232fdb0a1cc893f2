"""`vllm-repro fuzz` finds #23347 on 0.10.1.1 without being given the scenario, shrinks it, and
the written file reproduces with `vllm-repro run`; its example database makes a second campaign
(another seed) find it again in its first examples; 0.10.2 shows nothing with that signature,
and replaying the stored failure there does not make the database forget it."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.conftest import run_cli

pytestmark = pytest.mark.slow
SIG = "AssertionError@vllm/v1/core/sched/scheduler.py:schedule"
FOUND = re.compile(r"(\d+) requests after shrinking, found after (\d+)s / (\d+) examples")


def _stored(db) -> int:
    """Failures in the database's primary key (one folder per key, one file per example)."""
    from vllm_repro.fuzz.database import FindingsDatabase

    return FindingsDatabase(db, "scheduler").stored()


@pytest.fixture(scope="module")
def first_campaign(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    found, db = tmp / "found", tmp / "db"
    proc = run_cli("fuzz", "--vllm", "0.10.1.1", "--policy", "priority", "--time", "120s",
                   "--first", "--target", SIG, "--seed", "1", "--out", str(found),
                   "--reports", str(tmp / "r"), "--db", str(db))
    return tmp, found, db, proc


def test_finds_and_shrinks_23347_on_0_10_1_1(cli, first_campaign):
    tmp, found, db, proc = first_campaign
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 1: a reproduction was found
    files = sorted(found.glob("*.yaml"))
    assert [f.name for f in files] == ["crash-AssertionError-scheduler.schedule.yaml"]
    sc = yaml.safe_load(files[0].read_text())
    assert len(sc["requests"]) <= 5  # shrunk over the sequence of calls
    assert sc["vllm"]["reproduces_on"] == ["0.10.1.1"] and sc["level"] == "scheduler"
    assert (found / "test_crash_AssertionError_scheduler_schedule.py").is_file()
    assert _stored(db) >= 1, "the shrunk failure is kept in the example database"
    run = cli("run", str(files[0]), "--json", "--reports", str(tmp / "r2"))
    assert run.returncode == 0, run.stdout + run.stderr
    [verdict] = json.loads(run.stdout)
    assert verdict["ok"] is True
    assert "crash AssertionError vllm/v1/core/sched/scheduler.py:schedule" in verdict["observed"]


def test_a_second_campaign_finds_it_first_from_the_database(cli, first_campaign, tmp_path):
    _, _, db, first = first_campaign
    assert first.returncode == 1, first.stdout + first.stderr
    proc = cli("fuzz", "--vllm", "0.10.1.1", "--policy", "priority", "--time", "120s", "--first",
               "--target", SIG, "--seed", "2", "--workers", "1", "--out", str(tmp_path / "found"),
               "--reports", str(tmp_path / "r"), "--db", str(db))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"replaying \d+ stored failure\(s\) from .* first", proc.stderr), proc.stderr
    m = FOUND.search(proc.stdout)
    assert m, proc.stdout
    assert int(m.group(3)) <= 5, f"found only after {m.group(3)} examples: {proc.stdout}"
    # the same campaign without the database must search for it (it is not found at once)
    fresh = cli("fuzz", "--vllm", "0.10.1.1", "--policy", "priority", "--time", "30s",
                "--first", "--target", SIG, "--seed", "2", "--workers", "1",
                "--out", str(tmp_path / "found2"), "--reports", str(tmp_path / "r"), "--db", "none")
    m2 = FOUND.search(fresh.stdout)
    assert m2 is None or int(m2.group(3)) > int(m.group(3)), fresh.stdout


def test_0_10_2_has_no_such_failure_and_the_database_keeps_it(cli, first_campaign, tmp_path):
    _, _, db, first = first_campaign
    assert first.returncode == 1, first.stdout + first.stderr
    before = _stored(db)
    found = tmp_path / "found"
    proc = cli("fuzz", "--vllm", "0.10.2", "--policy", "priority", "--time", "60s",
               "--target", SIG, "--seed", "1", "--out", str(found), "--reports",
               str(tmp_path / "r"), "--db", str(db))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no failure found" in proc.stdout
    assert "stored failure(s)" in proc.stderr, "the fixed release replays the stored failure"
    assert not found.exists() or not list(found.glob("*.yaml"))
    assert _stored(db) == before, "a failure that does not fail on the fixed release is kept"


def test_engine_core_level_runs_the_engines_calls(cli, tmp_path):
    """At level engine-core the campaign runs the release's EngineCore: examples run, none is
    a lab error, and whatever it reports replays with `vllm-repro run`."""
    proc = cli("fuzz", "--vllm", "0.25.0", "--level", "engine-core", "--time", "25s",
               "--workers", "1", "--seed", "4", "--first", "--out", str(tmp_path / "found"),
               "--reports", str(tmp_path / "r"), "--db", "none")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "engine-core" in proc.stdout and "lab errors" not in proc.stderr, proc.stdout + proc.stderr
    for f in sorted((tmp_path / "found").glob("*.yaml")):
        sc = yaml.safe_load(f.read_text())
        assert sc["level"] == "engine-core"
        run = cli("run", str(f), "--json", "--reports", str(tmp_path / "r2"))
        assert run.returncode == 0, run.stdout + run.stderr


def test_draws_only_what_the_release_accepts(cli, tmp_path):
    """0.6.6.post1 refuses priorities, draft tokens, empty outputs, async scheduling and KV cache
    groups: the campaign says so and draws without them (no example is wasted as a lab error);
    forcing one of them is exit 2, and so is a level the release cannot run."""
    proc = cli("fuzz", "--vllm", "0.6.6.post1", "--time", "3s", "--workers", "1", "--seed", "3",
               "--out", str(tmp_path / "found"), "--reports", str(tmp_path / "r"), "--db", "none")
    # 0.6.6.post1 has a real bug in reach (#11562, a prefix-cache ref count leak): in 3 s the
    # campaign may or may not meet it, but what it says must match what it wrote
    found = sorted((tmp_path / "found").glob("*.yaml"))
    if proc.returncode == 0:
        assert "no failure found" in proc.stdout and not found, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 1 and found, proc.stdout + proc.stderr
        assert all(f.name in proc.stdout for f in found), proc.stdout
    assert ("vLLM 0.6.6.post1 refuses priority, spec decode, empty outputs, async scheduling, "
            "kv cache groups: fuzz draws without them") in proc.stderr
    assert "lab errors" not in proc.stderr and "error " not in proc.stdout
    forced = cli("fuzz", "--vllm", "0.6.6.post1", "--time", "3s", "--workers", "1", "--policy",
                 "priority", "--out", str(tmp_path / "found2"), "--reports", str(tmp_path / "r"),
                 "--db", "none")
    assert forced.returncode == 2, forced.stdout + forced.stderr
    assert "--policy priority: vLLM 0.6.6.post1's V1 Request has no priority" in forced.stderr
    level = cli("fuzz", "--vllm", "0.6.6.post1", "--time", "3s", "--workers", "1", "--level",
                "engine-core", "--out", str(tmp_path / "found3"), "--reports", str(tmp_path / "r"),
                "--db", "none")
    assert level.returncode == 2, level.stdout + level.stderr
    assert "--level engine-core: vLLM 0.6.6.post1's first-generation V1 engine" in level.stderr
