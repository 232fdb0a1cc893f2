"""The V0 audit over ``BlockSpaceManagerV1``'s books (audit/bm_v1.py), on books shaped as
``vllm/core/block_manager_v1.py`` keeps them: ``PhysicalTokenBlock`` objects in per-sequence
tables, an ``UncachedBlockAllocator`` (free list) or ``CachedBlockAllocator`` (``cached_blocks``,
an LRU evictor's ``free_table``) per device, with faults planted into them."""

from __future__ import annotations

from collections import OrderedDict, deque
from enum import Enum
from types import SimpleNamespace as NS

import pytest

from vllm_repro.audit.bm_v1 import V1Books, check_books_v1
from vllm_repro.audit.v0 import V0Auditor, check_queues, read_books
from vllm_repro.records import AuditSummary, RunResult


class Device(Enum):
    GPU = 0
    CPU = 1


class Block:
    """``vllm/block.py:PhysicalTokenBlock`` (identity-hashed, as vLLM's)."""

    def __init__(self, device, number, block_hash=-1):
        self.device, self.block_number, self.block_hash = device, number, block_hash
        self.ref_count = 0

    def __repr__(self):
        return f"Block({self.device.name} {self.block_number} rc={self.ref_count})"


class Uncached:
    """``UncachedBlockAllocator``: ``allocate`` pops the free list, ``free`` raises on ref 0."""

    def __init__(self, device, n):
        self.device, self.num_blocks = device, n
        self.free_blocks = [Block(device, i) for i in range(n)]

    def allocate(self):
        b = self.free_blocks.pop()
        b.ref_count = 1
        return b

    def free(self, block):
        if block.ref_count == 0:
            raise ValueError(f"Double free! {block} is already freed.")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.append(block)


class Cached:
    """``CachedBlockAllocator`` with an ``LRUEvictor`` (``free_table``), blocks made lazily."""

    def __init__(self, device, n):
        self.device, self.num_blocks, self.current_num_blocks = device, n, 0
        self.cached_blocks: dict[int, Block] = {}
        self.evictor = NS(free_table=OrderedDict())

    def allocate(self, block_hash):
        if block_hash in self.evictor.free_table:
            self.cached_blocks[block_hash] = self.evictor.free_table.pop(block_hash)
        if block_hash not in self.cached_blocks:
            self.cached_blocks[block_hash] = Block(self.device, self.current_num_blocks,
                                                   block_hash)
            self.current_num_blocks += 1
        b = self.cached_blocks[block_hash]
        b.ref_count += 1
        return b

    def free(self, block):
        if block.ref_count == 0:
            raise ValueError(f"Double free! {block} is already freed.")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.evictor.free_table[block.block_hash] = block
            del self.cached_blocks[block.block_hash]


class Group:
    def __init__(self, rid, seq_ids, status):
        self.request_id = rid
        self.seqs = [NS(seq_id=s, status=NS(name=status)) for s in seq_ids]

    def get_seqs(self):
        return self.seqs


class Table(list):
    """0.5.0's ``BlockTable`` (its ``list()``); before, the table is a plain list."""

    def list(self):
        return list(self)


def manager(cached=False, window=None, gpu=8, cpu=4):
    cls = Cached if cached else Uncached
    bm = NS(block_tables={}, gpu_allocator=cls(Device.GPU, gpu),
            cpu_allocator=cls(Device.CPU, cpu), block_sliding_window=window)
    bm.get_num_free_gpu_blocks = lambda: (
        len(bm.gpu_allocator.free_blocks) if not cached else
        gpu - bm.gpu_allocator.current_num_blocks + len(bm.gpu_allocator.evictor.free_table))
    sched = NS(block_manager=bm, waiting=deque(), running=deque(), swapped=deque())
    return sched, bm


def run(sched, rid, seq_ids, status="RUNNING"):
    q = {"RUNNING": sched.running, "SWAPPED": sched.swapped, "WAITING": sched.waiting}[status]
    q.append(Group(rid, seq_ids, status))


def checks(sched):
    b = read_books(sched)
    assert isinstance(b, V1Books) and b.readable and b.unread == []
    found, req_of_seq = check_queues(b, b.tables(), set())
    return found + check_books_v1(b, req_of_seq)


