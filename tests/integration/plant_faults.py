"""Faults planted into a real vLLM release, one per audit code (test-only plug-in).

Loaded by the engine worker inside the release environment (standard library + vLLM only) when
a test passes ``plant="<this file>:<function>"`` to ``Worker.run``. Each function patches the
release through ``ctx.patch`` (undone after the run) and records in ``ctx.note`` the step, the
request and the blocks it broke, which the tests compare with what the audit reports.
"""

from __future__ import annotations


def _after_schedule_at(ctx, step: int, action) -> None:
    """Run ``action(scheduler)`` right after the ``schedule()`` call of ``step``."""
    Scheduler = ctx.find("vllm.v1.core.sched.scheduler:Scheduler", "vllm.v1.core.scheduler:Scheduler")
    orig = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        so = orig(self, *args, **kwargs)
        if ctx.step == step and "step" not in ctx.notes:
            ctx.note("step", step)
            action(self)
        return so

    ctx.patch(Scheduler, "schedule", schedule)


def double_free(ctx, request: str = "A") -> None:
    """KV_DOUBLE_FREE: when ``request`` is freed, its blocks are given back to the pool a second
    time through ``BlockPool.free_blocks`` (a caller that kept the list and freed it again)."""
    KVCacheManager = ctx.find("vllm.v1.core.kv_cache_manager:KVCacheManager")
    orig = KVCacheManager.free

    def free(self, req, *args, **kwargs):
        if getattr(req, "request_id", None) != request or "blocks" in ctx.notes:
            return orig(self, req, *args, **kwargs)
        blocks = ctx.blocks_of(self, request)
        out = orig(self, req, *args, **kwargs)
        ctx.note("step", ctx.step)
        ctx.note("request", request)
        ctx.note("blocks", sorted(b.block_id for b in blocks))
        self.block_pool.free_blocks(list(reversed(blocks)))  # the fault: freed again
        return out

    ctx.patch(KVCacheManager, "free", free)


def extra_ref(ctx, at_step: int = 3, request: str = "A") -> None:
    """KV_REFCOUNT: after ``schedule()`` of ``at_step``, one of ``request``'s blocks gets a
    reference that no block table holds (a ``touch`` without the table entry)."""
    def action(s):
        b = ctx.blocks_of(s.kv_cache_manager, request)[0]
        b.ref_cnt += 1
        ctx.note("request", request)
        ctx.note("blocks", [b.block_id])

    _after_schedule_at(ctx, at_step, action)


def drop_from_free_queue(ctx, at_step: int = 3) -> None:
    """KV_FREE_QUEUE: after ``schedule()`` of ``at_step`` the free queue's head block is unlinked
    and counted out, though nobody takes it (ref_cnt stays 0)."""
    def action(s):
        b = s.kv_cache_manager.block_pool.free_block_queue.popleft()
        ctx.note("blocks", [b.block_id])

    _after_schedule_at(ctx, at_step, action)


def keep_blocks_of(ctx, request: str = "B") -> None:
    """KV_LEAK: when ``request`` finishes, ``KVCacheManager.free`` does nothing: its blocks stay
    in its block table (ref counts and tables still agree; only the owner is gone)."""
    KVCacheManager = ctx.find("vllm.v1.core.kv_cache_manager:KVCacheManager")
    orig = KVCacheManager.free

    def free(self, req, *args, **kwargs):
        if getattr(req, "request_id", None) == request and "step" not in ctx.notes:
            ctx.note("step", ctx.step)
            ctx.note("request", request)
            ctx.note("blocks", sorted(b.block_id for b in ctx.blocks_of(self, request)))
            return None  # the fault: nothing freed
        return orig(self, req, *args, **kwargs)

    ctx.patch(KVCacheManager, "free", free)


def unhash_cached_block(ctx, at_step: int = 3) -> None:
    """KV_PREFIX_MAP: after ``schedule()`` of ``at_step`` a cached block loses its hash while the
    prefix-cache map still maps the hash to it."""
    def action(s):
        pool = s.kv_cache_manager.block_pool
        b = next(b for b in pool.blocks if getattr(b, "block_hash", None) is not None)
        b.reset_hash()
        ctx.note("blocks", [b.block_id])

    _after_schedule_at(ctx, at_step, action)


