"""The V0 scheduler's queues as both V0 book readers see them (:mod:`vllm_repro.audit.v0`'s
``V0Books``, :mod:`vllm_repro.audit.bm_v1`'s ``V1Books``): ``vllm/core/scheduler.py``'s
``waiting`` / ``running`` / ``swapped`` deques and ``_async_stopped`` list.

Runs inside release environments: standard library only.
"""

from __future__ import annotations


def queues_of(scheduler) -> dict[str, list]:
    """The scheduler's ``waiting`` / ``running`` / ``swapped`` groups."""
    s = scheduler
    return {"waiting": list(s.waiting), "running": list(s.running), "swapped": list(s.swapped)}


def async_stopped_of(scheduler) -> list:
    """Groups that left ``running`` at ``max_model_len`` with async output processing
    (``Scheduler._async_stopped``, 0.6.1+): they keep their blocks until the engine's
    ``free_finished_seq_groups``."""
    return list(getattr(scheduler, "_async_stopped", ()) or ())