def books_with_a_and_b(cached=False):
    """A (sequence 1) holds 3 GPU blocks, B (sequence 2) 2, as ``allocate`` leaves them."""
    sched, bm = manager(cached)
    g = bm.gpu_allocator
    alloc = (lambda h: g.allocate(h)) if cached else (lambda h: g.allocate())
    bm.block_tables[1] = Table(alloc(h) for h in (11, 12, 13))
    bm.block_tables[2] = Table(alloc(h) for h in (21, 22))
    run(sched, "A", [1])
    run(sched, "B", [2])
    return sched, bm


@pytest.mark.parametrize("cached", [False, True])
def test_consistent_books_have_no_violation(cached):
    sched, bm = books_with_a_and_b(cached)
    assert checks(sched) == []
    for block in bm.block_tables.pop(2):  # B finishes: BlockSpaceManagerV1.free
        bm.gpu_allocator.free(block)
    sched.running.pop()
    assert checks(sched) == []


def test_a_reference_no_table_holds_is_kv_refcount_naming_the_holder():
    sched, bm = books_with_a_and_b()
    b = bm.block_tables[1][0]
    b.ref_count += 1  # planted
    found = checks(sched)
    assert [(v.code, v.blocks, v.requests) for v in found] == [
        ("KV_REFCOUNT", [b.block_number], ["A"])]
    assert f"GPU block {b.block_number} ref count 2 but held by A (expected 1)" in found[0].message


def test_an_n2_group_sharing_its_prompt_blocks_and_a_sliding_window_table_are_clean():
    """``allocate`` of an ``n = 2`` group: each prompt block has ref count 2 (two tables);
    with a sliding window of 2 blocks a 4-entry table reuses blocks 0 and 1 (one reference per
    table, as ``fork`` and ``_free_block_table`` count them)."""
    sched, bm = manager(window=2)
    g = bm.gpu_allocator
    shared = [g.allocate(), g.allocate()]
    for b in shared:
        b.ref_count = 2
    bm.block_tables[1] = Table(shared + shared)
    bm.block_tables[2] = Table(shared + shared)
    run(sched, "A", [1, 2])
    assert checks(sched) == []
    shared[0].ref_count = 3  # planted: a third reference
    assert [v.code for v in checks(sched)] == ["KV_REFCOUNT"]


def test_a_held_block_on_the_free_list_a_lost_block_and_a_duplicate_are_kv_free_queue():
    sched, bm = books_with_a_and_b()
    g = bm.gpu_allocator
    a0 = bm.block_tables[1][0]
    g.free_blocks.append(a0)  # planted: freed while A holds it
    lost = g.free_blocks.pop(0)  # planted: a free block vanishes
    msgs = [v.message for v in checks(sched) if v.code == "KV_FREE_QUEUE"]
    assert any(f"GPU block {a0.block_number} is on the free list with ref count 1, held by A"
               in m for m in msgs)
    assert any("neither free nor held" in m and str(lost.block_number) in m for m in msgs)
    sched2, bm2 = books_with_a_and_b()
    bm2.gpu_allocator.free_blocks.append(bm2.gpu_allocator.free_blocks[0])  # planted: twice
    assert any("free list holds block(s)" in v.message for v in checks(sched2))


def test_a_swapped_request_holding_a_gpu_block_is_kv_leak_and_cpu_blocks_are_counted():
    """GPU and CPU numbers overlap in BlockSpaceManagerV1: the device decides."""
    sched, bm = manager()
    c = bm.cpu_allocator
    bm.block_tables[1] = Table([c.allocate(), c.allocate()])  # swap_out left CPU blocks only
    run(sched, "C", [1], "SWAPPED")
    assert checks(sched) == []
    gpu_block = bm.gpu_allocator.allocate()
    bm.block_tables[1].append(gpu_block)  # planted: a GPU block kept while swapped
    leaks = [v for v in checks(sched) if v.code == "KV_LEAK"]
    assert [(v.requests, v.blocks) for v in leaks] == [(["C"], [gpu_block.block_number])]
    bm.block_tables[1].pop()
    bm.gpu_allocator.free(gpu_block)
    bm.block_tables[1][0].ref_count = 0  # planted: the CPU pool's books
    assert [(v.code, v.blocks) for v in checks(sched) if v.code == "KV_REFCOUNT"] == [
        ("KV_REFCOUNT", [bm.block_tables[1][0].block_number])]


