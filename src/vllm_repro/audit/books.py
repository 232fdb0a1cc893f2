"""The audit's view of a scheduler's books: block pool, block tables, holders, queues.

Where each release keeps them is read by :mod:`vllm_repro.engine.state` (the one place that
probes live scheduler / KV cache state; each probe names the vLLM source it follows). Runs
inside release environments (standard library only).
"""

from __future__ import annotations

import dataclasses
import types
from collections import Counter
from itertools import chain, compress, filterfalse
from operator import attrgetter, is_, ne

from ..engine import state
from ..engine.state import WAITING_QUEUES  # noqa: F401 - re-exported

_ref = attrgetter("ref_cnt")
_bid = attrgetter("block_id")


def _no_hash(block) -> None:
    """A block's hash where the release's ``KVCacheBlock`` has no hash field the lab knows."""
    return None

#: waiting statuses under which a request may legitimately hold KV blocks (a KV connector's
#: async load, a paused streaming session)
HOLDING_WAIT_STATUSES = ("WAITING_FOR_REMOTE_KVS", "WAITING_FOR_STREAMING_REQ")


class Books:
    """The live books of one scheduler: block pool, block tables, holders, queues.

    ``scheduler``: a release's ``vllm.v1.core.sched.scheduler.Scheduler``; ``hash_field``: the
    ``KVCacheBlock`` field that stores a block's prefix-cache hash (the capabilities record's
    ``kv_block_hash``: ``_block_hash`` up to 0.33, ``block_hash`` in 0.34), None where the
    release has none the lab knows (every hash then reads None and the hash checks are off:
    :attr:`hash_books`); ``tokens_field``: the field with the prefix tokens the hash covers
    (``kv_block_hash_tokens``), None without partial-block hashing. Raises ``AttributeError``
    naming what is missing when the KV cache manager has no block pool.
    """

    def __init__(self, scheduler, hash_field: str | None = "_block_hash",
                 tokens_field: str | None = None):
        self.scheduler = scheduler
        self.hash_field = hash_field
        self.tokens_field = tokens_field
        #: a block's prefix-cache hash (None: not cached, or no hash field known)
        self.hash_of = attrgetter(hash_field) if hash_field else _no_hash
        #: the prefix tokens a block's hash covers (None where unknown)
        self.tokens_of = attrgetter(tokens_field) if tokens_field else _no_hash
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
        #: the pool's block ids, 0 .. num_blocks - 1
        self.all_ids = frozenset(range(self.num_blocks))
        #: the :class:`BlockMirror` while installed and exact (None: read the blocks)
        self.mirror: BlockMirror | None = None
        #: per KV cache group: (request id -> a copy of its table list, -> the copy's block ids)
        self._id_cache: list[tuple[dict[str, list], dict[str, list[int]]]] = []
        self._dense: list[int] = [0] * self.num_blocks
        self._foreign: Counter = Counter()
        self._extra_ids: list[int] | None = None
        self._touched: set[int] = set()  # ids whose held count moved since refcounts_agree
        self._mismatch: set[int] | None = None  # ids whose table count != ref_cnt then

    def install_mirror(self) -> str | None:
        """Keep ``ref_cnt`` and ``_block_hash`` of every block in lists as they are written
        (:class:`BlockMirror`); None when installed, else why not (the blocks are then read
        one by one at every check, as before)."""
        mirror = BlockMirror(self.blocks, self.hash_field)
        why = mirror.install()
        if why is None:
            self.mirror = mirror
        return why

    def uninstall_mirror(self) -> None:
        if self.mirror is not None:
            self.mirror.uninstall()
            self.mirror = None

    def _exact_mirror(self):
        m = self.mirror
        return m if m is not None and m.exact else None

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
        if self._exact_mirror() is None:
            seqs = [bl for t in self.tables() for bl in t.values()]
            seqs += [bl for _, bl in self.extra_holders()]
            self._extra_ids = None
            return list(map(_bid, chain.from_iterable(seqs)))
        seqs = self._table_ids()
        extra = [list(map(_bid, bl)) for _, bl in self.extra_holders()]
        self._extra_ids = list(chain.from_iterable(extra))
        return list(chain.from_iterable(seqs + extra))

    def held_key(self) -> "HeldIds":
        """:meth:`held_ids` as a :class:`HeldIds` (the id lists, not flattened), with the mirror
        exact; the list itself (in a :class:`HeldIds`) without."""
        if self._exact_mirror() is None:
            return HeldIds([], self.held_ids(), self.null_id)
        tables = self._table_ids()
        extra = list(chain.from_iterable(map(_bid, bl) for _, bl in self.extra_holders()))
        self._extra_ids = extra
        null = self.null_id
        nnull = 0 if null is None else (
            (self._dense[null] if 0 <= null < self.num_blocks else self._foreign.get(null, 0))
            + extra.count(null))
        return HeldIds(tables, extra, null, nnull)

    def _table_ids(self, seqs: bool = True) -> list[list[int]]:
        """The block ids of each table list, in table order, keeping :attr:`_dense` (references
        held by the tables, by block id) and :attr:`_foreign` (ids outside the pool) up to
        date. A table list equal, element by element (identity first), to its copy at the last
        read holds the same block ids (block ids are never written while the mirror is exact):
        only the lists that changed are read block by block, only their ids counted again.

        Per KV cache group the last read is kept as two dicts by request id (a copy of its
        table list, its block ids), updated in place for the lists that changed and the
        requests gone. A group whose tables equal the copies (one C-level dict comparison: the
        same requests, every list equal to its copy) is done; otherwise the lists that differ
        from their copy are found for all requests at once with C-level ``map``, and only they
        (and the requests gone) go through the Python loop. Whether a list is the same object
        does not matter: only its content is counted. ``seqs`` False: the counts only (an
        empty list)."""
        cache = self._id_cache
        if len(cache) != len(self.managers):
            cache = self._id_cache = [({}, {}) for _ in self.managers]
        dense, foreign, n = self._dense, self._foreign, self.num_blocks
        touched = self._touched

        def count(ids, k):
            for i in ids:
                if 0 <= i < n:
                    dense[i] += k
                    touched.add(i)
                else:
                    foreign[i] += k
                    if not foreign[i]:
                        del foreign[i]

        def drop_gone(t, cpy, idl):  # the requests whose table is gone: their ids uncounted
            for rid in list(filterfalse(t.__contains__, cpy)):
                count(idl.pop(rid), -1)
                del cpy[rid]

        want, seqs = seqs, []
        for t, (cpy, idl) in zip(self.tables(), cache):
            if len(cpy) > len(t):  # (a free pops the table before free_blocks: first, then)
                drop_gone(t, cpy, idl)
            if t == cpy:
                # every list equal to its copy, and the same requests (at C speed: the rule
                # between two pool calls that changed no table)
                if want:
                    seqs += map(idl.__getitem__, t)
                continue
            rids = list(t)
            bls = list(t.values())
            # per list: whether it differs from its copy (None for a new request)
            for rid, bl in compress(zip(rids, bls), map(ne, map(cpy.get, rids), bls)):
                c1 = cpy.get(rid)
                if c1 is not None:
                    m = len(c1)
                    if m < len(bl) and bl[:m] == c1:  # blocks appended
                        more = list(map(_bid, bl[m:]))
                        count(more, 1)
                        cpy[rid] = list(bl)
                        idl[rid] = idl[rid] + more  # (a new list: HeldIds keep the old one)
                        continue
                    count(idl[rid], -1)
                ids = list(map(_bid, bl))
                count(ids, 1)
                cpy[rid] = list(bl)
                idl[rid] = ids
            if len(cpy) != len(rids):  # (every id in rids is a key now) tables gone
                drop_gone(t, cpy, idl)
            if want:
                seqs += map(idl.__getitem__, rids)
        return seqs

    def refcounts_agree(self) -> bool:
        """After :meth:`held_ids`, with the mirror exact: whether every non-null block's
        ``ref_cnt`` equals the references held to it and no held id is outside the pool, i.e.
        whether :func:`~vllm_repro.audit.checks.check_refcounts` finds nothing. Only the blocks
        whose ref count or held count moved since the last call are compared again (a set of
        the disagreeing ones is kept). False also without an exact mirror."""
        m = self._exact_mirror()
        if m is None or self._extra_ids is None:
            return False
        refs, dense, bad = m.refs, self._dense, self._mismatch
        if bad is None:  # the first look: every block
            moved = range(self.num_blocks)
            bad = self._mismatch = set()
        else:
            moved = self._touched | m.pend
        self._touched, m.pend = set(), set()
        for i in moved:
            if dense[i] != refs[i]:
                bad.add(i)
            else:
                bad.discard(i)
        if self._foreign:
            return False
        n, null = self.num_blocks, self.null_id
        extra = Counter(self._extra_ids) if self._extra_ids else {}
        for i in bad | extra.keys():
            if i == null:
                continue
            if not (0 <= i < n) or refs[i] != dense[i] + extra.get(i, 0):
                return False
        return True

    def held_counts(self) -> Counter:
        """block id -> number of references held (all tables of all groups + extra holders).
        The null block is counted too; callers ignore it (its ref_cnt is not maintained)."""
        return Counter(self.held_ids())

    def held_counts_of(self, block_ids) -> dict[int, int]:
        """block id -> references held, for ``block_ids`` only (ids held by no one included,
        as 0); the same counts as :meth:`held_counts`."""
        if self._exact_mirror() is None:
            self._extra_ids = None
            c = Counter(self.held_ids())
            return {b: c.get(b, 0) for b in block_ids}
        self._table_ids(seqs=False)  # the counts, without the list of ids
        self._extra_ids = list(chain.from_iterable(
            map(_bid, bl) for _, bl in self.extra_holders()))
        dense, foreign, n = self._dense, self._foreign, self.num_blocks
        extra = Counter(self._extra_ids) if self._extra_ids else {}
        return {b: (dense[b] if 0 <= b < n else foreign.get(b, 0)) + extra.get(b, 0)
                for b in block_ids}

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
        m = self._exact_mirror()
        return list(m.refs) if m is not None else list(map(_ref, self.blocks))

    @property
    def hash_books(self) -> bool:
        """Whether blocks' hashes can be read (the KV hash checks run only then)."""
        return self.hash_field is not None

    def hashes(self) -> list:
        """Every block's hash (:attr:`hash_field`; None: not cached), indexed by block id."""
        m = self._exact_mirror()
        return list(m.hashes) if m is not None else list(map(self.hash_of, self.blocks))

    # ---- free queue ------------------------------------------------------------------------
    def free_list(self, ids: list | None = None) -> tuple[list, bool]:
        """The blocks linked in the free queue, head first, and whether the walk ended
        properly (False: a cycle, or more links than blocks); ``ids``: a list to append their
        block ids to (read in the same walk)."""
        return state.free_list(self.pool, self.num_blocks, ids)

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


