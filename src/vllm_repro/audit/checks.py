"""The invariants of DESIGN.md as checks over a release's live objects (found by :class:`Books`).

The checks the auditor runs are registered at the end of this file
(:func:`~vllm_repro.audit.registry.check`: code, phase, levels, needs, text): each takes the
auditor and the :class:`~vllm_repro.audit.registry.Moment` and calls the functions above.
Each check returns violation records (:func:`~vllm_repro.audit.codes.make_violation`) without
``step``/``phase``; the :class:`~vllm_repro.audit.auditor.Auditor` fills those in. Runs inside
release environments (standard library only). The fast paths compare whole lists built by
C-level ``map``/``Counter`` and only walk block by block when something disagrees.
"""

from __future__ import annotations

from collections import Counter
from itertools import compress, count, repeat
from operator import attrgetter, is_not, ne

from ..engine import state
from ..records import Violation
from .books import HOLDING_WAIT_STATUSES, Books
from .codes import (BATCH_LIMIT, DRAFT_OVER_LIMIT, KV_FREE_QUEUE, KV_LEAK, KV_PREFIX_MAP, KV_TRANSFER_FREED,
                    KV_REFCOUNT, PREEMPT_UNREPORTED, REQ_OVER_MAX_LEN, REQ_RESIDUE, REQ_STARVED,
                    REQ_STATE, WORKER_BATCH_OVERFLOW, KV_CODES, NO_PROGRESS, make_violation, names)
from .registry import (AFTER_SCHEDULE, AFTER_UPDATE, END_OF_RUN, KV_BOOKS, REQUEST_CHECKS, Moment,
                       check)

_bid = attrgetter("block_id")
_ref = attrgetter("ref_cnt")
_rid = attrgetter("request_id")


def used_blocks(refs: list[int], null: int | None) -> int:
    """Non-null blocks with ``ref_cnt`` != 0 (a count below 0 is a KV_REFCOUNT finding)."""
    return len(refs) - refs.count(0) - (1 if null is not None and refs[null] != 0 else 0)


MAX_PER_CHECK = 20  # block-level findings reported per check and step (the rest are counted)


def _req_ids(holders: list[str]) -> list[str]:
    """Request ids from holder labels (``A``, ``A[g1]``; ``deferred-free@3`` is not one)."""
    out = []
    for h in holders:
        if h.startswith(("deferred-free@", "cow-copy[")):
            continue
        out.append(h.split("[g", 1)[0])
    return out


def status_name(req) -> str:
    st = getattr(req, "status", None)
    return getattr(st, "name", str(st))


def is_finished_status(name: str) -> bool:
    return name.startswith("FINISHED")


# ---- KV cache books ------------------------------------------------------------------------

def check_refcounts(books: Books, refs: list[int], held: Counter | list[int]) -> list[Violation]:
    """KV_REFCOUNT: every non-null block's ``ref_cnt`` equals the references held to it (block
    tables of every group, deferred frees, copy-on-write endpoints) and is never below 0.

    Mirrors the bookkeeping of ``BlockPool.get_new_blocks`` / ``touch`` / ``free_blocks``
    (``vllm/v1/core/block_pool.py``) against ``SingleTypeKVCacheManager.req_to_blocks``.
    ``held``: a ``Counter`` of block id -> references, or the list of held block ids.
    (:meth:`Books.refcounts_agree` answers "no finding" from the books' running counts.)
    """
    n = books.num_blocks
    null = books.null_id
    if isinstance(held, list):  # the held block ids
        if not books.caching:
            # without prefix caching no block is shared: the held ids are distinct and are
            # exactly the ids whose ref_cnt is not 0, each of which is 1
            ids = set(held)
            nz = set(compress(count(), refs))
            ones = refs.count(1)
            if null is not None:
                ids.discard(null)
                if refs[null]:
                    nz.discard(null)
                    ones -= refs[null] == 1
            if ones == len(nz) and ids == nz and len(held) - held.count(null) == len(ids):
                return []
        held = Counter(held)
    # at C speed: the held count of every block id, in id order, against the ref counts
    expected = list(map(held.get, range(n), repeat(0)))
    if null is not None:
        expected[null] = refs[null]  # the null block's ref_cnt is not maintained
    nonzero = n - refs.count(0) - (1 if null is not None and refs[null] != 0 else 0)
    outside = len(held) - (1 if null in held else 0) != nonzero if expected == refs else True
    if expected == refs and not outside:
        return []
    foreign = [bid for bid in held if not (0 <= bid < n)]
    if foreign:
        who = books.holders_of(foreign[:MAX_PER_CHECK])
        return [make_violation(KV_REFCOUNT, (
            f"block id {bid} is held by {names(who[bid])} but is not one of the pool's {n} "
            f"blocks (expected ids 0..{n - 1})"), requests=_req_ids(who[bid]), blocks=[])
            for bid in foreign[:MAX_PER_CHECK]]
    bad = [i for i in range(n) if refs[i] != expected[i]]
    who = books.holders_of(bad[:MAX_PER_CHECK])
    out = []
    for i in bad[:MAX_PER_CHECK]:
        holders = who[i]
        if refs[i] < 0:
            msg = (f"block {i} ref_cnt {refs[i]} is below 0 (held by {names(holders)}; "
                   f"expected {expected[i]})")
        else:
            msg = f"block {i} ref_cnt {refs[i]} but held by {names(holders)} (expected {expected[i]})"
        out.append(make_violation(KV_REFCOUNT, msg, requests=_req_ids(holders), blocks=[i]))
    if len(bad) > MAX_PER_CHECK:
        out[-1].message += f"; {len(bad) - MAX_PER_CHECK} more blocks disagree"
    return out


def check_free_queue(books: Books, refs: list[int]) -> tuple[list[Violation], list]:
    """KV_FREE_QUEUE: the free queue holds exactly the non-null blocks with ``ref_cnt`` 0, each
    once, its links end, its count is right, and free + used == ``num_gpu_blocks``.

    Mirrors ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``) as used by
    ``BlockPool``. Walks the queue's links (cost: the number of free blocks). Returns the
    findings and the walked free list (head first).
    """
    out = []
    n = books.num_blocks
    null = books.null_id
    ids: list = []
    free, ended = books.free_list(ids)
    nfree = books.num_free()
    if not ended:
        out.append(make_violation(KV_FREE_QUEUE, (
            f"the free queue's links do not end: more than {n + 1} blocks walked from its head "
            f"(a cycle); expected at most {n - 1}"), blocks=ids[:MAX_PER_CHECK]))
        return out, free
    seen = set(ids)
    if len(seen) != len(ids):
        dups = [b for b, c in Counter(ids).items() if c > 1]
        out.append(make_violation(KV_FREE_QUEUE, (
            f"block {names(dups)} linked more than once in the free queue (expected once)"),
            blocks=dups))
    if nfree != len(ids):
        out.append(make_violation(KV_FREE_QUEUE, (
            f"the free queue counts {nfree} free blocks (num_free_blocks) but links {len(ids)}"),
            blocks=[]))
    if (null is not None and null in seen) or not seen <= books.all_ids or \
            (_refs_of(refs, ids) and any(map(_ref, free))):
        # (every id a pool block's and none null: a free block i with a ref_cnt is one whose
        # refs[i] is not 0, refs[i] is read first, its own ref_cnt only when one is not)
        held_in_queue = [i for i in ids if i == null or not (0 <= i < n) or refs[i] != 0]
    else:
        held_in_queue = []
    if held_in_queue:
        who = books.holders_of(held_in_queue[:MAX_PER_CHECK])
        for i in held_in_queue[:MAX_PER_CHECK]:
            if i == null:
                msg = f"the null block {i} is in the free queue (expected never to be)"
            elif not (0 <= i < n):
                msg = f"block id {i} in the free queue is not one of the pool's {n} blocks"
            else:
                msg = (f"block {i} is in the free queue with ref_cnt {refs[i]} (held by "
                       f"{names(who.get(i, []))}; expected ref_cnt 0 for a free block)")
            out.append(make_violation(KV_FREE_QUEUE, msg, requests=_req_ids(who.get(i, [])),
                                      blocks=[i]))
    nzero = refs.count(0) - (1 if null is not None and refs[null] == 0 else 0)
    if nzero != len(seen) - len(set(held_in_queue)):
        lost = [i for i in range(n) if i != null and refs[i] == 0 and i not in seen]
        for i in lost[:MAX_PER_CHECK]:
            out.append(make_violation(KV_FREE_QUEUE, (
                f"block {i} has ref_cnt 0 but is not in the free queue (expected a ref-0 block "
                f"to be free; found it neither free nor held)"), blocks=[i]))
    used = used_blocks(refs, null) + (1 if null is not None else 0)
    if not out and nfree + used != n:
        out.append(make_violation(KV_FREE_QUEUE, (
            f"free {nfree} + used {used} != num_gpu_blocks {n}"), blocks=[]))
    return out, free