def test_prefix_caching_a_held_block_its_hash_does_not_map_to_is_kv_prefix_map():
    sched, bm = books_with_a_and_b(cached=True)
    g = bm.gpu_allocator
    a1 = bm.block_tables[1][1]
    g.cached_blocks[99] = g.cached_blocks.pop(12)  # planted: A's block under another hash
    found = checks(sched)
    codes = {(v.code, tuple(v.blocks)) for v in found}
    assert ("KV_PREFIX_MAP", (a1.block_number,)) in codes
    assert any("cached_blocks maps its hash 12 to nothing" in v.message for v in found)
    assert any("maps hash 99 to block" in v.message for v in found)


def test_prefix_caching_a_held_block_in_the_evictor_is_kv_free_queue():
    sched, bm = books_with_a_and_b(cached=True)
    g = bm.gpu_allocator
    b0 = bm.block_tables[2][0]
    g.evictor.free_table[b0.block_hash] = b0  # planted: evictable while B holds it
    found = checks(sched)
    assert any(v.code == "KV_FREE_QUEUE" and f"GPU block {b0.block_number} is in the evictor "
               "with ref count 1, held by B" in v.message for v in found)
    assert any(v.code == "KV_PREFIX_MAP" and "both cached" in v.message for v in found)


def test_double_free_hook_reports_inside_free_before_the_allocators_value_error():
    sched, bm = books_with_a_and_b()
    loop = NS(scheduler=sched, step=6)
    auditor = V0Auditor(NS(), keep_going=True)
    auditor.attach(loop)
    assert auditor.hook_names == ["GPU.Uncached.free", "CPU.Uncached.free"]
    b = bm.block_tables[2].pop()
    bm.gpu_allocator.free(b)
    with pytest.raises(ValueError, match="Double free"):  # the release's own check still runs
        bm.gpu_allocator.free(b)
    assert [(v.code, v.blocks, v.step, v.phase) for v in auditor.violations] == [
        ("KV_DOUBLE_FREE", [b.block_number], 6, "in Uncached.free")]
    assert auditor.hook_calls["GPU.free"] == 2
    auditor.finish(loop, "crash")
    assert "free" not in vars(bm.gpu_allocator)  # the hook is undone after the run
    assert auditor.summary().unread == []


def test_an_unknown_block_manager_is_unread_and_a_clean_run_says_so():
    """A block manager neither reader knows (0.6.3's PlaceholderBlockSpaceManager, 0.4.3's
    EmbeddingModelBlockSpaceManager) or an allocator of another shape: queues only, named in
    the summary's ``unread``, and the verdict's ``observed`` says it instead of plain clean."""
    from vllm_repro.verdict import describe_observed

    class PlaceholderBlockSpaceManager:
        def get_num_free_gpu_blocks(self):
            return 0

    sched = NS(block_manager=PlaceholderBlockSpaceManager(), waiting=deque(), running=deque(),
               swapped=deque())
    auditor = V0Auditor(NS(), keep_going=True)
    auditor.attach(NS(scheduler=sched, step=0))
    assert auditor._check() == []
    summary = auditor.summary()
    assert summary.unread == ["PlaceholderBlockSpaceManager"] and summary.hooks == []
    res = RunResult("clean", steps=5, finished={"A": "length"}, audit=summary)
    assert describe_observed(res) == (
        "clean (1 finished, 5 steps; audit: KV books unread: PlaceholderBlockSpaceManager)")
    res.audit = AuditSummary()
    assert describe_observed(res) == "clean (1 finished, 5 steps)"
    assert "unread" not in res.audit.to_dict()

    sched2, bm2 = manager()
    bm2.cpu_allocator = NS(device=Device.CPU)  # an allocator shape the reader does not know
    b = read_books(sched2)
    assert b.readable and b.unread == ["SimpleNamespace.cpu_allocator (SimpleNamespace)"]
