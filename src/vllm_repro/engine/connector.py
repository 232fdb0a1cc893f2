"""The scripted KV connector: a V1 KV connector whose answers come from the scenario.

vLLM's scheduler builds its KV connector itself (``Scheduler.__init__``:
``KVConnectorFactory.create_connector(config=vllm_config, role=KVConnectorRole.SCHEDULER,
...)``, from ``VllmConfig.kv_transfer_config``); the lab only registers this class with the
release's ``KVConnectorFactory`` (``register_connector(name, module, class)``) and names it in
``kv_transfer_config.kv_connector``. Its script (``kv_transfer_config.requests`` of the
scenario) rides in ``kv_connector_extra_config`` (vLLM's own field for a connector's settings).

Two halves, as vLLM splits a connector:

- :class:`ScriptedConnector` (the scheduler half, a subclass of the release's
  ``KVConnectorBase_V1``, ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``):
  ``get_num_new_matched_tokens`` answers the request's ``external_hit_tokens`` beyond the local
  hit and its ``load_async``; ``update_state_after_alloc`` notes which blocks the load writes;
  ``build_connector_meta`` hands the step's loads and sends to the worker as
  :class:`ScriptedConnectorMetadata` (on ``SchedulerOutput.kv_connector_metadata``);
  ``request_finished`` returns ``(delay_free, None)``: True keeps the blocks until the worker
  reports the send finished (``delay_free_on_abort``: an aborted request's too). The first
  ``not_ready_lookups`` lookups of a request answer ``(None, False)`` ("not yet": the
  scheduler skips the request this step and asks again, where the release's base declares
  ``int | None``). :class:`ScriptedHMAConnector` (``kv_transfer_config.supports_hma``, where
  the release's base has ``SupportsHMA``) also answers ``request_finished_all_groups``, so the
  release keeps its hybrid KV cache groups (``VllmConfig``: a connector without it turns the
  hybrid memory allocator off).
- :class:`~vllm_repro.engine.kv_worker.ScriptedWorker` (the worker half, the lab's, inside the
  fake worker; in its own module, which imports nothing from vLLM): reads the
  metadata each executed step, as a GPU worker's connector would, and reports
  ``finished_recving`` at ``recv_done_at_step`` (default: the step the load starts),
  ``finished_sending`` at ``send_done_at_step`` (default: the step it learns of the send) and
  failed loads (``load_fails``: the load's blocks in ``invalid_block_ids``, the request in
  ``failed_recving`` where the release's ``KVConnectorOutput`` has them) through the
  ``KVConnectorOutput`` of the fake runner's ``ModelRunnerOutput``.

The class of the scheduler half is made when this module is imported (vLLM's factory imports it
by name), so importing it needs the release's KV connector package. Runs inside the release
environment (standard library + vLLM).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                              KVConnectorMetadata)

from .kv_worker import ScriptedWorker  # noqa: F401 - the worker half, re-exported

#: the name the lab registers its connector under (``kv_transfer_config.kv_connector``)
NAME = "ScriptedConnector"
#: the name of the scripted connector that declares HMA support (``SupportsHMA``)
HMA_NAME = "ScriptedHMAConnector"
#: the key of ``kv_connector_extra_config`` that holds the scenario's script
SCRIPT_KEY = "vllm_repro_script"
#: the release's ``SupportsHMA`` (``kv_connector/v1/base.py``, 0.11.1+), or None
SupportsHMA = getattr(_base, "SupportsHMA", None)


class ScriptedConnectorMetadata(KVConnectorMetadata):
    """What the scheduler half tells the worker half in one step (``build_connector_meta``):
    ``loads``: request id -> ``(block ids the load writes in KV cache group 0, load_async)``;
    ``load_groups``: request id -> the block ids the load writes, one list per KV cache group
    (null blocks left out); ``sends``: request id -> the block ids (group 0) the connector holds
    after ``request_finished`` (delayed frees), which the send reads."""

    def __init__(self, loads: dict[str, tuple[list[int], bool]], sends: dict[str, list[int]],
                 load_groups: dict[str, list[list[int]]] | None = None):
        self.loads = loads
        self.sends = sends
        self.load_groups = load_groups or {}


def _first_group(block_ids) -> list[int]:
    """The block ids of the first KV cache group: ``KVCacheBlocks.get_block_ids()`` gives one
    list per group (a tuple or a list of lists), or a flat list on the oldest releases."""
    return _groups(block_ids)[0]


def _groups(block_ids) -> list[list[int]]:
    """One list of block ids per KV cache group (a flat list is one group)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [list(g) for g in block_ids]
    return [list(block_ids or ())]


def _null_ids(blocks) -> set[int]:
    """The ids of the null block (``KVCacheBlock.is_null``: a sliding window's skipped or a
    Mamba group's placeholder blocks) among ``KVCacheBlocks.blocks``; no load writes them."""
    out = set()
    for group in getattr(blocks, "blocks", None) or ():
        if isinstance(group, (list, tuple)):
            out.update(b.block_id for b in group if getattr(b, "is_null", False))
    return out


