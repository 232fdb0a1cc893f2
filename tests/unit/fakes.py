"""Tiny stand-ins for what vLLM's V1 objects look like to the lab, and keyword builders.

No vLLM release needed. The shapes follow vLLM's own classes (attribute names only):
``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``, ``FreeKVCacheBlockQueue``),
``vllm/v1/core/block_pool.py`` (``BlockPool``), ``kv_cache_coordinator.py`` /
``single_type_kv_cache_manager.py`` (``single_type_managers``, ``req_to_blocks``,
``num_cached_block``), ``vllm/v1/request.py`` (``Request``, ``RequestStatus``),
``vllm/v1/core/sched/scheduler.py`` (``running``, ``waiting``, ``requests``) and
``vllm/v1/core/sched/output.py`` (``SchedulerOutput``). The builders are in the manner of
vLLM's ``tests/v1/core/utils.py::create_scheduler``: keywords with defaults, e.g.
``make_books(num_gpu_blocks=8, tables={"A": [1, 2]})`` gives consistent books (ref counts equal
to the references held, every other block in the free queue) to plant a fault in.
"""

from __future__ import annotations

import enum
from collections import deque
from types import SimpleNamespace

from vllm_repro.audit.books import Books


def vf(v, name: str):
    """A violation's field, whether violations are dicts or a typed record."""
    return v[name] if isinstance(v, dict) else getattr(v, name)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


class KVCacheBlock:
    def __init__(self, block_id: int, ref_cnt: int = 0, block_hash=None):
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self._block_hash = block_hash
        self.prev_free_block = None
        self.next_free_block = None

    def __repr__(self):
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """A doubly linked list of blocks: with sentinels ``fake_free_list_head/tail`` (0.10.1+) or,
    ``sentinels=False``, a bare ``free_list_head`` (older)."""

    def __init__(self, blocks: list, sentinels: bool = True):
        self.num_free_blocks = len(blocks)
        self.sentinels = sentinels
        for a, b in zip(blocks, blocks[1:]):
            a.next_free_block, b.prev_free_block = b, a
        if sentinels:
            self.fake_free_list_head = KVCacheBlock(-1)
            self.fake_free_list_tail = KVCacheBlock(-1)
            first = blocks[0] if blocks else self.fake_free_list_tail
            last = blocks[-1] if blocks else self.fake_free_list_head
            self.fake_free_list_head.next_free_block = first
            first.prev_free_block = self.fake_free_list_head
            last.next_free_block = self.fake_free_list_tail
            self.fake_free_list_tail.prev_free_block = last
        else:
            self.free_list_head = blocks[0] if blocks else None


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool = False, null_block: bool = True,
                 sentinels: bool = True):
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.enable_caching = enable_caching
        self.null_block = self.blocks[0] if null_block else None
        self.cached_block_hash_to_block: dict = {}
        self.free_block_queue = FreeKVCacheBlockQueue([], sentinels)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def free_blocks(self, ordered_blocks) -> None:
        """As ``BlockPool.free_blocks``: drop one reference each; a block at 0 joins the free
        queue at its tail (the queue is relinked: fine for a handful of blocks)."""
        free = self._walk()
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and b is not self.null_block:
                free.append(b)
        for b in free:
            b.prev_free_block = b.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue(free, self.free_block_queue.sentinels)

    def _walk(self) -> list:
        fq, out = self.free_block_queue, []
        cur = fq.fake_free_list_head.next_free_block if fq.sentinels else fq.free_list_head
        while cur is not None and cur.block_id >= 0:
            out.append(cur)
            cur = cur.next_free_block
        return out


class SingleTypeManager:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.req_to_blocks: dict[str, list] = {}
        self.num_cached_block: dict[str, int] = {}


class Request:
    def __init__(self, request_id: str, prompt_len: int = 16, status=RequestStatus.WAITING,
                 num_computed_tokens: int = 0, num_output_tokens: int = 0, priority: int = 0):
        self.request_id = request_id
        self.status = status
        self.num_prompt_tokens = prompt_len
        self.num_output_tokens = num_output_tokens
        self.num_computed_tokens = num_computed_tokens
        self.priority = priority
        self.spec_token_ids: list[int] = []
        self.num_output_placeholders = 0
        self.block_hashes: list = []

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


class Scheduler:
    def __init__(self, kv_cache_manager, max_num_scheduled_tokens=64, max_num_running_reqs=4,
                 max_model_len=256):
        self.kv_cache_manager = kv_cache_manager
        self.running: list = []
        self.waiting: deque = deque()
        self.requests: dict[str, Request] = {}
        self.max_num_scheduled_tokens = max_num_scheduled_tokens
        self.max_num_running_reqs = max_num_running_reqs
        self.max_model_len = max_model_len


