"""Hooks on the block pool's entry points, for one run: a bad free is caught inside the call
that makes it, with the caller's stack, before vLLM's own asserts run.

The release's ``BlockPool`` instance (``vllm/v1/core/block_pool.py``) gets instance attributes
wrapping ``free_blocks``, ``touch`` and ``get_new_blocks`` (the class is never patched, so
nothing leaks into the next run in the same worker). Each wrapper checks the blocks it is handed
against the books *before* calling the release's own method:

- ``free_blocks(blocks)``: a block whose ``ref_cnt`` minus the times it is freed here would fall
  below the references still held to it (block tables, deferred frees) is a ``KV_DOUBLE_FREE``:
  ref_cnt already 0, or a free on behalf of a request that no longer holds it while another
  does. Skipped: the null block (its ref_cnt is not maintained: ``free_blocks`` of 0.8 to
  0.10 decrements it, 0.11+ skips it) and blocks of another pool (0.33 forwards those; a
  block's ``pool`` is the pool in 0.33, a weak reference to it in 0.34: ``state.pool_of``).
  A prefix-cached block freed to ref 0 stays in the hash map: that is eviction-by-reuse, not a
  fault.
- ``touch(blocks)``: a prefix hit; a ref-0 block taken must be in the free queue
  (``KV_FREE_QUEUE``) and carry a hash (``KV_PREFIX_MAP``). 0.9-0.11 pass one list per KV
  cache group, 0.8 and 0.33 a flat list: both are read.
- ``get_new_blocks(n)``: the ``n`` blocks at the head of the free queue, about to be handed out
  (and evicted from the prefix cache if cached), must have ref_cnt 0 and not be the null block.
"""

from __future__ import annotations

import sys
from collections import Counter

from ..engine import state
from .books import Books
from .codes import KV_DOUBLE_FREE, KV_FREE_QUEUE, KV_PREFIX_MAP, KV_REFCOUNT, names
from .registry import IN_CALL, Check, add
from .checks import _req_ids


def _freeing_request(depth: int = 3) -> str | None:
    """The request on whose behalf a free happens: the nearest caller frame with a
    ``request_id`` local (``SingleTypeKVCacheManager.free``) or a ``request`` local
    (``KVCacheManager.free``, ``Scheduler._free_blocks``)."""
    f = sys._getframe(depth)
    for _ in range(12):
        if f is None:
            return None
        loc = f.f_locals
        rid = loc.get("request_id")
        if isinstance(rid, str):
            return rid
        req = loc.get("request")
        rid = getattr(req, "request_id", None)
        if isinstance(rid, str):
            return rid
        f = f.f_back
    return None


#: single-type manager methods that free a request's blocks first and put the null block in
#: their table slots right after (``MambaManager.remove_skipped_blocks`` up to 0.29:
#: ``block_pool.free_blocks([blocks[i]])`` then ``blocks[i] = self._null_block``)
RELEASING_METHODS = ("remove_skipped_blocks",)


def _releasing_holder(managers, depth: int = 3) -> tuple[int, str] | None:
    """``(group, request id)`` when the free happens inside one of :data:`RELEASING_METHODS`
    of KV cache group ``group``'s manager for that request: the table entries it frees are
    references being given back by their holder, not a free behind a holder's back. The
    end-of-step KV_REFCOUNT check still sees any entry the method then fails to null out."""
    f = sys._getframe(depth)
    for _ in range(6):
        if f is None:
            return None
        if f.f_code.co_name in RELEASING_METHODS:
            me = f.f_locals.get("self")
            rid = f.f_locals.get("request_id")
            for g, m in enumerate(managers):
                if m is me and isinstance(rid, str):
                    return g, rid
            return None
        f = f.f_back
    return None


def _flatten(blocks) -> list:
    out = []
    for x in blocks:
        if isinstance(x, (list, tuple)):
            out.extend(x)
        else:
            out.append(x)
    return out


