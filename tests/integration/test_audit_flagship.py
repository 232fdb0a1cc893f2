"""The audit on the flagship scenario (vLLM #23347), through the CLI as a user runs it.

0.10.1.1 still crashes at step 3 (now with the audit's figures in the trace and a timeline);
0.10.2 runs to its end with the audit's finding of the residual defect at step 3 (the
preempted request left in num_scheduled_tokens) reported as 'also', not as a failure.
"""

from __future__ import annotations

import json

import pytest

from ..conftest import FLAGSHIP

pytestmark = pytest.mark.slow

NAME = "vllm-23347-priority-preempt-scheduled"


@pytest.fixture(scope="module")
def flagship_run(tmp_path_factory):
    from ..conftest import run_cli

    reports = tmp_path_factory.mktemp("reports")
    proc = run_cli("run", str(FLAGSHIP), "--reports", str(reports), "--sched-log", "--jobs", "1")
    return proc, reports


def trace(run_dir):
    return [json.loads(x) for x in (run_dir / "trace.jsonl").read_text().splitlines()]


def test_table_summary_and_exit_code(flagship_run):
    proc, _ = flagship_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {ln.split()[1]: ln for ln in proc.stdout.splitlines() if ln.startswith(NAME)}
    assert "crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3" in rows["0.10.1.1"]
    assert "ran to the end (2 finished" in rows["0.10.2"] and "also: REQ_STATE @3" in rows["0.10.2"]
    assert rows["0.10.2"].rstrip().endswith("yes")
    assert (f"  {NAME} on 0.10.2: REQ_STATE @3: L is in num_scheduled_tokens but was preempted in "
            "the same step (status PREEMPTED, in waiting)") in proc.stdout.splitlines()
    assert "also: 1 audit finding(s) in 1 run(s)" in proc.stdout


def test_crash_on_0_10_1_1_with_the_audits_trace_and_timeline(flagship_run):
    _, reports = flagship_run
    run = reports / NAME / "0.10.1.1"
    result = json.loads((run / "result.json").read_text())
    assert result["outcome"] == "crash" and result["crash"]["step"] == 3
    assert result["audit"]["keep_going"] is True  # an expected crash must be reached
    assert result["audit"]["by_code"] == {}       # no invariant broke before vLLM noticed
    lines = trace(run)
    assert [ln["audit"]["free"] for ln in lines] == [ln["free_blocks"] for ln in lines]
    assert lines[1]["audit"]["used"] == 4 and lines[1]["audit"]["total"] == 5
    assert (run / "timeline.png").stat().st_size > 10_000
    index = (reports / "index.html").read_text()
    assert f"{NAME}/0.10.1.1/timeline.png" in index


def test_0_10_2_residual_defect_found_at_step_3_and_run_completes(flagship_run):
    proc, reports = flagship_run
    run = reports / NAME / "0.10.2"
    result = json.loads((run / "result.json").read_text())
    assert result["outcome"] == "violation" and result["audit"]["stopped"] is None
    [v] = result["violations"]
    assert (v["code"], v["step"], v["phase"], v["requests"]) == (
        "REQ_STATE", 3, "after schedule", ["L"])
    assert sorted(result["finished"]) == ["H", "L"]
    assert result["verdict"]["ok"] is True and result["verdict"]["also"][0]["code"] == "REQ_STATE"
    step3 = trace(run)[2]
    assert step3["scheduled"] == {"L": 1, "H": 1} and step3["preempted"] == ["L"]
    assert step3["violations"][0]["code"] == "REQ_STATE"
    assert ("[AUDIT] step=3 REQ_STATE (after schedule): L is in num_scheduled_tokens but was "
            "preempted in the same step (status PREEMPTED, in waiting)") in proc.stdout


def test_audit_reads_a_priority_heap_with_tied_keys_and_reports_vllms_crash(cli, tmp_path):
    """The audit lists the waiting queue after every step; with two tied requests in the
    priority heap, iterating it raises TypeError (vLLM #29747). The audit must read the heap's
    raw entries (tuples on these releases) and leave the crash to vLLM's own pop_request,
    reported as a reproduction, not as a lab error (exit 3)."""
    from ..conftest import ROOT

    proc = cli("run", str(ROOT / "tests" / "data" / "priority-tie-waiting.yaml"), "--vllm", "0.11.0",
               "--reports", str(tmp_path), "--json")
    assert proc.returncode != 3, proc.stdout + proc.stderr
    (verdict,) = json.loads(proc.stdout)
    assert verdict["outcome"] == "crash", verdict
    assert "TypeError vllm/v1/core/sched/request_queue.py:pop_request" in verdict["observed"]