def _refs_of(refs: list[int], ids: list[int]) -> bool:
    """Whether ``refs[i]`` is not 0 for an ``i`` of ``ids`` (pool block ids); True when one
    cannot be read (then the blocks themselves are)."""
    try:
        return any(map(refs.__getitem__, ids))
    except (IndexError, TypeError):
        return True


def check_leaks(books: Books, requests: dict, finished: dict[str, str]) -> list[Violation]:
    """KV_LEAK: no block-table entry with real (non-null) blocks for a request that finished,
    was aborted or preempted, or waits without a reason to hold KV (a KV connector load in
    flight, reported finished or failed and not yet taken up by ``schedule()``, or promoted to
    ``WAITING`` with the computed tokens it loaded; a paused stream; the release's
    ``kv_holding_waiting`` queue): such a wait is the stall's to name (its cause), not a leak.
    A finished request the scheduler still keeps in ``requests`` while it has a KV connector
    is a delayed free, not a leak: the connector's ``request_finished`` returned True, or an
    aborted request's load is still in flight; ``_update_from_kv_xfer_finished`` frees it
    when the worker reports the transfer (one never freed is caught by the end-of-run check).

    Mirrors ``Scheduler._free_request`` / ``_preempt_request`` -> ``KVCacheManager.free``.
    """
    out = []
    running = set(map(_rid, books.scheduler.running))
    tables = books.tables()
    if all(t.keys() <= running for t in tables):  # (at C speed: as a rule every holder runs)
        return out
    null = books.null_id
    holding_ok = books.kv_holding_ids()
    multi = len(books.managers) > 1
    connector = getattr(books.scheduler, "connector", None) is not None
    if connector:  # a load reported (or failed) and not yet taken up by schedule()
        holding_ok = holding_ok | set(getattr(books.scheduler, "finished_recving_kv_req_ids", ())
                                      or ()) | set(getattr(books.scheduler,
                                                           "failed_recving_kv_req_ids", ()) or ())
    for g, table in enumerate(tables):
        if table.keys() <= running:
            continue
        for rid in [r for r in table if r not in running]:
            blocks = table[rid]
            if not blocks:
                continue
            real = [b.block_id for b in blocks if b.block_id != null]
            if not real:
                continue
            req = requests.get(rid)
            where = f" (KV cache group {g})" if multi else ""
            shown = ", ".join(map(str, real[:12])) + (" ..." if len(real) > 12 else "")
            if req is None:
                how = finished.get(rid, "finished")
                msg = (f"{rid} is gone from the scheduler ({how}) but still holds block(s) "
                       f"{shown}{where}; expected its blocks freed")
            else:
                st = status_name(req)
                if st == "RUNNING" or st in HOLDING_WAIT_STATUSES or rid in holding_ok:
                    continue
                if connector and is_finished_status(st):
                    continue  # a delayed free (see the docstring)
                if connector and st == "WAITING" and (getattr(req, "num_computed_tokens", 0)
                                                      or 0) > 0:
                    continue  # it holds what its KV load filled: waiting, not leaking
                if is_finished_status(st):
                    msg = f"{rid} finished ({st}) but still holds block(s) {shown}{where}"
                elif st == "PREEMPTED":
                    msg = (f"{rid} was preempted (status PREEMPTED) but still holds block(s) "
                           f"{shown}{where}; expected preemption to free them")
                else:
                    msg = (f"{rid} waits (status {st}) but holds block(s) {shown}{where}; "
                           f"expected no KV blocks before it is scheduled")
            out.append(make_violation(KV_LEAK, msg, requests=[rid], blocks=real))
    return out


def check_end_of_run(books: Books, refs: list[int], free: list) -> list[Violation]:
    """KV_LEAK at the end of a run where every request finished: every non-null block's
    ``ref_cnt`` is 0 and the free queue holds all ``num_gpu_blocks - 1`` of them."""
    out = []
    null = books.null_id
    n = books.num_blocks
    held = [i for i, r in enumerate(refs) if i != null and r != 0]
    if held:
        who = books.holders_of(held)
        by: dict[tuple, list[int]] = {}
        for i in held:
            by.setdefault(tuple(who[i]), []).append(i)
        for holders, bids in by.items():
            out.append(make_violation(KV_LEAK, (
                f"every request finished but block(s) {', '.join(map(str, bids[:12]))} still have "
                f"ref_cnt {', '.join(str(refs[i]) for i in bids[:12])} (held by "
                f"{names(holders)}); expected 0"), requests=_req_ids(list(holders)), blocks=bids))
    expected_free = n - (1 if null is not None else 0)
    if len(free) != expected_free and not held:
        out.append(make_violation(KV_LEAK, (
            f"every request finished but the free queue holds {len(free)} blocks; expected all "
            f"{expected_free} back"), blocks=[]))
    return out


def _maps_to(val, bid: int) -> bool:
    """Whether a hash map value (a block, or a dict ``block_id -> block``) holds block ``bid``."""
    if val is None:
        return False
    if isinstance(val, dict):
        return bid in val
    return getattr(val, "block_id", None) == bid