def two_queues(ctx, at_step: int = 3, request: str = "A") -> None:
    """REQ_STATE: after ``schedule()`` of ``at_step`` a running request is also appended to the
    waiting queue."""
    def action(s):
        req = s.requests[request]
        add = getattr(s.waiting, "add_request", None) or s.waiting.append
        add(req)
        ctx.note("request", request)

    _after_schedule_at(ctx, at_step, action)


def lift_token_budget(ctx, at_step: int = 3) -> None:
    """BATCH_LIMIT: during ``schedule()`` of ``at_step`` the scheduler's token budgets
    (``max_num_scheduled_tokens``, and the input budget 0.33 reads from
    ``scheduler_config.max_num_batched_tokens``) are 100x the configured limit."""
    Scheduler = ctx.find("vllm.v1.core.sched.scheduler:Scheduler", "vllm.v1.core.scheduler:Scheduler")
    orig = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        if ctx.step != at_step:
            return orig(self, *args, **kwargs)
        saved = self.max_num_scheduled_tokens
        cfg = self.scheduler_config
        saved_cfg = cfg.max_num_batched_tokens
        self.max_num_scheduled_tokens = saved * 100
        object.__setattr__(cfg, "max_num_batched_tokens", saved_cfg * 100)
        ctx.note("step", at_step)
        ctx.note("limit", saved)
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = saved
            object.__setattr__(cfg, "max_num_batched_tokens", saved_cfg)

    ctx.patch(Scheduler, "schedule", schedule)


def refuse_allocations(ctx, from_step: int = 3) -> None:
    """NO_PROGRESS: from ``from_step`` on ``KVCacheManager.allocate_slots`` finds no room for
    anybody (returns None), so every request is preempted and none can be scheduled again."""
    KVCacheManager = ctx.find("vllm.v1.core.kv_cache_manager:KVCacheManager")
    orig = KVCacheManager.allocate_slots

    def allocate_slots(self, *args, **kwargs):
        if ctx.step >= from_step:
            ctx.notes.setdefault("step", ctx.step)
            return None
        return orig(self, *args, **kwargs)

    ctx.patch(KVCacheManager, "allocate_slots", allocate_slots)


def broken_fake_model(ctx, at_step: int = 3) -> None:
    """A lab defect, not a vLLM one: from ``at_step`` on the fake model runner (called by the
    fake worker from inside vLLM's executor at level engine-core) raises a TypeError."""
    from vllm_repro.engine.fake_runner import FakeModelRunner

    orig = FakeModelRunner.execute

    def execute(self, step, *args, **kwargs):
        if step >= at_step:
            ctx.note("step", step)
            raise TypeError("planted: the fake model runner is broken")
        return orig(self, step, *args, **kwargs)

    ctx.patch(FakeModelRunner, "execute", execute)


def _schedule_wrapper(ctx, around) -> None:
    """Patch ``Scheduler.schedule`` with ``around(orig, self, *args, **kwargs)``."""
    Scheduler = ctx.find("vllm.v1.core.sched.scheduler:Scheduler", "vllm.v1.core.scheduler:Scheduler")
    orig = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        return around(orig, self, *args, **kwargs)

    ctx.patch(Scheduler, "schedule", schedule)


def residue_entry(ctx, request: str = "A") -> None:
    """REQ_RESIDUE: when ``request`` is freed, an empty block-table entry is left behind for it
    (as a ``defaultdict`` read after the free would create one): no block is held, only the
    key stays."""
    KVCacheManager = ctx.find("vllm.v1.core.kv_cache_manager:KVCacheManager")
    orig = KVCacheManager.free

    def free(self, req, *args, **kwargs):
        out = orig(self, req, *args, **kwargs)
        if getattr(req, "request_id", None) == request and "step" not in ctx.notes:
            ctx.tables(self)[0][request] = []  # the fault: the key stays
            ctx.note("step", ctx.step)
            ctx.note("request", request)
        return out

    ctx.patch(KVCacheManager, "free", free)


