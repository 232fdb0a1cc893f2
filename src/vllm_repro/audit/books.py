"""Where a release keeps its books: found by probing attributes of the live objects.

Runs inside release environments (standard library only). Nothing compares version numbers;
each probe names the vLLM source it follows:

- the block pool: ``KVCacheManager.block_pool`` (0.8 to 0.33; 0.9.2+ also
  ``KVCacheCoordinator.block_pool``), ``vllm/v1/core/block_pool.py:BlockPool``; in 0.6.x/0.7.x
  ``KVCacheManager.block_pool`` is the list of blocks and the manager keeps the rest itself.
- the block tables (``req_to_blocks``: request id -> blocks), one per KV cache group:
  ``KVCacheCoordinator.single_type_managers[i]`` (0.9.2+, ``kv_cache_coordinator.py``),
  ``KVCacheManager.single_type_manager`` (0.9.0/0.9.1), or the ``KVCacheManager`` itself (0.8.x).
- other holders of block references: ``Scheduler.deferred_frees`` (blocks popped from a
  table whose return to the pool waits for an in-flight step) and
  ``SingleTypeKVCacheManager._pending_cow_copies`` (copy-on-write endpoints), where they exist.
- the free queue: ``FreeKVCacheBlockQueue`` with ``fake_free_list_head/tail`` (0.10.1+) or
  ``free_list_head`` (older), ``num_free_blocks``.
- the prefix-cache hash map ``BlockPool.cached_block_hash_to_block``: a dict of
  ``hash -> {block_id: block}`` (<= 0.10) or a ``BlockHashToBlockMap`` whose ``_cache`` maps a
  hash to a block or a dict of them (0.11+); ``cached_block_hashes_by_block`` (secondary hashes
  of one block, where it exists). A block's own hash is ``KVCacheBlock._block_hash``.
- the request queues: ``Scheduler.running``, ``waiting``, ``skipped_waiting``,
  ``kv_holding_waiting`` (whichever exist).
"""

from __future__ import annotations

from collections import Counter
from itertools import chain
from operator import attrgetter

from ..engine.adapter import iter_queue

_ref = attrgetter("ref_cnt")
_bid = attrgetter("block_id")

#: scheduler attributes that are queues of waiting requests, where a release has them
WAITING_QUEUES = ("waiting", "skipped_waiting", "kv_holding_waiting")
#: waiting statuses under which a request may legitimately hold KV blocks (a KV connector's
#: async load, a paused streaming session)
HOLDING_WAIT_STATUSES = ("WAITING_FOR_REMOTE_KVS", "WAITING_FOR_STREAMING_REQ")