class PrefixMapCheck:
    """KV_PREFIX_MAP: every entry of ``BlockPool.cached_block_hash_to_block`` maps a hash to
    blocks that carry that hash (or list it among their secondary hashes), never the null block;
    every block with a hash is in the map under it; with prefix caching off the map is empty.

    Mirrors ``BlockPool.cache_full_blocks`` / ``_maybe_evict_cached_block``. Incremental: each
    check reads every block's hash (C-level) and compares the list with the last one; only the
    blocks whose hash changed are looked up in the map. The whole map is walked on the first
    check, whenever its size changes while no block's hash did, every ``full_every`` checks and
    on demand (``full=True``, at the end of a run).
    """

    def __init__(self, books: Books, full_every: int = 64):
        self.books = books
        self.full_every = full_every
        self.last: list | None = None
        self.last_keys = -1
        self.n = 0
        self.hashes: list = []
        self._nones: list = []

    def _inner(self):
        return self.books.hash_map()

    def snapshot(self, full: bool = True) -> tuple[list, int]:
        """(every block's hash, by block id; the number of keys in the hash map). With prefix
        caching off the hashes are only read when ``full`` (they must all be None; between full
        reads the map's size stands for them)."""
        inner = self._inner()
        nkeys = len(inner) if inner is not None else -1
        if not self.books.caching and not full:
            return self._none, nkeys
        return self.books.hashes(), nkeys

    @property
    def _none(self) -> list:
        n = self.books.num_blocks
        if len(self._nones) != n:
            self._nones = [None] * n
        return self._nones

    def check(self, full: bool = False, snap: tuple[list, int] | None = None) -> list[Violation]:
        books = self.books
        inner = self._inner()
        self.hashes = hashes = snap[0] if snap is not None else books.hashes()
        if inner is None or not books.hash_books:
            return []
        self.n += 1
        nkeys = len(inner)
        if not books.caching:
            if nkeys or hashes.count(None) != len(hashes):
                hashed = [i for i, h in enumerate(hashes) if h is not None]
                return [make_violation(KV_PREFIX_MAP, (
                    f"prefix caching is off but the hash map has {nkeys} entries and "
                    f"{len(hashed)} blocks carry a hash (expected none)"), blocks=hashed[:MAX_PER_CHECK])]
            return []
        last = self.last
        unchanged = last is not None and hashes == last
        due = full or last is None or self.n % self.full_every == 0 or \
            (unchanged and nkeys != self.last_keys)
        self.last, self.last_keys = hashes, nkeys
        if due:
            return self._full(inner, hashes)
        if unchanged:
            return []
        moved = ((bid, hashes[bid], last[bid]) for bid in compress(count(), map(is_not, hashes, last)))
        return self._moved_findings(inner, books, moved)

    def check_moved(self, mirror, full: bool = False) -> list[Violation]:
        """:meth:`check` with prefix caching on, on the books' mirror
        (:class:`~vllm_repro.audit.books.BlockMirror`): the blocks whose hash changed since the
        last check are the mirror's ``hash_old`` keys whose hash is another object now (what
        comparing every block's hash with the last list found); the same findings."""
        inner = self._inner()
        if inner is None or not self.books.hash_books:
            return []
        self.n += 1
        nkeys = len(inner)
        started = self.last is not None
        unchanged = started and not mirror.hashes_moved()
        due = full or not started or self.n % self.full_every == 0 or \
            (unchanged and nkeys != self.last_keys)
        hashes = mirror.hashes
        self.last, self.last_keys = hashes, nkeys  # (a marker: compared through hash_old)
        if due:
            return self._full(inner, list(hashes))
        if unchanged:
            return []
        old = mirror.hash_old
        ids = list(old)  # (the blocks whose hash is another object now, found at C speed)
        changed = sorted(compress(ids, map(is_not, map(hashes.__getitem__, ids), old.values())))
        moved = ((bid, hashes[bid], old[bid]) for bid in changed)
        return self._moved_findings(inner, self.books, moved)

    def _moved_findings(self, inner, books, moved) -> list[Violation]:
        """The findings over ``moved``: (block id, its hash now, its hash at the last check) of
        each block whose hash changed, in block order; at most MAX_PER_CHECK. Shared by
        :meth:`check` (a comparison of the lists) and :meth:`check_moved` (the mirror)."""
        sec = books.secondary_hashes()
        null = books.null_id
        out = []
        for bid, h, o in moved:
            if bid == null and h is not None:
                out.append(make_violation(KV_PREFIX_MAP, (
                    "the null block carries a prefix-cache hash (expected never cached)"), blocks=[bid]))
                continue
            if h is not None and not _maps_to(inner.get(h), bid):
                out.append(self._unmapped(bid))
            if o is not None and o != h and _maps_to(inner.get(o), bid) and o not in sec.get(bid, ()):
                out.append(make_violation(KV_PREFIX_MAP, (
                    f"block {bid} is in the hash map under a hash it does not carry (the block "
                    f"has {'no hash' if h is None else 'another hash'}; expected the map key)"),
                    blocks=[bid]))
            if len(out) >= MAX_PER_CHECK:
                break
        return out

    def _unmapped(self, bid: int) -> Violation:
        return make_violation(KV_PREFIX_MAP, (
            f"block {bid} carries a hash (ref_cnt {self.books.blocks[bid].ref_cnt}) but the hash "
            f"map does not map that hash to it (expected every hashed block in the map)"),
            blocks=[bid])

    def _full(self, inner: dict, hashes: list) -> list[Violation]:
        books = self.books
        sec = books.secondary_hashes()
        null = books.null_id
        out = []
        # blocks found in the map under their own hash object: the map maps that hash to them
        # (a dict holds one key per value), so the walk over the blocks below need not look
        # their hash up again (hashing a nested tuple hash, 0.9-0.10, costs more than the rest)
        mapped = set()
        for key, val in inner.items():
            isdict = isinstance(val, dict)
            blocks = list(val.values()) if isdict else [val]
            if not blocks:
                out.append(make_violation(KV_PREFIX_MAP, "a hash map entry with no block", blocks=[]))
            for b in blocks:
                bid = b.block_id
                if bid == null:
                    out.append(make_violation(KV_PREFIX_MAP, (
                        "the null block is in the prefix-cache hash map (expected never cached)"),
                        blocks=[bid]))
                    continue
                h = hashes[bid] if 0 <= bid < len(hashes) else None
                if h is key and (bid in val if isdict else val.block_id == bid):  # _maps_to
                    mapped.add(bid)
                    continue
                if h != key and key not in sec.get(bid, ()):
                    out.append(make_violation(KV_PREFIX_MAP, (
                        f"block {bid} is in the hash map under a hash it does not carry (the block "
                        f"has {'no hash' if h is None else 'another hash'}; expected the map key)"),
                        blocks=[bid]))
            if len(out) >= MAX_PER_CHECK:
                return out
        for bid, h in enumerate(hashes):
            if h is not None and bid not in mapped and not _maps_to(inner.get(h), bid):
                out.append(self._unmapped(bid))
                if len(out) >= MAX_PER_CHECK:
                    break
        return out + self._token_counts(hashes)[:max(0, MAX_PER_CHECK - len(out))]

    def _token_counts(self, hashes: list) -> list[Violation]:
        """With partial-block hashing (the books' ``tokens_field``,
        ``KVCacheBlock.block_hash_num_tokens``): a block's count of prefix tokens is set with its
        hash and cleared with it (``set_block_hash`` / ``reset_hash``), and is a positive
        multiple of ``BlockPool.hash_block_size`` (``cache_partial_block``'s rule)."""
        books = self.books
        if books.tokens_field is None:
            return []
        hbs = books.layout.hash_block_size or 1
        tokens_of, null = books.tokens_of, books.null_id
        out = []
        for bid, t in enumerate(map(tokens_of, books.blocks)):
            if bid == null:
                continue
            h = hashes[bid] if bid < len(hashes) else None
            if h is None and t is not None:
                out.append(make_violation(KV_PREFIX_MAP, (
                    f"block {bid} has no hash but block_hash_num_tokens {t} (expected None: "
                    "reset_hash clears both)"), blocks=[bid]))
            elif h is not None and t is not None and (t <= 0 or t % hbs):
                out.append(make_violation(KV_PREFIX_MAP, (
                    f"block {bid}'s hash covers {t} prefix tokens (expected a positive multiple "
                    f"of the hash block size {hbs})"), blocks=[bid]))
            if len(out) >= MAX_PER_CHECK:
                break
        return out


