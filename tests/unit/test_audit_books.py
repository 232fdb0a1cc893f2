"""The audit's checks and books on fake books (no vLLM release): each check fires its code on a
planted inconsistency, naming the request and blocks, and stays silent on consistent books."""

from __future__ import annotations

from collections import deque

import pytest

from vllm_repro.audit import checks
from vllm_repro.audit.books import Books
from vllm_repro.audit.codes import BATCH_LIMIT, KV_FREE_QUEUE, KV_LEAK, KV_PREFIX_MAP, KV_REFCOUNT, REQ_STATE
from vllm_repro.engine import state

from .fakes import (FreeKVCacheBlockQueue, Request, RequestStatus, make_books, make_output,
                    make_requests, vf)

LAYOUTS = ["coordinator", "single", "manager", "list"]


def kv_checks(books):
    refs = books.refs()
    out = checks.check_refcounts(books, refs, books.held_counts())
    out += checks.check_refcounts(books, refs, books.held_ids())
    fq, _ = checks.check_free_queue(books, refs)
    return out + fq


# ---- books: the layouts ----------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_books_read_every_layout(layout):
    books, s = make_books(num_gpu_blocks=6, tables={"A": [1, 2], "B": [3]}, layout=layout)
    assert books.num_blocks == 6
    assert books.null_id == (None if layout == "list" else 0)
    assert books.tables()[0].keys() == {"A", "B"}
    assert books.held_counts() == {1: 1, 2: 1, 3: 1}
    assert books.holders_of([2, 3]) == {2: ["A"], 3: ["B"]}
    free, ended = books.free_list()
    expected_free = [0, 4, 5] if layout == "list" else [4, 5]
    assert ended and [b.block_id for b in free] == expected_free
    assert books.num_free() == len(expected_free)
    assert state.num_free_blocks(s) == len(expected_free)
    assert [n for n, _ in books.queues()] == ["running", "waiting"]
    assert books.max_tokens == 64 and books.max_seqs == 4
    assert kv_checks(books) == []


def test_books_old_free_queue_without_sentinels():
    books, _ = make_books(num_gpu_blocks=5, tables={"A": [1]}, sentinels=False)
    free, ended = books.free_list()
    assert ended and [b.block_id for b in free] == [2, 3, 4]
    assert kv_checks(books) == []


def test_books_two_groups_label_holders_by_group():
    books, _ = make_books(num_gpu_blocks=8, groups=[{"A": [1, 2]}, {"A": [3]}])
    assert len(books.managers) == 2
    assert books.holders_of([1, 3]) == {1: ["A[g0]"], 3: ["A[g1]"]}
    assert kv_checks(books) == []


def test_books_missing_pool_and_tables_say_what_is_missing():
    from types import SimpleNamespace

    with pytest.raises(AttributeError, match="block_pool"):
        Books(SimpleNamespace(kv_cache_manager=SimpleNamespace()))
    with pytest.raises(AttributeError, match="req_to_blocks"):
        Books(SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=object())))


def test_extra_holders_count_deferred_frees():
    books, s = make_books(num_gpu_blocks=6, tables={"A": [1]})
    blk = books.blocks[4]
    s.deferred_frees = [(7, [blk])]
    assert books.extra_holders() == [("deferred-free@7", [blk])]
    assert books.holders_of([4]) == {4: ["deferred-free@7"]}


# ---- KV_REFCOUNT ---------------------------------------------------------------------------
def test_refcount_fires_on_a_count_that_disagrees_with_the_tables():
    books, _ = make_books(num_gpu_blocks=6, tables={"A": [1, 2], "B": [2]}, enable_caching=True)
    books.blocks[2].ref_cnt = 1  # held by A and B
    out = checks.check_refcounts(books, books.refs(), books.held_counts())
    assert [vf(v, "code") for v in out] == [KV_REFCOUNT]
    v = out[0]
    assert vf(v, "blocks") == [2] and vf(v, "requests") == ["A", "B"]
    assert "block 2 ref_cnt 1 but held by A and B (expected 2)" in vf(v, "message")