class Books:
    """The live books of one scheduler: block pool, block tables, holders, queues.

    ``scheduler``: a release's ``vllm.v1.core.sched.scheduler.Scheduler``. Raises
    ``AttributeError`` naming what is missing when the KV cache manager has no block pool.
    """

    def __init__(self, scheduler):
        self.scheduler = scheduler
        kvm = scheduler.kv_cache_manager
        self.kvm = kvm
        coord = getattr(kvm, "coordinator", None)
        self.pool = getattr(kvm, "block_pool", None) or getattr(coord, "block_pool", None)
        if self.pool is None:
            raise AttributeError("the KV cache manager has no block_pool (nor a coordinator's)")
        if coord is not None and hasattr(coord, "single_type_managers"):
            self.managers = list(coord.single_type_managers)
        elif hasattr(kvm, "single_type_manager"):
            self.managers = [kvm.single_type_manager]
        else:
            self.managers = [kvm]
        if not all(hasattr(m, "req_to_blocks") for m in self.managers):
            raise AttributeError("no req_to_blocks block table found on the KV cache managers")
        if isinstance(self.pool, list):
            # 0.6.x/0.7.x: the KVCacheManager keeps the pool itself (``block_pool`` is the list of
            # KVCacheBlocks; ``free_block_queue``, ``cached_block_hash_to_block`` and
            # ``enable_caching`` are its own attributes; no null block) - kv_cache_manager.py
            self.blocks = self.pool
            self.pool = kvm
        else:
            self.blocks = self.pool.blocks
        self.num_blocks = len(self.blocks)
        self.null = getattr(self.pool, "null_block", None)
        self.null_id = self.null.block_id if self.null is not None else None
        self.caching = bool(getattr(self.pool, "enable_caching", False))
        cfg = getattr(scheduler, "scheduler_config", None)
        self.max_tokens = getattr(scheduler, "max_num_scheduled_tokens", None) or \
            getattr(cfg, "max_num_batched_tokens", None)
        self.max_seqs = getattr(scheduler, "max_num_running_reqs", None) or \
            getattr(cfg, "max_num_seqs", None)
        self.max_model_len = getattr(scheduler, "max_model_len", None)

    # ---- block tables and holders --------------------------------------------------------
    def tables(self) -> list[dict]:
        """One ``req_to_blocks`` mapping per KV cache group (request id -> list of blocks)."""
        return [m.req_to_blocks for m in self.managers]

    def extra_holders(self) -> list[tuple[str, list]]:
        """``(label, blocks)`` for references held outside the block tables: deferred frees
        (``Scheduler.deferred_frees``) and copy-on-write endpoints (``_pending_cow_copies``)."""
        out = []
        deferred = getattr(self.scheduler, "deferred_frees", None)
        if deferred:
            for fence, blocks in deferred:
                out.append((f"deferred-free@{fence}", list(blocks)))
        for g, m in enumerate(self.managers):
            cow = getattr(m, "_pending_cow_copies", None)
            if cow:
                out.append((f"cow-copy[g{g}]", [b for pair in cow for b in pair]))
        return out

    def held_ids(self) -> list[int]:
        """The block ids of every reference held (all tables of all groups, then the extra
        holders), in table order: a fingerprint of the tables as well as their content."""
        seqs = [bl for t in self.tables() for bl in t.values()]
        seqs += [bl for _, bl in self.extra_holders()]
        return list(map(_bid, chain.from_iterable(seqs)))

    def held_counts(self) -> Counter:
        """block id -> number of references held (all tables of all groups + extra holders).
        The null block is counted too; callers ignore it (its ref_cnt is not maintained)."""
        return Counter(self.held_ids())

    def holders_of(self, block_ids) -> dict[int, list[str]]:
        """block id -> who holds it (request ids; ``A[g1]`` for group 1 of a multi-group
        cache; ``deferred-free@N``). Slow path, for messages."""
        want = set(block_ids)
        out: dict[int, list[str]] = {b: [] for b in want}
        multi = len(self.managers) > 1
        for g, t in enumerate(self.tables()):
            for rid, bl in t.items():
                for b in bl:
                    if b.block_id in want:
                        out[b.block_id].append(f"{rid}[g{g}]" if multi else str(rid))
        for label, bl in self.extra_holders():
            for b in bl:
                if b.block_id in want:
                    out[b.block_id].append(label)
        return out

    def refs(self) -> list[int]:
        """``ref_cnt`` of every block, indexed by block id."""
        return list(map(_ref, self.blocks))

    # ---- free queue ------------------------------------------------------------------------
    def free_list(self) -> tuple[list, bool]:
        """The blocks linked in the free queue, head first, and whether the walk ended
        properly (False: a cycle, or more links than blocks)."""
        fq = self.pool.free_block_queue
        head = getattr(fq, "fake_free_list_head", None)
        if head is not None:
            cur = head.next_free_block
            tail = fq.fake_free_list_tail
        else:
            cur = getattr(fq, "free_list_head", None)
            tail = None
        out = []
        append = out.append
        limit = self.num_blocks + 1
        n = 0
        while cur is not None and cur is not tail:
            append(cur)
            n += 1
            if n > limit:
                return out, False
            cur = cur.next_free_block
        return out, True

    def num_free(self) -> int:
        return self.pool.free_block_queue.num_free_blocks

    # ---- prefix-cache map ------------------------------------------------------------------
    def secondary_hashes(self) -> dict:
        """block id -> extra hashes it is cached under (0.33's ``cached_block_hashes_by_block``)."""
        return getattr(self.pool, "cached_block_hashes_by_block", None) or {}

    # ---- queues ----------------------------------------------------------------------------
    def queues(self) -> list[tuple[str, list]]:
        """``(name, requests)`` for ``running`` and every waiting queue the release has."""
        s = self.scheduler
        out = [("running", list(s.running))]
        for name in WAITING_QUEUES:
            q = getattr(s, name, None)
            if q is not None:
                out.append((name, iter_queue(q)))
        return out


def block_hash_of(block):
    """A block's prefix-cache hash (``KVCacheBlock._block_hash``; ``block_hash`` as fallback)."""
    try:
        return block._block_hash
    except AttributeError:
        return getattr(block, "block_hash", None)