def starve(ctx, at_step: int = 7, request: str = "B") -> None:
    """REQ_STARVED: during ``schedule()`` of ``at_step`` the running ``request`` is hidden from
    the running queue (put back at its place afterwards), so it gets nothing though the step has
    budget and blocks to spare."""
    def around(orig, self, *args, **kwargs):
        if ctx.step != at_step or "step" in ctx.notes:
            return orig(self, *args, **kwargs)
        req = self.requests[request]
        i = self.running.index(req)
        self.running.remove(req)
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.running.insert(i, req)
            ctx.note("step", at_step)
            ctx.note("request", request)

    _schedule_wrapper(ctx, around)


def preempt_unreported(ctx, at_step: int = 7, report: bool = False) -> None:
    """PREEMPT_UNREPORTED: in ``schedule()`` of ``at_step`` the first ``allocate_slots`` call
    finds no room, so the scheduler preempts (its own path); with ``report=False`` the
    preempted request is then taken out of the output's ``preempted_req_ids``. Notes whether
    the release's output has that field (``has_report``) and whom vLLM preempted."""
    KVCacheManager = ctx.find("vllm.v1.core.kv_cache_manager:KVCacheManager")
    orig_alloc = KVCacheManager.allocate_slots

    def allocate_slots(self, *args, **kwargs):
        if ctx.step == at_step and "refused" not in ctx.notes:
            ctx.note("refused", True)
            return None
        return orig_alloc(self, *args, **kwargs)

    ctx.patch(KVCacheManager, "allocate_slots", allocate_slots)

    def around(orig, self, *args, **kwargs):
        before = {r.request_id for r in self.running}
        so = orig(self, *args, **kwargs)
        if ctx.step == at_step and "step" not in ctx.notes:
            ctx.note("step", at_step)
            gone = sorted(rid for rid in before if rid in self.requests
                          and getattr(self.requests[rid].status, "name", "") == "PREEMPTED")
            ctx.note("preempted", gone)
            ctx.note("has_report", hasattr(so, "preempted_req_ids"))
            if hasattr(so, "preempted_req_ids"):
                ctx.note("reported", sorted(so.preempted_req_ids or ()))
                if not report and so.preempted_req_ids:
                    for rid in gone:
                        so.preempted_req_ids.discard(rid)  # the fault: not told to the worker
        return so

    _schedule_wrapper(ctx, around)


def lift_seq_limit(ctx, at_step: int = 1) -> None:
    """WORKER_BATCH_OVERFLOW: during ``schedule()`` of ``at_step`` the scheduler's request
    limits (``max_num_running_reqs``, 0.33's ``max_num_active_reqs``) are 100x max_num_seqs,
    so it schedules more requests than the worker's persistent batch has slots."""
    def around(orig, self, *args, **kwargs):
        if ctx.step != at_step:
            return orig(self, *args, **kwargs)
        names = [n for n in ("max_num_running_reqs", "max_num_active_reqs") if hasattr(self, n)]
        saved = {n: getattr(self, n) for n in names}
        for n in names:
            setattr(self, n, saved[n] * 100)
        ctx.note("step", at_step)
        ctx.note("limit", saved.get("max_num_running_reqs"))
        try:
            return orig(self, *args, **kwargs)
        finally:
            for n, v in saved.items():
                setattr(self, n, v)

    _schedule_wrapper(ctx, around)


def overrun_max_len(ctx, at_step: int = 7, request: str = "B") -> None:
    """REQ_OVER_MAX_LEN: after ``schedule()`` of ``at_step`` ``request``'s
    ``num_computed_tokens`` is set one past ``max_model_len``."""
    def action(s):
        req = s.requests[request]
        req.num_computed_tokens = s.max_model_len + 1
        ctx.note("request", request)
        ctx.note("value", req.num_computed_tokens)

    _after_schedule_at(ctx, at_step, action)


def zero_count(ctx, at_step: int = 3, request: str = "A") -> None:
    """BATCH_LIMIT (a scheduled count <= 0): the output of ``schedule()`` at ``at_step`` lists
    ``request`` with 0 tokens (the total kept the sum of the counts)."""
    def around(orig, self, *args, **kwargs):
        so = orig(self, *args, **kwargs)
        if ctx.step == at_step and "step" not in ctx.notes:
            n = so.num_scheduled_tokens[request]
            so.num_scheduled_tokens[request] = 0
            so.total_num_scheduled_tokens -= n
            ctx.note("step", at_step)
            ctx.note("request", request)
        return so

    _schedule_wrapper(ctx, around)


