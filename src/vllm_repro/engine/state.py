"""Reading a live scheduler's state: the one place that knows where each release keeps it.

Used by the adapter (queues and free blocks for the trace) and by the audit (its books).
Standard library only (runs inside release environments). Nothing compares version numbers;
each probe names the vLLM source it follows:

- the block pool: ``KVCacheManager.block_pool`` (0.8 to 0.33; 0.9.2+ also
  ``KVCacheCoordinator.block_pool``), ``vllm/v1/core/block_pool.py:BlockPool``; in 0.6.x/0.7.x
  ``KVCacheManager.block_pool`` is the list of blocks and the manager keeps the rest itself.
- the block tables (``req_to_blocks``: request id -> blocks), one per KV cache group:
  ``KVCacheCoordinator.single_type_managers[i]`` (0.9.2+, ``kv_cache_coordinator.py``),
  ``KVCacheManager.single_type_manager`` (0.9.0/0.9.1), or the ``KVCacheManager`` itself (0.8.x).
- other holders of block references: ``Scheduler.deferred_frees`` (blocks popped from a
  table whose return to the pool waits for an in-flight step) and
  ``SingleTypeKVCacheManager._pending_cow_copies`` (copy-on-write endpoints), where they exist.
- the free queue: ``FreeKVCacheBlockQueue`` with ``fake_free_list_head/tail`` (0.10.1+) or
  ``free_list_head`` (older), ``num_free_blocks``; ``BlockPool.get_num_free_blocks()``.
- the prefix-cache hash map ``BlockPool.cached_block_hash_to_block``: a dict of
  ``hash -> {block_id: block}`` (<= 0.10) or a ``BlockHashToBlockMap`` whose ``_cache`` maps a
  hash to a block or a dict of them (0.11 to 0.33), to a block id with ``_dup_ids`` for the
  hashes of several blocks (0.34: :class:`BlockIdHashMap`); ``cached_block_hashes_by_block`` (secondary hashes
  of one block, where it exists). A block's own hash is the ``KVCacheBlock`` field the
  capabilities record names (``kv_block_hash``: ``_block_hash``, ``block_hash`` in 0.34).
- the request queues: ``Scheduler.running``, ``waiting``, ``skipped_waiting``,
  ``kv_holding_waiting`` (whichever exist); a waiting queue is a deque, a list or a
  ``RequestQueue`` (``vllm/v1/core/sched/request_queue.py``).
- the scheduler's limits: ``max_num_scheduled_tokens`` / ``max_num_running_reqs`` /
  ``max_model_len``, else ``scheduler_config.max_num_batched_tokens`` / ``max_num_seqs``.
- ``SchedulerOutput`` (``vllm/v1/core/sched/output.py``): ``scheduled_new_reqs``,
  ``scheduled_cached_reqs`` (one ``CachedRequestData``, or a list of them up to 0.9.1), or the
  first generation's ``scheduled_resumed_reqs`` + ``scheduled_running_reqs``;
  ``scheduled_spec_decode_tokens``.
"""

from __future__ import annotations

from operator import attrgetter

_block_id = attrgetter("block_id")  # KVCacheBlock.block_id

#: scheduler attributes that are queues of waiting requests, where a release has them
WAITING_QUEUES = ("waiting", "skipped_waiting", "kv_holding_waiting")


def iter_queue(q) -> list:
    """Requests in a waiting queue: a deque, a list, or vLLM's ``RequestQueue`` (heap for the
    priority policy; iterating it yields requests in policy order). A heap that cannot be
    iterated (``TypeError`` comparing two ``Request`` objects with equal keys, vLLM #29747) is
    read raw: its entries are requests or ``(priority, arrival_time, request)`` tuples,
    depending on the release (vllm/v1/core/sched/request_queue.py, PriorityRequestQueue)."""
    try:
        return list(q)
    except Exception:  # noqa: BLE001 - e.g. TypeError comparing Requests in a broken heap
        items = getattr(q, "_heap", None)
        if items is None:
            raise
        return [x[-1] if isinstance(x, tuple) else x for x in items]


# ---- KV cache layout ---------------------------------------------------------------------
def block_pool(scheduler):
    """The ``BlockPool`` (or, 0.6.x/0.7.x, the list of blocks): the manager's, else its
    coordinator's; None where neither has one."""
    kvm = scheduler.kv_cache_manager
    pool = getattr(kvm, "block_pool", None)
    if pool is None:
        pool = getattr(getattr(kvm, "coordinator", None), "block_pool", None)
    return pool


def num_free_blocks(scheduler) -> int | None:
    """``BlockPool.get_num_free_blocks()``, else the manager's own free queue (0.6.x/0.7.x)."""
    pool = block_pool(scheduler)
    if pool is not None and hasattr(pool, "get_num_free_blocks"):
        return pool.get_num_free_blocks()
    kvm = scheduler.kv_cache_manager
    if hasattr(kvm, "free_block_queue"):
        return kvm.free_block_queue.num_free_blocks
    return None