def make_requests(n: int, prompt_len: int = 16, status=RequestStatus.WAITING, prefix: str = "R",
                  **kw) -> list[Request]:
    """``n`` requests ``R0``, ``R1``... with the same prompt length and status."""
    return [Request(f"{prefix}{i}", prompt_len, status, **kw) for i in range(n)]


def make_books(num_gpu_blocks: int = 8, block_size: int = 16, tables: dict | None = None,
               groups: list[dict] | None = None, layout: str = "coordinator",
               enable_caching: bool = False, sentinels: bool = True,
               statuses: dict | None = None, requests: list | None = None,
               **sched_kw) -> tuple[Books, Scheduler]:
    """Consistent books and their scheduler.

    ``tables``: request id -> block ids (one KV cache group), or ``groups``: one such mapping per
    group (``layout="coordinator"`` only). ``layout``: ``coordinator`` (0.9.2+:
    ``kvm.coordinator.single_type_managers``), ``single`` (0.9.0/0.9.1:
    ``kvm.single_type_manager``), ``manager`` (0.8: ``kvm.req_to_blocks``), ``list`` (0.6/0.7:
    ``kvm.block_pool`` is the list of blocks, the manager keeps the free queue; no null block).
    ``statuses``: request id -> ``RequestStatus`` name (default RUNNING, in ``running``; other
    statuses go to ``waiting``). ``requests``: extra requests (placed by their status).
    Ref counts are the references held; every other non-null block is in the free queue.
    """
    groups = groups if groups is not None else [tables or {}]
    statuses = statuses or {}
    null = layout != "list"
    pool = BlockPool(num_gpu_blocks, enable_caching, null_block=null, sentinels=sentinels)
    managers = [SingleTypeManager(block_size) for _ in groups]
    for m, t in zip(managers, groups):
        for rid, ids in t.items():
            m.req_to_blocks[rid] = [pool.blocks[i] for i in ids]
            for i in ids:
                pool.blocks[i].ref_cnt += 1
    if pool.null_block is not None:
        pool.null_block.ref_cnt = 0
    free = [b for b in pool.blocks if b.ref_cnt == 0 and b is not pool.null_block]
    pool.free_block_queue = FreeKVCacheBlockQueue(free, sentinels)
    if layout == "coordinator":
        kvm = SimpleNamespace(block_pool=pool, coordinator=SimpleNamespace(
            block_pool=pool, single_type_managers=managers))
    elif layout == "single":
        assert len(managers) == 1
        kvm = SimpleNamespace(block_pool=pool, single_type_manager=managers[0])
    elif layout == "manager":
        assert len(managers) == 1
        kvm = managers[0]
        kvm.block_pool = pool
    elif layout == "list":
        assert len(managers) == 1
        kvm = managers[0]
        kvm.block_pool = pool.blocks
        kvm.free_block_queue = pool.free_block_queue
        kvm.cached_block_hash_to_block = pool.cached_block_hash_to_block
        kvm.enable_caching = enable_caching
    else:
        raise ValueError(layout)
    s = Scheduler(kvm, **sched_kw)
    rids = dict.fromkeys(rid for t in groups for rid in t)
    reqs = [Request(rid, status=RequestStatus[statuses.get(rid, "RUNNING")]) for rid in rids]
    for r in reqs + list(requests or ()):
        s.requests[r.request_id] = r
        (s.running if r.status == RequestStatus.RUNNING else s.waiting).append(r)
    return Books(s), s


def new_req(req_id: str, num_computed_tokens: int = 0):
    """``NewRequestData`` as the audit reads it."""
    return SimpleNamespace(req_id=req_id, num_computed_tokens=num_computed_tokens)


def make_output(num_scheduled_tokens: dict, new: dict | None = None, cached: dict | None = None,
                spec: dict | None = None, total: int | None = None, cached_list: bool = False):
    """A ``SchedulerOutput``: ``new`` / ``cached``: request id -> num_computed_tokens before the
    step; ``cached_list``: the <= 0.9.1 shape (a list of per-request ``CachedRequestData``)."""
    cached = cached or {}
    if cached_list:
        cr = [SimpleNamespace(req_id=r, num_computed_tokens=n) for r, n in cached.items()]
    else:
        cr = SimpleNamespace(req_ids=list(cached), num_computed_tokens=list(cached.values()))
    return SimpleNamespace(
        scheduled_new_reqs=[new_req(r, n) for r, n in (new or {}).items()],
        scheduled_cached_reqs=cr, num_scheduled_tokens=dict(num_scheduled_tokens),
        total_num_scheduled_tokens=sum(num_scheduled_tokens.values()) if total is None else total,
        scheduled_spec_decode_tokens=spec or {})
