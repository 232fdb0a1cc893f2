"""The audit over the V0 engine's books (``level: v0-engine``).

What it reads (``vllm/core/block_manager.py:SelfAttnBlockSpaceManager``, the "v2" block
manager: the only one from 0.6.3; before, ``use_v2_block_manager: true``):

- ``block_manager.block_tables``: sequence id -> ``BlockTable`` (``physical_block_ids``);
- ``block_manager.block_allocator`` (``CpuGpuBlockAllocator``): ``_allocators`` by device
  (``NaiveBlockAllocator``: ``_all_block_indices``, ``_free_block_indices``, ``_refcounter``;
  ``PrefixCachingBlockAllocator``: the same through ``_hashless_allocator``, plus the
  ``evictor``'s ``free_table`` of cached blocks with ref count 0), and ``_null_block`` (the
  sliding window's placeholder, held by many tables, never counted);
- the scheduler's ``waiting`` / ``running`` / ``swapped`` deques of ``SequenceGroup``.

Codes (docs/audit.md): ``KV_REFCOUNT`` (a block's ref count is not the number of block-table
references to it, GPU and CPU pools alike), ``KV_FREE_QUEUE`` (a free block with references or a
ref count, a block neither free nor held, free + used != the pool), ``KV_LEAK`` (a swapped
request holding GPU blocks, a block table of a sequence no queue holds (the async output processor's
``_async_stopped`` groups count as held: they are freed by the engine's next
``free_finished_seq_groups``), and at the end of a run
a GPU block not back), ``REQ_STATE`` (a request in two queues, a sequence whose status is
not its queue's, or a group of an aborted request still queued), ``KV_DOUBLE_FREE`` (a hook
on each allocator's ``RefCounter.decr``: a block
given back at ref count 0, caught inside the call), ``REQ_RESIDUE`` (at the end of a clean run, a
child group of an ``n > 1`` request still a key of ``LLMEngine.seq_id_to_seq_group`` after it
left every queue and the engine collected its finish: nothing takes it out any more). The older
``BlockSpaceManagerV1`` (``vllm/core/block_manager_v1.py``, the default up to 0.6.2, gone in
0.6.3) keeps its books as ``PhysicalTokenBlock`` objects: :mod:`vllm_repro.audit.bm_v1`
reads them with the same codes, and its allocators' ``free`` carry the ``KV_DOUBLE_FREE`` hook.
A block manager neither reader knows (the embedding models' and attention-free models'
placeholders) or an allocator of an unknown shape is named in the summary's ``unread``; only
queues are checked then, and a clean run says so (``clean (...; audit: KV books unread: ...)``).

Runs inside release environments: standard library + the release's own objects.
"""

from __future__ import annotations

import traceback
from collections import Counter

from ..records import AuditSummary, TraceLine, Violation
from .auditor import AuditStop
from .bm_v1 import V1Books, check_books_v1, is_block_manager_v1
from .v0_queues import async_stopped_of, queues_of
from .codes import (KV_DOUBLE_FREE, KV_FREE_QUEUE, KV_LEAK, KV_PREFIX_MAP, KV_REFCOUNT,
                    REQ_RESIDUE, REQ_STATE, make_violation, names)
from .registry import (AFTER_SCHEDULE, AFTER_UPDATE, END_OF_RUN, IN_CALL, V0_LEVELS, Check, Moment,
                       add, check, checks_for)

#: the queue each unfinished sequence status belongs to (``vllm/sequence.py:SequenceStatus``)
QUEUE_OF_STATUS = {"WAITING": "waiting", "RUNNING": "running", "SWAPPED": "swapped"}


def read_books(scheduler):
    """The reader of ``scheduler``'s block manager, by its attributes: :class:`V0Books` (the v2
    ``SelfAttnBlockSpaceManager``), :class:`~vllm_repro.audit.bm_v1.V1Books`
    (``BlockSpaceManagerV1``), else a :class:`V0Books` whose ``readable`` is False (queues
    only; ``unread`` names the block manager)."""
    bm = scheduler.block_manager
    if getattr(getattr(bm, "block_allocator", None), "_allocators", None) is None \
            and is_block_manager_v1(bm):
        return V1Books(scheduler)
    return V0Books(scheduler)


