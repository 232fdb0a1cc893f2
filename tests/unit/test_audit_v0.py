"""The V0 audit's checks (audit/v0.py) on books shaped as vLLM's V0 block manager keeps them
(``SelfAttnBlockSpaceManager``: block tables, ``CpuGpuBlockAllocator`` with a
``NaiveBlockAllocator`` per device, ``RefCounter``), with faults planted into them."""

from __future__ import annotations

from collections import deque
from enum import Enum
from types import SimpleNamespace as NS

import pytest

from vllm_repro.audit.v0 import V0Auditor, V0Books, check_books, check_queues


class Device(Enum):
    GPU = 0
    CPU = 1


class RefCounter:
    def __init__(self, ids):
        self._refcounts = {b: 0 for b in ids}

    def decr(self, b):
        assert self._refcounts[b] > 0
        self._refcounts[b] -= 1
        return self._refcounts[b]


def allocator(ids):
    return NS(_all_block_indices=frozenset(ids), _free_block_indices=deque(ids),
              _refcounter=RefCounter(ids))


def take(alloc, b):
    alloc._free_block_indices.remove(b)
    alloc._refcounter._refcounts[b] += 1


class Group:
    def __init__(self, rid, seq_id, status):
        self.request_id = rid
        self.seq = NS(seq_id=seq_id, status=NS(name=status))

    def get_seqs(self):
        return [self.seq]


def books(running=(), swapped=()):
    """GPU blocks 0-7, CPU blocks 8-11; ``running`` / ``swapped``: (request id, seq id, block
    ids) held as vLLM holds them."""
    gpu, cpu = allocator(range(8)), allocator(range(8, 12))
    tables = {}
    for _rid, sid, blocks in (*running, *swapped):
        for b in blocks:
            take(gpu if b < 8 else cpu, b)
        tables[sid] = NS(physical_block_ids=list(blocks))
    bm = NS(block_tables=tables,
            block_allocator=NS(_allocators={Device.GPU: gpu, Device.CPU: cpu}, _null_block=None),
            get_num_free_gpu_blocks=lambda: len(gpu._free_block_indices))
    sched = NS(block_manager=bm, waiting=deque(),
               running=deque(Group(r, s, "RUNNING") for r, s, _ in running),
               swapped=deque(Group(r, s, "SWAPPED") for r, s, _ in swapped))
    return V0Books(sched), gpu, cpu


def all_checks(b: V0Books):
    found, req_of_seq = check_queues(b, b.tables(), b.pools()["GPU"]["all"])
    return found + check_books(b, req_of_seq)


def test_consistent_books_have_no_violation():
    b, _, _ = books(running=[("A", 1, [0, 1]), ("B", 2, [2])], swapped=[("C", 3, [8, 9])])
    assert all_checks(b) == []


def test_a_ref_count_above_the_block_table_references_is_kv_refcount():
    b, gpu, _ = books(running=[("A", 1, [0, 1])])
    gpu._refcounter._refcounts[1] += 1  # planted: a reference nobody holds
    found = all_checks(b)
    assert [(v.code, v.blocks, v.requests) for v in found] == [("KV_REFCOUNT", [1], ["A"])]
    assert "GPU block 1 ref count 2 but held by A (expected 1)" in found[0].message


def test_a_block_in_two_tables_with_one_reference_is_kv_refcount_naming_both():
    b, _, _ = books(running=[("A", 1, [0]), ("B", 2, [3])])
    b.bm.block_tables[2].physical_block_ids.append(0)  # planted: B's table also points at 0
    found = [v for v in all_checks(b) if v.code == "KV_REFCOUNT"]
    assert [(v.blocks, v.requests) for v in found] == [([0], ["A", "B"])]


def test_a_held_block_on_the_free_list_and_a_lost_block_are_kv_free_queue():
    b, gpu, _ = books(running=[("A", 1, [0, 1])])
    gpu._free_block_indices.append(1)  # planted: freed while A holds it
    gpu._free_block_indices.remove(5)  # planted: block 5 vanishes from the free list
    msgs = [v.message for v in all_checks(b) if v.code == "KV_FREE_QUEUE"]
    assert any("GPU block 1 is on the free list with ref count 1" in m for m in msgs)
    assert any("GPU block 5 has ref count 0 and no holder" in m for m in msgs)


