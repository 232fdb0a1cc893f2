"""The audit's block mirror (no vLLM release): ref counts and hashes kept as they are written
equal what reading every block gives, whoever writes them; a tracked block behaves as the
release's (name, repr, equality); the blocks get their class back at the end."""

from __future__ import annotations

import dataclasses
from itertools import compress

import pytest

from vllm_repro.audit import checks
from vllm_repro.audit.books import BlockMirror

from .fakes import make_books


@dataclasses.dataclass
class DictBlock:  # 0.8-0.32: a plain dataclass (fields in the instance dict)
    block_id: int
    ref_cnt: int = 0
    _block_hash: object = None
    prev_free_block: object = None
    next_free_block: object = None


@dataclasses.dataclass(slots=True)
class SlotBlock:  # 0.33: dataclass(slots=True)
    block_id: int
    ref_cnt: int = 0
    _block_hash: object = None
    prev_free_block: object = None
    next_free_block: object = None


def read(blocks):
    refs = [b.ref_cnt for b in blocks]
    hashes = [b._block_hash for b in blocks]
    return refs, hashes


@pytest.mark.parametrize("cls", [DictBlock, SlotBlock])
def test_the_mirror_follows_every_write_and_gives_the_class_back(cls):
    blocks = [cls(i) for i in range(6)]
    blocks[1].ref_cnt = 2
    blocks[1]._block_hash = b"h1"
    other = cls(3)  # another pool's block with the same fields
    m = BlockMirror(blocks)
    assert m.install() is None
    assert type(blocks[0]).__name__ == cls.__name__ and type(blocks[0]) is not cls
    assert repr(blocks[3]) == repr(other) and blocks[3] == other and other == blocks[3]
    assert blocks[3] != cls(4)
    m.take()
    for b, r, h in [(2, 1, None), (1, 0, None), (4, 3, b"h4"), (2, 0, b"h2"), (5, -1, None)]:
        blocks[b].ref_cnt = r
        blocks[b]._block_hash = h
        blocks[b].prev_free_block = blocks[0]  # an untracked field: no cost, no effect
    blocks[4].ref_cnt = blocks[4].ref_cnt + 1
    refs, hashes = read(blocks)
    assert (m.refs, m.hashes) == (refs, hashes)
    assert m.nzero == refs.count(0)
    assert m.nhashed == len(list(filter(None, hashes)))
    assert m.nhashed_held == len(list(filter(None, compress(hashes, refs))))
    assert set(m.ref_old) == {1, 2, 4, 5} and m.ref_old[1] == 2 and m.ref_old[4] == 0
    assert m.refs_moved() and m.hashes_moved()
    blocks[5].ref_cnt = 0  # back to its value at take(): not moved
    blocks[2].ref_cnt, blocks[2]._block_hash = 0, None
    blocks[1].ref_cnt, blocks[1]._block_hash = 2, b"h1"
    blocks[4].ref_cnt, blocks[4]._block_hash = 0, None
    assert not m.refs_moved() and not m.hashes_moved()
    other.ref_cnt = 9  # not one of the pool's blocks
    assert m.refs[3] == 0
    assert m.exact
    m.uninstall()
    assert all(type(b) is cls for b in blocks)


@pytest.mark.parametrize("cls", [DictBlock, SlotBlock])
def test_writing_a_block_id_makes_the_mirror_inexact(cls):
    blocks = [cls(i) for i in range(3)]
    m = BlockMirror(blocks)
    assert m.install() is None
    blocks[1].block_id = 7
    assert not m.exact


def test_blocks_whose_ids_are_not_their_positions_are_read_one_by_one():
    m = BlockMirror([DictBlock(1), DictBlock(0)])
    assert "positions" in m.install()
    assert not m.exact and type(m.blocks[0]) is DictBlock


@pytest.mark.parametrize("layout", ["coordinator", "single", "manager", "list"])
def test_the_books_counts_from_the_mirror_agree_with_a_full_read(layout):
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1, 2], "B": [3]}, layout=layout)
    why = books.install_mirror()
    if why is not None:  # the fakes are plain classes: the mirror takes them as dataclasses do
        pytest.skip(why)
    ids = books.held_ids()
    assert books.refcounts_agree() == (checks.check_refcounts(books, books.refs(), ids) == [])
    table = books.tables()[0]
    blk = books.blocks
    table["A"].append(blk[4])  # held without a ref count: KV_REFCOUNT
    ids = books.held_ids()
    assert not books.refcounts_agree()
    assert checks.check_refcounts(books, books.refs(), ids)
    blk[4].ref_cnt += 1  # now it agrees again
    ids = books.held_ids()
    assert books.refcounts_agree() and checks.check_refcounts(books, books.refs(), ids) == []
    assert books.held_counts_of([4, 1, 6]) == {4: 1, 1: 1, 6: 0}
    del table["B"]  # a table gone without a free: block 3 keeps ref_cnt 1
    ids = books.held_ids()
    assert not books.refcounts_agree()
    assert books.refs() == [b.ref_cnt for b in blk]
    books.uninstall_mirror()


@pytest.mark.parametrize("seed", range(6))
def test_held_ids_and_counts_follow_any_table_edit(seed):
    """The incremental reads of the block tables (only changed lists read again, the flat list
    of held ids built only when needed) give what reading every table gives, after any edit a
    scheduler (or a bug) makes: blocks appended, a list replaced, edited in place, emptied,
    re-inserted in another order, a table gone, a request added; in two KV cache groups, with
    an extra holder and the null block held."""
    import random

    from vllm_repro.audit.books import HeldIds

    rnd = random.Random(seed)
    books, s = make_books(num_gpu_blocks=24, groups=[{"A": [1, 2], "B": [3]}, {"A": [4]}])
    if books.install_mirror() is not None:
        pytest.skip("mirror")
    blk = books.blocks
    tables = books.tables()
    last_key = None
    last_flat = None
    for _ in range(200):
        t = rnd.choice(tables)
        op = rnd.randrange(8)
        rid = rnd.choice("ABCDE")
        if op == 0:
            t.setdefault(rid, []).extend(rnd.sample(blk, rnd.randrange(1, 3)))
        elif op == 1:
            t[rid] = rnd.sample(blk, rnd.randrange(0, 4))
        elif op == 2 and t.get(rid):
            t[rid][rnd.randrange(len(t[rid]))] = rnd.choice(blk)
        elif op == 3 and rid in t:
            t.pop(rid)
        elif op == 4 and rid in t:
            t[rid] = t.pop(rid)  # the same list, now last in the dict
        elif op == 5 and rid in t:
            del t[rid][len(t[rid]) // 2:]
        elif op == 6:
            s.deferred_frees = [(7, [blk[0], rnd.choice(blk)])] if rnd.random() < 0.5 else []
        # op 7: nothing moved
        flat = [b.block_id for tb in books.tables() for bl in tb.values() for b in bl]
        flat += [b.block_id for _, bl in books.extra_holders() for b in bl]
        key = books.held_key()
        assert key.flat() == flat and len(key) == len(flat)
        assert key.refs_held == len(flat) - flat.count(books.null_id)
        assert (key == last_key) == (flat == last_flat)
        assert (key == flat) and HeldIds([], flat, books.null_id) == key
        assert books.held_ids() == flat
        want = {i: flat.count(i) for i in range(len(blk))}
        assert books.held_counts_of(range(len(blk))) == want
        last_key, last_flat = key, flat