class HeldIds:
    """The block ids of every reference held, in table order (:meth:`Books.held_ids`), kept as
    the table lists' id lists (``tables``; never mutated once made) and the extra holders' ids
    (``extra``), so that the auditor's "did the tables move" comparison need not build the
    flat list: equal to another :class:`HeldIds` (or a flat list) exactly when the flat lists
    are equal. ``refs_held``: the references to blocks other than the null block."""

    __slots__ = ("tables", "extra", "total", "refs_held", "_flat")

    def __init__(self, tables: list[list[int]], extra: list[int], null: int | None,
                 nnull: int | None = None):
        self.tables = tables
        self.extra = extra
        self._flat: list[int] | None = None if tables else extra
        self.total = sum(map(len, tables)) + len(extra)
        if nnull is None:
            nnull = 0 if null is None else self.flat().count(null)
        self.refs_held = self.total - nnull

    def flat(self) -> list[int]:
        """The flat list (:meth:`Books.held_ids`)."""
        if self._flat is None:
            self._flat = list(chain.from_iterable(self.tables)) + self.extra
        return self._flat

    def __len__(self) -> int:
        return self.total

    def __eq__(self, other) -> bool:
        if isinstance(other, HeldIds):
            a, b = self.tables, other.tables
            if len(a) == len(b) and all(map(is_, a, b)):  # the same id lists: compare the rest
                return self.extra == other.extra
            return self.total == other.total and self.flat() == other.flat()
        if isinstance(other, list):
            return self.total == len(other) and self.flat() == other
        return NotImplemented

    __hash__ = None