class RequestHashCheck:
    """KV_PREFIX_MAP, request side: the i-th cached block of a request's table carries the
    request's i-th block hash (``Request.block_hashes``, 0.10.1+, or
    ``KVCacheManager.req_to_block_hashes``, older), for ``i < num_cached_block[request]``.

    With partial-block hashing (``KVCacheBlock.block_hash_num_tokens``, 0.26+: the books'
    ``tokens_field``) the block's hash covers ``t`` prefix tokens: ``t`` must end inside the
    block (``i * block_size < t <= (i + 1) * block_size``) on a hash-block boundary, and the
    hash is the request's hash at that boundary (``block_hashes[t // hash_block_size - 1]``,
    as ``BlockPool.cache_full_blocks`` / ``_get_partial_block_hash`` key it), or one of the
    block's secondary hashes (``cached_block_hashes_by_block``) is.

    Incremental: each (group, request) table is verified once per block; the requests whose
    table object and cached count are as at their last look are told apart at C speed. Without
    ``block_hash_num_tokens``, skipped where a cache block spans several hash blocks (0.33's
    ``hash_block_size`` != the group's block size). Off where the books cannot read hashes.
    """

    def __init__(self, books: Books):
        self.books = books
        #: group -> request id -> (id of its table list, its blocks verified) at the last look
        self.done: dict[int, dict[str, tuple[int, int]]] = {}
        self.groups = state.hash_checkable_groups(books.layout, books.tokens_field is not None)

    def check(self, requests: dict, only=None) -> list[Violation]:
        """``only``: the request ids to look at (those scheduled in the step: a request's
        blocks are cached when ``schedule()`` allocates for it); None for all."""
        books = self.books
        if not books.caching or not books.hash_books:
            return []
        out = []
        side = state.req_block_hashes(books.kvm)
        null = books.null_id
        hash_of, plain = books.hash_of, state.plain_block_hash
        tokens_of = books.tokens_of if books.tokens_field is not None else None
        hbs = books.layout.hash_block_size
        for g in self.groups:
            m = books.managers[g]
            counts = m.num_cached_block
            done = self.done.setdefault(g, {})
            tables = m.req_to_blocks
            bs = getattr(m, "block_size", None) or hbs
            if only is None:
                pairs = counts.items()
            else:
                # a request whose table list and cached count are as at its last look has
                # nothing new to verify (the loop below would skip it at start >= k)
                only = list(only)
                rids = list(compress(only, map(counts.__contains__, only)))
                ks = list(map(counts.__getitem__, rids))
                now = zip(map(id, map(tables.get, rids)), ks)
                pairs = compress(zip(rids, ks), map(ne, map(done.get, rids), now))
            for rid, k in pairs:
                table = tables.get(rid)
                req = requests.get(rid)
                if not table or req is None:
                    continue
                lid, start = done.get(rid, (id(table), 0))
                if lid != id(table) or start > k:
                    start = 0
                if start >= k:
                    continue
                req_hashes = getattr(req, "block_hashes", None)
                if req_hashes is None and side is not None:
                    req_hashes = side.get(rid)
                if req_hashes is None:
                    continue
                tail = tokens_of is not None and bool(hbs) and bool(bs) and bs != hbs
                for i in range(start, min(k + tail, len(table))):
                    b = table[i]
                    if b.block_id == null:
                        continue
                    h = hash_of(b)
                    if h is None:
                        continue  # a hit block re-cached later; the map check covers it
                    if i == k:  # the tail: a partial entry (cache_partial_block), if any
                        out += self._partial_tail(rid, i, b, h, bs, hbs, req_hashes)
                        continue
                    if tokens_of is None or not hbs or not bs:
                        if i < len(req_hashes) and plain(h) != req_hashes[i]:
                            out.append(self._other_hash(rid, i, b.block_id, f"#{i}"))
                        continue
                    t = tokens_of(b)
                    if t is None:  # no count written (an offload pool's copy): a full block
                        t = (i + 1) * bs
                    if t % hbs or not (i * bs < t <= (i + 1) * bs):
                        out.append(make_violation(KV_PREFIX_MAP, (
                            f"block {b.block_id} is {rid}'s cached block #{i} and carries a hash "
                            f"covering {t} prefix tokens (expected a multiple of the hash block "
                            f"size {hbs} in {i * bs + 1}..{(i + 1) * bs})"),
                            requests=[rid], blocks=[b.block_id]))
                        continue
                    j = t // hbs - 1
                    if j >= len(req_hashes):
                        continue  # the request has not hashed that far (a partial hit)
                    want = req_hashes[j]
                    if plain(h) != want and not any(
                            plain(x) == want for x in books.secondary_hashes().get(b.block_id, ())):
                        out.append(self._other_hash(rid, i, b.block_id,
                                                    f"#{j} (its first {t} tokens)"))
                done[rid] = (id(table), k)
        return out

    def _partial_tail(self, rid: str, i: int, b, h, bs: int, hbs: int,
                      req_hashes) -> list[Violation]:
        """The block after a request's cached ones, where it carries a hash: a partial entry
        (``FullAttentionManager._cache_partial_tail_block``: the prompt's last hash boundary
        inside a cache block). Its token count must end inside the block on a hash-block
        boundary, and one of its hashes (the primary or a secondary one: the block may be shared
        from a request whose prefix it was cached for) must be the request's hash at one of the
        hash boundaries inside the block."""
        books = self.books
        t = books.tokens_of(b)
        if t is None:
            return []
        if t % hbs or not (i * bs < t <= (i + 1) * bs):
            return [make_violation(KV_PREFIX_MAP, (
                f"block {b.block_id} is {rid}'s block #{i} (after its cached ones) and carries a "
                f"hash covering {t} prefix tokens (expected a multiple of the hash block size "
                f"{hbs} in {i * bs + 1}..{(i + 1) * bs})"), requests=[rid], blocks=[b.block_id])]
        plain = state.plain_block_hash
        lo, hi = i * bs // hbs, min((i + 1) * bs // hbs, len(req_hashes))
        want = set(req_hashes[lo:hi])
        if not want:
            return []  # the request has not hashed into this block
        have = {plain(h)} | {plain(x) for x in books.secondary_hashes().get(b.block_id, ())}
        if want.isdisjoint(have):
            return [self._other_hash(rid, i, b.block_id, f"#{lo}..#{hi - 1} (a partial entry "
                                     f"covering {t} tokens)")]
        return []

    @staticmethod
    def _other_hash(rid: str, i: int, bid: int, which: str) -> Violation:
        return make_violation(KV_PREFIX_MAP, (
            f"block {bid} is {rid}'s cached block #{i} but carries another hash than {rid}'s "
            f"block hash {which} (expected the same content hash)"), requests=[rid], blocks=[bid])


# ---- requests and the batch ----------------------------------------------------------------

