"""How verdicts treat audit findings (issue #3): clean_on requires no crash, no stall and none
of the scenario's own signature; other violations are reported as 'also', never flip ok."""

from __future__ import annotations

from vllm_repro.scenario import load_scenario
from vllm_repro.verdict import audit_keeps_going, exit_code, findings_lines, judge, violations_at

from ..conftest import FLAGSHIP
from .builders import make_result, make_scenario, make_violation


def flagship():
    return load_scenario(FLAGSHIP)  # reproduces_on 0.10.1.1 (crash @3), clean_on 0.10.2, >=0.10.2


def violation(code="REQ_STATE", step=3, msg=None):
    return make_violation(code, step, msg) if msg else make_violation(code, step)


def ran_to_end(violations, stopped=None, **extra):
    return make_result("violation", violations=violations, steps=31,
                       finished={"L": "FINISHED_LENGTH_CAPPED", "H": "FINISHED_LENGTH_CAPPED"},
                       unfinished=[], limit_reached=False,
                       audit={"keep_going": stopped is None, "stopped": stopped}, **extra)


def test_clean_on_release_with_an_unrelated_violation_is_ok_and_says_also():
    v = judge(flagship(), "0.10.2", ran_to_end([violation()]))
    assert v.ok is True and v.expected == "clean" and v.outcome == "violation"
    assert v.observed == "ran to the end (2 finished, 31 steps); also: REQ_STATE @3"
    assert [x.code for x in v.also] == ["REQ_STATE"]
    assert v.as_dict()["also"][0]["message"].startswith("L is in num_scheduled_tokens")
    lines = findings_lines([v])
    assert lines[0].startswith("also: 1 audit finding(s) in 1 run(s)")
    assert "vllm-23347-priority-preempt-scheduled on 0.10.2: REQ_STATE @3: L is in" in lines[1]
    assert exit_code([v]) == 0


def test_clean_on_needs_the_whole_run_a_stopped_audit_is_not_clean():
    res = ran_to_end([violation()], stopped={"step": 3, "code": "REQ_STATE", "phase": "x"})
    res.steps, res.finished, res.unfinished = 3, {}, ["L", "H"]
    v = judge(flagship(), "0.10.2", res)
    assert v.ok is False and "--keep-going" in v.reason and exit_code([v]) == 1


def test_clean_on_fails_on_the_scenarios_own_signature():
    sc = flagship()
    sc.expect = type(sc.expect)(outcome="violation", code="KV_DOUBLE_FREE")
    v = judge(sc, "0.10.2", ran_to_end([violation(), violation("KV_DOUBLE_FREE", 9, "block 3")]))
    assert v.ok is False and "KV_DOUBLE_FREE @9" in v.reason
    # the same findings without the signature code: fine
    assert judge(sc, "0.10.2", ran_to_end([violation()])).ok is True


def test_clean_on_still_fails_on_crash_or_stall_and_shows_earlier_findings():
    crash = make_result("crash", violations=[violation("KV_REFCOUNT", 2, "block 4 ...")],
                        crash={"type": "AssertionError", "where": None, "step": 5, "message": ""})
    v = judge(flagship(), "0.10.2", crash)
    assert v.ok is False and v.observed.endswith("; also: KV_REFCOUNT @2")
    stall = make_result("stall", stall={"step": 30, "since": 11, "unfinished": ["L"]})
    assert judge(flagship(), "0.10.2", stall).ok is False


def test_expected_crash_matches_with_earlier_findings_as_also():
    res = make_result("crash", violations=[violation("KV_LEAK", 2, "L ...")],
                      crash={"type": "AssertionError", "step": 3, "message": "",
                             "where": {"file": "vllm/v1/core/sched/scheduler.py",
                                       "function": "schedule"}})
    v = judge(flagship(), "0.10.1.1", res)
    assert v.ok is True
    assert v.observed == ("crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3; "
                          "also: KV_LEAK @2")


def test_keep_going_is_chosen_when_the_verdict_is_about_the_end_of_the_run():
    sc = flagship()
    assert audit_keeps_going(sc, "0.10.2") is True      # clean_on
    assert audit_keeps_going(sc, "0.11.0") is True      # clean_on range
    assert audit_keeps_going(sc, "0.10.1.1") is True    # an expected crash must be seen
    assert audit_keeps_going(sc, "0.8.5") is False      # no expectation: stop at the first
    sc.expect = type(sc.expect)(outcome="violation", code="REQ_STATE")
    assert audit_keeps_going(sc, "0.10.1.1") is False   # the violation is the verdict