class V0Books:
    """Reads the V0 books of one scheduler (see the module docstring). ``readable`` is False
    where the block manager is not the one this module knows (then only queues are read, and
    ``unread`` names it)."""

    kind = "SelfAttnBlockSpaceManager"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        bm = scheduler.block_manager
        self.bm = bm
        alloc = getattr(bm, "block_allocator", None)
        self.allocators = dict(getattr(alloc, "_allocators", {}) or {})
        self.readable = bool(self.allocators) and hasattr(bm, "block_tables")
        self.cpu_gpu = alloc
        self.unread: list[str] = [] if self.readable else [type(bm).__name__]

    def gpu_total(self) -> int:
        """GPU blocks in the pool (the null block left out)."""
        return len(self.pools().get("GPU", {}).get("all", ()) or ()) - (
            1 if self.null_block_id() is not None else 0)

    # ---- per allocator ---------------------------------------------------------------------
    @staticmethod
    def naive_of(allocator):
        """The ``NaiveBlockAllocator`` holding the free list (itself, or a prefix-caching
        allocator's ``_hashless_allocator``)."""
        return getattr(allocator, "_hashless_allocator", allocator)

    @staticmethod
    def refcounts(allocator) -> dict[int, int]:
        rc = getattr(allocator, "_refcounter", None)
        rc = getattr(rc, "_refcounter", rc)  # ReadOnlyRefCounter wraps the RefCounter
        return dict(getattr(rc, "_refcounts", {}) or {})

    def pools(self) -> dict[str, dict]:
        """device name -> ``{"all": ids, "free": free-list ids, "cached": evictor ids, "refs":
        ref counts}``."""
        out = {}
        for device, allocator in self.allocators.items():
            naive = self.naive_of(allocator)
            evictor = getattr(allocator, "evictor", None)
            out[getattr(device, "name", str(device))] = {
                "all": set(getattr(naive, "_all_block_indices", ()) or ()),
                "free": list(getattr(naive, "_free_block_indices", ()) or ()),
                "cached": set(getattr(evictor, "free_table", {}) or {}),
                "refs": self.refcounts(allocator),
            }
        return out

    def null_block_id(self):
        nb = getattr(self.cpu_gpu, "_null_block", None)
        return getattr(nb, "block_id", None) if nb is not None else None

    def tables(self) -> dict[int, list[int]]:
        """sequence id -> its physical block ids (the null block left out)."""
        null = self.null_block_id()
        out = {}
        for seq_id, table in dict(self.bm.block_tables).items():
            ids = getattr(table, "physical_block_ids", None)
            if ids is None:
                ids = [getattr(b, "block_id", None) for b in getattr(table, "blocks", ())]
            out[seq_id] = [b for b in ids if b is not None and b != null]
        return out

    def queues(self) -> dict[str, list]:
        return queues_of(self.scheduler)

    def async_stopped(self) -> list:
        return async_stopped_of(self.scheduler)

    def gpu_blocks_of(self, seq_id: int, tables: dict[int, list[int]] | None = None) -> list[int]:
        """The GPU block ids in sequence ``seq_id``'s table (ids are unique across pools)."""
        tables = self.tables() if tables is None else tables
        gpu = self.pools().get("GPU", {}).get("all", set())
        return [b for b in tables.get(seq_id, ()) if b in gpu]