def test_cpu_pool_is_checked_too():
    b, _, cpu = books(swapped=[("C", 3, [8])])
    cpu._refcounter._refcounts[8] = 0  # planted
    found = all_checks(b)
    assert [(v.code, v.blocks) for v in found if v.code == "KV_REFCOUNT"] == [("KV_REFCOUNT", [8])]


def test_a_swapped_request_holding_gpu_blocks_is_kv_leak():
    b, _, _ = books(swapped=[("C", 3, [8, 2])])
    found = [v for v in all_checks(b) if v.code == "KV_LEAK"]
    assert [(v.requests, v.blocks) for v in found] == [(["C"], [2])]


def test_queue_states_request_in_two_queues_and_status_mismatch():
    b, _, _ = books(running=[("A", 1, [0])])
    b.scheduler.swapped.append(b.scheduler.running[0])  # planted: A also in swapped
    found = [v for v in all_checks(b) if v.code == "REQ_STATE"]
    assert any(v.message == "A is in running and swapped" for v in found)
    assert any("is RUNNING but in swapped" in v.message for v in found)


def test_a_block_table_of_a_sequence_no_queue_holds_is_kv_leak():
    b, _, _ = books(running=[("A", 1, [0])])
    b.scheduler.running.clear()  # planted: A left the queues, its table stayed
    found = [v for v in all_checks(b) if v.code == "KV_LEAK"]
    assert len(found) == 1 and "sequence 1 has a block table (1 blocks)" in found[0].message


def test_double_free_hook_reports_inside_decr_before_vllms_assert():
    b, gpu, _ = books(running=[("A", 1, [0])])
    loop = NS(scheduler=b.scheduler, step=4)
    auditor = V0Auditor(NS(), keep_going=True)
    auditor.attach(loop)
    assert "GPU.RefCounter.decr" in auditor.hook_names
    gpu._refcounter.decr(0)
    with pytest.raises(AssertionError):  # the release's own assert still runs
        gpu._refcounter.decr(0)
    assert [(v.code, v.blocks, v.step, v.phase) for v in auditor.violations] == [
        ("KV_DOUBLE_FREE", [0], 4, "in RefCounter.decr")]
    auditor.finish(loop, "crash")
    assert "decr" not in vars(gpu._refcounter)  # the hook is undone after the run


def test_a_group_parked_in_async_stopped_keeps_its_table_without_a_leak():
    """With async output processing a group past max_model_len leaves ``running`` for the
    scheduler's ``_async_stopped`` and keeps its blocks until ``free_finished_seq_groups``."""
    b, _, _ = books(running=[("A", 1, [0])])
    parked = b.scheduler.running.popleft()
    b.scheduler._async_stopped = [parked]
    assert all_checks(b) == []
    b.scheduler._async_stopped = []
    assert [v.code for v in all_checks(b)] == ["KV_LEAK"]


def test_a_group_of_an_aborted_request_still_queued_is_req_state_naming_the_parent():
    """After ``LLMEngine.abort_request(A)`` no group of A may stay queued; a child of an
    ``n > 1`` request counts for its parent, by the engine's ``seq_id_to_seq_group``."""
    b, _, _ = books(running=[("A_parallel_sample_0", 1, [0]), ("B", 2, [1])])
    parents = {"A_parallel_sample_0": "A"}
    loop = NS(scheduler=b.scheduler, step=4, aborted_ids=set(),
              request_of=lambda rid: parents.get(rid, rid))
    auditor = V0Auditor(NS(), keep_going=True)
    auditor.attach(loop)
    assert auditor._check() == []
    loop.aborted_ids.add("A")  # the caller aborted A; vLLM left its child running
    found = auditor._check()
    assert [(v.code, v.requests, v.message) for v in found] == [
        ("REQ_STATE", ["A"], "A (its group A_parallel_sample_0) is in running after "
                             "LLMEngine.abort_request(A)")]
    b.scheduler.running.popleft()  # what abort_seq_group does once it finds the child...
    b.bm.block_tables.pop(1)       # ...and frees its table
    b.bm.block_allocator._allocators[Device.GPU]._refcounter._refcounts[0] = 0
    b.bm.block_allocator._allocators[Device.GPU]._free_block_indices.append(0)
    assert auditor._check() == []