class RequestChecks:
    """REQ_STATE and BATCH_LIMIT over the scheduler's queues, requests and output.

    Mirrors ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``: running/waiting queues,
    ``_update_after_schedule``, the token and sequence budgets) and ``update_from_output``.
    Keeps, per request, the last ``num_computed_tokens`` and status seen, so that a count moving
    backwards is told apart from a preemption or rejected draft tokens.
    """

    def __init__(self, books: Books, advanced_in_schedule: bool = True):
        self.books = books
        #: whether schedule() itself advances num_computed_tokens by the scheduled count (0.8+);
        #: 0.6.x/0.7.x advance it in update_from_output (the adapter probes which)
        self.advanced_in_schedule = advanced_in_schedule
        #: rid -> (num_computed_tokens, status, num_preemptions) at the last look
        self.last: dict[str, tuple[int, str, int]] = {}
        self.preempted_now: set[str] = set()  # PREEMPTED now, not PREEMPTED at the last look
        self._names: dict = {}  # RequestStatus member -> name
        #: rid -> ((its status, num_computed_tokens, num_output_placeholders),
        #: num_preemptions, its queue) at its last look (:meth:`_looks`)
        self._seen: dict[str, tuple] = {}
        self._flagged: set[str] = set()  # rids a check of its own found wrong at the last look
        self._absent: set[str] = set()  # fields a request lacked (read with a default since)
        self._last_queues: list | None = None  # the queues where() last read, and its answer
        self._last_where: tuple[dict, dict] = ({}, {})

    _status = attrgetter("status")
    _nct = attrgetter("num_computed_tokens")
    _npre = attrgetter("num_preemptions")
    _three = attrgetter("status", "num_computed_tokens", "num_output_placeholders")

    def _looks(self, reqs: list, rids: list[str], where: dict) -> list[tuple]:
        """What each request's own checks read: ((its status, ``num_computed_tokens``,
        ``num_output_placeholders``), ``num_preemptions``, its queue in ``where``), the two
        counts 0 where the release has no such field; read at C speed, one call per request
        for the first three. Two looks are equal when every field is (the status: the same
        member of the release's ``RequestStatus``, an ``IntEnum`` of distinct values)."""
        absent = self._absent
        if "num_output_placeholders" not in absent:
            try:
                three = list(map(self._three, reqs))
            except AttributeError:  # (a release without it: getattr from now on)
                absent.add("num_output_placeholders")
        if "num_output_placeholders" in absent:
            three = list(zip(map(self._status, reqs), map(self._nct, reqs),
                             map(getattr, reqs, repeat("num_output_placeholders"), repeat(0))))
        if "num_preemptions" not in absent:
            try:
                npre = list(map(self._npre, reqs))
            except AttributeError:
                absent.add("num_preemptions")
        if "num_preemptions" in absent:  # (the release's Request has no such field: 0 each)
            npre = [0] * len(reqs)
        return list(zip(three, npre, map(where.get, rids)))

    def where(self) -> tuple[dict[str, str], dict[str, list[str]]]:
        """(request id -> its queue, request id -> every queue it is in, for ids in more than
        one place). Queues holding the same request objects as at the last call (compared at
        C speed) give the same answer, which is then reused (callers only read it)."""
        queues = self.books.queues()
        if queues == self._last_queues:
            return self._last_where
        where: dict[str, str] = {}
        listed = [(name, list(map(_rid, reqs))) for name, reqs in queues]
        total = sum(len(ids) for _, ids in listed)
        for name, ids in reversed(listed):  # earlier queues overwrite: running wins
            where.update(dict.fromkeys(ids, name))
        dups: dict[str, list[str]] = {}
        if total != len(where):
            seen: dict[str, list[str]] = {}
            for name, reqs in queues:
                for r in reqs:
                    seen.setdefault(r.request_id, []).append(name)
            dups = {rid: qs for rid, qs in seen.items() if len(qs) > 1}
        self._last_queues, self._last_where = queues, (where, dups)
        return where, dups

    def _name(self, status) -> str:
        name = self._names.get(status)
        if name is None:
            name = self._names[status] = getattr(status, "name", str(status))
        return name

    def check(self, phase: str, so=None, scheduled=None) -> list[Violation]:
        """``phase``: ``schedule`` (after ``schedule()``, with its output ``so`` and the
        adapter's ``scheduled`` list) or ``update`` (after ``update_from_output``)."""
        s = self.books.scheduler
        requests = s.requests
        out: list[Violation] = []
        self.preempted_now = set()
        where, dups = self.where()
        name = self._name
        by_rid: dict[str, list[str]] = {}  # rid -> problems (one REQ_STATE record per request)
        for rid, qs in dups.items():
            by_rid.setdefault(rid, []).append(
                f"{rid} is in {' and '.join(qs)} (expected in exactly one queue)")
        # (as a rule every request is in a queue and every queued one a request: the two
        # differences below are then empty, and the comparison builds no set)
        differ = where.keys() != requests.keys()
        for rid in (where.keys() - requests.keys()) if differ else ():
            by_rid.setdefault(rid, []).append(
                f"{rid} is in {where[rid]} but not in scheduler.requests")
        for rid in (requests.keys() - where.keys()) if differ else ():
            st = name(requests[rid].status)
            if not st.startswith("FINISHED") and st != "WAITING_FOR_STREAMING_REQ":
                by_rid.setdefault(rid, []).append(
                    f"{rid} (status {st}) is in scheduler.requests but in no queue (expected in "
                    "running or waiting)")
        spec = state.spec_tokens(so) if so is not None else {}
        nst = getattr(so, "num_scheduled_tokens", None) or {}
        last = self.last
        names_of = self._names
        mml = self.books.max_model_len
        seen, flagged = self._seen, self._flagged
        if phase == "update":
            # update_from_output only touches the requests it was given (the others keep the
            # status and count the after-schedule check saw); finished ones leave the dict
            for rid in last.keys() - requests.keys():
                del last[rid]
                seen.pop(rid, None)
            new_last = last
            # as after schedule(): a scheduled request whose look is as at its last look (after
            # this step's schedule(), as a rule: update_from_output appends tokens but moves
            # no count, status or queue of a request it does not finish), which found nothing
            # wrong with it then, has nothing to find now; only the others are looked at
            rids = list(filter(requests.__contains__, nst))
            reqs = list(map(requests.__getitem__, rids))
            cur = self._looks(reqs, rids, where)
            moved = list(map(ne, map(seen.get, rids), cur))
            if flagged:
                moved = [m or rid in flagged for rid, m in zip(rids, moved)]
            items = list(compress(zip(rids, reqs), moved))
            looks = list(compress(zip(rids, cur), moved))
        else:
            # a request whose status, count, preemptions, placeholders and queue are as at its
            # last look, which found nothing wrong with it then, has nothing to find now: its
            # bounds and continuity are only checked when its count moved (the loop below
            # skips it at "unchanged since the last look"); only the others are looked at
            rids = list(requests)
            reqs = list(requests.values())
            cur = self._looks(reqs, rids, where)
            now = dict(zip(rids, cur))
            moved = list(map(ne, map(seen.get, rids), cur))  # in request order
            if flagged:
                flagged.intersection_update(now.keys())
            if flagged:
                moved = [m or rid in flagged for rid, m in zip(rids, moved)]
            new_last = dict(last)  # the requests not looked at keep theirs
            for rid in (last.keys() - now.keys()) if last.keys() != now.keys() else ():
                del new_last[rid]
            items = list(compress(zip(rids, reqs), moved))
            looks = list(compress(zip(rids, cur), moved))
            self._seen = seen = now  # (holds every look read just now: no update below)
        if phase == "update":
            seen.update(looks)
        if flagged:
            for rid, _ in looks:
                flagged.discard(rid)
        # (the look's count, preemptions, placeholders and queue: read just now, the same values)
        for (rid, req), (_, ((status, nct, nop), npre, q)) in zip(items, looks):
            st = names_of.get(status) or name(status)
            if q == "running":
                if st != "RUNNING":
                    flagged.add(rid)
                    by_rid.setdefault(rid, []).append(
                        f"{rid} is in running with status {st} (expected RUNNING)")
            elif q is not None and (st == "RUNNING" or st.startswith("FINISHED")):
                flagged.add(rid)
                by_rid.setdefault(rid, []).append(
                    f"{rid} is in {q} with status {st} (expected a waiting status or PREEMPTED)")
            prev = last.get(rid)
            # vLLM's own count (Request.num_preemptions, 0.13+; absent before): a preemption
            # between two looks (reset_prefix_cache(reset_running_requests=True) preempts and
            # the next schedule() resumes) leaves the status RUNNING at both
            npre = npre or 0
            new_last[rid] = (nct, st, npre)  # (when new_last is last, prev was read first)
            if st == "PREEMPTED" and (prev is None or prev[1] != "PREEMPTED"):
                self.preempted_now.add(rid)
            nop = nop or 0
            if nop < 0:
                flagged.add(rid)
                # AsyncScheduler asserts it only on the frames it does not discard
                # (vllm/v1/core/sched/async_scheduler.py:_update_request_with_output)
                by_rid.setdefault(rid, []).append(
                    f"{rid} num_output_placeholders is {nop} (expected >= 0: tokens in flight "
                    "cannot be negative)")
            if prev is not None and nct == prev[0]:
                continue  # unchanged since the last look: bounds held then
            if mml is not None and nct > mml:
                out.append(make_violation(REQ_OVER_MAX_LEN, (
                    f"{rid} num_computed_tokens {nct} is over max_model_len {mml} (num_tokens "
                    f"{req.num_tokens}); expected at most {mml}"), requests=[rid]))
            ntok = req.num_tokens
            if nct < 0 or nct > ntok:
                upper = ntok + max(len(getattr(req, "spec_token_ids", None) or ()),
                                   len(spec.get(rid, ()))) + \
                    (getattr(req, "num_output_placeholders", 0) or 0)
                if nct < 0 or nct > upper:
                    by_rid.setdefault(rid, []).append(
                        f"{rid} num_computed_tokens {nct} is outside 0..{upper} (num_tokens {ntok})")
            if prev is None or st != "RUNNING" or prev[1] != "RUNNING" or npre != prev[2]:
                continue  # new, preempted, resumed or waiting: no continuity to check
            if nct < prev[0]:
                allowed = len(spec[rid]) + 1 if phase == "update" and spec.get(rid) else 0
                if prev[0] - nct > allowed:
                    by_rid.setdefault(rid, []).append(
                        f"{rid} num_computed_tokens went from {prev[0]} to {nct} without a "
                        f"preemption (expected never to move backwards"
                        + (f" by more than {allowed} rejected draft tokens)" if allowed else ")"))
            elif phase == "schedule" and rid not in nst:
                by_rid.setdefault(rid, []).append(
                    f"{rid} num_computed_tokens went from {prev[0]} to {nct} in a step that did "
                    "not schedule it (expected unchanged)")
        self.last = new_last
        if so is not None and phase == "schedule":
            out += self._check_output(so, scheduled, where, by_rid)
        for rid, problems in by_rid.items():
            out.append(make_violation(REQ_STATE, "; ".join(problems), requests=[rid]))
        return out

    def _check_output(self, so, scheduled, where, by_rid) -> list[Violation]:
        s = self.books.scheduler
        requests = s.requests
        out = []
        nst = so.num_scheduled_tokens
        new_ids = [nr.req_id for nr in so.scheduled_new_reqs]
        ids = new_ids + state.cached_req_ids(so)
        listed = set(ids)
        # (at C speed: as a rule every listed id is listed once and has a count, and the loop
        # below, which reports the others, has nothing to report)
        if len(listed) != len(ids) or not listed <= nst.keys():
            for rid, c in Counter(ids).items():
                if c > 1:
                    by_rid.setdefault(rid, []).append(
                        f"{rid} is listed {c} times in one scheduler output (scheduled_new_reqs + "
                        "scheduled_cached_reqs; expected once)")
                if rid not in nst:
                    by_rid.setdefault(rid, []).append(
                        f"{rid} is in the output's request data but has no num_scheduled_tokens "
                        "entry")
        before = {x.req_id: x.num_computed_before for x in (scheduled or [])}
        for rid, n in nst.items():
            if n <= 0:
                out.append(make_violation(BATCH_LIMIT, (
                    f"{rid} is scheduled with {n} tokens (expected > 0)"), requests=[rid]))
            req = requests.get(rid)
            if req is None:
                by_rid.setdefault(rid, []).append(
                    f"{rid} is in num_scheduled_tokens but not in scheduler.requests")
                continue
            st = self._name(req.status)
            q = where.get(rid)
            if st != "RUNNING" or q != "running":
                q = q or "no queue"
                if st == "PREEMPTED" and rid in self.preempted_now:
                    by_rid.setdefault(rid, []).insert(0,
                        f"{rid} is in num_scheduled_tokens but was preempted in the same step "
                        f"(status PREEMPTED, in {q})")
                else:
                    by_rid.setdefault(rid, []).insert(0,
                        f"{rid} is in num_scheduled_tokens with status {st} (in {q}); expected "
                        "RUNNING, in running")
                continue
            if rid not in listed:
                by_rid.setdefault(rid, []).append(
                    f"{rid} is in num_scheduled_tokens but in neither scheduled_new_reqs nor "
                    "scheduled_cached_reqs")
            b = before.get(rid)
            if self.advanced_in_schedule and b is not None and req.num_computed_tokens != b + n:
                by_rid.setdefault(rid, []).append(
                    f"{rid} num_computed_tokens is {req.num_computed_tokens} after schedule(); "
                    f"expected {b} + {n} scheduled = {b + n}")
        for rid, drafts in state.spec_tokens(so).items():
            n = nst.get(rid)
            if n is None:
                out.append(make_violation(BATCH_LIMIT, (
                    f"{rid} has {len(drafts)} draft tokens in scheduled_spec_decode_tokens but no "
                    "num_scheduled_tokens entry (expected drafts only for a scheduled request)"),
                    requests=[rid]))
            elif len(drafts) > n:
                out.append(make_violation(BATCH_LIMIT, (
                    f"{rid} is scheduled with {n} tokens but {len(drafts)} draft tokens (expected "
                    "the drafts to be part of its scheduled count)"), requests=[rid]))
        total = sum(nst.values())
        limit = self.books.max_tokens
        if limit is not None and total > limit:
            out.append(make_violation(BATCH_LIMIT, (
                f"{total} tokens scheduled in one step, over max_num_batched_tokens {limit}"),
                requests=list(nst)))
        tot = getattr(so, "total_num_scheduled_tokens", total)
        if tot != total:
            out.append(make_violation(BATCH_LIMIT, (
                f"total_num_scheduled_tokens is {tot} but the per-request counts sum to {total}"),
                requests=list(nst)))
        seqs = self.books.max_seqs
        if seqs is not None:
            active = state.max_active_reqs(s, seqs)
            if len(s.running) > active:
                out.append(make_violation(BATCH_LIMIT, (
                    f"{len(s.running)} requests running, over max_num_seqs {active}"),
                    requests=[r.request_id for r in s.running]))
            if len(nst) > seqs:
                out.append(make_violation(BATCH_LIMIT, (
                    f"{len(nst)} requests scheduled in one step, over max_num_seqs {seqs}"),
                    requests=list(nst)))
        return out