def test_refcount_fires_below_zero():
    books, _ = make_books(num_gpu_blocks=6, tables={"A": [1]})
    books.blocks[1].ref_cnt = -1
    out = checks.check_refcounts(books, books.refs(), books.held_ids())
    assert [vf(v, "code") for v in out] == [KV_REFCOUNT]
    assert "below 0" in vf(out[0], "message") and vf(out[0], "requests") == ["A"]


# ---- KV_FREE_QUEUE -------------------------------------------------------------------------
def test_free_queue_fires_on_a_held_block_in_the_queue():
    books, _ = make_books(num_gpu_blocks=6, tables={"A": [1]})
    books.pool.free_block_queue = FreeKVCacheBlockQueue([books.blocks[i] for i in (1, 2, 3, 4, 5)])
    out, _ = checks.check_free_queue(books, books.refs())
    assert [vf(v, "code") for v in out] == [KV_FREE_QUEUE]
    assert vf(out[0], "blocks") == [1] and vf(out[0], "requests") == ["A"]
    assert "block 1 is in the free queue with ref_cnt 1" in vf(out[0], "message")


def test_free_queue_fires_on_a_lost_block_and_a_wrong_count():
    books, _ = make_books(num_gpu_blocks=6, tables={"A": [1]})
    books.pool.free_block_queue = FreeKVCacheBlockQueue([books.blocks[i] for i in (2, 3, 4)])
    out, _ = checks.check_free_queue(books, books.refs())
    assert [(vf(v, "code"), vf(v, "blocks")) for v in out] == [(KV_FREE_QUEUE, [5])]
    assert "block 5 has ref_cnt 0 but is not in the free queue" in vf(out[0], "message")
    books.pool.free_block_queue.num_free_blocks = 9
    out, _ = checks.check_free_queue(books, books.refs())
    assert any("counts 9 free blocks" in vf(v, "message") for v in out)


def test_free_queue_fires_on_a_cycle():
    books, _ = make_books(num_gpu_blocks=6, tables={"A": [1]})
    books.blocks[5].next_free_block = books.blocks[2]  # 2 -> 3 -> 4 -> 5 -> 2 ...
    out, _ = checks.check_free_queue(books, books.refs())
    assert [vf(v, "code") for v in out] == [KV_FREE_QUEUE]
    assert "do not end" in vf(out[0], "message")


def test_free_queue_fires_on_the_null_block():
    books, _ = make_books(num_gpu_blocks=6, tables={"A": [1]})
    books.pool.free_block_queue = FreeKVCacheBlockQueue([books.blocks[i] for i in (0, 2, 3, 4, 5)])
    out, _ = checks.check_free_queue(books, books.refs())
    assert [(vf(v, "code"), vf(v, "blocks")) for v in out] == [(KV_FREE_QUEUE, [0])]
    assert "null block" in vf(out[0], "message")


# ---- KV_LEAK -------------------------------------------------------------------------------
def test_leak_silent_for_running_and_fires_for_a_finished_request():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1, 2], "B": [3]})
    assert checks.check_leaks(books, s.requests, {}) == []
    # B finished and left the scheduler without freeing its table
    s.running.remove(s.requests.pop("B"))
    out = checks.check_leaks(books, s.requests, {"B": "FINISHED_STOPPED"})
    assert [(vf(v, "code"), vf(v, "requests"), vf(v, "blocks")) for v in out] == \
        [(KV_LEAK, ["B"], [3])]
    assert "B is gone from the scheduler (FINISHED_STOPPED) but still holds block(s) 3" in \
        vf(out[0], "message")


def test_leak_fires_for_a_preempted_request_but_not_for_a_remote_kv_wait():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1, 2], "C": [4]},
                          statuses={"A": "PREEMPTED", "C": "WAITING_FOR_REMOTE_KVS"})
    out = checks.check_leaks(books, s.requests, {})
    assert [(vf(v, "requests"), vf(v, "blocks")) for v in out] == [(["A"], [1, 2])]
    assert "preempted" in vf(out[0], "message")