def test_an_n_child_left_in_seq_id_to_seq_group_after_its_finish_is_collected_is_req_residue():
    """A child group of an ``n > 1`` request stays a key of ``LLMEngine.seq_id_to_seq_group``
    after it left the queues and the engine collected its finish (0.7.3, #14353): REQ_RESIDUE
    at the end of a clean run, at the step it was first seen left behind; while its id still
    waits in ``_finished_requests_ids`` it is not judged; deleted (0.8.0) it is clean."""
    b, gpu, _ = books(running=[("A_parallel_sample_0", 1, [0]), ("B", 2, [1])])
    sched = b.scheduler
    sched._finished_requests_ids = []
    child = NS(seqs=[NS(status=NS(name="RUNNING"))])
    group = NS(group_id="A", to_be_finished={"A_parallel_sample_0": child}, finished_reqs={})
    engine = NS(scheduler=sched, seq_id_to_seq_group={"A_parallel_sample_0": group})
    loop = NS(scheduler=sched, step=4, engine=engine, aborted_ids=set())
    auditor = V0Auditor(NS(), keep_going=True)
    auditor.attach(loop)
    assert auditor._check() == []
    sched.running.popleft()  # free_finished_seq_groups: the child leaves running...
    b.bm.block_tables.pop(1)
    gpu._refcounter._refcounts[0] = 0
    gpu._free_block_indices.append(0)
    sched._finished_requests_ids.append("A_parallel_sample_0")  # ...its id waits
    child.seqs[0].status.name = "FINISHED_LENGTH_CAPPED"  # SequenceGroupBase.finish_seq
    group.finished_reqs["A_parallel_sample_0"] = group.to_be_finished.pop("A_parallel_sample_0")
    loop.step = 5
    assert auditor._check() == [] and auditor.residue_keys(loop) == []
    sched._finished_requests_ids = []  # LLMEngine.step collected it (0.7.3 keeps the key)
    loop.step = 6
    assert auditor._check() == []  # reported at the end of a clean run only
    sched.running.popleft()  # B finishes
    b.bm.block_tables.pop(2)
    gpu._refcounter._refcounts[1] = 0
    gpu._free_block_indices.append(1)
    loop.step = 9
    auditor.finish(loop, "clean")
    assert [(v.code, v.requests, v.step) for v in auditor.violations] == [
        ("REQ_RESIDUE", ["A"], 6)]
    assert "A (its group A_parallel_sample_0, finished (length)) left the scheduler by step 6" \
        in auditor.violations[0].message
    assert auditor.violations[0].mechanism == "finished"
    child.seqs[0].status.name = "FINISHED_IGNORED"  # #12973's path: the mechanism is named
    assert "(its group A_parallel_sample_0, ignored by the scheduler)" in \
        auditor.residue(loop, 9)[0].message and auditor.residue(loop, 9)[0].mechanism == "ignored"
    del engine.seq_id_to_seq_group["A_parallel_sample_0"]  # what 0.8.0's LLMEngine.step does
    fixed = V0Auditor(NS(), keep_going=True)
    fixed.attach(loop)
    fixed.finish(loop, "clean")
    assert fixed.violations == []


class SeqData:
    def __init__(self, tokens, computed=0):
        self.tokens, self.computed = list(tokens), computed

    def get_token_ids(self):
        return self.tokens

    def get_num_computed_tokens(self):
        return self.computed

    def get_prompt_len(self):
        return len(self.tokens)


