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
        #: (step, request id, event) for the trace: "load", "recv", "load_failed", "send"
        self.events: list[tuple[int, str, str]] = []

    def step(self, n: int, meta) -> tuple[set[str], set[str], set[int], set[str]]:
        invalid: set[int] = set()
        failed: set[str] = set()
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
