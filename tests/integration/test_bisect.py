"""``vllm-repro bisect`` on the real releases, through the CLI as a user runs it: vLLM #23347 was
fixed in 0.10.2. Builds 0.10.1's environment on first use (cached afterwards)."""

from __future__ import annotations

import json

import pytest

from ..conftest import FLAGSHIP, SCENARIOS

pytestmark = pytest.mark.slow

NAME = "vllm-23347-priority-preempt-scheduled"


def test_flagship_first_fixed_release_is_0_10_2(cli, tmp_path):
    reports = tmp_path / "reports"
    proc = cli("bisect", str(FLAGSHIP), "--bad", "0.10.0", "--good", "0.10.2", "--reports", str(reports))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "first fixed release: 0.10.2 (last bad: 0.10.1.1); 4 of 4 releases run"
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert list(rows) == ["0.10.0", "0.10.1", "0.10.1.1", "0.10.2"]  # every release between, in order
    for v in ("0.10.0", "0.10.1", "0.10.1.1"):
        assert "crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3" in rows[v]
        assert rows[v].rstrip().endswith(" bad")
    assert "ran to the end (2 finished" in rows["0.10.2"] and rows["0.10.2"].rstrip().endswith(" good")
    # the endpoints first, then the middle of what is left
    progress = [line.removeprefix("bisect: ") for line in proc.stderr.splitlines()
                if line.startswith("bisect: ")]
    assert progress[1:3] == ["checking --bad 0.10.0", "checking --good 0.10.2"]
    assert [line.split()[0] for line in progress[3:5]] == ["0.10.1", "0.10.1.1"]
    # each run's report, with the verdict that decided it
    for v, expected in (("0.10.1", "crash"), ("0.10.2", "clean")):
        verdict = json.loads((reports / NAME / v / "result.json").read_text())["verdict"]
        assert (verdict["expected"], verdict["ok"]) == (expected, True)
    assert (reports / "index.html").is_file()


def test_a_v0_engine_entry_bisects_over_v0_releases_to_its_first_fixed_one(cli, tmp_path):
    """The catalog's V0 entry for vLLM #8881 (``level: v0-engine``): 0.8.3 dies on the issue's
    assertion in the V0 scheduler, 0.8.4's front door refuses the long prompt (its ``fixed:``
    outcome), so the first fixed release is 0.8.4: both run their V0 engine (a release with both
    engines runs its V0 one at this level). Two adjacent releases keep it short; the search
    between endpoints is the flagship's test above."""
    entry = SCENARIOS / "vllm-8881-v0-async-stopped-long-prompt.yaml"
    proc = cli("bisect", str(entry), "--bad", "0.8.3", "--good", "0.8.4", "--reports",
               str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "first fixed release: 0.8.4 (last bad: 0.8.3); 2 of 2 releases run"
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert list(rows) == ["0.8.3", "0.8.4"]
    assert "crash AssertionError vllm/core/scheduler.py:_schedule_running @5" in rows["0.8.3"]
    assert rows["0.8.3"].rstrip().endswith(" bad")
    assert "crash ValueError vllm/engine/llm_engine.py:_validate_model_input @3" in rows["0.8.4"]
    assert rows["0.8.4"].rstrip().endswith(" good")


def test_an_endpoint_that_does_not_reproduce_is_exit_2_and_nothing_else_runs(cli, tmp_path):
    proc = cli("bisect", str(FLAGSHIP), "--bad", "0.10.2", "--good", "0.11.0",
               "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --bad 0.10.2 runs clean, it does not reproduce the scenario's expected "
                      "bug: observed ran to the end (2 finished, 31 steps); also: REQ_STATE @3; "
                      "pass --bad a release that reproduces it"]
    assert not (tmp_path / "r" / NAME / "0.11.0").exists()
    assert not proc.stdout.strip()