class BlockMirror:
    """``ref_cnt`` and the hash (``hash_field``: ``_block_hash``, ``block_hash`` in 0.34) of
    every block of a pool, kept as they are written: each
    block's class is swapped, for the run, for a subclass of the release's ``KVCacheBlock``
    (same name, fields, methods and equality) whose ``ref_cnt`` and ``_block_hash`` are data
    descriptors that also store those two fields into ``refs`` / ``hashes`` by block id (see
    :meth:`_subclass`; a block with an instance dict also gets a copy of it, the same fields,
    so that reads of the other fields specialize). Any write by any code goes through them, so
    the lists equal what reading every block gives (what the audit did at every check before),
    at the cost of a Python call per write instead of a read of every block per check.

    Also kept as they are written: ``ref_old`` / ``hash_old`` (block id -> its value at the
    last :meth:`take`, for the blocks written since), ``pend`` (ids whose ref count was written
    since :meth:`Books.refcounts_agree` last looked), ``nzero`` (blocks with ``ref_cnt`` 0),
    ``nhashed`` (blocks with a hash) and ``nhashed_held`` (those with ``ref_cnt`` != 0).

    ``exact`` turns False for good (the auditor then reads the blocks again) if a block's
    ``block_id`` is written or an attribute deleted. The class itself is never patched;
    :meth:`uninstall` gives every block its class back.
    """

    def __init__(self, blocks: list, hash_field: str | None = "_block_hash"):
        self.blocks = blocks
        #: the hash field tracked (None: only ref counts; every hash stays None)
        self.hash_field = hash_field
        self.refs: list[int] = []
        self.hashes: list = []
        self.ref_old: dict[int, int] = {}
        self.hash_old: dict[int, object] = {}
        self.pend: set[int] = set()
        self.nzero = self.nhashed = self.nhashed_held = 0
        self.exact = False
        self.base: type | None = None

    def install(self) -> str | None:
        """Swap the blocks' class; None on success, else why not (nothing is changed)."""
        blocks = self.blocks
        if not blocks:
            return "no blocks"
        base = type(blocks[0])
        if any(type(b) is not base for b in blocks):
            return "blocks of more than one class"
        if any(b.block_id != i for i, b in enumerate(blocks)):
            return "block ids are not their positions in the pool"
        try:
            self.refs = list(map(_ref, blocks))
            self.hashes = (list(map(attrgetter(self.hash_field), blocks)) if self.hash_field
                           else [None] * len(blocks))
        except AttributeError as exc:
            return f"a block has no {exc.name or 'ref_cnt/' + str(self.hash_field)}"
        self.nzero = self.refs.count(0)
        self.nhashed = len(list(filter(None, self.hashes)))
        self.nhashed_held = len(list(filter(None, compress(self.hashes, self.refs))))
        tracked = self._subclass(base)
        if isinstance(tracked, str):
            return tracked
        done = []
        try:
            for b in blocks:
                b.__class__ = tracked
                done.append(b)
                if hasattr(b, "__dict__"):
                    # a dict of its own, the same fields: an instance made by the release's
                    # class keeps that class's shared keys, which the tracked class's attribute
                    # reads cannot specialize on, so every read of a field (vLLM's, the free
                    # queue walk's) went the slow way; 30 ms of 200 of the audit a 0.10.1.1
                    # stress run, measured side by side in one process
                    b.__dict__ = dict(b.__dict__)
        except TypeError as exc:  # a layout that does not allow it
            for b in done:
                b.__class__ = base
            return f"cannot swap {base.__name__}'s class: {exc}"
        self.base = base
        self.exact = True
        return None

    def uninstall(self) -> None:
        if self.base is None:
            return
        base, self.base, self.exact = self.base, None, False
        for b in self.blocks:
            if type(b) is not base:
                b.__class__ = base

    def take(self) -> None:
        """Start ``ref_old`` / ``hash_old`` afresh (the books as they are now are the base)."""
        self.ref_old = {}
        self.hash_old = {}

    def refs_moved(self) -> bool:
        """Whether a ref count differs from its value at the last :meth:`take`."""
        refs = self.refs
        for i, o in self.ref_old.items():
            if refs[i] != o:
                return True
        return False

    def hashes_moved(self) -> bool:
        """Whether a hash differs (``!=``, identity first) from its value at the last take."""
        hashes = self.hashes
        for i, o in self.hash_old.items():
            h = hashes[i]
            if h is not o and h != o:
                return True
        return False

    def _on_ref(self, i: int, v) -> None:
        refs = self.refs
        old = refs[i]
        if i not in self.ref_old:
            self.ref_old[i] = old
        self.pend.add(i)
        refs[i] = v
        if (old == 0) != (v == 0):
            self.nzero += 1 if v == 0 else -1
        if self.hashes[i] and bool(old) != bool(v):
            self.nhashed_held += 1 if v else -1

    def _on_hash(self, i: int, v) -> None:
        hashes = self.hashes
        old = hashes[i]
        if i not in self.hash_old:
            self.hash_old[i] = old
        hashes[i] = v
        if bool(old) != bool(v):
            k = 1 if v else -1
            self.nhashed += k
            if self.refs[i]:
                self.nhashed_held += k

    def _subclass(self, base: type) -> type | str:
        """The tracked subclass of ``base``, or why there is none: ``ref_cnt`` and
        ``_block_hash`` become data descriptors that store as the release's class does (the
        slot's member descriptor, or the instance dict) and then update the mirror; writing
        ``block_id`` makes the mirror inexact. Reads and other fields are untouched (a slot's
        own getter; an instance dict wins over a descriptor without ``__get__``)."""
        ns: dict = {}
        tracked = [("ref_cnt", self._on_ref), ("block_id", None)]
        if self.hash_field:
            tracked.insert(1, (self.hash_field, self._on_hash))
        for name, on in tracked:
            md = next((vars(k)[name] for k in base.__mro__ if name in vars(k)), None)
            if isinstance(md, types.MemberDescriptorType):  # __slots__ (0.33's dataclass)
                ns[name] = self._slot_field(md, on)
            elif md is None or not hasattr(type(md), "__set__"):  # the instance dict
                ns[name] = self._dict_field(name, on)
            else:
                return f"{base.__name__}.{name} is a {type(md).__name__}"
        ns.update({"__slots__": (), "__module__": base.__module__,
                   "__qualname__": base.__qualname__, "__doc__": base.__doc__})
        params = getattr(base, "__dataclass_params__", None)
        if params is not None and params.eq and "__eq__" in vars(base):
            # the dataclass __eq__ compares only instances of exactly one class: keep a tracked
            # block equal to an untracked one (another pool's) with the same fields
            keys = tuple(f.name for f in dataclasses.fields(base) if f.compare)
            # (the fields read at C speed: releases that compare blocks do it in pool calls)
            fields = attrgetter(*keys) if keys else (lambda obj: ())

            def __eq__(self, other):
                if isinstance(other, base):
                    return fields(self) == fields(other)
                return NotImplemented

            ns["__eq__"] = __eq__
            ns["__hash__"] = vars(base).get("__hash__")
        return type(base.__name__, (base,), ns)

    def _slot_field(self, md, on):
        get, set_, del_ = md.__get__, md.__set__, md.__delete__
        mirror, blocks, n = self, self.blocks, len(self.blocks)

        if on is None:
            def fset(obj, value):
                set_(obj, value)
                mirror.exact = False
        else:
            def fset(obj, value):
                set_(obj, value)
                i = obj.block_id
                if type(i) is int and 0 <= i < n and blocks[i] is obj:
                    on(i, value)

        def fdel(obj):
            del_(obj)
            mirror.exact = False

        return property(get, fset, fdel)

    def _dict_field(self, name: str, on):
        mirror, blocks, n = self, self.blocks, len(self.blocks)
        refs, hashes = self.refs, self.hashes  # (made by install() before this, never replaced)

        if on is None:
            def __set__(self, obj, value):
                obj.__dict__[name] = value
                mirror.exact = False
        elif on == mirror._on_ref:
            def __set__(self, obj, value):
                d = obj.__dict__
                d[name] = value
                i = d.get("block_id", -1)
                if type(i) is int and 0 <= i < n and blocks[i] is obj:
                    # BlockMirror._on_ref inline: a write of ref_cnt is in every pool call
                    old = refs[i]
                    ref_old = mirror.ref_old
                    if i not in ref_old:
                        ref_old[i] = old
                    mirror.pend.add(i)
                    refs[i] = value
                    if (old == 0) != (value == 0):
                        mirror.nzero += 1 if value == 0 else -1
                    if hashes[i] and bool(old) != bool(value):
                        mirror.nhashed_held += 1 if value else -1
        elif on == mirror._on_hash:
            def __set__(self, obj, value):
                d = obj.__dict__
                d[name] = value
                i = d.get("block_id", -1)
                if type(i) is int and 0 <= i < n and blocks[i] is obj:
                    # BlockMirror._on_hash inline
                    old = hashes[i]
                    hash_old = mirror.hash_old
                    if i not in hash_old:
                        hash_old[i] = old
                    hashes[i] = value
                    if bool(old) != bool(value):
                        k = 1 if value else -1
                        mirror.nhashed += k
                        if refs[i]:
                            mirror.nhashed_held += k
        else:
            def __set__(self, obj, value):
                d = obj.__dict__
                d[name] = value
                i = d.get("block_id", -1)
                if type(i) is int and 0 <= i < n and blocks[i] is obj:
                    on(i, value)

        def __delete__(self, obj):
            del obj.__dict__[name]
            mirror.exact = False

        # no __get__: the instance dict wins on reads, at no cost
        return type(f"tracked_{name}", (), {"__slots__": (), "__set__": __set__,
                                            "__delete__": __delete__})()