def check_books(books: V0Books, req_of_seq: dict[int, str]) -> list[Violation]:
    """The block-table / ref-count / free-list checks of one moment (see the module
    docstring). ``req_of_seq``: sequence id -> request id of the live sequences."""
    found: list[Violation] = []
    tables = books.tables()
    holders: dict[int, list[str]] = {}
    for seq_id, ids in tables.items():
        for b in ids:
            holders.setdefault(b, []).append(req_of_seq.get(seq_id, f"seq {seq_id}"))
    null = books.null_block_id()
    for device, pool in books.pools().items():
        refs, free, cached, every = pool["refs"], pool["free"], pool["cached"], pool["all"]
        free_set = set(free)
        for b in sorted(every):
            if b == null:
                continue
            held = holders.get(b, [])
            rc = refs.get(b, 0)
            if rc != len(held):
                found.append(make_violation(
                    KV_REFCOUNT, f"{device} block {b} ref count {rc} but held by "
                    f"{names(held)} (expected {len(held)})", requests=held, blocks=[b]))
            if b in free_set and (rc or held):
                found.append(make_violation(
                    KV_FREE_QUEUE, f"{device} block {b} is on the free list with ref count {rc}, "
                    f"held by {names(held)}", requests=held, blocks=[b]))
            if rc == 0 and not held and b not in free_set and b not in cached:
                found.append(make_violation(
                    KV_FREE_QUEUE, f"{device} block {b} has ref count 0 and no holder but is "
                    "neither on the free list nor cached (lost)", blocks=[b]))
        if len(free) != len(free_set):
            dup = [b for b, n in Counter(free).items() if n > 1]
            found.append(make_violation(KV_FREE_QUEUE, f"{device} free list holds block(s) "
                                        f"{dup} twice", blocks=dup))
        used = sum(1 for b in every if b != null and (refs.get(b, 0) > 0))
        n_free = len(free_set) + len(cached - free_set)
        if used + n_free != len(every - {null}):
            found.append(make_violation(
                KV_FREE_QUEUE, f"{device}: free {n_free} + used {used} != {len(every - {null})} "
                "blocks in the pool"))
    return found


def check_queues(books: V0Books, tables: dict[int, list[int]] | None,
                 gpu_ids: set[int]) -> tuple[list[Violation], dict[int, str]]:
    """``(violations, sequence id -> request id of live sequences)``: a request in two queues,
    a sequence whose status is not its queue's, a swapped request holding GPU blocks (``gpu_ids``
    at the v2 reader, whose ids are unique across pools; each block's ``device`` at
    ``BlockSpaceManagerV1``'s), and (``tables`` given) a block table whose sequence no queue
    holds, or a cross-attention table whose request none holds."""
    found: list[Violation] = []
    seen: dict[str, str] = {}
    req_of_seq: dict[int, str] = {}
    for qname, groups in books.queues().items():
        for sg in groups:
            rid = sg.request_id
            if rid in seen:
                found.append(make_violation(REQ_STATE, f"{rid} is in {seen[rid]} and {qname}",
                                            requests=[rid]))
            seen[rid] = qname
            for seq in sg.get_seqs():
                req_of_seq[seq.seq_id] = rid
                status = getattr(getattr(seq, "status", None), "name", "")
                want = QUEUE_OF_STATUS.get(status)
                if want is not None and want != qname:
                    found.append(make_violation(
                        REQ_STATE, f"{rid} (sequence {seq.seq_id}) is {status} but in {qname}",
                        requests=[rid]))
                if qname == "swapped" and tables is not None:
                    on_gpu = (books.gpu_blocks_of(seq.seq_id) if isinstance(books, V1Books)
                              else [b for b in tables.get(seq.seq_id, ()) if b in gpu_ids])
                    if on_gpu:
                        found.append(make_violation(
                            KV_LEAK, f"{rid} is swapped out but its block table holds GPU "
                            f"block(s) {on_gpu[:8]}", requests=[rid], blocks=on_gpu))
    if tables is not None:
        stopped = books.async_stopped()
        parked = {seq.seq_id for sg in stopped for seq in sg.get_seqs()}
        for seq_id, ids in tables.items():
            if seq_id not in req_of_seq and seq_id not in parked:
                found.append(make_violation(
                    KV_LEAK, f"sequence {seq_id} has a block table ({len(ids)} blocks) but no "
                    "queue holds it (finished or aborted)", blocks=ids))
        if isinstance(books, V1Books):
            live = set(seen) | {sg.request_id for sg in stopped}
            for rid, blocks in books.cross_objects().items():
                if rid not in live:
                    found.append(make_violation(
                        KV_LEAK, f"{rid} has a cross-attention block table ({len(blocks)} "
                        "blocks) but no queue holds it (finished or aborted)", requests=[rid],
                        blocks=[b.block_number for b in blocks]))
    return found, req_of_seq