# ---- what the books say about requests that left, were skipped or preempted ---------------

def check_residue(books: Books, seen: set, left_at: dict[str, int], before_step: int,
                  end_step: int) -> list[Violation]:
    """REQ_RESIDUE at the end of a run where every request finished: no request that left the
    scheduler is still a key of a dict or set attribute of the scheduler, the KV cache manager,
    its coordinator and single-type managers, the structured-output manager or the KV connector
    (:func:`vllm_repro.engine.state.per_request_owners`). The containers are found by walking
    those objects' attributes (any dict or set with a request id among its keys, or a request
    object), not by a list of names per release.

    Only requests that left before ``before_step`` (the last step whose ``schedule()`` ran) are
    judged: ids of the last step stay legitimately until the next ``schedule()`` hands them to
    the worker (``Scheduler.finished_req_ids`` and the like). ``left_at``: request id -> the
    step it left the scheduler; the record's step is that step."""
    found: dict[str, list[str]] = {}
    for label, obj in state.per_request_owners(books.scheduler):
        for attr, cont in state.keyed_containers(obj):
            try:
                keys = list(cont)
            except Exception:  # noqa: BLE001 - a container changing or unreadable: skip it
                continue
            for key in keys:
                rid = state.request_key(key)
                if rid is None or rid not in seen:
                    continue
                if left_at.get(rid, end_step) >= before_step:
                    continue
                kind = "set" if isinstance(cont, (set, frozenset)) else "dict"
                what = f"{label}.{attr} ({kind}"
                if kind == "dict":
                    val = cont.get(key)
                    shown = repr(val)
                    what += f", value {shown[:40] + '...' if len(shown) > 40 else shown}"
                found.setdefault(rid, []).append(what + ")")
    out = []
    for rid, where in found.items():
        at = left_at.get(rid)
        when = f"left the scheduler at step {at}" if at is not None else "left the scheduler"
        out.append(make_violation(REQ_RESIDUE, (
            f"{rid} {when} but is still a key of {names(where)} at the end of the run (step "
            f"{end_step}); expected every per-request entry dropped when a request leaves"),
            requests=[rid], step=at))
    return out


def _block_size(books: Books) -> int:
    for m in books.managers:
        bs = getattr(m, "block_size", None)
        if bs:
            return bs
    return getattr(books.kvm, "block_size", None) or 16