def managers_of(kvm) -> list:
    """The holders of ``req_to_blocks``, one per KV cache group: the coordinator's
    ``single_type_managers`` (0.9.2+), ``single_type_manager`` (0.9.0/0.9.1), else ``kvm``."""
    coord = getattr(kvm, "coordinator", None)
    if coord is not None and hasattr(coord, "single_type_managers"):
        return list(coord.single_type_managers)
    if hasattr(kvm, "single_type_manager"):
        return [kvm.single_type_manager]
    return [kvm]


def req_block_hashes(kvm):
    """The manager's own request id -> block hashes table (``req_to_block_hashes``, before the
    request carried its ``block_hashes``); None where absent."""
    return getattr(kvm, "req_to_block_hashes", None)


def max_active_reqs(scheduler, default):
    """``Scheduler.max_num_active_reqs`` where the release has it, else ``default``."""
    return getattr(scheduler, "max_num_active_reqs", None) or default


class KVLayout:
    """Where one scheduler keeps its KV books: ``kvm`` (the KV cache manager), ``pool`` (what
    holds ``free_block_queue`` and the hash map: the ``BlockPool``, or the 0.6/0.7 manager),
    ``blocks`` (every ``KVCacheBlock``, by id), ``managers`` (one holder of ``req_to_blocks``
    per KV cache group), ``null`` / ``null_id``, ``caching``, and the scheduler's limits.

    Raises ``AttributeError`` naming what is missing."""

    def __init__(self, scheduler):
        kvm = scheduler.kv_cache_manager
        self.kvm = kvm
        coord = getattr(kvm, "coordinator", None)
        self.pool = getattr(kvm, "block_pool", None) or getattr(coord, "block_pool", None)
        if self.pool is None:
            raise AttributeError("the KV cache manager has no block_pool (nor a coordinator's)")
        self.managers = managers_of(kvm)
        if not all(hasattr(m, "req_to_blocks") for m in self.managers):
            raise AttributeError("no req_to_blocks block table found on the KV cache managers")
        if isinstance(self.pool, list):
            # 0.6.x/0.7.x: the KVCacheManager keeps the pool itself (``block_pool`` is the list of
            # KVCacheBlocks; ``free_block_queue``, ``cached_block_hash_to_block`` and
            # ``enable_caching`` are its own attributes; no null block) - kv_cache_manager.py
            self.blocks = self.pool
            self.pool = kvm
        else:
            self.blocks = self.pool.blocks
        self.num_blocks = len(self.blocks)
        self.null = getattr(self.pool, "null_block", None)
        self.null_id = self.null.block_id if self.null is not None else None
        self.caching = bool(getattr(self.pool, "enable_caching", False))
        cfg = getattr(scheduler, "scheduler_config", None)
        self.max_tokens = getattr(scheduler, "max_num_scheduled_tokens", None) or \
            getattr(cfg, "max_num_batched_tokens", None)
        self.max_seqs = getattr(scheduler, "max_num_running_reqs", None) or \
            getattr(cfg, "max_num_seqs", None)
        self.max_model_len = getattr(scheduler, "max_model_len", None)
        #: the block size prefix hashes are computed at (``BlockPool.hash_block_size``, 0.33)
        self.hash_block_size = getattr(self.pool, "hash_block_size", None)


def extra_holders(scheduler, managers) -> list[tuple[str, list]]:
    """``(label, blocks)`` for references held outside the block tables: deferred frees
    (``Scheduler.deferred_frees``: ``(fence, blocks)`` pairs) and copy-on-write endpoints
    (``SingleTypeKVCacheManager._pending_cow_copies``: block pairs)."""
    out = []
    deferred = getattr(scheduler, "deferred_frees", None)
    if deferred:
        for fence, blocks in deferred:
            out.append((f"deferred-free@{fence}", list(blocks)))
    for g, m in enumerate(managers):
        cow = getattr(m, "_pending_cow_copies", None)
        if cow:
            out.append((f"cow-copy[g{g}]", [b for pair in cow for b in pair]))
    return out


def free_queue_ends(pool) -> tuple:
    """(the first free block or what ends the walk, the tail sentinel or None): with
    ``fake_free_list_head/tail`` (0.10.1+) the walk ends at the tail sentinel, with a bare
    ``free_list_head`` (older) at None."""
    fq = pool.free_block_queue
    head = getattr(fq, "fake_free_list_head", None)
    if head is not None:
        return head.next_free_block, fq.fake_free_list_tail
    return getattr(fq, "free_list_head", None), None