class KVContent:
    """What a GPU's KV cache would hold, block by block, given the ``ExecuteModelRequest``s the
    worker got: the model runner writes KV for the positions it computes into the sequence's
    block table and reads the rest; with prefix caching it skips the blocks the scheduler lists
    in ``computed_block_nums`` (``vllm/worker/model_runner.py:_compute_lens`` and
    ``_compute_for_prefix_cache_hit``), so those must hold KV of exactly the sequence's tokens.

    ``content[block id]`` is the identity of the tokens a full block's KV was computed from (a
    hash of the whole token prefix up to the block's end, as KV depends on every earlier token),
    ``None`` for a block being written; swaps and copies move it between pools.
    ``meant[block id]`` is ``(sequence id, token ids, block index)`` for a full prompt block a
    prefill step's block table lists but did not compute (chunked prefill), dropped when
    anything is written into the block: a later sequence told to skip that block as cached
    with the same tokens is on a prefix-cache hit on KV that was never computed, not on a
    fresh block counted as cached (the finding says which).
    :meth:`execute` returns ``KV_PREFIX_MAP`` findings for blocks skipped as cached whose
    content is not the sequence's."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.gpu: dict[int, int | None] = {}
        self.cpu: dict[int, int | None] = {}
        self.meant: dict[int, tuple[int, list, int]] = {}

    def execute(self, req, request_of) -> list[Violation]:
        bs = self.bs
        for src, dst in getattr(req, "blocks_to_swap_out", ()) or ():
            self.cpu[dst] = self.gpu.get(src)
        for src, dst in getattr(req, "blocks_to_swap_in", ()) or ():
            self.gpu[dst] = self.cpu.get(src)
        for src, dst in getattr(req, "blocks_to_copy", ()) or ():
            self.gpu[dst] = self.gpu.get(src)
        found = []
        for meta in getattr(req, "seq_group_metadata_list", ()) or ():
            tables = getattr(meta, "block_tables", None) or {}
            prompt = bool(getattr(meta, "is_prompt", False))
            cached = list(getattr(meta, "computed_block_nums", None) or ())
            for seq_id, data in (getattr(meta, "seq_data", None) or {}).items():
                table = tables.get(seq_id, ()) or ()
                tokens = None  # read only when a block is checked or completed (cost per step)
                seq_len = data.get_len() if hasattr(data, "get_len") else len(
                    tokens := list(data.get_token_ids()))
                if prompt:
                    context = data.get_num_computed_tokens()
                    seq_len = min(seq_len, context + int(meta.token_chunk_size))
                else:
                    context = seq_len - 1
                start = context
                hit = len(cached) * bs if prompt else 0
                if hit > context:
                    start = hit if hit < seq_len else seq_len - 1
                    # the blocks wholly skipped as cached: they must hold these tokens' KV
                    for i in range(-(-context // bs), start // bs):
                        if i >= len(table):
                            break
                        tokens = tokens if tokens is not None else data.get_token_ids()
                        want = hash(tuple(tokens[:(i + 1) * bs]))
                        held = self.gpu.get(table[i], _NEVER)
                        if held != want:
                            rid = request_of(meta.request_id)
                            how, mech = self._how_skipped(table[i], seq_id, want)
                            found.append(make_violation(
                                KV_PREFIX_MAP, f"{rid} (sequence {seq_id}): the worker is told "
                                f"to skip GPU block {table[i]} (prompt tokens {i * bs} to "
                                f"{(i + 1) * bs - 1}) as a cached prefix (computed_block_nums "
                                f"{cached[:8]}), but that block holds no KV of those tokens "
                                f"({_HELD.get(held, 'it holds the KV of other tokens')}); "
                                + how, requests=[rid], blocks=[table[i]], mechanism=mech))
                for p in range(start, seq_len):  # the positions computed this step
                    i = p // bs
                    if i >= len(table):
                        break
                    if p % bs == bs - 1:
                        tokens = tokens if tokens is not None else data.get_token_ids()
                        self.gpu[table[i]] = hash(tuple(tokens[:p + 1]))
                        self.meant.pop(table[i], None)
                    elif p % bs == 0 or p == start:
                        self.gpu[table[i]] = None
                        self.meant.pop(table[i], None)
                if prompt:  # full prompt blocks this chunk did not reach
                    reached = -(-seq_len // bs)
                    full = min(len(table), data.get_prompt_len() // bs)
                    if reached < full:
                        tokens = tokens if tokens is not None else data.get_token_ids()
                        for i in range(reached, full):
                            self.meant[table[i]] = (seq_id, tokens, i)
        return found

    def _how_skipped(self, block: int, seq_id: int, want: int) -> tuple[str, str]:
        """The mechanism of a ``KV_PREFIX_MAP`` finding, as (the sentence's second half, the
        record's ``mechanism`` tag): whether ``block`` was last listed, uncomputed, in a
        sequence's prefill for the same tokens (another's, or this one's before a preemption: a
        prefix-cache hit on a block freed before its KV was computed, ``uncomputed-hit``) or not
        (a fresh block counted as cached, as with #18957's stale ``ComputedBlocksTracker``
        count, ``fresh-block``)."""
        meant = self.meant.get(block)
        if meant is not None:
            other, tokens, i = meant
            if hash(tuple(tokens[:(i + 1) * self.bs])) == want:
                who = ("this sequence was given before (preempted or rescheduled since)"
                       if other == seq_id else f"sequence {other} was given")
                return (f"a prefix-cache hit on a block {who} for the same tokens and never "
                        "computed", "uncomputed-hit")
        return ("not a prefix-cache hit on these tokens: a fresh block counted as cached",
                "fresh-block")


#: a GPU block no worker request ever wrote (absent from ``KVContent.gpu``)
_NEVER = object()
#: what a block skipped as cached holds instead of the tokens' KV, by its ``KVContent`` entry
#: (anything else: the identity of other tokens): the mechanism differs (#18957: a block
#: reused for other tokens; a block freed before its prompt chunk was computed: never written)
_HELD = {_NEVER: "nothing was ever computed into it", None: "it was last written in part and never completed"}


#: how a child group of an ``n > 1`` request ended, by its sequence's status
#: (``vllm/sequence.py:SequenceStatus``), as (the sentence's words, the record's ``mechanism``):
#: the residue's mechanism differs (#14353: a child that finished and was collected; #12973: a
#: child the scheduler ignored, never collected)
_ENDED = {"FINISHED_STOPPED": ("finished (stop)", "finished"),
          "FINISHED_LENGTH_CAPPED": ("finished (length)", "finished"),
          "FINISHED_ABORTED": ("aborted", "aborted"),
          "FINISHED_IGNORED": ("ignored by the scheduler", "ignored")}


def _how_child_ended(group, key: str) -> tuple[str, str | None]:
    """(``finished (length)``, ``finished``), (``ignored by the scheduler``, ``ignored``) ...:
    the status of the child ``SequenceGroup`` ``key`` that its ``SequenceGroupBase``
    (``vllm/sequence.py``) holds in ``finished_reqs`` or ``to_be_finished``; (``status
    unknown``, None) where neither holds it."""
    child = None
    for attr in ("finished_reqs", "to_be_finished"):
        child = (getattr(group, attr, None) or {}).get(key) or child
    seqs = getattr(child, "seqs", None) or ()
    names = {getattr(getattr(s, "status", None), "name", None) for s in seqs} - {None}
    if len(names) != 1:
        return "status unknown", None
    name = names.pop()
    return _ENDED.get(name, (f"still {name}", None))


class V0Auditor:
    """The observer (``StepLoop``'s protocol) for ``level: v0-engine``: every check above after
    each ``schedule()`` and after each engine step, the double-free hook inside every
    ``RefCounter.decr`` of the block allocators."""

    stop_exception = AuditStop

    def __init__(self, adapter, keep_going: bool = False, max_records: int = 200):
        self.adapter = adapter
        self.keep_going = keep_going
        self.max_records = max_records
        self.violations: list[Violation] = []
        self._keys: set[tuple] = set()
        self._step_new: list[Violation] = []
        self.checks = 0
        self.dropped = 0
        self.stopped: dict | None = None
        self.loop = None
        self.books: V0Books | None = None
        self.hook_names: list[str] = []
        self.hook_calls: Counter = Counter()
        self._undo: list = []
        self.loop_ended = None  # the loop finish() was given (the end-of-run checks read it)
        #: child group id -> the step it was first seen left behind in seq_id_to_seq_group
        self._residue_since: dict[str, int] = {}
        self.kv: KVContent | None = None

    # ---- observer protocol ----------------------------------------------------------------
    def attach(self, loop) -> None:
        self.loop = loop
        self.books = read_books(loop.scheduler)
        if not self.books.readable:
            return
        for device, allocator in self.books.allocators.items():
            if isinstance(self.books, V1Books):
                self._hook_free(device, allocator)
            else:
                self._hook_decr(getattr(device, "name", str(device)), allocator)

    def before_execute(self, step: int, req) -> None:
        """The worker got ``req`` (an ``ExecuteModelRequest``): :class:`KVContent`'s check of
        the blocks it is told to skip as cached; a finding stops the run inside the call (as the
        double-free hook does), unless ``keep_going``."""
        loop = self.loop
        if self.kv is None:
            cc = getattr(getattr(loop, "engine_config", None), "cache_config", None)
            mc = getattr(getattr(loop, "engine_config", None), "model_config", None)
            if cc is None or getattr(mc, "get_sliding_window", lambda: None)() is not None:
                return  # V0 prefix caching does not skip blocks with a sliding window
            self.kv = KVContent(int(cc.block_size))
        for v in self.kv.execute(req, loop.request_of):
            v.phase = "in Worker.execute_model"
            if self._record(v, step, v.phase) and not self.keep_going:
                self.stopped = {"step": step, "code": v.code, "phase": v.phase}
                raise AuditStop(v)

    def after_schedule(self, step: int, so, scheduled) -> bool:
        return self._record_all(self._run_checks(Moment(step, AFTER_SCHEDULE, so, scheduled)),
                                step, "after schedule")

    def after_update(self, step: int, so, line: TraceLine) -> bool:
        return self._record_all(self._run_checks(Moment(step, AFTER_UPDATE, so, line=line)),
                                step, "after step")

    def annotate(self, line: TraceLine) -> None:
        if self._step_new:
            line.violations = [v.brief() for v in self._step_new]
        self._step_new = []

    def finish(self, loop, outcome: str) -> bool:
        """End-of-run: after a clean run every GPU block is back (``KV_LEAK``)."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self.loop_ended = loop
        for v in self._run_checks(Moment(loop.step, END_OF_RUN, outcome=outcome)):
            self._record(v, loop.step, "end of run")
        return bool(self.violations)

    def _run_checks(self, moment: Moment) -> list[Violation]:
        """Every registered check of ``moment.phase`` at level v0-engine, in order."""
        found: list[Violation] = []
        for c in checks_for(moment.phase, V0_LEVELS[0], moment.outcome):
            found += c.run(self, moment)
        return found

    def summary(self) -> AuditSummary:
        by_code = Counter(v.code for v in self.violations)
        unread = list(self.books.unread) if self.books is not None else []
        return AuditSummary(self.keep_going, self.stopped, self.checks, dict(by_code),
                            len(self.violations), self.dropped, list(self.hook_names),
                            dict(self.hook_calls), unread)

    # ---- checks ---------------------------------------------------------------------------
    def _check(self) -> list[Violation]:
        self.checks += 1
        b = self.books
        if b is None:
            return []
        self._check_residue(getattr(self.loop, "step", 0))
        if not b.readable:
            return check_queues(b, None, set())[0] + self._check_aborted(b)
        tables = b.tables()
        if isinstance(b, V1Books):
            found, req_of_seq = check_queues(b, tables, set())
            return found + self._check_aborted(b) + check_books_v1(b, req_of_seq)
        gpu = b.pools().get("GPU", {}).get("all", set())
        found, req_of_seq = check_queues(b, tables, gpu)
        return found + self._check_aborted(b) + check_books(b, req_of_seq)

    def _check_residue(self, step: int) -> None:
        """Note the step each key of ``seq_id_to_seq_group`` is first seen left behind (see
        :meth:`residue`); reported only at the end of a clean run."""
        for key in self.residue_keys(self.loop):
            self._residue_since.setdefault(key, step)

    @staticmethod
    def residue_keys(loop) -> list[str]:
        """Keys of the engine's ``seq_id_to_seq_group`` (``vllm/engine/llm_engine.py``; filled by
        ``vllm/sequence.py:ParallelSampleSequenceGroup.add_request``, one per child group of an
        ``n > 1`` request) whose group is in no queue of any scheduler (``waiting``, ``running``,
        ``swapped``, ``_async_stopped``) and whose id no longer waits in the scheduler's
        ``_finished_requests_ids``: the engine already collected the finish
        (``Scheduler.get_and_reset_finished_requests_ids`` in ``LLMEngine.step``, where 0.8.0
        deletes the key), so nothing takes the entry out any more. ``[]`` where the release has
        no such map."""
        engine = getattr(loop, "engine", None)
        mapping = getattr(engine, "seq_id_to_seq_group", None)
        if not mapping:
            return []
        scheds = engine.scheduler if isinstance(engine.scheduler, list) else [engine.scheduler]
        held: set[str] = set()
        for s in scheds:
            for q in (s.waiting, s.running, s.swapped, getattr(s, "_async_stopped", ()) or ()):
                held.update(sg.request_id for sg in q)
            held.update(getattr(s, "_finished_requests_ids", ()) or ())
        return [k for k in list(mapping) if k not in held]

    def residue(self, loop, end_step: int) -> list[Violation]:
        """``REQ_RESIDUE`` records for the keys :meth:`residue_keys` finds now; the record's step
        is the step the key was first seen left behind."""
        out = []
        mapping = getattr(getattr(loop, "engine", None), "seq_id_to_seq_group", None) or {}
        for key in self.residue_keys(loop):
            at = self._residue_since.get(key, end_step)
            group = mapping.get(key)
            parent = getattr(group, "group_id", None) or key
            how, mech = _how_child_ended(group, key)
            out.append(make_violation(REQ_RESIDUE, (
                f"{parent} (its group {key}, {how}) left the scheduler "
                f"by step {at} but is still a key of LLMEngine.seq_id_to_seq_group at the end of "
                f"the run (step {end_step}); expected the entry dropped when the engine collects "
                "the finished request"),
                requests=[parent], step=at, mechanism=mech))
        return out

    def _check_aborted(self, b: V0Books) -> list[Violation]:
        """``REQ_STATE``: a sequence group of a request the caller aborted still in a queue
        after ``LLMEngine.abort_request`` returned (``Scheduler.abort_seq_group`` takes every
        group of the request out at once; a child of an ``n > 1`` request counts for its
        parent, by the engine's own ``seq_id_to_seq_group``)."""
        loop = self.loop
        aborted = getattr(loop, "aborted_ids", None)
        if not aborted:
            return []
        found = []
        for qname, groups in b.queues().items():
            for sg in groups:
                rid = loop.request_of(sg.request_id)
                if rid in aborted:
                    what = rid if rid == sg.request_id else f"{rid} (its group {sg.request_id})"
                    found.append(make_violation(
                        REQ_STATE, f"{what} is in {qname} after LLMEngine.abort_request({rid})",
                        requests=[rid]))
        return found

    def _hook_decr(self, device: str, allocator) -> None:
        """Wrap ``RefCounter.decr`` of ``allocator`` (on the instance): a block given back at
        ref count 0 is ``KV_DOUBLE_FREE``, recorded before vLLM's own assert runs."""
        rc = getattr(allocator, "_refcounter", None)
        rc = getattr(rc, "_refcounter", rc)
        if rc is None or not hasattr(rc, "decr") or "decr" in vars(rc):
            return
        decr = rc.decr
        auditor = self

        def hooked_decr(block_id):
            auditor.hook_calls[f"{device}.decr"] += 1
            before = getattr(rc, "_refcounts", {}).get(block_id)
            if before == 0:
                auditor._hook_report(make_violation(
                    KV_DOUBLE_FREE, f"{device} block {block_id} given back with ref count 0",
                    blocks=[block_id]))
            return decr(block_id)

        rc.decr = hooked_decr
        self._undo.append(lambda: vars(rc).pop("decr", None))
        self.hook_names.append(f"{device}.RefCounter.decr")

    def _hook_free(self, device: str, allocator) -> None:
        """Wrap ``free`` of a ``BlockSpaceManagerV1`` allocator (``UncachedBlockAllocator`` /
        ``CachedBlockAllocator``, on the instance): a block given back at ref count 0 is
        ``KV_DOUBLE_FREE``, recorded before the allocator's own ``ValueError("Double free!
        ...")`` (which still follows with ``keep_going``)."""
        if not callable(getattr(allocator, "free", None)) or "free" in vars(allocator):
            return
        free = allocator.free
        auditor = self
        where = f"{type(allocator).__name__}.free"

        def hooked_free(block, *args, **kwargs):
            auditor.hook_calls[f"{device}.free"] += 1
            if getattr(block, "ref_count", None) == 0:
                n = getattr(block, "block_number", None)
                auditor._hook_report(make_violation(
                    KV_DOUBLE_FREE, f"{device} block {n} given back with ref count 0",
                    blocks=[n] if isinstance(n, int) else []), phase=f"in {where}")
            return free(block, *args, **kwargs)

        allocator.free = hooked_free
        self._undo.append(lambda: vars(allocator).pop("free", None))
        self.hook_names.append(f"{device}.{where}")

    def _hook_report(self, v: Violation, phase: str = "in RefCounter.decr") -> None:
        step = getattr(self.loop, "step", 0)
        v.stack = [f"{fs.filename}:{fs.lineno} {fs.name}" for fs in traceback.extract_stack()[:-2]
                   if "/vllm/" in fs.filename][-8:]
        v.phase = phase
        if self._record(v, step, v.phase) and not self.keep_going:
            self.stopped = {"step": step, "code": v.code, "phase": v.phase}
            raise AuditStop(v)

    def _record(self, v: Violation, step: int, phase: str) -> bool:
        key = (v.code, tuple(v.requests), tuple(v.blocks), v.message)
        if key in self._keys:
            return False
        if len(self.violations) >= self.max_records:
            self.dropped += 1
            return False
        self._keys.add(key)
        v.step = step if v.step is None else v.step
        v.phase = v.phase or phase
        self.violations.append(v)
        self._step_new.append(v)
        return True

    def _record_all(self, found: list[Violation], step: int, phase: str) -> bool:
        new = [v for v in found if self._record(v, step, phase)]
        if new and not self.keep_going:
            self.stopped = {"step": step, "code": new[0].code, "phase": phase}
            return True
        return False


# ---- the registered checks of level v0-engine (audit/registry.py; run in this order) -------

@check("V0 books", codes=(REQ_STATE, KV_REFCOUNT, KV_FREE_QUEUE, KV_LEAK),
       phase=(AFTER_SCHEDULE, AFTER_UPDATE), levels=V0_LEVELS,
       needs="a block manager whose books are readable (SelfAttnBlockSpaceManager or V1)",
       text="queues and statuses, aborted requests out of every queue, each allocator's ref "
            "counts against the block tables, the free list and the evictor")
def v0_books(auditor, m: Moment) -> list[Violation]:
    return auditor._check()


@check("V0 residue", codes=REQ_RESIDUE, phase=END_OF_RUN, outcomes=("clean",),
       levels=V0_LEVELS, needs="LLMEngine.seq_id_to_seq_group (n > 1)",
       text="no collected child group of an n > 1 request is still a key of "
            "LLMEngine.seq_id_to_seq_group")
def v0_residue(auditor, m: Moment) -> list[Violation]:
    auditor._check_residue(m.step)
    return auditor.residue(auditor.loop_ended, m.step)


@check("V0 GPU blocks back", codes=KV_LEAK, phase=END_OF_RUN, outcomes=("clean",),
       levels=V0_LEVELS, text="after a clean run every GPU block is free")
def v0_blocks_back(auditor, m: Moment) -> list[Violation]:
    b = auditor.books
    if b is None or not b.readable:
        return []
    try:
        free = b.bm.get_num_free_gpu_blocks()
        total = b.gpu_total()
    except Exception:  # noqa: BLE001 - books unreadable after the run: nothing to add
        return []
    if free == total:
        return []
    return [make_violation(KV_LEAK, f"at the end of the run {total - free} GPU block(s) are "
                                    f"not back ({free} of {total} free)")]


add(Check("V0 double free", (KV_DOUBLE_FREE,), (IN_CALL,), V0_LEVELS,
          "a block given back at ref count 0, caught in each allocator's RefCounter.decr (or "
          "BlockSpaceManagerV1's allocator free) before vLLM's own assert"))
add(Check("V0 KV content", (KV_PREFIX_MAP,), (IN_CALL,), V0_LEVELS,
          "a block the worker is told to skip as a cached prefix holds KV of exactly that "
          "sequence's tokens (in Worker.execute_model)",
          needs="prefix caching without a sliding window"))
