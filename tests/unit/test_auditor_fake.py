"""The auditor over fake books: a finding carries its step, phase, code, requests and blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_repro.records import TraceLine
from vllm_repro.audit import Auditor, AuditStop
from vllm_repro.audit.codes import KV_DOUBLE_FREE, KV_LEAK, KV_REFCOUNT

from .fakes import make_books, make_output, vf


def attached(keep_going=True, **kw):
    books, s = make_books(**kw)
    loop = SimpleNamespace(scheduler=s, step=0, finished={}, created=list(s.requests))
    aud = Auditor(SimpleNamespace(computed_advanced_in_schedule=True, vllm_file=""),
                  keep_going=keep_going)
    aud.attach(loop)
    return aud, books, s, loop


def test_a_consistent_step_records_nothing():
    aud, books, s, loop = attached(num_gpu_blocks=8, tables={"A": [1, 2]})
    so = make_output({"A": 4}, cached={"A": 0})
    s.requests["A"].num_computed_tokens = 4
    aud.after_schedule(1, so, None)
    aud.after_update(1, so, TraceLine(1, scheduled={"A": 4}))
    assert aud.violations == []


def test_a_planted_refcount_is_recorded_with_its_step_and_phase():
    aud, books, s, loop = attached(num_gpu_blocks=8, tables={"A": [1, 2]})
    books.blocks[2].ref_cnt = 2
    so = make_output({"A": 4}, cached={"A": 0})
    s.requests["A"].num_computed_tokens = 4
    aud.after_schedule(3, so, None)
    v = [v for v in aud.violations if vf(v, "code") == KV_REFCOUNT]
    assert v and vf(v[0], "step") == 3 and vf(v[0], "phase") == "after schedule"
    assert vf(v[0], "requests") == ["A"] and vf(v[0], "blocks") == [2]


def test_without_keep_going_a_step_check_stops_and_a_hook_raises():
    aud, books, s, loop = attached(keep_going=False, num_gpu_blocks=8, tables={"A": [1]})
    books.blocks[1].ref_cnt = 0
    assert aud.after_schedule(2, make_output({}), None) is True
    assert aud.stopped == {"step": 2, "code": KV_REFCOUNT, "phase": "after schedule"}
    assert vf(aud.violations[0], "step") == 2

    aud, books, s, loop = attached(keep_going=False, num_gpu_blocks=8, tables={"A": [1]})
    loop.step = 5
    with pytest.raises(AuditStop):
        books.pool.free_blocks([books.blocks[1]])  # A still holds it: a double free
    v = aud.violations[0]
    assert vf(v, "code") == KV_DOUBLE_FREE and vf(v, "step") == 5 and vf(v, "blocks") == [1]
    assert vf(v, "phase").startswith("in ")


def test_end_of_a_clean_run_finds_the_block_never_given_back():
    aud, books, s, loop = attached(num_gpu_blocks=8, tables={"A": [1, 2]})
    s.running.remove(s.requests.pop("A"))
    loop.finished = {"A": "FINISHED_STOPPED"}
    loop.step = 9
    assert aud.finish(loop, "clean") is True
    (v,) = [v for v in aud.violations if vf(v, "code") == KV_LEAK]
    assert vf(v, "step") == 9 and vf(v, "blocks") == [1, 2] and vf(v, "requests") == ["A"]


def test_figures_of_a_step_whose_update_freed_blocks_are_read_after_the_frees():
    """Issue 18 item 6: a step's audit figures came from before update_from_output when that
    call only freed blocks (free 61 where the pool's free count said 63). A request finishing
    in the update gives its blocks back; the line's figures must count them."""
    aud, books, s, loop = attached(num_gpu_blocks=8, tables={"A": [1, 2]})
    so = make_output({"A": 1}, cached={"A": 16})
    s.requests["A"].num_computed_tokens = 16
    loop.step = 1
    aud.after_schedule(1, so, None)
    aud.after_update(1, so, TraceLine(1, scheduled={"A": 1}))
    loop.step = 2
    aud.after_schedule(2, so, None)
    # A finishes inside update_from_output: the manager frees its blocks through the pool
    m = s.kv_cache_manager.coordinator.single_type_managers[0] if hasattr(
        s.kv_cache_manager, "coordinator") else s.kv_cache_manager.single_type_manager
    blocks = m.req_to_blocks.pop("A")
    s.running.remove(s.requests.pop("A"))
    loop.finished = {"A": "FINISHED_STOPPED"}
    books.pool.free_blocks(blocks)
    line = TraceLine(2, scheduled={"A": 1}, finished=["A"])
    aud.after_update(2, so, line)
    aud.annotate(line)
    assert line.audit["free"] == books.num_free() == 7
    assert line.audit["used"] == 0


def test_without_the_mirror_a_planted_refcount_is_still_recorded():
    """Where the block mirror turns off mid-run (a write to a block's ``block_id``), the checks
    read every block again and find the same KV_REFCOUNT as with the mirror."""
    aud, books, s, loop = attached(num_gpu_blocks=8, tables={"A": [1, 2]})
    so = make_output({"A": 4}, cached={"A": 0})
    s.requests["A"].num_computed_tokens = 4
    aud.after_schedule(1, so, None)
    mirror = aud.books.mirror
    if mirror is None:
        pytest.skip(f"no mirror on the fakes: {aud.mirror_off}")
    books.blocks[5].block_id = 5  # the same id, written: the mirror is no longer trusted
    assert not mirror.exact
    books.blocks[2].ref_cnt = 2
    aud.after_update(1, so, TraceLine(1, scheduled={"A": 4}))
    aud.after_schedule(2, make_output({}), None)
    v = [v for v in aud.violations if vf(v, "code") == KV_REFCOUNT]
    assert v and vf(v[0], "step") == 2 and vf(v[0], "blocks") == [2]


def test_a_request_put_in_a_second_queue_between_two_checks_is_reported():
    # the queues' answer is reused while they hold the same requests: a request added to another
    # queue after a clean check must still be found at the next one
    aud, books, s, loop = attached(num_gpu_blocks=8, tables={"A": [1]})
    so = make_output({"A": 4}, cached={"A": 0})
    s.requests["A"].num_computed_tokens = 4
    aud.after_schedule(1, so, None)
    aud.after_update(1, so, TraceLine(1, scheduled={"A": 4}))
    assert aud.violations == []
    s.waiting.append(s.running[0])  # A in running and in waiting
    so = make_output({"A": 1}, cached={"A": 4})
    s.requests["A"].num_computed_tokens = 5
    aud.after_schedule(2, so, None)
    found = [v for v in aud.violations if "expected in exactly one queue" in vf(v, "message")]
    assert found and vf(found[0], "requests") == ["A"] and vf(found[0], "step") == 2