def bare_free_head(pool):
    """The first free block of a queue without sentinels (``free_list_head``, before 0.10.1):
    linked though its ``prev_free_block`` is None. None where the queue has sentinels."""
    fq = pool.free_block_queue
    if hasattr(fq, "fake_free_list_head"):
        return None
    return getattr(fq, "free_list_head", None)


def free_list(pool, num_blocks: int, ids: list | None = None) -> tuple[list, bool]:
    """The blocks linked in ``pool.free_block_queue``, head first, and whether the walk ended
    properly (False: a cycle, or more links than blocks). ``ids``: a list to append each
    walked block's ``block_id`` to, in the same walk (each block is read once)."""
    cur, tail = free_queue_ends(pool)
    out = []
    append = out.append
    ended = False
    for _ in range(num_blocks + 2):  # (a counted loop: the audit walks the queue often)
        if cur is None or cur is tail:
            ended = True
            break
        append(cur)
        cur = cur.next_free_block
    if ids is not None:  # (read after the walk, at C speed: one Python call less a block)
        ids += map(_block_id, out)
    return out, ended  # not ended: num_blocks + 2 linked, more than the pool has


def pool_of(owner):
    """The pool a ``KVCacheBlock.pool`` names: the ``BlockPool`` itself (0.33) or a
    ``weakref.ref`` to it (0.34: "Weak to avoid ref cycles"), dereferenced; None for a dead
    reference."""
    import weakref

    return owner() if isinstance(owner, weakref.ref) else owner


def free_count(pool) -> int:
    """``FreeKVCacheBlockQueue.num_free_blocks``."""
    return pool.free_block_queue.num_free_blocks


def hash_map(pool):
    """The prefix-cache map as a dict (hash -> block or {block_id: block}), or a
    :class:`BlockIdHashMap` read the same way where the map holds block ids (0.34); None where
    the map has no ``_cache`` dict."""
    m = pool.cached_block_hash_to_block
    if isinstance(m, dict):
        return m
    cache = getattr(m, "_cache", None)
    dups, blocks = getattr(m, "_dup_ids", None), getattr(m, "_blocks", None)
    if cache is not None and dups is not None and blocks is not None:
        return BlockIdHashMap(cache, dups, blocks)
    return cache


class BlockIdHashMap:
    """0.34's ``BlockHashToBlockMap`` (``vllm/v1/core/block_pool.py``), whose entries hold
    block ids: ``_cache`` maps a hash to one block id, ``_dup_ids`` a hash several blocks are
    cached under to ``{block id: None}`` (in insertion order), ``_blocks`` is the pool's list.
    Read as the older map is: :meth:`get` gives the block, or ``{block id: block}`` for a hash
    of several; :meth:`items` every key so; ``len`` the number of keys."""

    __slots__ = ("_ids", "_dups", "_blocks")

    def __init__(self, ids: dict, dups: dict, blocks: list):
        self._ids, self._dups, self._blocks = ids, dups, blocks

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, key, default=None):
        dup = self._dups.get(key)
        if dup is not None:
            blocks = self._blocks
            return {i: blocks[i] for i in dup}
        i = self._ids.get(key)
        return default if i is None else self._blocks[i]

    def items(self):
        get = self.get
        return [(k, get(k)) for k in list(self._ids)]


def secondary_hashes(pool) -> dict:
    """block id -> extra hashes it is cached under (0.33's ``cached_block_hashes_by_block``)."""
    return getattr(pool, "cached_block_hashes_by_block", None) or {}


def plain_block_hash(key):
    """The block hash without its KV cache group (``BlockHashWithGroupId``: a namedtuple with
    ``block_hash`` in 0.9/0.10, bytes ending in a 4-byte group id in 0.11+)."""
    if isinstance(key, (bytes, bytearray)):
        return bytes(key[:-4])
    inner = getattr(key, "block_hash", None)
    if inner is not None and hasattr(key, "group_id"):
        return inner
    return key


def hash_checkable_groups(layout: KVLayout, tokens_known: bool = False) -> list[int]:
    """The KV cache groups whose tables can be checked block by block against a request's block
    hashes: the manager counts its cached blocks (``num_cached_block``) and a cache block is one
    hash block (``block_size`` == 0.33's ``BlockPool.hash_block_size``, where it exists), or,
    where blocks say how many prefix tokens their hash covers (``tokens_known``:
    ``KVCacheBlock.block_hash_num_tokens``), a whole number of hash blocks (the block's hash is
    then the request's hash at that prefix boundary: ``BlockPool._get_partial_block_hash``)."""
    hbs = layout.hash_block_size
    return [g for g, m in enumerate(layout.managers)
            if hasattr(m, "num_cached_block")
            and (hbs is None or getattr(m, "block_size", hbs) == hbs
                 or (tokens_known and getattr(m, "block_size", 0) % hbs == 0))]


