"""Keyword builders of the lab's records for unit tests, in the manner of vLLM's
``tests/v1/core/utils.py::create_scheduler``: give only what the test is about.

``make_result("crash", crash={"type": "AssertionError", "step": 3})`` is a
:class:`~vllm_repro.records.RunResult` built through ``RunResult.from_dict`` (so a builder call
with a field of the wrong shape fails as a real ``result.json`` would).
"""

from __future__ import annotations

from vllm_repro.records import RunResult, TraceLine, Violation


def make_result(outcome: str = "clean", **fields) -> RunResult:
    """A run's result; nested records may be given as mappings."""
    return RunResult.from_dict({"outcome": outcome, **fields})


def make_violation(code: str = "REQ_STATE", step: int = 3, message: str = "L is in "
                   "num_scheduled_tokens but was preempted in the same step (status PREEMPTED, "
                   "in waiting)", requests=("L",), blocks=(), phase: str = "after schedule") -> Violation:
    """One audit finding at ``step``."""
    return Violation(code, message, step, phase, list(requests), list(blocks))


def make_trace(*lines: dict) -> list[TraceLine]:
    """Trace lines from mappings (``{"step": 3, "crash": {...}}``)."""
    return [TraceLine.from_dict(x) for x in lines]