class ScriptedConnector(KVConnectorBase_V1):
    """The scheduler half (see the module docstring). ``script``: request id -> its entry
    (``external_hit_tokens``, ``load_async``, ``delay_free``, ...), read from
    ``kv_transfer_config.kv_connector_extra_config``. The audit's residue walk enters this
    object (``Scheduler.connector``); ``script`` is the scenario's, not per-request state."""

    audit_static_attrs = ("script", "not_ready_log")

    def __init__(self, vllm_config, role, kv_cache_config=None, *args, **kwargs):
        import inspect

        params = inspect.signature(KVConnectorBase_V1.__init__).parameters
        if "kv_cache_config" in params:
            super().__init__(vllm_config, role, kv_cache_config)
        else:
            super().__init__(vllm_config, role)
        ktc = vllm_config.kv_transfer_config
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        self.script: dict[str, dict] = dict(extra.get(SCRIPT_KEY) or {})
        self.block_size = vllm_config.cache_config.block_size
        #: request id -> num_computed_tokens (the local hit) at its last lookup
        self._lookup: dict[str, int] = {}
        #: loads allocated since the last build_connector_meta: id -> (blocks, async)
        self._loads: dict[str, tuple[list[int], bool]] = {}
        #: requests whose frees were delayed since the last build_connector_meta -> their blocks
        self._sends: dict[str, list[int]] = {}
        #: loads allocated since the last build_connector_meta: id -> blocks, one list a group
        self._load_groups: dict[str, list[list[int]]] = {}
        #: request id -> lookups answered "not yet" so far (``not_ready_lookups``)
        self._not_ready: dict[str, int] = {}
        #: request ids answered "not yet" since the lab last read them (the trace's
        #: ``kv_connector.not_ready``; emptied by the engine-core loop after each schedule())
        self.not_ready_log: list[str] = []

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """``(tokens the external cache holds beyond num_computed_tokens, load_async)``: the
        script's ``external_hit_tokens`` less the local hit (0 for a request without one);
        ``(None, False)`` ("not yet", the lookup is still running) for the request's first
        ``not_ready_lookups`` lookups."""
        entry = self.script.get(request.request_id) or {}
        pending = int(entry.get("not_ready_lookups") or 0)
        asked = self._not_ready.get(request.request_id, 0)
        if asked < pending:
            self._not_ready[request.request_id] = asked + 1
            self.not_ready_log.append(request.request_id)
            return None, False
        ext = int(entry.get("external_hit_tokens") or 0)
        n = max(0, ext - int(num_computed_tokens))
        if n:
            self._lookup[request.request_id] = int(num_computed_tokens)
        return n, bool(entry.get("load_async")) and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """Note the blocks a load of ``num_external_tokens`` writes: those covering the tokens
        after the local hit (``blocks``: the request's blocks, ``KVCacheBlocks``)."""
        rid = request.request_id
        local = self._lookup.pop(rid, None)
        if not num_external_tokens or local is None:
            return
        null = _null_ids(blocks)
        bs = self.block_size
        first, last = local // bs, -(-(local + num_external_tokens) // bs)
        groups = [[b for b in ids[first:last] if b not in null]
                  for ids in _groups(blocks.get_block_ids())]
        entry = self.script.get(rid) or {}
        self._loads[rid] = (groups[0], bool(entry.get("load_async")))
        self._load_groups[rid] = groups

    def build_connector_meta(self, scheduler_output) -> ScriptedConnectorMetadata:
        meta = ScriptedConnectorMetadata(dict(self._loads), dict(self._sends),
                                         dict(self._load_groups))
        self._loads.clear()
        self._sends.clear()
        self._load_groups.clear()
        return meta

    def request_finished(self, request, block_ids):
        """``(delay_free, None)``: with ``delay_free`` the connector keeps the blocks of a
        request that finished on its own (stopped, length-capped: not aborted) until the worker
        reports its send finished (``finished_sending``); as NixlConnector's request_finished
        delays only a finished prefill, never an abort (``kv_connector/v1/nixl_connector.py``).
        ``delay_free_on_abort`` delays an aborted request's free too, as a connector whose save
        of it is already under way does (OffloadingConnector with stores in flight)."""
        rid = request.request_id
        self._lookup.pop(rid, None)
        self._loads.pop(rid, None)
        self._load_groups.pop(rid, None)
        self._not_ready.pop(rid, None)
        entry = self.script.get(rid) or {}
        status = getattr(getattr(request, "status", None), "name", "")
        key = "delay_free_on_abort" if status == "FINISHED_ABORTED" else "delay_free"
        delay = bool(entry.get(key))
        if delay:
            self._sends[rid] = _first_group(block_ids)
        return delay, None

    # ---- worker side: the lab's ScriptedWorker stands for it (no forward pass here) -----------
    # The worker role's reports are the ScriptedWorker's, once the lab attaches one
    # (attach_worker): vLLM's own MultiConnector on the worker calls them for its children.
    def attach_worker(self, worker, step_of) -> None:
        """Report through ``worker`` (a :class:`ScriptedWorker` with this child's script);
        ``step_of()``: the engine step being executed."""
        self._worker, self._step_of = worker, step_of
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()

    def get_finished(self, finished_req_ids):
        """``(finished_sending, finished_recving)`` of this step's transfers (None when
        empty, as vLLM's connectors answer), from the bound metadata; the failed loads are kept
        for ``get_block_ids_with_load_errors`` / ``get_transfer_results``."""
        worker = getattr(self, "_worker", None)
        if worker is None:
            return None, None
        meta = getattr(self, "_connector_metadata", None)
        sending, recving, self._load_errors, self._failed = worker.step(self._step_of(), meta)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = set(getattr(self, "_load_errors", ())), set()
        return out

    if hasattr(KVConnectorBase_V1, "get_transfer_results"):
        def get_transfer_results(self, finished_req_ids):
            """The base's ``KVConnectorTransferResults`` with this step's failed loads."""
            sending, recving = self.get_finished(finished_req_ids)
            kw = dict(finished_sending=set(sending or ()), finished_recving=set(recving or ()))
            results = _base.KVConnectorTransferResults
            if "failed_recving" in getattr(results, "__dataclass_fields__", {}):
                kw["failed_recving"] = set(getattr(self, "_failed", ()))
            return results(**kw)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self):
        return None