# ---- request queues ------------------------------------------------------------------------
def named_queues(scheduler) -> list[tuple[str, list]]:
    """``(name, requests)`` for ``running`` and every waiting queue the release has."""
    out = [("running", list(scheduler.running))]
    for name in WAITING_QUEUES:
        q = getattr(scheduler, name, None)
        if q is not None:
            out.append((name, iter_queue(q)))
    return out


def kv_holding_ids(scheduler) -> set:
    """Ids in ``Scheduler.kv_holding_waiting`` (waiting requests allowed to keep their KV)."""
    q = getattr(scheduler, "kv_holding_waiting", None)
    return {r.request_id for r in iter_queue(q)} if q is not None else set()


def queue_ids(scheduler, preempted_status) -> tuple[list[str], list[str], list[str]]:
    """(waiting ids, running ids, preempted ids) — ``waiting`` then ``skipped_waiting``;
    preempted are waiting with status ``preempted_status`` (``Scheduler._preempt_request``)."""
    waiting = [r.request_id for r in iter_queue(scheduler.waiting)]
    skipped = getattr(scheduler, "skipped_waiting", None)
    if skipped is not None:
        waiting += [r.request_id for r in iter_queue(skipped)]
    running = [r.request_id for r in scheduler.running]
    preempted = [rid for rid in waiting
                 if getattr(scheduler.requests.get(rid), "status", None) == preempted_status]
    return waiting, running, preempted


# ---- SchedulerOutput -----------------------------------------------------------------------
def cached_reqs(so):
    """``scheduled_cached_reqs`` (a ``CachedRequestData`` or a list of per-request ones), or
    0.6.x/0.7.x's ``scheduled_resumed_reqs`` + ``scheduled_running_reqs`` as one list."""
    cached = getattr(so, "scheduled_cached_reqs", None)
    if cached is None:
        cached = [*getattr(so, "scheduled_resumed_reqs", ()),
                  *getattr(so, "scheduled_running_reqs", ())]
    return cached


def cached_req_ids(so) -> list[str]:
    cached = cached_reqs(so)
    return list(cached.req_ids) if hasattr(cached, "req_ids") else [c.req_id for c in cached]


def computed_before(so) -> tuple[dict[str, int], set]:
    """(request id -> ``num_computed_tokens`` before this step, for new and cached requests;
    the ids of new requests)."""
    before: dict[str, int] = {}
    new_ids = set()
    for nr in so.scheduled_new_reqs:
        before[nr.req_id] = nr.num_computed_tokens
        new_ids.add(nr.req_id)
    cached = cached_reqs(so)
    if isinstance(cached, list):  # <= 0.9.1: one CachedRequestData per request
        for cr in cached:
            before[cr.req_id] = cr.num_computed_tokens
    else:
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
            before[rid] = n
    return before, new_ids


def spec_tokens(so) -> dict:
    """``scheduled_spec_decode_tokens`` (request id -> draft tokens), ``{}`` where absent."""
    return getattr(so, "scheduled_spec_decode_tokens", None) or {}


def grammar_rows(grammar_output, so, spec_counts: dict[str, int]) -> dict[str, list]:
    """Request id -> the grammar bitmask rows of its positions (one per scheduled draft, then
    the bonus position), as the GPU model runner unpacks them. From ``GrammarOutput``
    (``structured_output_request_ids``: a list, ``grammar_bitmask``; what ``EngineCore.step``
    hands ``sample_tokens``, ``vllm/v1/core/sched/output.py``), else from the scheduler
    output's own ``grammar_bitmask`` and ``structured_output_request_ids`` (releases that do not
    split sampling: a dict of request id -> row, or a list). Empty without a bitmask."""
    src = grammar_output if grammar_output is not None else so
    bitmask = getattr(src, "grammar_bitmask", None)
    ids = getattr(src, "structured_output_request_ids", None)
    if bitmask is None or not ids:
        return {}
    if hasattr(bitmask, "numpy"):  # a torch tensor on some releases
        bitmask = bitmask.cpu().numpy()
    order = sorted(ids, key=ids.get) if isinstance(ids, dict) else list(ids)
    rows: dict[str, list] = {}
    at = 0
    for rid in order:
        n = 1 + spec_counts.get(rid, 0)
        rows[rid] = [bitmask[at + i] for i in range(n) if at + i < len(bitmask)]
        at += n
    return rows


def grammar_future(request):
    """The ``concurrent.futures.Future`` of a request's grammar while the release's
    StructuredOutputManager compiles it (``StructuredOutputRequest._grammar``,
    ``vllm/v1/structured_output/request.py``), else None (compiled, failed and resolved, or no
    structured output)."""
    from concurrent.futures import Future

    so_req = getattr(request, "structured_output_request", None)
    fut = getattr(so_req, "_grammar", None) if so_req is not None else None
    return fut if isinstance(fut, Future) else None


