"""Step and stats expectations (issue 46): a wrong decision judged on the trace, held on the
buggy release and required not to hold (or to hold as ``fixed`` writes) on the fixed one."""

from __future__ import annotations

import pytest

from vllm_repro.errors import EXIT_MISMATCH, EXIT_OK
from vllm_repro.records import RunResult, TraceLine
from vllm_repro.scenario.schema import Scenario
from vllm_repro.verdict import audit_keeps_going, exit_code, judge

STEPS = [{"at_step": 3, "scheduled": {"L": 1}, "preempted": ["L"], "preempted_by": "schedule",
          "not_scheduled": ["C"]},
         {"at_step": 4, "finished": {"L": "length"}}]
STATS = [{"at_step": 3, "prefix_cache_stats.hits": 0},
         {"prefix_cache_stats.queries": ">= 40", "num_running_reqs": 0}]


def scenario(**more) -> Scenario:
    return Scenario.model_validate({
        "name": "s", "vllm": {"reproduces_on": ["0.10.1.1"], "clean_on": ["0.10.2"]},
        "config": {"num_gpu_blocks": 8},
        "requests": [{"id": "L", "prompt_len": 4}, {"id": "C", "prompt_len": 4}],
        "expect": {"outcome": "clean", "steps": STEPS, "stats": STATS}, **more})


def trace(buggy: bool) -> list[TraceLine]:
    three = TraceLine(3, scheduled={"L": 1, "C": 0 if buggy else 2},
                      preemptions={"L": "schedule"} if buggy else None,
                      stats={"prefix_cache_stats.queries": 16, "num_running_reqs": 2})
    return [TraceLine(1, scheduled={"L": 4, "C": 4},
                      stats={"prefix_cache_stats.queries": 32, "prefix_cache_stats.hits": 8}),
            TraceLine(2, scheduled={"L": 1}, stats={}), three,
            TraceLine(4, scheduled={"L": 1}, finished=["L", "C"], stats={})]


def run() -> RunResult:
    return RunResult("clean", steps=4, finished={"L": "FINISHED_LENGTH_CAPPED",
                                                 "C": "FINISHED_STOPPED"}, unfinished=[])


def test_the_wrong_decision_holds_on_the_buggy_release():
    v = judge(scenario(), "0.10.1.1", run(), trace(buggy=True))
    assert v.ok is True, v.reason


def test_each_unmet_expectation_is_said():
    sc = scenario()
    sc.expect.steps[0].scheduled = {"L": 2}
    sc.expect.stats[1].__pydantic_extra__["num_running_reqs"] = 1
    v = judge(sc, "0.10.1.1", run(), trace(buggy=True))
    assert v.ok is False
    assert "step 3: L scheduled 1 token(s), not 2" in v.reason
    assert "stats of the run: num_running_reqs = 0, not 1" in v.reason
    v = judge(scenario(), "0.10.1.1", run(), trace(buggy=False))
    assert "step 3: L not preempted" in v.reason and "C scheduled 2 token(s), expected none" in v.reason


def test_on_the_fixed_release_they_must_not_all_hold():
    assert judge(scenario(), "0.10.2", run(), trace(buggy=False)).ok is True
    v = judge(scenario(), "0.10.2", run(), trace(buggy=True))
    assert v.ok is False and "wrong decision (step 3, step 4, stats at step 3, stats as expect says) "\
        "shows on 0.10.2" in v.reason
    assert exit_code([v]) == EXIT_MISMATCH


def test_fixed_steps_hold_as_written():
    sc = scenario(fixed={"outcome": "clean", "steps": [{"at_step": 3, "scheduled": {"C": 2},
                                                        "not_preempted": ["L"]}]})
    v = judge(sc, "0.10.2", run(), trace(buggy=False))
    assert v.ok is True and exit_code([v]) == EXIT_OK
    v = judge(sc, "0.10.2", run(), trace(buggy=True))
    assert v.ok is False and "L preempted (by schedule)" in v.reason


def test_no_trace_is_no_pass():
    v = judge(scenario(), "0.10.1.1", run())
    assert v.ok is False and "no trace.jsonl" in v.reason


def test_the_audit_keeps_going_for_step_expectations():
    sc = Scenario.model_validate({**scenario().model_dump(exclude_none=True),
                                  "expect": {"outcome": "violation", "code": "REQ_STATE",
                                             "steps": STEPS}})
    assert audit_keeps_going(sc, "0.10.1.1")


@pytest.mark.parametrize("bad, words", [
    ({"at_step": 3}, "say what to check"),
    ({"at_step": 3, "preempted": ["X"]}, "unknown request id 'X'"),
    ({"at_step": 3, "finished": {"L": "done"}}, "'done' is no finish"),
    ({"at_step": 3, "scheduled": {"L": 1}, "preempted_by": "schedule"}, "goes with `preempted"),
    ({"at_step": 999, "scheduled": {"L": 1}}, "past limits.max_steps"),
])
def test_bad_step_expectations_are_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        scenario(fixed={"outcome": "clean", "steps": [bad]})


@pytest.mark.parametrize("bad, words", [
    ({"at_step": 3}, "name at least one stat"),
    ({"hits": "lots"}, "give a number or a comparison"),
    ({"Prefix-Hits": 1}, "not a SchedulerStats field name"),
])
def test_bad_stats_expectations_are_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        scenario(fixed={"outcome": "clean", "stats": [bad]})


def test_sampled_tokens_and_reasoning_ended_are_judged_on_the_trace():
    """``expect.steps``' ``sampled`` (the tokens a structured-output request sampled through
    its bitmask) and ``reasoning_ended`` (the release's flag after the step, absent: false)."""
    sc = Scenario.model_validate({
        "name": "s", "level": "engine-core", "vllm": {"reproduces_on": ["0.33.0"]},
        "config": {"num_gpu_blocks": 8, "reasoning_parser": "deepseek_r1"},
        "requests": [{"id": "A", "prompt_len": 4, "structured_outputs": {"regex": "[0-9]+"}}],
        "expect": {"outcome": "clean", "steps": [
            {"at_step": 2, "sampled": {"A": [4]}, "reasoning_ended": {"A": False}},
            {"at_step": 3, "sampled": {"A": [356]}, "reasoning_ended": {"A": True}}]}})
    res = RunResult("clean", steps=3, finished={"A": "FINISHED_STOPPED"}, unfinished=[])
    held = [TraceLine(1, sampled={"A": [355]}, reasoning_ended={"A": None}),
            TraceLine(2, sampled={"A": [4]}, reasoning_ended={"A": False}),
            TraceLine(3, sampled={"A": [356]}, reasoning_ended={"A": True})]
    v = judge(sc, "0.33.0", res, held)
    assert v.ok is True, v.reason
    # the grammar applied from the first token: t4 gave way to a digit, nothing latched
    applied = [TraceLine(1, sampled={"A": [285]}), TraceLine(2, sampled={"A": [285]}),
               TraceLine(3, sampled={"A": [2]})]
    v = judge(sc, "0.33.0", res, applied)
    assert v.ok is False
    assert "step 2: A sampled [285], not [4]" in v.reason
    assert "step 3: A's reasoning_ended is false, not true" in v.reason
    v = judge(sc, "0.33.0", res, [TraceLine(1), TraceLine(2), TraceLine(3)])
    assert "step 2: A sampled nothing through a grammar bitmask, not [4]" in v.reason