class PoolHooks:
    """Installs and removes the wrappers on ``books.pool``.

    ``report(code, message, requests, blocks)`` is called for each finding; it may raise (the
    auditor's stop exception) to end the run right there, inside the call.
    """

    ENTRY_POINTS = ("free_blocks", "touch", "get_new_blocks")

    def __init__(self, books: Books, report):
        self.books = books
        self.report = report
        self.installed: list[str] = []
        self.calls: Counter = Counter()
        self.error: str | None = None  # the audit's own failure inside a hook (a lab bug)
        self.verified_frees = 0  # free_blocks calls whose every block was checked after it too

    def _guarded(self, check, *args) -> None:
        """Run a check inside a vLLM call: the auditor's stop exception passes; any other
        exception is the audit's own bug, which must never pass for a vLLM crash: it is kept in
        ``error`` (the auditor raises it as a lab error at its next check) and the hooks stop
        checking."""
        if self.error is not None:
            return None
        try:
            return check(*args)
        except Exception:  # noqa: BLE001 - reported as a lab error, not a crash of vLLM
            import traceback

            self.error = traceback.format_exc()[-3000:]

    def install(self) -> list[str]:
        pool = self.books.pool
        for name in self.ENTRY_POINTS:
            orig = getattr(pool, name, None)
            if orig is None or name in vars(pool):
                continue
            setattr(pool, name, getattr(self, f"_wrap_{name}")(orig))
            self.installed.append(name)
        return self.installed

    def uninstall(self) -> None:
        pool = self.books.pool
        for name in self.installed:
            vars(pool).pop(name, None)
        self.installed = []

    # ---- wrappers -----------------------------------------------------------------------
    def _wrap_free_blocks(self, orig):
        def free_blocks(ordered_blocks, *args, **kwargs):
            blocks = list(ordered_blocks)  # callers pass reversed() iterators: read once
            self.calls["free_blocks"] += 1
            if not blocks and self.error is None:
                # nothing to free (0.6-0.8 call it at every allocation with the blocks a
                # sliding window skipped, as a rule none): what check_free and check_freed
                # find for an empty list, without running them
                self.verified_frees += 1
                return orig(blocks, *args, **kwargs)
            freed = self._guarded(self.check_free, blocks)
            out = orig(blocks, *args, **kwargs)
            if freed is not None and self._guarded(self.check_freed, *freed):
                self.verified_frees += 1
            return out

        free_blocks.__wrapped__ = orig
        return free_blocks

    def _wrap_touch(self, orig):
        calls, guarded, check = self.calls, self._guarded, self.check_touch

        def touch(blocks, *args, **kwargs):
            if any(blocks):  # 0.9-0.11 touch one (often empty) list per group every allocation
                calls["touch"] += 1
                guarded(check, _flatten(blocks))
            if args or kwargs:
                return orig(blocks, *args, **kwargs)
            return orig(blocks)  # (a plain call: touch runs at every allocation)

        touch.__wrapped__ = orig
        return touch

    def _wrap_get_new_blocks(self, orig):
        def get_new_blocks(num_blocks, *args, **kwargs):
            self.calls["get_new_blocks"] += 1
            self._guarded(self.check_take, num_blocks)
            if args or kwargs:
                return orig(num_blocks, *args, **kwargs)
            return orig(num_blocks)

        get_new_blocks.__wrapped__ = orig
        return get_new_blocks

    # ---- checks -------------------------------------------------------------------------
    def check_free(self, blocks: list) -> None:
        """KV_DOUBLE_FREE before ``BlockPool.free_blocks`` decrements anything."""
        books = self.books
        pool = books.pool
        null = books.null
        freed: dict = {}  # block id -> times freed here (a plain dict: Counter's += is slower)
        objs = {}
        get = freed.get
        for b in blocks:
            if b is null or getattr(b, "is_null", False):
                continue
            owner = getattr(b, "pool", None)
            if owner is not None and owner is not pool and state.pool_of(owner) is not pool:
                continue
            bid = b.block_id
            freed[bid] = get(bid, 0) + 1
            objs[bid] = b
        if not freed:
            return objs, {}
        held = books.held_counts_of(freed)
        releasing = _releasing_holder(books.managers)
        if releasing is not None:
            g, rid = releasing
            for b in books.managers[g].req_to_blocks.get(rid, ()):
                if b.block_id in freed and held.get(b.block_id, 0) > 0:
                    held[b.block_id] -= 1
        bad = [bid for bid, k in freed.items() if objs[bid].ref_cnt - k < held.get(bid, 0)]
        if not bad:
            return objs, held
        who = books.holders_of(bad)
        rid = _freeing_request()
        for_whom = f" for {rid}" if rid else ""
        for bid in bad:
            r, k, holders = objs[bid].ref_cnt, freed[bid], who[bid]
            times = "" if k == 1 else f" {k} times"
            if r - k < 0:
                msg = (f"block {bid} freed{times}{for_whom} while its ref_cnt is {r} (held by "
                       f"{names(holders)}); expected a holder giving back a reference")
            else:
                msg = (f"block {bid} ref_cnt {r} freed{times}{for_whom} but still held by "
                       f"{names(holders)}: ref_cnt would drop to {r - k}, expected >= {len(holders)}")
            reqs = _req_ids(holders) + ([rid] if rid else [])
            self.report(KV_DOUBLE_FREE, msg, reqs, [bid])
        return None  # (keep going) the books are already known to be wrong

    def check_freed(self, objs: dict, held) -> bool:
        """Right after ``free_blocks``: every block it freed has ``ref_cnt`` == the references
        still held to it, and one at 0 is linked into the free queue. True when all agree (the
        pool then moved only as verified here); a disagreement is reported."""
        head = state.bare_free_head(self.books.pool)
        ok = True
        for bid, b in objs.items():
            r, h = b.ref_cnt, held.get(bid, 0)
            if r != h:
                ok = False
                who = self.books.holders_of([bid])[bid]
                self.report(KV_REFCOUNT, (
                    f"block {bid} ref_cnt {r} after free_blocks but held by {names(who)} "
                    f"(expected {h})"), _req_ids(who), [bid])
            elif r == 0 and b.prev_free_block is None and b is not head:
                ok = False
                self.report(KV_FREE_QUEUE, (
                    f"block {bid} reached ref_cnt 0 in free_blocks but is not in the free queue "
                    "(expected a freed block to be free)"), [], [bid])
        return ok

    def check_touch(self, blocks: list) -> None:
        """A prefix hit (``BlockPool.touch``) may only take a free block that is linked in the
        free queue and still carries its hash."""
        books = self.books
        null = books.null
        old_head = state.bare_free_head(books.pool)
        for b in blocks:
            if b is null or getattr(b, "is_null", False):
                continue
            r = b.ref_cnt
            if r < 0:
                self.report(KV_REFCOUNT, (
                    f"block {b.block_id} ref_cnt {r} is below 0 when touched for a prefix hit"),
                    [], [b.block_id])
                continue
            if books.caching and books.hash_books and books.hash_of(b) is None:
                self.report(KV_PREFIX_MAP, (
                    f"block {b.block_id} is touched as a prefix-cache hit but carries no hash "
                    f"(ref_cnt {r}; expected a cached block)"), [], [b.block_id])
            if r == 0 and b.prev_free_block is None and b is not old_head:
                self.report(KV_FREE_QUEUE, (
                    f"block {b.block_id} has ref_cnt 0 but is not in the free queue when "
                    f"touched for a prefix hit (expected a ref-0 cached block to be free)"),
                    [], [b.block_id])

    def check_take(self, num_blocks: int) -> None:
        """The blocks ``get_new_blocks(num_blocks)`` is about to pop from the free queue."""
        if num_blocks <= 0:
            return
        books = self.books
        cur, tail = state.free_queue_ends(books.pool)
        null = books.null
        bad = []
        for _ in range(num_blocks):
            if cur is None or cur is tail:
                break
            if cur is null or cur.ref_cnt != 0:
                bad.append(cur)
            cur = cur.next_free_block
        if not bad:
            return
        who = books.holders_of([b.block_id for b in bad])
        for b in bad:
            if b is null:
                msg = "get_new_blocks is about to hand out the null block (it is in the free queue)"
            else:
                msg = (f"block {b.block_id} is at the head of the free queue with ref_cnt "
                       f"{b.ref_cnt} (held by {names(who[b.block_id])}) and get_new_blocks is "
                       f"about to hand it out again; expected ref_cnt 0")
            self.report(KV_FREE_QUEUE, msg, _req_ids(who[b.block_id]), [b.block_id])


add(Check("block pool hooks", (KV_DOUBLE_FREE, KV_REFCOUNT, KV_FREE_QUEUE, KV_PREFIX_MAP),
          (IN_CALL,), ("scheduler", "engine-core"),
          "inside BlockPool.free_blocks / touch / get_new_blocks, before the release's method "
          "runs: no free below the references held, a prefix hit only on a queued, hashed ref-0 "
          "block, only ref-0 non-null blocks handed out"))