# ---- per-request containers, preemption report, what the scheduler may withhold -----------
#: the containers the end-of-run residue check walks (dicts and sets; a deque or list of
#: requests is a queue, which REQ_STATE reads)
_KEYED = (dict, set, frozenset)


def per_request_owners(scheduler) -> list[tuple[str, object]]:
    """``(label, object)`` for every object whose dict and set attributes may be keyed by
    request id: the ``Scheduler``, its ``kv_cache_manager``, the manager's ``coordinator``
    (0.9.2+) and single-type managers (``kv_cache_coordinator.py``), the
    ``structured_output_manager`` (``vllm/v1/structured_output/__init__.py``) and the KV
    connector (``Scheduler.connector``, ``vllm/distributed/kv_transfer``), with the objects of
    vLLM's (or the lab's) own classes those two hold directly (a connector's scheduler half,
    ``connector_scheduler``; a grammar backend; not a tokenizer, whose vocabulary is keyed by
    strings, nor the manager's reasoning parser, a ``ReasoningParser`` holding that vocabulary
    (``reasoner.vocab``, 0.9 to 0.11): a key ``A`` there is the token, not request A).
    Found by attribute, whichever exist."""
    out: list[tuple[str, object]] = [("Scheduler", scheduler)]
    kvm = getattr(scheduler, "kv_cache_manager", None)
    if kvm is not None:
        out.append(("KVCacheManager", kvm))
        coord = getattr(kvm, "coordinator", None)
        if coord is not None:
            out.append(("KVCacheManager.coordinator", coord))
        for g, m in enumerate(managers_of(kvm)):
            if m is not kvm:
                out.append((f"{type(m).__name__}[g{g}]", m))
    for label, attr in (("StructuredOutputManager", "structured_output_manager"),
                        ("KVConnector", "connector")):
        obj = getattr(scheduler, attr, None)
        if obj is None:
            continue
        out.append((label, obj))
        for name, val in _attrs(obj):
            if _is_plain_object(val) and type(val).__module__.split(".")[0] in _OWN_PACKAGES \
                    and not _is_reasoning_parser(val):
                out.append((f"{label}.{name}", val))
    return out


def _is_reasoning_parser(val) -> bool:
    """An instance of vLLM's ``ReasoningParser`` (``vllm/reasoning/abs_reasoning_parsers.py``;
    by class name in its MRO, nothing imported)."""
    return any(k.__name__ == "ReasoningParser" for k in type(val).__mro__)


def _attrs(obj) -> list[tuple[str, object]]:
    try:
        return list(vars(obj).items())
    except TypeError:  # __slots__ only
        return []


def _is_plain_object(val) -> bool:
    """An instance of a library's class with attributes of its own: not a container, number,
    string, class, function, method or module (their types are builtins)."""
    if val is None or isinstance(val, (type, str, bytes, int, float, bool, list, tuple, *_KEYED)):
        return False
    return hasattr(val, "__dict__") and type(val).__module__ != "builtins"


#: packages whose objects the residue walk enters below the connector and the structured-output
#: manager
_OWN_PACKAGES = ("vllm", "vllm_repro")


def keyed_containers(obj) -> list[tuple[str, object]]:
    """``(attribute, container)`` for every dict or set attribute of ``obj`` (defaultdicts,
    OrderedDicts and subclasses included), less the attributes its class names in
    ``audit_static_attrs``: a lab class (a scripted connector) keeps its scenario script there,
    keyed by request id but not per-request state."""
    static = getattr(type(obj), "audit_static_attrs", ())
    return [(name, val) for name, val in _attrs(obj)
            if isinstance(val, _KEYED) and name not in static]


def request_key(key):
    """The request id a container key stands for: the key itself (a string), or a
    ``Request``'s ``request_id`` (sets and dicts keyed by the request object); else None."""
    if isinstance(key, str):
        return key
    rid = getattr(key, "request_id", None)
    return rid if isinstance(rid, str) else None


_ABSENT = object()


def preempted_report(so):
    """``SchedulerOutput.preempted_req_ids`` (the step's preemptions, as the worker is told
    them; ``vllm/v1/core/sched/output.py``): a set of ids, None where the release's output has
    the field but left it unset, and ``ABSENT`` where its output has no such field."""
    return getattr(so, "preempted_req_ids", _ABSENT)


ABSENT = _ABSENT


def worker_max_num_reqs(scheduler):
    """The persistent batch's size on the worker (``GPUModelRunner``'s ``InputBatch(
    max_num_reqs=scheduler_config.max_num_seqs)``); the scheduler's ``max_num_running_reqs``
    where the config is not found; None where neither."""
    cfg = getattr(scheduler, "scheduler_config", None)
    return getattr(cfg, "max_num_seqs", None) or getattr(scheduler, "max_num_running_reqs", None)