class StarvationCheck:
    """REQ_STARVED after ``schedule()``: a running request with tokens pending that got nothing
    in a step which left room for it: the output's total (with every request's draft and
    lookahead slots) left token budget under ``max_num_batched_tokens``, and the block pool
    still has blocks enough for everything the request could have asked for (its pending tokens
    up to the budget, lookahead included, one block more per KV cache group).

    Room and pending work are read from vLLM's own state (the output, the block pool, the
    request's counts); the check does not schedule anything itself. It stays quiet where a
    release legitimately withholds a running request: a paused scheduler, a KV connector
    (pending block frees stop the running loop), a request in flight in the batch queue
    (``scheduled_req_ids``), async scheduling's last placeholder, the max_model_len cap, a
    grammar not compiled yet, encoder inputs, a prefill held back by prefill cadence, prefill
    lookahead or Mamba block alignment, a prefill that does not fit whole without chunked
    prefill, V2+PP decode eligibility, and every running request after the first one the pool
    could not have served (the running loop may stop there). In a step with a preemption the
    auditor leaves alone the request that preempted itself and those after it (the running loop
    stops there, though the blocks are free afterwards); where it cannot tell the running order
    before ``schedule()`` (a release whose output has no ``preempted_req_ids``) it does not run
    the check in such a step.
    """

    def __init__(self, books: Books):
        self.books = books
        s = books.scheduler
        cfg = getattr(s, "scheduler_config", None)
        limits = [x for x in (books.max_tokens, getattr(cfg, "max_num_batched_tokens", None)) if x]
        self.budget = min(limits) if limits else None
        self.block_size = _block_size(books)
        self.look = state.lookahead_tokens(s)
        self.chunked = state.chunked_prefill(s)
        self.groups = max(1, len(books.managers))
        self.holds_prefills = bool((getattr(s, "local_prefill_interval", 1) or 1) > 1
                                   or getattr(s, "num_prefill_lookahead", 0)
                                   or getattr(s, "need_mamba_block_aligned_split", False))

    def check(self, so, paused: bool = False, exempt: set[str] = frozenset()) -> list[Violation]:
        """``exempt``: request ids not judged (in a step with a preemption: the request that
        preempted itself and those after it, :func:`~vllm_repro.audit.auditor.
        self_preempted_and_after`)."""
        s = self.books.scheduler
        nst = so.num_scheduled_tokens
        running = s.running
        if len(running) <= len(nst) and all(r.request_id in nst for r in running):
            return []
        if self.budget is None or paused or state.scheduler_paused(s) \
                or getattr(s, "connector", None) is not None:
            return []
        total = sum(nst.values())
        left = self.budget - total - self.look * (len(nst) + 1)
        if left < 1:
            return []
        free = self.books.num_free()
        in_flight = state.in_flight_ids(s)
        mml = self.books.max_model_len
        bs = self.block_size
        out = []
        for r in list(running):
            rid = r.request_id
            if rid in nst or rid in exempt:
                continue
            if status_name(r) != "RUNNING" or rid in in_flight:
                continue
            if state.grammar_pending(r) or getattr(r, "has_encoder_inputs", False):
                continue
            nct = r.num_computed_tokens
            nop = getattr(r, "num_output_placeholders", 0) or 0
            with_spec = getattr(r, "num_tokens_with_spec", None)
            if with_spec is None:
                with_spec = r.num_tokens + len(getattr(r, "spec_token_ids", None) or ())
            pending = with_spec + nop - nct
            if pending <= 0:
                continue
            if nop > 0:
                mt = state.request_max_tokens(r)
                outs = getattr(r, "num_output_tokens", None)
                if mt is None or outs is None or outs + nop + self.look + 1 >= mt:
                    continue  # async: the tokens in flight may already end it
            if mml is not None and mml - nct - 1 - self.look < 1:
                continue
            prefill = nct < getattr(r, "num_prompt_tokens", 0)
            if prefill and (self.holds_prefills or (not self.chunked and pending > left)):
                continue
            if getattr(r, "next_decode_eligible_step", 0) > getattr(s, "current_step", 1 << 62):
                continue
            need = self.groups * (-(-(min(pending, self.budget) + self.look) // bs) + 1)
            if free < need:
                break  # the running loop may have stopped at this one
            out.append(make_violation(REQ_STARVED, (
                f"{rid} is running with {pending} token(s) pending (num_computed_tokens {nct}) "
                f"but got none in a step that scheduled {total} of {self.budget} tokens ({left} "
                f"left) and left {free} blocks free (it needs at most {need}); expected the "
                f"scheduler to schedule it"), requests=[rid]))
        return out


def check_preempt_report(so, preempted: list[str], between: list[str] = ()) -> list[Violation]:
    """PREEMPT_UNREPORTED: every request preempted inside this step's ``schedule()``
    (``preempted``), and every one preempted since the last step by an engine-core event
    (``between``: ``reset_prefix_cache(reset_running_requests=True)``, ``pause``), is in this
    step's ``SchedulerOutput.preempted_req_ids`` (which tells the worker to drop the request's
    state) where the release has that field (the ids: read by the auditor)."""
    report = state.preempted_report(so)
    if report is state.ABSENT or report is None or (not preempted and not between):
        return []
    out = []
    for rid, when in [*((r, "in this step's schedule() but is not in its") for r in preempted),
                      *((r, "between steps (by an engine-core event) but is not in the next "
                            "step's") for r in between if r not in preempted)]:
        if rid not in report:
            out.append(make_violation(PREEMPT_UNREPORTED, (
                f"{rid} was preempted {when} SchedulerOutput.preempted_req_ids "
                f"({names(sorted(report)) if report else 'empty'}); expected every preemption "
                f"reported to the worker"), requests=[rid]))
    return out


def check_worker_batch(overflow: list) -> list[Violation]:
    """WORKER_BATCH_OVERFLOW: the fake runner's persistent batch
    (:class:`vllm_repro.engine.fake_runner.PersistentBatch`) found no free slot for a scheduled
    request; ``overflow``: its new ``(step, request id, slots in use, max_num_reqs)`` entries."""
    return [make_violation(WORKER_BATCH_OVERFLOW, (
        f"the worker's persistent batch has no slot for {rid}: {used} of its {cap} slots "
        f"(max_num_seqs) are taken by requests scheduled in this step, and InputBatch.add_request"
        f" would fail (assert new_req_index < max_num_reqs); expected at most {cap} requests in "
        f"one batch"), requests=[rid], step=step) for step, rid, used, cap in overflow]


def check_transfer_blocks(books: Books, transfers: dict[str, tuple[str, list[int]]]
                          ) -> list[Violation]:
    """KV_TRANSFER_FREED: every block a KV transfer in flight uses is in its request's block
    table (KV cache group 0, where the connector's transfers land). ``transfers``: request id ->
    ``("load", block ids)`` for an asynchronous load still writing them (not yet reported in
    ``finished_recving``) or ``("send", block ids)`` for a delayed free whose send still reads
    them (not yet reported in ``finished_sending``), as the scripted connector's worker half
    knows them. Mirrors what the scheduler must keep: a request in ``WAITING_FOR_REMOTE_KVS``
    keeps its blocks until the worker says the write is done, and a request whose
    ``request_finished`` returned True keeps them until the send is done
    (``Scheduler._update_from_kv_xfer_finished`` frees both); freed earlier, the pool hands
    them to the next request while the transfer still uses them."""
    if not transfers:
        return []
    tables = books.tables()
    table = tables[0] if tables else {}
    holders: dict[int, list[str]] = {}
    for rid, blocks in table.items():
        for b in blocks or ():
            holders.setdefault(b.block_id, []).append(rid)
    out = []
    for rid, (kind, want) in transfers.items():
        held = {b.block_id for b in table.get(rid) or ()}
        gone = [b for b in want if b not in held]
        if not gone:
            continue
        others = sorted({o for b in gone for o in holders.get(b, ()) if o != rid})
        where = (f"; now held by {names(others)}" if others else "; now free")
        shown = ", ".join(map(str, gone[:12])) + (" ..." if len(gone) > 12 else "")
        what, report = (("asynchronous KV load is still writing", "finished_recving")
                        if kind == "load" else
                        ("KV send (a delayed free) is still reading", "finished_sending"))
        out.append(make_violation(KV_TRANSFER_FREED, (
            f"{rid}'s {what} block(s) {shown} (not reported in {report}) but they are no "
            f"longer in its block table{where}; expected the scheduler to keep them until the "
            f"transfer finishes"), requests=[rid, *others], blocks=gone))
    return out


def self_preempted_and_after(pre: list[tuple[str, int]], preempted: list[str], so) -> set[str]:
    """The running requests the starvation check leaves alone in a step with a preemption:
    the one that preempted itself (the last, in the running order before ``schedule()``
    (``pre``), of those preempted in it that got no tokens) and every one after it, which
    vLLM's running loop never reached (it stops there). Empty when none preempted itself."""
    scheduled_tokens = so.num_scheduled_tokens
    order = [rid for rid, _ in pre]
    selves = [rid for rid in order if rid in preempted and not scheduled_tokens.get(rid)]
    if not selves:
        return set()
    return set(order[order.index(selves[-1]):])


# ---- the registered checks (levels scheduler and engine-core; run in this order) -----------
# Each is ``fn(auditor, moment) -> list[Violation]``; the auditor (audit/auditor.py) runs those
# of a phase, turning a check's ``group`` off when the release's books lack an attribute.

@check("KV books", codes=(KV_REFCOUNT, KV_FREE_QUEUE, KV_LEAK, KV_PREFIX_MAP),
       phase=(AFTER_SCHEDULE, AFTER_UPDATE), group=KV_BOOKS,
       needs="Capabilities.kv_block_hash for the hash checks",
       text="every block's ref count against the block tables, the free queue's links and count, "
            "blocks of finished requests, the prefix-cache hash map against the blocks' hashes "
            "(after update: only leaks when no pool call ran since the last check)")
def kv_books(auditor, m: Moment) -> list[Violation]:
    if m.phase == AFTER_SCHEDULE:
        return auditor._kv_checks(scheduled_ids=m.so.num_scheduled_tokens)
    return auditor._kv_checks(quick=True)


@check("request states", codes=(REQ_STATE, BATCH_LIMIT, REQ_OVER_MAX_LEN),
       phase=(AFTER_SCHEDULE, AFTER_UPDATE), group=REQUEST_CHECKS,
       text="each request in one queue with the status of that queue, num_computed_tokens in "
            "bounds and moving forwards, the scheduler output's counts within the batch limits")
def request_states(auditor, m: Moment) -> list[Violation]:
    if m.phase == AFTER_SCHEDULE:
        return auditor.req_checks.check("schedule", m.so, m.scheduled)
    return auditor.req_checks.check("update", m.so)


@check("worker batch", codes=WORKER_BATCH_OVERFLOW, phase=AFTER_UPDATE,
       needs="the fake runner's persistent batch (or the release's InputBatch)",
       text="every scheduled request found a slot in the worker's max_num_seqs slots")
def worker_batch(auditor, m: Moment) -> list[Violation]:
    slots = getattr(getattr(auditor.loop, "runner", None), "slots", None)
    overflow = getattr(slots, "overflow", None)
    if not overflow or len(overflow) <= auditor._overflow_seen:
        return []
    new = overflow[auditor._overflow_seen:]
    auditor._overflow_seen = len(overflow)
    return check_worker_batch(new)


@check("KV transfers", codes=KV_TRANSFER_FREED, phase=(AFTER_SCHEDULE, AFTER_UPDATE),
       needs="a scripted KV connector (loop.kv_worker)",
       text="every block a KV load or send in flight uses is still in its request's block table")
def kv_transfers(auditor, m: Moment) -> list[Violation]:
    worker = getattr(auditor.loop, "kv_worker", None)
    if worker is None:
        return []
    return check_transfer_blocks(auditor.books, worker.transfers_in_flight())


@check("preemption report", codes=PREEMPT_UNREPORTED, phase=AFTER_SCHEDULE,
       needs="SchedulerOutput.preempted_req_ids (0.12+, probed)",
       text="every request preempted inside schedule() or by an engine-core event between steps "
            "is in the step's preempted_req_ids")
def preemption_report(auditor, m: Moment) -> list[Violation]:
    return check_preempt_report(m.so, m.extra["preempted_in_schedule"],
                                auditor._preempted_between())


@check("starvation", codes=REQ_STARVED, phase=AFTER_SCHEDULE,
       text="no running request with tokens pending gets nothing in a step that left token budget "
            "and free blocks for it (a step with a preemption: only the requests the running "
            "loop visited)")
def starvation(auditor, m: Moment) -> list[Violation]:
    paused = bool(getattr(auditor.loop, "_paused", False))
    pre = m.extra["running_before"]
    if not auditor.req_checks.preempted_now:
        return auditor.starve_check.check(m.so, paused=paused)
    if pre is not None and state.preempted_report(m.so) is not state.ABSENT:
        # a preemption in this step: the running loop stopped at the request whose
        # allocation failed and that preempted itself; the requests before it were visited
        return auditor.starve_check.check(
            m.so, paused=paused,
            exempt=self_preempted_and_after(pre, m.extra["preempted_in_schedule"], m.so))
    return []


@check("draft limit", codes=DRAFT_OVER_LIMIT, phase=AFTER_SCHEDULE,
       needs="spec decode (Scheduler.num_spec_tokens > 0)",
       text="no request is scheduled with more draft tokens than num_speculative_tokens")
def draft_limit(auditor, m: Moment) -> list[Violation]:
    """``Scheduler.schedule`` schedules every draft a request holds (0.24.0
    ``vllm/v1/core/sched/scheduler.py``: ``scheduled_spec_decode_tokens[req_id] =
    request.spec_token_ids``, trimmed only to the tokens it schedules): vLLM's drafters propose
    at most ``num_speculative_tokens``, and the model runner verifies that many per request."""
    limit = getattr(auditor.books.scheduler, "num_spec_tokens", 0) or 0
    if not limit:
        return []
    return [make_violation(DRAFT_OVER_LIMIT, (
        f"{rid} is scheduled with {len(drafts)} draft tokens but num_speculative_tokens is "
        f"{limit}; expected at most {limit} (the drafter's proposals are capped there)"),
        requests=[rid]) for rid, drafts in state.spec_tokens(m.so).items() if len(drafts) > limit]


@check("KV books at the end", codes=(KV_LEAK, KV_REFCOUNT, KV_FREE_QUEUE, KV_PREFIX_MAP),
       phase=END_OF_RUN, outcomes=("clean",), group=KV_BOOKS,
       text="after a clean run every block is back in the free queue and the hash map agrees "
            "with every block")
def kv_books_at_end(auditor, m: Moment) -> list[Violation]:
    books = auditor.books
    refs = books.refs()
    free, _ = books.free_list()
    return check_end_of_run(books, refs, free) + auditor.map_check.check(full=True)


@check("residue", codes=REQ_RESIDUE, phase=END_OF_RUN, outcomes=("clean",),
       group=REQUEST_CHECKS,
       text="no request that left the scheduler is still a key of a per-request dict or set")
def residue(auditor, m: Moment) -> list[Violation]:
    loop = auditor.loop_ended
    return check_residue(auditor.books, set(loop.created), auditor._left_at,
                         auditor._last_schedule_step, m.step)


@check("stall", codes=NO_PROGRESS, phase=END_OF_RUN, outcomes=("stall",),
       text="a run that stalled gets one record naming its first step without progress")
def stall(auditor, m: Moment) -> list[Violation]:
    return [auditor._no_progress(auditor.loop_ended, m.step)]


@check("KV books after a crash", codes=KV_CODES, phase=END_OF_RUN, outcomes=("crash",),
       group=KV_BOOKS, text="the KV cache's books as vLLM left them when it raised")
def kv_books_after_crash(auditor, m: Moment) -> list[Violation]:
    return [v for v in auditor._kv_checks(with_leaks=False) if v.code in KV_CODES]