def prefill(rid, seq_id, tokens, table, cached=(), chunk=None):
    return NS(request_id=rid, is_prompt=True, token_chunk_size=chunk or len(tokens),
              computed_block_nums=list(cached), block_tables={seq_id: list(table)},
              seq_data={seq_id: SeqData(tokens)})


def test_kv_content_a_skipped_block_must_hold_the_sequences_kv():
    """The model runner skips the blocks in ``computed_block_nums``: a block written by an
    earlier prefill of the same tokens passes; a block whose KV is another prompt's (or was
    never written) is KV_PREFIX_MAP naming the request and the block; swaps carry content."""
    from vllm_repro.audit.v0 import KVContent

    kv = KVContent(4)
    p = list(range(12))
    assert kv.execute(NS(seq_group_metadata_list=[prefill("P", 1, p, [5, 6, 7])]),
                      str) == []
    w = p[:8] + [90, 91, 92, 93]  # W shares P's first two blocks
    assert kv.execute(NS(seq_group_metadata_list=[prefill("W", 2, w, [5, 6, 3], cached=[5, 6])]),
                      str) == []
    other = [50 + i for i in range(8)]  # R overwrites blocks 5 and 6 with its own prompt
    kv.execute(NS(seq_group_metadata_list=[prefill("R", 3, other, [5, 6])]), str)
    found = kv.execute(NS(seq_group_metadata_list=[prefill("W", 4, w, [5, 6, 3],
                                                           cached=[5, 6])]), str)
    assert [(v.code, v.requests, v.blocks) for v in found] == [
        ("KV_PREFIX_MAP", ["W"], [5]), ("KV_PREFIX_MAP", ["W"], [6])]
    assert found[0].message.endswith("(it holds the KV of other tokens); not a prefix-cache "
                                     "hit on these tokens: a fresh block counted as cached")
    assert {v.mechanism for v in found} == {"fresh-block"}
    # chunked prefill: A's table lists 3 full blocks, its first chunk computes one; B (the same
    # prompt) is told to skip all three: a prefix-cache hit on KV never computed (not #18957)
    a = [200 + i for i in range(12)]
    kv.execute(NS(seq_group_metadata_list=[prefill("A", 5, a, [8, 9, 10], chunk=4)]), str)
    found = kv.execute(NS(seq_group_metadata_list=[prefill("B", 6, a + [7], [8, 9, 10, 11],
                                                           cached=[8, 9, 10])]), str)
    assert [v.blocks for v in found] == [[9], [10]]
    assert {v.mechanism for v in found} == {"uncomputed-hit"}
    assert found[0].message.endswith("(nothing was ever computed into it); a prefix-cache hit "
                                     "on a block sequence 5 was given for the same tokens and "
                                     "never computed")
    # preempted (recompute) and rescheduled: the sequence hits its own uncomputed blocks
    c = [300 + i for i in range(12)]
    kv.execute(NS(seq_group_metadata_list=[prefill("C", 7, c, [12, 13, 14], chunk=4)]), str)
    found = kv.execute(NS(seq_group_metadata_list=[prefill("C", 7, c, [12, 13, 14],
                                                           cached=[12, 13])]), str)
    assert [v.blocks for v in found] == [[13]] and found[0].message.endswith(
        "a prefix-cache hit on a block this sequence was given before (preempted or rescheduled "
        "since) for the same tokens and never computed")
    kv2 = KVContent(4)
    kv2.execute(NS(seq_group_metadata_list=[prefill("P", 1, p, [5, 6, 7])]), str)
    kv2.execute(NS(blocks_to_swap_out=[(5, 0), (6, 1)], seq_group_metadata_list=[]), str)
    kv2.execute(NS(seq_group_metadata_list=[prefill("R", 3, other, [5, 6])]), str)
    kv2.execute(NS(blocks_to_swap_in=[(0, 2), (1, 4)], seq_group_metadata_list=[]), str)
    assert kv2.execute(NS(seq_group_metadata_list=[prefill("W", 2, w, [2, 4, 3],
                                                            cached=[2, 4])]), str) == []
