"""The audit's pool hooks on fake books: a bad free is caught inside the call that makes it,
naming the block, the holders and the freeing request."""

from __future__ import annotations

import pytest

from vllm_repro.audit.codes import KV_DOUBLE_FREE, KV_FREE_QUEUE, KV_REFCOUNT
from vllm_repro.audit.hooks import PoolHooks

from .fakes import FreeKVCacheBlockQueue, make_books


def hooked(**kw):
    books, s = make_books(**kw)
    found = []
    hooks = PoolHooks(books, lambda code, msg, reqs, blocks: found.append((code, msg, reqs, blocks)))
    return books, s, hooks, found


def test_install_wraps_and_uninstall_restores():
    books, _, hooks, _ = hooked(num_gpu_blocks=6, tables={"A": [1]})
    assert hooks.install() == ["free_blocks"]  # the fake pool has no touch / get_new_blocks
    assert "free_blocks" in vars(books.pool)
    hooks.uninstall()
    assert "free_blocks" not in vars(books.pool)


def test_a_free_by_the_holder_is_silent_and_verified():
    books, s, hooks, found = hooked(num_gpu_blocks=6, tables={"A": [1, 2]})
    hooks.install()
    table = books.tables()[0]
    blocks = table.pop("A")
    books.pool.free_blocks(reversed(blocks))
    assert found == [] and hooks.error is None and hooks.verified_frees == 1
    assert books.num_free() == 5


def test_a_double_free_names_block_holders_and_freeing_request():
    books, s, hooks, found = hooked(num_gpu_blocks=6, tables={"A": [1, 2], "B": [2]},
                                    enable_caching=True)
    hooks.install()

    def free(request_id):  # like SingleTypeKVCacheManager.free: a request_id local
        books.pool.free_blocks([books.blocks[2]])  # without popping B's table

    free("B")
    assert [(c, r, b) for c, _, r, b in found] == [(KV_DOUBLE_FREE, ["A", "B", "B"], [2])]
    msg = found[0][1]
    assert "block 2 ref_cnt 2 freed for B but still held by A and B" in msg


@pytest.mark.parametrize("sentinels", [True, False])
def test_take_of_a_held_block_at_the_free_queue_head(sentinels):
    books, _, hooks, found = hooked(num_gpu_blocks=6, tables={"A": [1]}, sentinels=sentinels)
    books.pool.free_block_queue = FreeKVCacheBlockQueue([books.blocks[i] for i in (1, 2, 3)],
                                                        sentinels)
    hooks.check_take(2)
    assert [(c, r, b) for c, _, r, b in found] == [(KV_FREE_QUEUE, ["A"], [1])]
    assert "about to hand it out again" in found[0][1]


def test_touch_of_a_ref0_block_outside_the_free_queue_and_below_zero():
    books, _, hooks, found = hooked(num_gpu_blocks=6, tables={"A": [1]})
    books.pool.free_block_queue = FreeKVCacheBlockQueue([books.blocks[i] for i in (2, 3, 4)])
    books.blocks[5].prev_free_block = books.blocks[5].next_free_block = None
    hooks.check_touch([books.blocks[2], books.blocks[5]])
    assert [(c, b) for c, _, _, b in found] == [(KV_FREE_QUEUE, [5])]
    books.blocks[3].ref_cnt = -1
    hooks.check_touch([books.blocks[3]])
    assert found[-1][0] == KV_REFCOUNT and found[-1][3] == [3]


def test_the_bare_queue_head_counts_as_linked():
    books, _, hooks, found = hooked(num_gpu_blocks=6, tables={"A": [1]}, sentinels=False)
    hooks.check_touch([books.blocks[2]])  # the head: prev_free_block None, yet linked
    assert found == []