# ---- level v0-engine, BlockSpaceManagerV1 (vllm/core/block_manager_v1.py, 0.4.0 to 0.6.2) ----
def _v0_table_of(scheduler, request: str) -> list:
    """The ``PhysicalTokenBlock`` objects of ``request``'s first sequence (V0 scheduler)."""
    bm = scheduler.block_manager
    for q in (scheduler.running, scheduler.swapped, scheduler.waiting):
        for sg in q:
            if sg.request_id == request:
                table = bm.block_tables[sg.get_seqs()[0].seq_id]
                return list(table.list() if hasattr(table, "list") else table)
    return []


def v0_bm1_extra_ref(ctx, at_step: int = 3, request: str = "A") -> None:
    """KV_REFCOUNT at level v0-engine: after the V0 ``Scheduler.schedule()`` of ``at_step``, the
    first block of ``request``'s table gets a reference no block table holds
    (``PhysicalTokenBlock.ref_count`` raised behind the block manager's back)."""
    Scheduler = ctx.find("vllm.core.scheduler:Scheduler")
    orig = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if ctx.step == at_step and "step" not in ctx.notes:
            b = _v0_table_of(self, request)[0]
            b.ref_count += 1
            ctx.note("step", at_step)
            ctx.note("request", request)
            ctx.note("blocks", [b.block_number])
        return out

    ctx.patch(Scheduler, "schedule", schedule)


def v0_bm1_double_free(ctx, request: str = "A") -> None:
    """KV_DOUBLE_FREE at level v0-engine: when ``BlockSpaceManagerV1.free`` frees ``request``'s
    sequence, its first block is given back to the GPU allocator a second time."""
    Manager = ctx.find("vllm.core.block_manager_v1:BlockSpaceManagerV1")
    orig = Manager.free

    def free(self, seq, *args, **kwargs):
        table = self.block_tables.get(seq.seq_id)
        blocks = list(table.list() if hasattr(table, "list") else table or ())
        out = orig(self, seq, *args, **kwargs)
        s = ctx.scheduler  # the output processor frees a finished sequence of a running group
        mine = any(sg.request_id == request and any(x is seq for x in sg.get_seqs())
                   for q in (s.running, s.swapped, s.waiting) for sg in q)
        if blocks and mine and "blocks" not in ctx.notes:
            ctx.note("step", ctx.step)
            ctx.note("request", request)
            ctx.note("blocks", [blocks[0].block_number])
            self.gpu_allocator.free(blocks[0])  # the fault: freed again
        return out

    ctx.patch(Manager, "free", free)


def livelock_in_schedule(ctx, at_step: int = 3) -> None:
    """A livelock in a copy of the release's own ``Scheduler.schedule``: its source, with a loop
    that never ends from ``at_step`` on put first in its body, compiled under the release's file
    name and line numbers (so its frame reads ``vllm/v1/core/sched/scheduler.py:schedule``) and
    patched in. Notes the file and the loop's line."""
    import ast
    import inspect
    import textwrap

    Scheduler = ctx.find("vllm.v1.core.sched.scheduler:Scheduler", "vllm.v1.core.scheduler:Scheduler")
    fn = Scheduler.schedule
    lines, first = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    func = tree.body[0]
    body_line = func.body[0].lineno
    loop = ast.parse("while _plant_ctx.step >= _plant_at:\n    _plant_spins = len(self.running)").body[0]
    ast.increment_lineno(loop, body_line - 1)
    func.body.insert(0, loop)
    func.decorator_list = []
    ast.increment_lineno(tree, first - 1)
    code = compile(tree, inspect.getsourcefile(fn), "exec")
    scope = dict(fn.__globals__, _plant_ctx=ctx, _plant_at=at_step)
    exec(code, scope)  # noqa: S102 - the release's own source, with the planted loop
    ctx.patch(Scheduler, "schedule", scope[fn.__name__])
    ctx.note("file", inspect.getsourcefile(fn))
    ctx.note("line", first + body_line - 1)
