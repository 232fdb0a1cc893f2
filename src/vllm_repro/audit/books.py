"""The audit's view of a scheduler's books: block pool, block tables, holders, queues.

Where each release keeps them is read by :mod:`vllm_repro.engine.state` (the one place that
probes live scheduler / KV cache state; each probe names the vLLM source it follows). Runs
inside release environments (standard library only).
"""

from __future__ import annotations

from collections import Counter
from itertools import chain
from operator import attrgetter

from ..engine import state
from ..engine.state import WAITING_QUEUES, block_hash_of  # noqa: F401 - re-exported

_ref = attrgetter("ref_cnt")
_bid = attrgetter("block_id")

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
        lay = state.KVLayout(scheduler)
        self.layout = lay
        self.kvm = lay.kvm
        self.pool = lay.pool
        self.managers = lay.managers
        self.blocks = lay.blocks
        self.num_blocks = lay.num_blocks
        self.null = lay.null
        self.null_id = lay.null_id
        self.caching = lay.caching
        self.max_tokens = lay.max_tokens
        self.max_seqs = lay.max_seqs
        self.max_model_len = lay.max_model_len

    # ---- block tables and holders --------------------------------------------------------
    def tables(self) -> list[dict]:
        """One ``req_to_blocks`` mapping per KV cache group (request id -> list of blocks)."""
        return [m.req_to_blocks for m in self.managers]

    def extra_holders(self) -> list[tuple[str, list]]:
        """``(label, blocks)`` for references held outside the block tables: deferred frees
        (``Scheduler.deferred_frees``) and copy-on-write endpoints (``_pending_cow_copies``)."""
        return state.extra_holders(self.scheduler, self.managers)

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
        return state.free_list(self.pool, self.num_blocks)

    def num_free(self) -> int:
        return state.free_count(self.pool)

    # ---- prefix-cache map ------------------------------------------------------------------
    def secondary_hashes(self) -> dict:
        """block id -> extra hashes it is cached under (0.33's ``cached_block_hashes_by_block``)."""
        return state.secondary_hashes(self.pool)

    def hash_map(self):
        """The prefix-cache map as a dict (``BlockPool.cached_block_hash_to_block``)."""
        return state.hash_map(self.pool)

    # ---- queues ----------------------------------------------------------------------------
    def queues(self) -> list[tuple[str, list]]:
        """``(name, requests)`` for ``running`` and every waiting queue the release has."""
        return state.named_queues(self.scheduler)

    def kv_holding_ids(self) -> set:
        """Waiting requests the release lets keep their KV (``kv_holding_waiting``)."""
        return state.kv_holding_ids(self.scheduler)