def test_a_planted_run_is_never_an_observation():
    res = ran_to_end([violation()], planted={"plant": "/x/plant_faults.py:two_queues"})
    v = judge(flagship(), "0.10.2", res)
    assert v.ok is False and "planted" in v.reason and exit_code([v]) == 1


def test_no_expectation_violation_is_a_finding_exit_1():
    v = judge(flagship(), "0.8.5", ran_to_end([violation()],
                                              stopped={"step": 3, "code": "REQ_STATE", "phase": ""}))
    assert v.ok is None and v.observed == "violation REQ_STATE @3" and exit_code([v]) == 1


def test_a_run_that_did_not_finish_is_never_clean():
    """limits.max_steps reached with requests unfinished (issue 18: 20,000 requests, 19,250
    unfinished, was judged clean): outcome incomplete, a mismatch on a clean_on release and not
    a reproduction on a reproduces_on one."""
    res = make_result("incomplete", steps=500, finished={"A": "FINISHED_STOPPED"},
                      unfinished=["B", "C"], limit_reached=True)
    clean = judge(flagship(), "0.10.2", res)
    assert clean.ok is False and exit_code([clean]) == 1
    assert clean.observed == "incomplete (max_steps 500 reached, 2 unfinished, 1 finished)"
    assert "limits.max_steps (500) with 2 request(s) unfinished" in clean.reason
    bad = judge(flagship(), "0.10.1.1", res)
    assert bad.ok is False and "neither clean nor a reproduction" in bad.reason
    # findings collected on the way do not make an unfinished run clean either
    kept = ran_to_end([violation()])
    kept.unfinished = ["B"]
    v = judge(flagship(), "0.10.2", kept)
    assert v.ok is False and "did not finish" in v.reason


def test_an_unfinished_run_without_an_expectation_is_not_a_finding_of_a_bug():
    sc = make_scenario(vllm={"clean_on": ["0.10.2"]}, limits={"max_steps": 5})
    res = make_result("incomplete", steps=5, finished={}, unfinished=["R0", "R1"], limit_reached=True)
    v = judge(sc, "0.10.2", res)
    assert v.expected == "clean" and v.ok is False and exit_code([v]) == 1
    other = judge(sc, "0.9.0", res)  # a release the scenario says nothing about
    assert other.ok is None and exit_code([other]) == 1


def residue(rid: str, step: int = 6, mechanism: str | None = "finished"):
    v = violation("REQ_RESIDUE", step, f"{rid} (its group A, finished (length)) left the scheduler")
    v.requests, v.mechanism = [rid], mechanism
    return v


def test_observed_says_each_distinct_finding_once_with_its_mechanism_and_a_count():
    """#14353's two children, each its own REQ_RESIDUE record at one step, read
    ``REQ_RESIDUE/finished @6 ×2`` (the fuzz signature's ``CODE/mechanism``), not the code
    twice; the verdict (ok) is the same as with the plain code."""
    sc = make_scenario(expect={"outcome": "violation", "code": "REQ_RESIDUE"})
    found = [residue("A_parallel_sample_0"), residue("A_parallel_sample_1")]
    v = judge(sc, "0.10.1.1", ran_to_end(found))
    assert v.ok is True
    assert v.observed == "violation REQ_RESIDUE/finished @6 ×2, ran to the end (2 finished, 31 steps)"
    stopped = ran_to_end(found, stopped={"step": 6, "code": "REQ_RESIDUE", "phase": "end"})
    assert judge(sc, "0.10.1.1", stopped).observed == "violation REQ_RESIDUE/finished @6 ×2"
    # distinct mechanisms or steps stay apart; past three distinct ones, (+N) counts the rest
    many = found + [residue("C", 6, "ignored"), violation("KV_LEAK", 9), violation("KV_LEAK", 9),
                    violation("REQ_STATE", 12)]
    assert violations_at(many) == ("REQ_RESIDUE/finished @6 ×2, REQ_RESIDUE/ignored @6, "
                                   "KV_LEAK @9 ×2 (+1)")


def test_findings_outside_the_bug_carry_their_mechanism_in_the_summary_and_result_json():
    v = judge(flagship(), "0.10.2", ran_to_end([residue("A_parallel_sample_0"),
                                                residue("A_parallel_sample_1")]))
    assert v.ok is True
    assert v.observed == "ran to the end (2 finished, 31 steps); also: REQ_RESIDUE/finished @6 ×2"
    assert [a["mechanism"] for a in v.as_dict()["also"]] == ["finished", "finished"]
    assert "on 0.10.2: REQ_RESIDUE/finished @6: A_parallel_sample_1 (its group" in findings_lines([v])[2]