def test_leak_allows_the_kv_holding_waiting_queue():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1]}, statuses={"A": "WAITING"})
    assert [vf(v, "requests") for v in checks.check_leaks(books, s.requests, {})] == [["A"]]
    s.kv_holding_waiting = deque([s.requests["A"]])
    assert checks.check_leaks(books, s.requests, {}) == []


# ---- end of run ----------------------------------------------------------------------------
def test_end_of_run_silent_when_all_free_and_fires_on_a_held_block():
    books, s = make_books(num_gpu_blocks=6)
    free, _ = books.free_list()
    assert checks.check_end_of_run(books, books.refs(), free) == []
    books, s = make_books(num_gpu_blocks=6, tables={"A": [3]})
    free, _ = books.free_list()
    out = checks.check_end_of_run(books, books.refs(), free)
    assert [(vf(v, "code"), vf(v, "requests"), vf(v, "blocks")) for v in out] == \
        [(KV_LEAK, ["A"], [3])]
    assert "block(s) 3 still have ref_cnt 1 (held by A)" in vf(out[0], "message")


# ---- KV_PREFIX_MAP -------------------------------------------------------------------------
G0 = (0).to_bytes(4, "little")


def cached_books():
    books, s = make_books(num_gpu_blocks=6, tables={"A": [1, 2]}, enable_caching=True)
    # 0.11+: a block's hash is the request's block hash + a 4-byte KV cache group id
    for bid, h in ((1, b"h1" + G0), (2, b"h2" + G0)):
        books.blocks[bid]._block_hash = h
        books.pool.cached_block_hash_to_block[h] = {bid: books.blocks[bid]}
    return books, s


def test_prefix_map_silent_on_consistent_books_and_fires_on_a_missing_entry():
    books, _ = cached_books()
    chk = checks.PrefixMapCheck(books)
    assert chk.check(full=True) == []
    del books.pool.cached_block_hash_to_block[b"h2" + G0]
    out = chk.check(full=True)
    assert [(vf(v, "code"), vf(v, "blocks")) for v in out] == [(KV_PREFIX_MAP, [2])]
    assert "block 2 carries a hash" in vf(out[0], "message")


def test_prefix_map_incremental_check_sees_a_new_unmapped_hash():
    books, _ = cached_books()
    chk = checks.PrefixMapCheck(books)
    assert chk.check() == []
    books.blocks[3]._block_hash = b"h3"  # hashed, never put in the map
    out = chk.check()
    assert [(vf(v, "code"), vf(v, "blocks")) for v in out] == [(KV_PREFIX_MAP, [3])]


def test_prefix_map_fires_on_the_null_block_and_a_wrong_key():
    books, _ = cached_books()
    books.pool.cached_block_hash_to_block[b"h0"] = {0: books.blocks[0]}
    books.pool.cached_block_hash_to_block[b"hx"] = {1: books.blocks[1]}
    out = checks.PrefixMapCheck(books).check(full=True)
    msgs = {vf(v, "blocks")[0]: vf(v, "message") for v in out}
    assert set(msgs) == {0, 1}
    assert "null block" in msgs[0] and "hash it does not carry" in msgs[1]


def test_prefix_map_with_caching_off_must_be_empty():
    books, _ = make_books(num_gpu_blocks=6, tables={"A": [1]})
    books.blocks[1]._block_hash = b"h1"
    out = checks.PrefixMapCheck(books).check(full=True)
    assert [(vf(v, "code"), vf(v, "blocks")) for v in out] == [(KV_PREFIX_MAP, [1])]
    assert "prefix caching is off" in vf(out[0], "message")


def test_request_hash_check_names_request_and_block():
    books, s = cached_books()
    m = books.managers[0]
    m.num_cached_block["A"] = 2
    s.requests["A"].block_hashes = [b"h1", b"h2"]
    chk = checks.RequestHashCheck(books)
    assert chk.check(s.requests) == []
    books, s = cached_books()
    books.managers[0].num_cached_block["A"] = 2
    s.requests["A"].block_hashes = [b"h1", b"other"]
    out = checks.RequestHashCheck(books).check(s.requests)
    assert [(vf(v, "code"), vf(v, "requests"), vf(v, "blocks")) for v in out] == \
        [(KV_PREFIX_MAP, ["A"], [2])]
    assert "A's cached block #1" in vf(out[0], "message")


