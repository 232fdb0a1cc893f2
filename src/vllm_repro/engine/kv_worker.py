"""The worker half of the lab's scripted KV connector (:mod:`vllm_repro.engine.connector`).

What a GPU worker's KV connector reports after each step (``get_finished``,
``get_block_ids_with_load_errors`` in ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``),
from the scenario's script and the scheduler half's metadata. Standard library only (no vLLM:
the unit tests drive it without a release).
"""

from __future__ import annotations


class ScriptedWorker:
    """The worker half (the lab's; see the module docstring). ``script`` as the scheduler
    half's; ``fields``: the fields of the release's ``KVConnectorOutput`` (which failure
    reports it can carry). ``step(n, metadata)`` returns ``(finished_sending,
    finished_recving, invalid_block_ids, failed_recving)`` for step ``n``."""

    def __init__(self, script: dict[str, dict], fields: set[str], blocks_of=None):
        self.script = script
        self.fields = fields
        #: request id -> its block ids now (the first group), for the sends of a connector whose
        #: metadata does not carry them (vLLM's NixlConnector: ``reqs_to_send`` holds deadlines)
        self.blocks_of = blocks_of
        self.recv: dict[str, tuple[int, list[int], bool]] = {}  # id -> (done at, blocks, fails)
        #: request id -> the blocks its load writes, one list per KV cache group
        self.groups: dict[str, list[list[int]]] = {}
        self.send: dict[str, tuple[int, list[int]]] = {}  # id -> (done at, blocks)
        self.failed_once: set[str] = set()
        #: (step, request id, event) for the trace: "load", "recv", "load_failed", "send",
        #: and for vLLM's OffloadingConnector "store" (a store job started), "stored" (done)
        self.events: list[tuple[int, str, str]] = []
        #: OffloadingConnector's transfer jobs in flight: job id -> (done at, request id,
        #: "load" | "store", the GPU blocks a load writes (group 0))
        self.jobs: dict[int, tuple[int, str, str, list[int]]] = {}
        #: the job ids this step completed (what the release's OffloadingConnectorWorker
        #: reports in ``KVConnectorOutput.kv_connector_worker_meta``), read after step()
        self.completed_jobs: list[int] = []

    def step(self, n: int, meta) -> tuple[set[str], set[str], set[int], set[str]]:
        invalid: set[int] = set()
        failed: set[str] = set()
        if meta is not None and hasattr(meta, "load_jobs") and hasattr(meta, "store_jobs"):
            return self._offloading_step(n, meta)
        meta = self._translate(meta)
        if meta is not None and hasattr(meta, "loads"):  # ScriptedConnectorMetadata
            for rid, groups in (getattr(meta, "load_groups", None) or {}).items():
                self.groups[rid] = [list(g) for g in groups]
            for rid, (blocks, is_async) in meta.loads.items():
                entry = self.script.get(rid) or {}
                fails = bool(entry.get("load_fails")) and rid not in self.failed_once
                if fails:
                    self.failed_once.add(rid)
                self.events.append((n, rid, "load"))
                if is_async:
                    done = max(n, int(entry.get("recv_done_at_step") or n))
                    self.recv[rid] = (done, blocks, fails)
                elif fails:  # a synchronous load fails inside this step's forward pass
                    self._fail(rid, blocks, invalid, failed)
                    self.events.append((n, rid, "load_failed"))
            for rid, blocks in meta.sends.items():
                entry = self.script.get(rid) or {}
                self.send[rid] = (max(n, int(entry.get("send_done_at_step") or n)), list(blocks))
        recving = set()
        for rid, (done, blocks, fails) in list(self.recv.items()):
            if done <= n:
                del self.recv[rid]
                recving.add(rid)
                if fails:
                    self._fail(rid, blocks, invalid, failed)
                self.events.append((n, rid, "load_failed" if fails else "recv"))
        sending = {rid for rid, (done, _) in self.send.items() if done <= n}
        for rid in sending:
            del self.send[rid]
            self.events.append((n, rid, "send"))
        for rid in [r for r in self.groups if r not in self.recv]:
            del self.groups[rid]  # a load done (or failed): its blocks are no longer watched
        return sending, recving, invalid, failed

    def _offloading_step(self, n: int, meta) -> tuple[set[str], set[str], set[int], set[str]]:
        """vLLM's OffloadingConnector (``kv_connector/v1/offloading``): its scheduler half hands
        the worker ``OffloadingConnectorMetadata`` (``load_jobs`` / ``store_jobs``: job id ->
        ``TransferJob(req_id, src_spec, dst_spec)``, ``jobs_to_flush``: jobs whose GPU blocks
        are about to be reused). As the release's ``OffloadingConnectorWorker``, a load is
        reported in ``finished_recving`` when done, a store never in ``finished_sending``, and
        every finished job by id (``completed_jobs``, ``kv_connector_worker_meta``). A load
        is done at its request's ``recv_done_at_step``, a store at ``send_done_at_step`` or
        ``store_steps`` steps after the worker learns of it (default: the step it learns of
        it), a flushed job at once (the worker waits
        for it before the blocks are overwritten)."""
        for kind, jobs in (("load", meta.load_jobs), ("store", meta.store_jobs)):
            key = "recv_done_at_step" if kind == "load" else "send_done_at_step"
            for job_id, job in (jobs or {}).items():
                rid = job.req_id
                entry = self.script.get(rid) or {}
                at = int(entry.get(key) or n)
                if kind == "store" and entry.get("store_steps"):
                    at = n + int(entry["store_steps"])  # each store takes that many steps
                blocks = _spec_blocks(_load_dst(job)) if kind == "load" else []
                self.jobs[int(job_id)] = (max(n, at), rid, kind, blocks)
                self.events.append((n, rid, kind))
        for job_id in getattr(meta, "jobs_to_flush", None) or ():
            if job_id in self.jobs:
                _, rid, kind, blocks = self.jobs[job_id]
                self.jobs[job_id] = (n, rid, kind, blocks)
        recving: set[str] = set()
        self.completed_jobs = []
        for job_id, (done, rid, kind, _) in sorted(self.jobs.items()):
            if done <= n:
                del self.jobs[job_id]
                self.completed_jobs.append(job_id)
                if kind == "load":
                    recving.add(rid)
                self.events.append((n, rid, "recv" if kind == "load" else "stored"))
        return set(), recving, set(), set()

    def _translate(self, meta):
        """vLLM's own connector's metadata in the scripted metadata's terms (``loads``,
        ``sends``), or ``meta`` as it is. ``NixlConnectorMetadata``
        (``kv_connector/v1/nixl``): ``reqs_to_recv`` (request id -> ``ReqMeta`` with the
        ``local_block_ids`` the pull writes) are asynchronous loads, as NixlConnector's worker
        reads them remotely between steps; ``reqs_to_send`` (request id -> expiry) are the
        delayed frees of finished prefills, read by the decode side (reported done at
        ``send_done_at_step``, or at once, as the decode side's read or the expiry would)."""
        if meta is None or hasattr(meta, "loads") or not hasattr(meta, "reqs_to_recv"):
            return meta
        recv = getattr(meta, "reqs_to_recv", None) or {}
        loads = {rid: (_first_group(getattr(m, "local_block_ids", ())), True)
                 for rid, m in recv.items()}
        sends = {rid: (_first_group(self.blocks_of(rid)) if self.blocks_of else [])
                 for rid in (getattr(meta, "reqs_to_send", None) or {})}
        out = _Translated(loads, sends)
        out.load_groups = {rid: _groups(getattr(m, "local_block_ids", ()))
                           for rid, m in recv.items()}
        return out

    def transfers_in_flight(self) -> dict[str, tuple[str, list[int]]]:
        """Request id -> ``("load", block ids)`` for an asynchronous load still writing them
        (started, not yet reported in ``finished_recving``), or ``("send", block ids)`` for a
        delayed free whose send still reads them (not yet reported in ``finished_sending``)."""
        out = {rid: ("send", list(blocks)) for rid, (_, blocks) in self.send.items()}
        out.update({rid: ("load", list(blocks)) for rid, (_, blocks, _) in self.recv.items()})
        # OffloadingConnector's loads; its stores read blocks the scheduler may free (it fences
        # their reuse with jobs_to_flush instead), so they are not held to a block table
        out.update({rid: ("load", list(blocks)) for _, rid, kind, blocks in self.jobs.values()
                    if kind == "load"})
        return out

    def _fail(self, rid: str, blocks: list[int], invalid: set[int], failed: set[str]) -> None:
        """Report ``rid``'s load failed: the request in ``failed_recving`` and the blocks in
        ``invalid_block_ids`` (where the release's ``KVConnectorOutput`` has them): those of
        the KV cache groups ``load_fails_groups`` names (default: every group the load wrote;
        ``[]``: no block, the request only), ``blocks`` (group 0) where the metadata gave no
        groups."""
        if "failed_recving" in self.fields:
            failed.add(rid)
        if "invalid_block_ids" in self.fields:
            groups = self.groups.pop(rid, None) or [blocks]
            chosen = (self.script.get(rid) or {}).get("load_fails_groups")
            if chosen is None:
                chosen = range(len(groups))
            for g in chosen:
                if 0 <= g < len(groups):
                    invalid.update(groups[g])


