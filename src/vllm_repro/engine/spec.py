"""The release side's records of what a run was asked to do: the lab's limits
(:class:`LabLimits`), the scenario's own ``limits:`` (:class:`ScenarioLimits`) and its
``requests`` (:class:`ScenarioRequest`), built once
from the plain mappings the host sends (:meth:`vllm_repro.limits.RunLimits.as_dict`, the
``limits`` and ``requests`` of :meth:`vllm_repro.scenario.schema.Scenario.child_payload`).

Standard-library frozen dataclasses (the release environment has no pydantic); the host's
pydantic schema (``scenario/schema.py``) stays the user-facing one and has already validated
and bounded every value, so these only carry them. A key the mapping lacks takes the default
the loops used before (a scenario built in a test may leave ``limits`` out).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


def _known(cls, data: Mapping[str, Any] | None) -> dict[str, Any]:
    """The entries of ``data`` that name a field of ``cls`` (others are ignored: a newer host
    may send more)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in (data or {}).items() if k in names}


@dataclass(frozen=True)
class LabLimits:
    """The lab's limits for this machine (:class:`vllm_repro.limits.RunLimits`, from the
    ``VLLM_REPRO_*`` settings), as the worker received them; ``None`` where not sent (a run
    without limits, as tests start one).

    ``max_kv_blocks``: an engine-core pool larger than this many KV blocks is refused
    (:class:`~vllm_repro.engine.loop.OverLimit`); ``max_trace_mb``: a ``trace.jsonl`` reaching
    this many MB (2**20 bytes) stops the run (``OverLimit``); ``worker_memory_mb``: the worker's
    address-space limit in MB (named in the out-of-memory error); ``step_timeout_s``: the
    watchdog's seconds per step where the scenario sets none. ``max_tokens``, ``max_steps``,
    ``memory_gib``: checked on the host before the run (carried, unused here)."""

    max_kv_blocks: int | None = None
    max_tokens: int | None = None
    max_steps: int | None = None
    max_trace_mb: float | None = None
    worker_memory_mb: int | None = None
    memory_gib: float | None = None
    step_timeout_s: float | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "LabLimits":
        """From ``RunLimits.as_dict()`` (or None: no limits)."""
        if isinstance(data, cls):
            return data
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class ScenarioLimits:
    """The scenario's ``limits:`` (schema ``Limits``): ``max_steps`` (stop after this many
    steps), ``stall_steps`` (this many steps without progress while requests are unfinished is
    a stall), ``step_timeout_s`` (the watchdog's seconds per step; None: the lab's)."""

    max_steps: int = 500
    stall_steps: int = 20
    step_timeout_s: float | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "ScenarioLimits":
        """From the payload's ``limits`` (None or absent: the defaults)."""
        if isinstance(data, cls):
            return data
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class ScenarioRequest:
    """One of the scenario's ``requests`` (schema ``RequestSpec``): added just before step
    ``at_step``; ``prompt_len`` tokens (the first ``prefix_len`` drawn from the shared
    ``prefix``, when given), ``max_tokens`` to generate, ``n`` sequences (V0), vLLM's
    ``priority`` and ``arrival_time`` (None: the order of adding), ``structured_outputs``
    (vLLM's own parameter names, as ``child_payload`` writes them), ``kv_transfer_params``
    (the connector's, passed through ``SamplingParams.extra_args``) and ``allowed_token_ids``
    (``SamplingParams.allowed_token_ids``)."""

    id: str
    prompt_len: int
    at_step: int = 1
    max_tokens: int = 16
    n: int = 1
    priority: int = 0
    arrival_time: float | None = None
    prefix: str | None = None
    prefix_len: int | None = None
    structured_outputs: Mapping[str, Any] | None = None
    kv_transfer_params: Mapping[str, Any] | None = None
    allowed_token_ids: tuple[int, ...] | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "ScenarioRequest":
        """From one entry of the payload's ``requests``."""
        if isinstance(data, cls):
            return data
        known = _known(cls, data)
        if known.get("allowed_token_ids") is not None:
            known["allowed_token_ids"] = tuple(known["allowed_token_ids"])
        return cls(**known)


__all__ = ["LabLimits", "ScenarioLimits", "ScenarioRequest"]