# ---- REQ_STATE / BATCH_LIMIT ---------------------------------------------------------------
def scheduled_books(n_tokens: int = 8):
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1], "B": [2]})
    for r in s.running:
        r.num_computed_tokens = n_tokens
    return books, s


def test_request_state_silent_on_a_consistent_step():
    books, s = scheduled_books()
    chk = checks.RequestChecks(books)
    so = make_output({"A": 8, "B": 8}, cached={"A": 0, "B": 0})
    assert chk.check("schedule", so) == []
    assert chk.check("update", so) == []


def test_request_state_fires_on_a_request_in_two_queues():
    books, s = scheduled_books()
    s.waiting.append(s.requests["B"])
    out = checks.RequestChecks(books).check("schedule")
    assert [(vf(v, "code"), vf(v, "requests")) for v in out] == [(REQ_STATE, ["B"])]
    assert "B is in running and waiting" in vf(out[0], "message")


def test_request_state_fires_on_status_and_queue_disagreeing():
    books, s = scheduled_books()
    s.requests["A"].status = RequestStatus.PREEMPTED
    out = checks.RequestChecks(books).check("schedule")
    assert [(vf(v, "code"), vf(v, "requests")) for v in out] == [(REQ_STATE, ["A"])]
    assert "A is in running with status PREEMPTED (expected RUNNING)" in vf(out[0], "message")


def test_request_state_fires_on_computed_tokens_moving_backwards():
    books, s = scheduled_books()
    chk = checks.RequestChecks(books)
    assert chk.check("schedule") == []
    s.requests["A"].num_computed_tokens = 4
    out = chk.check("schedule")
    assert [vf(v, "requests") for v in out] == [["A"]]
    assert "went from 8 to 4 without a preemption" in vf(out[0], "message")


def test_request_state_fires_on_a_scheduled_waiting_request_and_a_double_listing():
    books, s = scheduled_books()
    (w,) = make_requests(1, prefix="W")
    s.requests["W0"] = w
    s.waiting.append(w)
    so = make_output({"A": 8, "W0": 4}, new={"W0": 0}, cached={"A": 0}, cached_list=True)
    so.scheduled_new_reqs.append(so.scheduled_new_reqs[0])
    out = checks.RequestChecks(books).check("schedule", so)
    by = {vf(v, "requests")[0]: vf(v, "message") for v in out}
    assert set(by) == {"W0"}
    assert "W0 is in num_scheduled_tokens with status WAITING" in by["W0"]
    assert "listed 2 times" in by["W0"]


def test_request_state_checks_the_advance_against_the_adapter_view():
    from vllm_repro.engine.adapter import Scheduled

    books, s = scheduled_books(n_tokens=8)
    so = make_output({"A": 8}, cached={"A": 4})
    sch = [Scheduled("A", 8, 4, [], False)]
    out = checks.RequestChecks(books).check("schedule", so, sch)
    assert [vf(v, "requests") for v in out] == [["A"]]
    assert "expected 4 + 8 scheduled = 12" in vf(out[0], "message")


def test_batch_limits_fire_on_tokens_seqs_and_totals():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1], "B": [2], "C": [3]},
                          max_num_scheduled_tokens=10, max_num_running_reqs=2)
    for r in s.running:
        r.num_computed_tokens = 6
    so = make_output({"A": 6, "B": 6, "C": 0}, cached={"A": 0, "B": 0, "C": 0}, total=5)
    out = checks.RequestChecks(books).check("schedule", so)
    msgs = [vf(v, "message") for v in out if vf(v, "code") == BATCH_LIMIT]
    assert any("C is scheduled with 0 tokens" in m for m in msgs)
    assert any("12 tokens scheduled in one step, over max_num_batched_tokens 10" in m for m in msgs)
    assert any("total_num_scheduled_tokens is 5" in m for m in msgs)
    assert any("3 requests running, over max_num_seqs 2" in m for m in msgs)
    assert any("3 requests scheduled in one step, over max_num_seqs 2" in m for m in msgs)