class MultiWorkerHalf:
    """The worker half under ``kv_connector: MultiConnector``: vLLM's own ``MultiConnector`` in
    its worker role (``kv_connector/v1/multi_connector.py``: it binds each child's share of
    ``MultiKVConnectorMetadata``, merges the children's reports and holds a request's
    ``finished_sending`` until every child that saved it reports, by the scheduler's
    ``extra_async_saves``), built from the engine's ``vllm_config`` and KV cache config on the
    first step; its children are scripted connectors, each reporting through a
    :class:`ScriptedWorker` with its own script. ``step(n, metadata)`` answers as
    :meth:`ScriptedWorker.step`, for what ``GPUModelRunner`` asks the connector after a
    forward pass (``get_finished`` / ``get_transfer_results``, then
    ``get_block_ids_with_load_errors``)."""

    def __init__(self, scripts: list[dict], fields: set[str], build):
        #: (cls, role) -> ``cls(vllm_config=..., role=role, kv_cache_config=...)`` with the
        #: engine's configs, once it is built (the arguments the release's constructor takes)
        self._build = build
        self.scripts, self.fields = scripts, fields
        self.connector = None
        self.workers: list[ScriptedWorker] = []
        self.events: list[tuple[int, str, str]] = []  # shared by the children's workers
        self.completed_jobs: list[int] = []
        self._step = 0

    def _start(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

        self.connector = self._build(MultiConnector, KVConnectorRole.WORKER)
        for child, script in zip(self.connector._connectors, self.scripts):
            worker = ScriptedWorker(script, self.fields)
            worker.events = self.events
            child.attach_worker(worker, lambda: self._step)
            self.workers.append(worker)

    def step(self, n: int, meta) -> tuple[set[str], set[str], set[int], set[str]]:
        if self.connector is None:
            self._start()
        self._step = n
        mc = self.connector
        if meta is None:
            return set(), set(), set(), set()
        mc.bind_connector_metadata(meta)
        try:
            if hasattr(mc, "get_transfer_results"):
                r = mc.get_transfer_results(set())
                sending, recving = set(r.finished_sending), set(r.finished_recving)
                failed = set(getattr(r, "failed_recving", ()) or ())
            else:
                sending, recving = (set(x or ()) for x in mc.get_finished(set()))
                failed = set()
            errors = getattr(mc, "get_block_ids_with_load_errors", None)  # where it has them
            invalid = set((errors() if errors is not None else None) or ())
        finally:
            mc.clear_connector_metadata()
        return sending, recving, invalid, failed

    def transfers_in_flight(self) -> dict[str, tuple[str, list[int]]]:
        out: dict[str, tuple[str, list[int]]] = {}
        for w in self.workers:
            out.update(w.transfers_in_flight())
        return out


if SupportsHMA is not None:
    class ScriptedHMAConnector(ScriptedConnector, SupportsHMA):
        """The scripted connector declaring hybrid memory allocator support (the release's
        ``SupportsHMA``): vLLM keeps the scenario's KV cache groups and calls
        ``request_finished_all_groups`` (block ids: one list per group) instead of
        ``request_finished``; the decision is the same script's."""

        def request_finished_all_groups(self, request, block_ids):
            return self.request_finished(request, block_ids)
else:  # the release has no SupportsHMA: build.py refuses supports_hma before naming it
    ScriptedHMAConnector = None


__all__ = ["HMA_NAME", "MultiWorkerHalf", "NAME", "SCRIPT_KEY", "ScriptedConnector", "ScriptedConnectorMetadata",
           "ScriptedHMAConnector", "ScriptedWorker", "SupportsHMA"]