def scheduler_paused(scheduler) -> bool:
    """Whether the release's scheduler is paused (``Scheduler._pause_state`` other than
    ``UNPAUSED``, where it exists: ``pause_scheduler``)."""
    st = getattr(scheduler, "_pause_state", None)
    if st is None:
        return False
    name = getattr(st, "name", str(st))
    return name != "UNPAUSED"


def in_flight_ids(scheduler):
    """Ids of requests whose batch is still executing, which the scheduler skips
    (``Scheduler.scheduled_req_ids``, the batch queue's set in 0.9/0.10); empty where absent."""
    return getattr(scheduler, "scheduled_req_ids", None) or ()


def lookahead_tokens(scheduler) -> int:
    """Slots a scheduled request takes beyond its scheduled tokens: draft tokens per request
    (``num_spec_tokens``) and lookahead slots (``num_lookahead_tokens``), where they exist."""
    return (getattr(scheduler, "num_spec_tokens", 0) or 0) + \
        (getattr(scheduler, "num_lookahead_tokens", 0) or 0)


def chunked_prefill(scheduler) -> bool:
    """``SchedulerConfig.chunked_prefill_enabled`` (or ``enable_chunked_prefill``); True where
    neither is found."""
    cfg = getattr(scheduler, "scheduler_config", None)
    for name in ("chunked_prefill_enabled", "enable_chunked_prefill"):
        v = getattr(cfg, name, None)
        if v is not None:
            return bool(v)
    return True


def num_kv_groups(scheduler) -> int:
    return max(1, len(managers_of(scheduler.kv_cache_manager)))


def request_max_tokens(req):
    """``Request.max_tokens`` or its ``sampling_params.max_tokens``; None where neither."""
    n = getattr(req, "max_tokens", None)
    if n is None:
        n = getattr(getattr(req, "sampling_params", None), "max_tokens", None)
    return n


def grammar_pending(req) -> bool:
    """A structured-output request whose grammar is not ready yet
    (``StructuredOutputRequest.is_grammar_ready`` / its ``grammar``)."""
    if not getattr(req, "use_structured_output", False):
        return False
    sor = getattr(req, "structured_output_request", None)
    if sor is None:
        return True
    ready = getattr(sor, "is_grammar_ready", None)
    if callable(ready):
        ready = ready()
    if ready is None:
        ready = getattr(sor, "grammar", None) is not None
    return not ready


def reasoning_parser_class(manager) -> str | None:
    """The name of vLLM's reasoning parser class the ``StructuredOutputManager`` built from
    the config: its ``reasoner_cls`` (0.26+: a parser per request is built from it), else the
    class of the ``reasoner`` it holds (0.9 to 0.11); None where it has neither."""
    cls = getattr(manager, "reasoner_cls", None)
    if cls is None and getattr(manager, "reasoner", None) is not None:
        cls = type(manager.reasoner)
    return getattr(cls, "__name__", None)


def reasoning_ended(requests, ids) -> dict[str, bool | None]:
    """Request id -> the release's own ``StructuredOutputRequest.reasoning_ended`` of each
    structured-output request of ``ids`` still in ``requests`` (the scheduler's ``requests``):
    None before the manager first looked (``should_fill_bitmask`` / ``_get_constraint_bounds``
    read the prompt then), False while the request reasons (its grammar held back), True once
    the reasoning parser saw the end (``should_advance`` / ``accept_tokens`` latch it; the
    grammar advances from there). Requests without a structured-output request are left out."""
    out: dict[str, bool | None] = {}
    for rid in ids:
        sor = getattr(requests.get(rid), "structured_output_request", None)
        if sor is not None and hasattr(sor, "reasoning_ended"):
            value = sor.reasoning_ended
            out[rid] = None if value is None else bool(value)
    return out


def stall_message(scheduler, unfinished: list[str], waiting: list[str] | None,
                  running: list[str] | None, block_size: int,
                  scheduled: dict[str, int] | None = None) -> str:
    """Where each unfinished request of a stalled run is stuck, and why where the books say:
    one clause per request, ``; ``-separated (:func:`stall_clauses`)."""
    return "; ".join(text for text, _ in stall_clauses(scheduler, unfinished, waiting, running,
                                                         block_size, scheduled))


#: the causes :func:`stall_clauses` tells apart (``Stall.cause``, the fuzz signature's
#: ``stall:CAUSE``), most specific first
STALL_CAUSES = ("pool-too-small", "kv-load-not-promoted", "kv-load-in-flight", "kv-load-held",
                "no-free-blocks", "zero-tokens", "placeholders", "waiting", "running", "gone")


