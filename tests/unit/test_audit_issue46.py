"""The audit's issue-46 changes over fake books (tests/unit/fakes.py; no release): the
starvation check runs in a step with a preemption, leaving alone only the request that
preempted itself and those after it; a preemption between steps (reset_prefix_cache, pause)
must be in the next step's preempted_req_ids where the release has that field."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_repro.audit import Auditor
from vllm_repro.audit.codes import PREEMPT_UNREPORTED, REQ_STARVED

from .fakes import RequestStatus, make_books, make_output, vf


def scheduler_preempting(victim: str, scheduled: dict, report=None):
    """Fake books with A, B, C running (one token pending each, 32 blocks); schedule()
    preempts ``victim`` (its blocks freed) and schedules ``scheduled``."""
    books, s = make_books(num_gpu_blocks=32, tables={"A": [1], "B": [2], "C": [3]})
    for r in s.running:
        r.num_computed_tokens = r.num_tokens - 1

    def schedule():
        v = s.requests[victim]
        s.running.remove(v)
        books.pool.free_blocks(books.managers[0].req_to_blocks.pop(victim))
        v.status, v.num_computed_tokens = RequestStatus.PREEMPTED, 0
        s.waiting.appendleft(v)
        for rid in scheduled:
            s.requests[rid].num_computed_tokens += scheduled[rid]
        so = make_output(dict(scheduled), cached={rid: 15 for rid in scheduled})
        so.preempted_req_ids = {victim} if report is None else report
        return so

    s.schedule = schedule
    return books, s


def audited_step(books, s, line=None):
    loop = SimpleNamespace(scheduler=s, step=1, finished={}, created=dict.fromkeys(s.requests),
                           _line=line)
    aud = Auditor(SimpleNamespace(computed_advanced_in_schedule=True, vllm_file=""),
                  keep_going=True)
    aud.attach(loop)
    so = s.schedule()  # through the auditor's wrapper: it reads the running order first
    aud.after_schedule(1, so, None)
    return aud


def codes(aud) -> list[str]:
    return [vf(v, "code") for v in aud.violations]


def test_a_request_the_running_loop_visited_is_starved_in_a_preemption_step():
    # C (the last) was preempted for A; B, before it, was visited and got nothing with room
    aud = audited_step(*scheduler_preempting("C", {"A": 1}))
    starved = [v for v in aud.violations if vf(v, "code") == REQ_STARVED]
    assert [vf(v, "requests") for v in starved] == [["B"]], aud.violations


def test_the_request_that_preempted_itself_and_those_after_it_are_left_alone():
    # B could not get a block and preempted itself: the running loop stopped there, C unvisited
    aud = audited_step(*scheduler_preempting("B", {"A": 1}))
    assert REQ_STARVED not in codes(aud), aud.violations


def test_a_preemption_between_steps_must_be_reported_in_the_next_output():
    from vllm_repro.records import TraceLine

    books, s = make_books(num_gpu_blocks=32, tables={"A": [1]})
    s.requests["A"].num_computed_tokens = s.requests["A"].num_tokens - 1

    def schedule():
        s.requests["A"].num_computed_tokens += 1
        so = make_output({"A": 1}, cached={"A": 15})
        so.preempted_req_ids = set()
        return so

    s.schedule = schedule
    line = TraceLine(1, preemptions={"A": "reset_prefix_cache"})
    # a release that flushes such requests another way (no set of them kept): nothing required
    assert PREEMPT_UNREPORTED not in codes(audited_step(books, s, line))
    s.reset_preempted_req_ids = set()  # 0.26+: carried into the next output
    aud = audited_step(books, s, line)
    (v,) = [v for v in aud.violations if vf(v, "code") == PREEMPT_UNREPORTED]
    assert vf(v, "requests") == ["A"]
    assert "A was preempted between steps (by an engine-core event) but is not in the next " \
        "step's SchedulerOutput.preempted_req_ids" in vf(v, "message")
    s.schedule = lambda: SimpleNamespace(**{**vars(schedule()), "preempted_req_ids": {"A"}})
    assert PREEMPT_UNREPORTED not in codes(audited_step(books, s, line))
