"""The audit's reader of ``BlockSpaceManagerV1``'s books (``level: v0-engine``).

``vllm/core/block_manager_v1.py`` (0.4.0 to 0.6.2: the V0 scheduler's default block manager
while ``use_v2_block_manager`` defaulted to false; 0.6.3 made v2 the default and removed it) keeps
its books as Python objects, not ids:

- ``block_tables``: sequence id -> its ``BlockTable`` (0.5.0 on: ``vllm/block.py:BlockTable``,
  a list of ``PhysicalTokenBlock`` with ``list()``; before, a plain ``List[PhysicalTokenBlock]``);
  ``cross_block_tables`` (0.5.0 on): request id -> the encoder's table of an encoder-decoder
  group;
- ``gpu_allocator`` / ``cpu_allocator``: ``UncachedBlockAllocator`` (``free_blocks``: the list
  of free ``PhysicalTokenBlock`` objects, ``num_blocks``) or, with prefix caching,
  ``CachedBlockAllocator`` (``cached_blocks``: hash -> held block, ``evictor.free_table``:
  hash -> ref-0 cached block, ``current_num_blocks``: blocks created so far, lazily);
- ``PhysicalTokenBlock``: ``device`` (``Device.GPU`` / ``Device.CPU``), ``block_number`` (per
  device: GPU and CPU numbers overlap), ``ref_count``, ``block_hash``;
- ``block_sliding_window``: with a sliding window a table reuses its first blocks
  (``append_slots``: ``block_table[len % window]``) and holds one reference per table, not per
  entry (``_allocate_sequence`` sets ``ref_count`` to the group's sequences, ``fork`` increments
  ``set(table)``, ``_free_block_table`` frees ``set(table[-window:])``).

What the allocators hold, found by probing their attributes (no version checks): a pool whose
allocator has neither shape is named in :attr:`V1Books.unread` and its books are not read.

The invariants (codes as at the v2 reader, :mod:`vllm_repro.audit.v0`): each block's
``ref_count`` equals the block tables referencing it (``KV_REFCOUNT``; an ``n > 1`` group's
sequences each hold the shared prompt blocks, ``fork`` adds one, copy-on-write in
``append_slots`` moves one); a free block (on the free list, or in the evictor) has ref count 0
and is in no table, a block is never free twice, never two objects of one number, never
neither free nor held, and free + used = ``num_blocks`` per device (``KV_FREE_QUEUE``); with
prefix caching every held block is ``cached_blocks[block.block_hash]`` and every evictor entry
is keyed by its block's hash (``KV_PREFIX_MAP``). Swapped requests holding GPU blocks and tables
no queue holds are :func:`vllm_repro.audit.v0.check_queues`' (``KV_LEAK``), through
:meth:`V1Books.gpu_blocks_of`.

Runs inside release environments: standard library + the release's own objects.
"""

from __future__ import annotations

from collections import Counter

from ..records import Violation
from .codes import KV_FREE_QUEUE, KV_PREFIX_MAP, KV_REFCOUNT, make_violation, names
from .v0_queues import async_stopped_of, queues_of


def device_name(obj) -> str:
    """``GPU`` / ``CPU`` from a block's or allocator's ``device`` (``vllm/utils.py:Device``)."""
    dev = getattr(obj, "device", None)
    return str(getattr(dev, "name", dev))


def blocks_in(table) -> list:
    """The ``PhysicalTokenBlock`` objects of one table, in order (``BlockTable.list()`` from
    0.5.0, else the table is the list)."""
    lister = getattr(table, "list", None)
    return list(lister() if callable(lister) else table)


def allocator_kind(allocator) -> str | None:
    """``"uncached"`` (a ``free_blocks`` list), ``"cached"`` (``cached_blocks`` and an evictor
    with a ``free_table``), or ``None`` (a shape this reader does not know)."""
    if allocator is None:
        return None
    if isinstance(getattr(allocator, "free_blocks", None), list):
        return "uncached"
    if isinstance(getattr(allocator, "cached_blocks", None), dict) and isinstance(
            getattr(getattr(allocator, "evictor", None), "free_table", None), dict):
        return "cached"
    return None


def is_block_manager_v1(bm) -> bool:
    """Whether ``bm`` keeps ``BlockSpaceManagerV1``'s books (by attributes)."""
    return (isinstance(getattr(bm, "block_tables", None), dict)
            and hasattr(bm, "gpu_allocator") and hasattr(bm, "cpu_allocator"))


