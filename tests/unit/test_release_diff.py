"""``vllm-repro diff``'s alignment (issue 46): the first step whose decisions differ, on
hand-made traces."""

from __future__ import annotations

from vllm_repro.diff import diff_lines, first_difference, release_diff
from vllm_repro.records import Crash, Frame, ReleaseDiff, RunResult, TraceLine


def lines(**step3) -> list[TraceLine]:
    return [TraceLine(1, scheduled={"A": 8, "B": 8}, free_blocks=4),
            TraceLine(2, scheduled={"A": 1, "B": 1, "C": 0}, free_blocks=4),
            TraceLine(3, **{"scheduled": {"A": 1}, "free_blocks": 3, **step3})]


def test_same_decisions_no_difference():
    assert first_difference(lines(), lines()) == (None, [])
    # a request listed with 0 tokens schedules nothing: the same decision
    b = lines()
    b[1].scheduled = {"A": 1, "B": 1}
    assert first_difference(lines(), b) == (None, [])


def test_the_first_differing_step_and_fields():
    b = lines(preemptions={"A": "schedule"}, free_blocks=2)
    assert first_difference(lines(), b) == (3, ["preempted", "free_blocks"])
    assert first_difference(lines(), lines()[:2]) == (3, ["present", "scheduled", "preempted",
                                                          "finished", "free_blocks"])


def test_the_record_and_what_is_printed():
    crashed = lines(scheduled=None, preemptions={"A": "schedule"}, crash=Crash(
        "AssertionError", where=Frame("vllm/v1/core/sched/scheduler.py", "schedule", 530)))
    fixed = lines(scheduled={"A": 1, "B": 1}, preemptions={"A": "schedule"})
    d = release_diff("s", [("1.0", RunResult("crash"), crashed, "r/1.0"),
                           ("1.1", RunResult("clean"), fixed, "r/1.1")])
    assert d.step == 3 and d.differs == ["scheduled", "crash"]
    assert d.scheduled_and_preempted == {"1.1": ["A"]}
    assert ReleaseDiff.from_json(d.to_json()) == d
    head, rows, notes = diff_lines(d)
    assert head[1] == "first difference at step 3 (scheduled, crash)"
    assert rows[0] == ["* scheduled (tokens)", "(schedule() did not return)", "A=1 B=1"]
    assert rows[1] == ["  preempted (by)", "A (schedule)", "A (schedule)"]
    assert "on 1.1: A scheduled and preempted in one schedule() call" in notes
