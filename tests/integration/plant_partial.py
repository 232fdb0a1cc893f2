"""Plants for partial-block hashing (issue #42, test_new_release.py): patched into a release with
``KVCacheBlock.block_hash_num_tokens`` (0.34) inside the engine worker (``vllm_repro.audit.plant``).
Standard library only."""

from __future__ import annotations


def count_partial(ctx):
    """Count ``BlockPool.cache_partial_block`` calls that registered an entry (``notes.partial``)."""
    pool_cls = ctx.find("vllm.v1.core.block_pool:BlockPool")
    orig = pool_cls.cache_partial_block
    seen = {"entries": 0}

    def counted(self, *args, **kwargs):
        key = orig(self, *args, **kwargs)
        if key is not None:
            seen["entries"] += 1
            ctx.note("partial", dict(seen))
        return key

    ctx.patch(pool_cls, "cache_partial_block", counted)
    ctx.note("partial", dict(seen))


def partial_count_off_boundary(ctx):
    """The first partial entry that becomes a block's own hash has its token count moved one token
    past its hash boundary (what a pool writing the count wrong would leave): notes ``step``,
    ``block`` and ``tokens``."""
    pool_cls = ctx.find("vllm.v1.core.block_pool:BlockPool")
    orig = pool_cls.cache_partial_block

    def corrupt(self, request, block, num_tokens, *args, **kwargs):
        had = block.block_hash
        key = orig(self, request, block, num_tokens, *args, **kwargs)
        if key is not None and had is None and "block" not in ctx.notes \
                and block.block_hash == key:
            block.block_hash_num_tokens = num_tokens + 1
            ctx.note("step", ctx.step)
            ctx.note("block", block.block_id)
            ctx.note("tokens", num_tokens + 1)
        return key

    ctx.patch(pool_cls, "cache_partial_block", corrupt)
