"""Compare what a run observed with what the scenario expects on that release.

A scenario's ``expect`` applies on the releases it ``reproduces_on``; on ``clean_on`` releases
the expectation is ``clean``; elsewhere there is none (observed only, ``ok`` is ``None``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import EXIT_ENV, EXIT_INPUT, EXIT_MISMATCH, EXIT_OK
from .scenario.schema import Scenario


@dataclass
class Verdict:
    """One row of the verdict table. ``ok``: True match, False mismatch, None no expectation."""

    scenario: str
    vllm: str
    expected: str
    observed: str
    ok: bool | None
    outcome: str
    reason: str = ""
    error_kind: str | None = None

    @property
    def ok_text(self) -> str:
        if self.outcome == "error":
            return "ERROR"
        return {True: "yes", False: "NO", None: "-"}[self.ok]

    def as_dict(self) -> dict:
        return {"scenario": self.scenario, "vllm": self.vllm, "expected": self.expected,
                "observed": self.observed, "ok": self.ok, "outcome": self.outcome,
                "reason": self.reason}


def describe_observed(result: dict) -> str:
    """The table's ``observed`` text, e.g.
    ``crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3``."""
    outcome = result.get("outcome", "error")
    if outcome == "crash":
        c = result["crash"]
        where = c.get("where")
        loc = f"{where['file']}:{where['function']}" if where else "(no vLLM frame)"
        return f"crash {c['type']} {loc} @{c['step']}"
    if outcome == "violation":
        vs = result.get("violations") or []
        if vs:
            v = vs[0]
            extra = f" (+{len(vs) - 1})" if len(vs) > 1 else ""
            return f"violation {v['code']} @{v['step']}{extra}"
        return "violation"
    if outcome == "stall":
        s = result["stall"]
        return f"stall @{s['step']} ({len(s['unfinished'])} unfinished)"
    if outcome == "clean":
        n = len(result.get("finished") or {})
        steps = result.get("steps")
        if result.get("limit_reached"):
            return f"clean (max_steps {steps} reached, {n} finished)"
        return f"clean ({n} finished, {steps} steps)"
    err = result.get("error") or {}
    return f"error: {err.get('message', 'unknown')}"


def _matches_where(expected: str, where: dict | None) -> bool:
    if where is None:
        return False
    file_part, _, func = expected.partition(":")
    if where["file"] != file_part:
        return False
    return not func or where["function"] == func


def judge(scenario: Scenario, version: str, result: dict) -> Verdict:
    """The verdict for one (scenario, release) run."""
    outcome = result.get("outcome", "error")
    observed = describe_observed(result)
    kind = scenario.vllm.expectation_for(version)
    exp = scenario.expect
    if kind == "reproduce" and exp is not None:
        expected = exp.outcome
    elif kind == "reproduce":
        expected = "not clean"
    elif kind == "clean":
        expected = "clean"
    else:
        expected = "-"
    v = Verdict(scenario.name, version, expected, observed, None, outcome)
    if outcome == "error":
        v.ok = False
        v.error_kind = (result.get("error") or {}).get("kind", "lab")
        v.reason = "the lab or the input failed; not a reproduction"
        return v
    if kind is None:
        v.ok = None
        return v
    if kind == "clean":
        v.ok = outcome == "clean"
        if not v.ok:
            v.reason = f"expected clean on {version}, observed {outcome}"
        return v
    if exp is None:
        v.ok = outcome != "clean"
        return v
    reasons = []
    if outcome != exp.outcome:
        reasons.append(f"outcome {outcome} != {exp.outcome}")
    elif outcome == "crash":
        c = result["crash"]
        if exp.exception and c["type"] != exp.exception:
            reasons.append(f"exception {c['type']} != {exp.exception}")
        if exp.where and not _matches_where(exp.where, c.get("where")):
            w = c.get("where")
            reasons.append(f"innermost vLLM frame {w['file'] + ':' + w['function'] if w else None} "
                           f"!= {exp.where}")
        if exp.message and not re.search(exp.message, c.get("message", "")):
            reasons.append(f"message {c.get('message')!r} does not match {exp.message!r}")
        if exp.step and c["step"] != exp.step:
            reasons.append(f"step {c['step']} != {exp.step}")
    elif outcome == "violation":
        codes = [x["code"] for x in result.get("violations") or []]
        if exp.code and exp.code not in codes:
            reasons.append(f"violation codes {codes} lack {exp.code}")
        if exp.step and not any(x["step"] == exp.step for x in result.get("violations") or []
                                if not exp.code or x["code"] == exp.code):
            reasons.append(f"no violation at step {exp.step}")
    elif outcome == "stall" and exp.step and result["stall"]["step"] != exp.step:
        reasons.append(f"stall step {result['stall']['step']} != {exp.step}")
    v.ok = not reasons
    v.reason = "; ".join(reasons)
    return v


def exit_code(verdicts: list[Verdict]) -> int:
    """DESIGN.md's exit codes over a table: 3/2 for a lab/input error, 1 for a mismatch or an
    unexpected reproduction, else 0."""
    errors = [v for v in verdicts if v.outcome == "error"]
    if errors:
        return EXIT_INPUT if all(v.error_kind == "input" for v in errors) else EXIT_ENV
    if any(v.ok is False for v in verdicts):
        return EXIT_MISMATCH
    if any(v.ok is None and v.outcome != "clean" for v in verdicts):
        return EXIT_MISMATCH
    return EXIT_OK