# ---- engine/state.py on SchedulerOutput and queues ------------------------------------------
@pytest.mark.parametrize("cached_list", [False, True])
def test_state_reads_both_scheduler_output_shapes(cached_list):
    so = make_output({"N": 4, "C": 1}, new={"N": 0}, cached={"C": 7}, cached_list=cached_list,
                     spec={"C": [5]})
    assert state.cached_req_ids(so) == ["C"]
    assert state.computed_before(so) == ({"N": 0, "C": 7}, {"N"})
    assert state.spec_tokens(so) == {"C": [5]}


def test_state_reads_first_generation_resumed_and_running_lists():
    from types import SimpleNamespace

    so = SimpleNamespace(scheduled_new_reqs=[],
                         scheduled_resumed_reqs=[SimpleNamespace(req_id="R", num_computed_tokens=3)],
                         scheduled_running_reqs=[SimpleNamespace(req_id="U", num_computed_tokens=9)])
    assert state.cached_req_ids(so) == ["R", "U"]
    assert state.computed_before(so) == ({"R": 3, "U": 9}, set())
    assert state.spec_tokens(so) == {}


def test_state_queue_ids_tell_preempted_apart():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1]},
                          requests=[Request("P", status=RequestStatus.PREEMPTED),
                                    Request("W", status=RequestStatus.WAITING)])
    assert state.queue_ids(s, RequestStatus.PREEMPTED) == (["P", "W"], ["A"], ["P"])


def test_iter_queue_reads_a_broken_heap_raw():
    class Heap:
        def __init__(self, items):
            self._heap = items

        def __iter__(self):
            raise TypeError("'<' not supported between instances of 'Request' and 'Request'")

    a, b = Request("A"), Request("B")
    assert state.iter_queue(Heap([(0, 1.0, a), b])) == [a, b]
    with pytest.raises(TypeError):
        state.iter_queue(type("Q", (), {"__iter__": Heap.__iter__})())


def test_plain_block_hash_reads_both_group_id_shapes():
    from collections import namedtuple

    BlockHashWithGroupId = namedtuple("BlockHashWithGroupId", "block_hash group_id")
    assert state.plain_block_hash(b"abcd" + G0) == b"abcd"  # 0.11+: bytes + 4-byte group id
    assert state.plain_block_hash(BlockHashWithGroupId("h", 0)) == "h"  # 0.9/0.10
    assert state.plain_block_hash(12345) == 12345  # older: the hash itself


def test_hash_checkable_groups_skip_a_group_whose_block_spans_several_hash_blocks():
    books, _ = make_books(num_gpu_blocks=8, groups=[{"A": [1]}, {"A": [2]}], block_size=16)
    assert state.hash_checkable_groups(books.layout) == [0, 1]
    books.managers[1].block_size = 32
    books.layout.hash_block_size = 16  # 0.33's BlockPool.hash_block_size
    assert state.hash_checkable_groups(books.layout) == [0]
    del books.managers[0].num_cached_block
    assert state.hash_checkable_groups(books.layout) == []


def test_request_state_repeats_a_lasting_disagreement_at_every_look_and_sees_a_new_one():
    # the checks look again only at requests that moved since their last look, and at those
    # found wrong then: a lasting fault is reported at every check, as when all were read
    books, s = scheduled_books()
    chk = checks.RequestChecks(books)
    assert chk.check("schedule") == []
    s.requests["A"].status = RequestStatus.PREEMPTED  # A stays in running
    for phase in ("schedule", "schedule", "update", "schedule"):
        out = chk.check(phase, make_output({"A": 8}) if phase == "update" else None)
        assert [vf(v, "requests") for v in out] == [["A"]], phase
    s.requests["A"].status = RequestStatus.RUNNING
    assert chk.check("schedule") == []
    s.requests["B"].num_computed_tokens += 3  # moved in a step that did not schedule it
    out = chk.check("schedule", make_output({}))
    assert [vf(v, "requests") for v in out] == [["B"]]
    assert "in a step that did not schedule it" in vf(out[0], "message")