class V1Books:
    """Reads ``BlockSpaceManagerV1``'s books of one scheduler (see the module docstring).
    ``readable``: at least the GPU pool's allocator has a known shape; ``unread``: the parts
    not read (``BlockSpaceManagerV1.cpu_allocator (SomeAllocator)``)."""

    kind = "BlockSpaceManagerV1"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        bm = scheduler.block_manager
        self.bm = bm
        self.window = getattr(bm, "block_sliding_window", None)
        self.allocators: dict[str, object] = {}
        self.kinds: dict[str, str] = {}
        self.unread: list[str] = []
        for attr in ("gpu_allocator", "cpu_allocator"):
            allocator = getattr(bm, attr, None)
            kind = allocator_kind(allocator)
            if kind is None:
                self.unread.append(f"{type(bm).__name__}.{attr} ({type(allocator).__name__})")
                continue
            name = device_name(allocator) if hasattr(allocator, "device") else attr[:3].upper()
            self.allocators[name] = allocator
            self.kinds[name] = kind
        self.readable = "GPU" in self.allocators

    def queues(self) -> dict[str, list]:
        return queues_of(self.scheduler)

    def async_stopped(self) -> list:
        return async_stopped_of(self.scheduler)

    # ---- tables ------------------------------------------------------------------------------
    def table_objects(self) -> dict[int, list]:
        """sequence id -> its ``PhysicalTokenBlock`` objects, in order."""
        return {seq_id: blocks_in(t) for seq_id, t in dict(self.bm.block_tables).items()}

    def cross_objects(self) -> dict[str, list]:
        """request id -> the blocks of its cross-attention table (encoder-decoder groups)."""
        return {rid: blocks_in(t) for rid, t in
                dict(getattr(self.bm, "cross_block_tables", None) or {}).items()}

    def tables(self) -> dict[int, list[int]]:
        """sequence id -> its block numbers (GPU and CPU numbers overlap: see
        :meth:`gpu_blocks_of`)."""
        return {seq_id: [b.block_number for b in blocks]
                for seq_id, blocks in self.table_objects().items()}

    def gpu_blocks_of(self, seq_id: int) -> list[int]:
        """The GPU block numbers in sequence ``seq_id``'s table."""
        table = dict(self.bm.block_tables).get(seq_id)
        if table is None:
            return []
        return [b.block_number for b in blocks_in(table) if device_name(b) == "GPU"]

    # ---- pools -------------------------------------------------------------------------------
    def num_blocks(self, device: str) -> int:
        allocator = self.allocators[device]
        return int(getattr(allocator, "num_blocks", 0) or 0)

    def free_objects(self, device: str) -> list:
        """The free blocks of ``device`` as the allocator keeps them: the free list, or the
        evictor's ref-0 cached blocks (a ``CachedBlockAllocator`` creates the others lazily)."""
        allocator = self.allocators[device]
        if self.kinds[device] == "uncached":
            return list(allocator.free_blocks)
        return list(allocator.evictor.free_table.values())

    def num_free(self, device: str) -> int:
        """What ``get_num_free_blocks`` would answer, from the books: the free list's length,
        or ``num_blocks - current_num_blocks + evictor.num_blocks``."""
        allocator = self.allocators[device]
        if self.kinds[device] == "uncached":
            return len(allocator.free_blocks)
        created = int(getattr(allocator, "current_num_blocks", 0) or 0)
        return self.num_blocks(device) - created + len(allocator.evictor.free_table)

    def gpu_total(self) -> int:
        return self.num_blocks("GPU") if "GPU" in self.allocators else 0


def _holders(books: V1Books, req_of_seq: dict[int, str]) -> tuple[dict[int, list[str]], dict]:
    """``(id(block) -> the holders of one reference each, id(block) -> block)`` over every
    table: one reference per table with a sliding window (its entries repeat), else one per
    entry."""
    holders: dict[int, list[str]] = {}
    objs: dict[int, object] = {}

    def add(blocks, who):
        seen = set()
        for b in blocks:
            if books.window is not None and id(b) in seen:
                continue
            seen.add(id(b))
            holders.setdefault(id(b), []).append(who)
            objs[id(b)] = b

    for seq_id, blocks in books.table_objects().items():
        add(blocks, req_of_seq.get(seq_id, f"seq {seq_id}"))
    for rid, blocks in books.cross_objects().items():
        add(blocks, f"{rid} (cross-attention)")
    return holders, objs


def check_books_v1(books: V1Books, req_of_seq: dict[int, str]) -> list[Violation]:
    """The block-table / ref-count / free-list / prefix-cache checks of one moment over
    ``BlockSpaceManagerV1``'s books (module docstring). ``req_of_seq``: sequence id -> request
    id of the live sequences.

    Cost: per-block Python work only for held and cached blocks; the free pools (the CPU pool
    alone is thousands of blocks with the default ``swap_space``) are read with C-level
    ``map`` / ``set`` operations, and looked at block by block only where one of them disagrees.
    """
    found: list[Violation] = []
    holders, held_objs = _holders(books, req_of_seq)
    for device in books.allocators:
        found += _check_pool(books, device, holders, held_objs)
    return found


