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


def make_scenario(*, name: str = "s", level: str = "scheduler", requests=None, vllm=None,
                  expect=None, limits=None, **config):
    """A validated :class:`~vllm_repro.scenario.schema.Scenario`; ``config`` keywords are the
    scenario's ``config:`` (vLLM's own names: ``num_gpu_blocks``, ``block_size``, ...), with a
    small pool by default; ``requests`` a list of mappings or ``make_scenario_requests(n)``."""
    from vllm_repro.scenario import parse_scenario

    cfg = {"num_gpu_blocks": 8, **config} if level == "scheduler" else dict(config)
    data = {"name": name, "level": level, "config": cfg,
            "requests": requests if requests is not None else make_scenario_requests(2),
            "vllm": vllm or {"reproduces_on": ["0.10.1.1"], "clean_on": ["0.10.2"]}}
    if expect is not None:
        data["expect"] = expect
    if limits is not None:
        data["limits"] = limits
    return parse_scenario(data, "<builder>")


def make_scenario_requests(n: int, prompt_len: int = 16, max_tokens: int = 4) -> list[dict]:
    """``n`` requests ``R0`` .. ``R<n-1>`` arriving at step 1, one after the other."""
    return [{"id": f"R{i}", "prompt_len": prompt_len, "max_tokens": max_tokens} for i in range(n)]