class _Translated:
    """A step's loads and sends (see :meth:`ScriptedWorker._translate`)."""

    def __init__(self, loads: dict[str, tuple[list[int], bool]], sends: dict[str, list[int]]):
        self.loads = loads
        self.sends = sends


def _load_dst(job):
    """The GPU side of an offloading load job: ``TransferJob.dst_spec``, or the second of its
    ``transfer_spec`` pair ``(src, dst)`` where the job has one."""
    if hasattr(job, "dst_spec"):
        return job.dst_spec
    pair = getattr(job, "transfer_spec", None)
    return pair[1] if isinstance(pair, (tuple, list)) and len(pair) == 2 else None


def _spec_blocks(spec) -> list[int]:
    """The GPU block ids of KV cache group 0 in an offloading ``GPULoadStoreSpec``
    (``vllm/v1/kv_offload``: ``block_ids`` ordered by group, ``group_sizes`` per group)."""
    raw = getattr(spec, "block_ids", None)
    ids = [int(b) for b in raw] if raw is not None else []
    sizes = list(getattr(spec, "group_sizes", None) or ())
    return ids[:int(sizes[0])] if sizes else ids


def _first_group(block_ids) -> list[int]:
    """The block ids of the first KV cache group of ``BlockIds`` (one list per group, or a
    flat list)."""
    return _groups(block_ids)[0]


def _groups(block_ids) -> list[list[int]]:
    """One list of block ids per KV cache group (a flat list is one group)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [list(g) for g in block_ids]
    return [list(block_ids or ())]


__all__ = ["ScriptedWorker"]