def _check_pool(books: V1Books, device: str, holders: dict[int, list[str]],
                held_objs: dict[int, object]) -> list[Violation]:
    found: list[Violation] = []
    allocator = books.allocators[device]
    cached = books.kinds[device] == "cached"
    where = "in the evictor" if cached else "on the free list"
    free = books.free_objects(device)
    free_ids = set(map(id, free))
    held = {i: b for i, b in held_objs.items() if device_name(b) == device}
    hash_map = dict(allocator.cached_blocks) if cached else {}
    # the blocks looked at one by one: held, cached (ref > 0 by the books), and free ones that
    # are held, have a ref count, or are on the list twice
    look = dict(held)
    look.update((id(b), b) for b in hash_map.values())
    if len(free_ids) != len(free):
        dup = sorted({b.block_number for b, n in Counter(free).items() if n > 1})
        found.append(make_violation(KV_FREE_QUEUE, f"{device} {where} holds block(s) {dup} "
                                    "twice", blocks=dup))
    if any(map(_ref_count, free)) or not free_ids.isdisjoint(held):
        look.update((id(b), b) for b in free if _ref_count(b) or id(b) in held)
    for i, b in sorted(look.items(), key=lambda kv: kv[1].block_number):
        n = b.block_number
        who = holders.get(i, [])
        rc = _ref_count(b)
        if rc != len(who):
            found.append(make_violation(
                KV_REFCOUNT, f"{device} block {n} ref count {rc} but held by {names(who)} "
                f"(expected {len(who)})", requests=_rids(who), blocks=[n]))
        if i in free_ids and (rc or who):
            found.append(make_violation(
                KV_FREE_QUEUE, f"{device} block {n} is {where} with ref count {rc}, held by "
                f"{names(who)}", requests=_rids(who), blocks=[n]))
        if rc == 0 and not who and i not in free_ids:
            found.append(make_violation(
                KV_FREE_QUEUE, f"{device} block {n} has ref count 0 and no holder but is not "
                f"{where} (lost)", blocks=[n]))
        if cached and who:
            mapped = hash_map.get(b.block_hash)
            if mapped is not b:
                other = "nothing" if mapped is None else f"block {mapped.block_number}"
                found.append(make_violation(
                    KV_PREFIX_MAP, f"{device} block {n} is held by {names(who)} but "
                    f"cached_blocks maps its hash {b.block_hash} to {other} (expected the "
                    "block itself)", requests=_rids(who), blocks=[n]))
    # one object per block number, and (uncached: every block exists from the start) each
    # number free or held
    free_numbers = set(map(_block_number, free))
    known = {id(b): b for b in look.values() if id(b) not in free_ids}
    numbers = free_numbers | {b.block_number for b in known.values()}
    if len(numbers) != len(free_ids) + len(known):
        by_number: dict[int, list] = {}
        for b in [*{id(x): x for x in free}.values(), *known.values()]:
            by_number.setdefault(b.block_number, []).append(b)
        for number, objs in sorted(by_number.items()):
            if len(objs) > 1:
                found.append(make_violation(
                    KV_FREE_QUEUE, f"{device} block {number} exists as {len(objs)} "
                    "PhysicalTokenBlock objects (expected one per block number)",
                    blocks=[number]))
    total = books.num_blocks(device)
    if not cached and len(numbers) != total:
        missing = sorted(set(range(total)) - numbers)
        if missing:
            found.append(make_violation(
                KV_FREE_QUEUE, f"{device} block(s) {missing[:8]} neither free nor held "
                "(lost: not on the free list, in no block table)", blocks=missing[:8]))
    if cached:
        for h, b in hash_map.items():
            if b.block_hash != h:
                found.append(make_violation(
                    KV_PREFIX_MAP, f"{device} cached_blocks maps hash {h} to block "
                    f"{b.block_number}, whose hash is {b.block_hash}", blocks=[b.block_number]))
        for h, b in dict(allocator.evictor.free_table).items():
            if b.block_hash != h:
                found.append(make_violation(
                    KV_PREFIX_MAP, f"{device} evictor keys block {b.block_number} by hash "
                    f"{h}, but its hash is {b.block_hash}", blocks=[b.block_number]))
            if h in hash_map:
                found.append(make_violation(
                    KV_PREFIX_MAP, f"{device} hash {h} is both cached (block "
                    f"{hash_map[h].block_number}) and in the evictor (block {b.block_number})",
                    blocks=[b.block_number, hash_map[h].block_number]))
    used = sum(1 for b in look.values() if _ref_count(b) > 0)  # every block with a ref count
    n_free = books.num_free(device)
    if used + n_free != total:
        found.append(make_violation(
            KV_FREE_QUEUE, f"{device}: free {n_free} + used {used} != {total} blocks in the "
            "pool"))
    return found


def _ref_count(b) -> int:
    return int(getattr(b, "ref_count", 0) or 0)


def _block_number(b) -> int:
    return b.block_number


def _rids(held: list[str]) -> list[str]:
    """Request ids of holders (a cross-attention holder counts for its request)."""
    return [h.split(" (", 1)[0] for h in held if not h.startswith("seq ")]