def stall_clauses(scheduler, unfinished: list[str], waiting: list[str] | None,
                  running: list[str] | None, block_size: int,
                  scheduled: dict[str, int] | None = None) -> list[tuple[str, str]]:
    """``(clause, cause)`` per unfinished request of a stalled run. A clause names the
    request's queue (``in waiting``, ``in running``, ``in no queue``, ``not in the
    scheduler``), then what holds it, e.g. ``huge in waiting, needs 64 KV blocks for its 1009
    tokens, more than the pool's 50`` or ``A in running, 1 output placeholder(s)``:

    - ``pool-too-small``: with one KV cache group and a ``BlockPool`` whose size it reports
      (``BlockPool.num_gpu_blocks``), the blocks of ``block_size`` tokens it needs for every
      token it computes to finish (``num_prompt_tokens + max_tokens - 1``) are more than the
      pool has (``more than the pool's P``) or fit only by counting the null block (``the
      pool's P with the null block, P - 1 without``);
    - ``kv-load-in-flight`` / ``kv-load-not-promoted``: it waits for its KV connector load
      (``WAITING_FOR_REMOTE_KVS``) that the worker never reported finished, or that was
      reported (``Scheduler.finished_recving_kv_req_ids``) and never promoted to ``WAITING``;
    - ``kv-load-held``: it waits holding the KV blocks a load filled (a connector, computed
      tokens, status ``WAITING``) and is never scheduled;
    - ``no-free-blocks``: it waits needing more KV blocks for its remaining tokens than the
      pool has free, and names who holds the rest (``held by A (3), B (2)``);
    - ``zero-tokens``: the last step scheduled it with 0 tokens (``scheduled``: that step's
      ``num_scheduled_tokens``);
    - ``placeholders``: ``Request.num_output_placeholders`` > 0 (async scheduling: tokens the
      scheduler believes in flight);
    - else its queue (``waiting``, ``running``) or ``gone``.

    Reads ``Scheduler.requests``, the block pool (:func:`block_pool`), the KV cache managers'
    tables and the request's fields; never raises (an unreadable part is left out)."""
    waiting, running = set(waiting or ()), set(running or ())
    scheduled = scheduled or {}
    try:
        pool = block_pool(scheduler)
        total = getattr(pool, "num_gpu_blocks", None) if num_kv_groups(scheduler) == 1 else None
        null = getattr(pool, "null_block", None) is not None
        requests = getattr(scheduler, "requests", {}) or {}
    except Exception:  # noqa: BLE001 - a release without these reads gets queues only
        total, null, requests = None, False, {}
    try:
        free = num_free_blocks(scheduler)
    except Exception:  # noqa: BLE001
        free = None
    connector = getattr(scheduler, "connector", None) is not None
    recved = set(getattr(scheduler, "finished_recving_kv_req_ids", ()) or ())
    clauses = []
    for rid in unfinished:
        req = requests.get(rid)
        where = ("in running" if rid in running else "in waiting" if rid in waiting
                 else "in no queue" if req is not None else "not in the scheduler")
        parts = [f"{rid} {where}"]
        causes = []
        prompt = getattr(req, "num_prompt_tokens", None)
        max_tokens = request_max_tokens(req) if req is not None else None
        if isinstance(total, int) and isinstance(prompt, int) and isinstance(max_tokens, int):
            tokens = prompt + max(max_tokens, 1) - 1
            need = -(-tokens // block_size)
            usable = total - 1 if null else total
            if need > total:
                parts.append(f"needs {need} KV blocks for its {tokens} tokens, more than the "
                             f"pool's {total}")
                causes.append("pool-too-small")
            elif need > usable:
                parts.append(f"needs {need} KV blocks for its {tokens} tokens, the pool's "
                             f"{total} with the null block, {usable} without")
                causes.append("pool-too-small")
        status = getattr(getattr(req, "status", None), "name", None)
        if status == "WAITING_FOR_REMOTE_KVS":
            if rid in recved:
                parts.append("its KV load was reported finished (finished_recving) and never "
                             "promoted out of WAITING_FOR_REMOTE_KVS")
                causes.append("kv-load-not-promoted")
            else:
                parts.append("waits for its KV load (WAITING_FOR_REMOTE_KVS), which the worker "
                             "never reported finished")
                causes.append("kv-load-in-flight")
        elif rid in waiting and req is not None and not causes:
            computed = getattr(req, "num_computed_tokens", 0) or 0
            if connector and status == "WAITING" and computed > 0:
                parts.append(f"holds the KV its load filled ({computed} computed tokens) and is "
                             "never scheduled")
                causes.append("kv-load-held")
            else:
                short = _blocks_short(scheduler, req, block_size, free)
                if short:
                    parts.append(short)
                    causes.append("no-free-blocks")
        placeholders = getattr(req, "num_output_placeholders", 0)
        if isinstance(placeholders, int) and placeholders > 0:
            parts.append(f"{placeholders} output placeholder(s)")
            causes.append("placeholders")
        if rid in scheduled and not scheduled[rid]:
            parts.append("scheduled with 0 tokens in the last step")
            causes.append("zero-tokens")
        if not causes:
            causes.append("running" if rid in running else "waiting" if rid in waiting
                          else "gone")
        clauses.append((", ".join(parts), causes[0]))
    return clauses


def stall_cause(clauses: list[tuple[str, str]]) -> str | None:
    """The stall's cause (``Stall.cause``): the most specific of its clauses' causes in the
    order of :data:`STALL_CAUSES`, None for no clause."""
    found = {cause for _, cause in clauses}
    return next((c for c in STALL_CAUSES if c in found), None)


def _blocks_short(scheduler, req, block_size: int, free) -> str | None:
    """``needs N KV blocks for its next M tokens, F free (held by A (3), B (2))`` where a
    waiting request's remaining tokens need more blocks than the pool has free; else None."""
    try:
        left = (req.num_tokens - (req.num_computed_tokens or 0))
        need = -(-left // block_size)
        if not isinstance(free, int) or need <= free or need <= 0:
            return None
        held: dict[str, int] = {}
        for m in managers_of(scheduler.kv_cache_manager):
            for rid, blocks in (getattr(m, "req_to_blocks", {}) or {}).items():
                n = sum(1 for b in blocks if not getattr(b, "is_null", False))
                if n:
                    held[rid] = held.get(rid, 0) + n
        who = ", ".join(f"{rid} ({n})" for rid, n in sorted(held.items(), key=lambda x: -x[1])[:6])
        return (f"needs {need} KV blocks for its next {left} tokens, {free} free"
                + (f" (held by {who})" if who else ""))
    except Exception:  # noqa: BLE001 - a release whose books read otherwise: left out
        return None


def preemption_marks(scheduler) -> dict[str, int]:
    """Running request id -> ``Request.num_preemptions`` (-1 where the release's ``Request``
    has none), read before a call that may preempt (``schedule()``, ``reset_prefix_cache``,
    ``pause_scheduler``): what :func:`preempted_since` compares. Only running requests can be
    preempted (``Scheduler._preempt_request``), so only they are read."""
    return {r.request_id: getattr(r, "num_preemptions", -1)
            for r in iter_queue(getattr(scheduler, "running", ()))}


def preempted_since(scheduler, before: dict[str, int]) -> list[str]:
    """The requests running at ``before`` (:func:`preemption_marks`) preempted since: status
    ``PREEMPTED`` now, or ``num_preemptions`` up (preempted and resumed in one call), in the
    running order they had."""
    requests = getattr(scheduler, "requests", {})
    out = []
    for rid, count in before.items():
        req = requests.get(rid)
        if req is None:
            continue
        status = getattr(getattr(req, "status", None), "name", None)
        now = getattr(req, "num_preemptions", -1)
        if status == "PREEMPTED" or (count >= 0 and isinstance(now, int) and now > count):
            out.append(rid)
    return out


def flat_stats(stats) -> dict:
    """A ``SchedulerStats`` (``vllm/v1/metrics/stats.py``) as ``{dotted name: number}``: its
    numbers, those of its ``prefix_cache_stats`` / ``spec_decoding_stats`` / ... as
    ``prefix_cache_stats.hits``, list entries as ``name.0``, ``name.1``; strings, sets and
    ``None`` left out."""
    out: dict = {}

    def walk(prefix: str, value, depth: int) -> None:
        if isinstance(value, bool):
            out[prefix] = int(value)
        elif isinstance(value, (int, float)):
            out[prefix] = value
        elif isinstance(value, (list, tuple)) and depth < 3:
            for i, v in enumerate(value[:32]):
                walk(f"{prefix}.{i}", v, depth + 1)
        elif depth < 3 and hasattr(value, "__dict__") and not isinstance(value, type):
            for k, v in vars(value).items():
                if not k.startswith("_"):
                    walk(f"{prefix}.{k}" if prefix else k, v, depth + 1)

    walk("", stats, 0)
    return out


def reports_preemptions_between_steps(scheduler) -> bool:
    """Whether the release's scheduler carries preemptions made outside ``schedule()``
    (``reset_prefix_cache(reset_running_requests=True)``, ``pause``) into the next
    ``SchedulerOutput.preempted_req_ids``: it keeps a set of such ids on itself
    (``Scheduler.reset_preempted_req_ids``, later releases). Releases without one flush those
    requests from the worker's batch another way (``prev_step_scheduled_req_ids.clear()``)."""
    try:
        return any(isinstance(v, set) and k.endswith("preempted_req_ids")
                   for k, v in vars(scheduler).items())
    except TypeError:
        return False
