"""Step and stats expectations (``expect.steps``, ``expect.stats``): a bug that is a wrong
decision, not a crash, judged on the run's trace (:class:`~vllm_repro.records.TraceLine`).

``steps``: at step ``at_step``, ``scheduled`` (request id -> the exact tokens scheduled),
``not_scheduled`` (ids with no tokens scheduled), ``preempted`` (ids preempted in that step,
by ``preempted_by`` where given: ``schedule``, ``reset_prefix_cache``, ``pause``),
``not_preempted``, ``finished`` (id -> how it finished: ``length``, ``stop``, ``abort``,
``ignored`` or vLLM's ``FINISHED_*`` name), ``drafts`` (id -> draft tokens scheduled),
``sampled`` (id -> the token ids sampled through its grammar bitmask: ``TraceLine.sampled``),
``reasoning_ended`` (id -> the release's ``reasoning_ended`` after the step:
``TraceLine.reasoning_ended``; absent reads false).

``stats``: the release's own ``SchedulerStats`` as the trace records them (``TraceLine.stats``:
``num_running_reqs``, ``kv_cache_usage``, ``prefix_cache_stats.queries`` / ``hits``,
``spec_decoding_stats.num_draft_tokens`` / ``num_accepted_tokens`` ...): at ``at_step`` that
step's values, else over the run: the sum of a counter (``prefix_cache_stats.*``,
``spec_decoding_stats.*``, ``num_corrupted_reqs``: vLLM makes them per step and its loggers
add them up) and the last value of anything else. A value is a number (equal) or a comparison
(``">= 1"``, ``"< 0.5"``, ``"!= 0"``).

:func:`decision_reasons` says why the expectations do not hold (empty: they all hold).
"""

from __future__ import annotations

import operator
import re

from .records import RunResult, TraceLine

#: short finish names -> vLLM's RequestStatus names
FINISH_NAMES = {"length": "FINISHED_LENGTH_CAPPED", "stop": "FINISHED_STOPPED",
                "abort": "FINISHED_ABORTED", "ignored": "FINISHED_IGNORED"}
#: the stats vLLM makes per step (summed over a run without ``at_step``)
COUNTER_PREFIXES = ("prefix_cache_stats.", "spec_decoding_stats.", "connector_prefix_cache_stats.",
                    "num_corrupted_reqs")
COMPARISON = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?)\s*$")
OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
       ">": operator.gt, "<": operator.lt}


def finish_name(status: str | None) -> str | None:
    """``length`` / ``FINISHED_LENGTH_CAPPED`` / V0's ``length`` -> ``FINISHED_LENGTH_CAPPED``."""
    if status is None:
        return None
    return FINISH_NAMES.get(status.lower(), status.upper())


def check_value(expected, got) -> bool:
    """Whether ``got`` (a number, None for absent: 0) meets ``expected`` (a number or a
    comparison string, :data:`COMPARISON`)."""
    got = 0 if got is None else got
    if isinstance(expected, str):
        m = COMPARISON.match(expected)
        if not m:
            return False
        return OPS[m.group(1)](got, float(m.group(2)))
    return abs(float(got) - float(expected)) <= 1e-9 * max(1.0, abs(float(expected)))


def _step_reasons(exp, line: TraceLine | None, result: RunResult) -> list[str]:
    at = exp.at_step
    if line is None:
        return [f"step {at}: the run has no step {at} (it ran {result.steps} step(s))"]
    out = []
    scheduled = line.scheduled or {}
    for rid, n in (exp.scheduled or {}).items():
        if scheduled.get(rid, 0) != n:
            out.append(f"step {at}: {rid} scheduled {scheduled.get(rid, 0)} token(s), not {n}")
    for rid in exp.not_scheduled or ():
        if scheduled.get(rid, 0):
            out.append(f"step {at}: {rid} scheduled {scheduled[rid]} token(s), expected none")
    pre = line.preemptions or {}
    for rid in exp.preempted or ():
        if rid not in pre:
            out.append(f"step {at}: {rid} not preempted"
                       + (f" (preempted: {', '.join(pre)})" if pre else ""))
        elif exp.preempted_by and pre[rid] != exp.preempted_by:
            out.append(f"step {at}: {rid} preempted by {pre[rid]}, not {exp.preempted_by}")
    for rid in exp.not_preempted or ():
        if rid in pre:
            out.append(f"step {at}: {rid} preempted (by {pre[rid]})")
    finished = set(line.finished or ())
    for rid, how in (exp.finished or {}).items():
        status = (result.finished or {}).get(rid)
        if rid not in finished:
            out.append(f"step {at}: {rid} did not finish" + (f" (it did as {status})" if status else ""))
        elif finish_name(status) != finish_name(how):
            out.append(f"step {at}: {rid} finished as {status}, not {finish_name(how)}")
    drafts = line.drafts or {}
    for rid, n in (exp.drafts or {}).items():
        if drafts.get(rid, 0) != n:
            out.append(f"step {at}: {rid} had {drafts.get(rid, 0)} draft token(s) scheduled, "
                       f"not {n}")
    sampled = line.sampled or {}
    for rid, tokens in (exp.sampled or {}).items():
        if rid not in sampled:
            out.append(f"step {at}: {rid} sampled nothing through a grammar bitmask, not "
                       f"{list(tokens)}")
        elif list(sampled[rid]) != list(tokens):
            out.append(f"step {at}: {rid} sampled {list(sampled[rid])}, not {list(tokens)}")
    ended = line.reasoning_ended or {}
    for rid, want in (exp.reasoning_ended or {}).items():
        got = bool(ended.get(rid))
        if got != want:
            out.append(f"step {at}: {rid}'s reasoning_ended is {str(got).lower()}, not "
                       f"{str(want).lower()}")
    return out


def _stats_over(trace: list[TraceLine], at_step: int | None) -> dict | None:
    if at_step is not None:
        line = next((ln for ln in trace if ln.step == at_step), None)
        return None if line is None else dict(line.stats or {})
    total: dict = {}
    for line in trace:
        for k, v in (line.stats or {}).items():
            if k.startswith(COUNTER_PREFIXES):
                total[k] = total.get(k, 0) + v
    last = next((ln.stats for ln in reversed(trace) if ln.stats is not None), None) or {}
    gauges = {k: v for k, v in last.items() if not k.startswith(COUNTER_PREFIXES)}
    return {**gauges, **total}


def _stats_reasons(exp, trace: list[TraceLine]) -> list[str]:
    where = f"step {exp.at_step}" if exp.at_step is not None else "the run"
    values = _stats_over(trace, exp.at_step)
    if values is None:
        return [f"stats at step {exp.at_step}: the run has no step {exp.at_step}"]
    if not any(line.stats is not None for line in trace):
        return ["stats: the release made no SchedulerStats in this run"]
    out = []
    for name, want in exp.values().items():
        got = values.get(name)
        if not check_value(want, got):
            out.append(f"stats of {where}: {name} = {0 if got is None else got}, not {want}")
    return out


def decision_reasons(exp, trace: list[TraceLine] | None, result: RunResult) -> list[str]:
    """Why ``exp``'s ``steps`` and ``stats`` (an ``Expect``) do not hold on ``trace``; empty
    when they all do (or it has none)."""
    if not getattr(exp, "steps", None) and not getattr(exp, "stats", None):
        return []
    if trace is None:
        return ["no trace.jsonl to check expect.steps / expect.stats against"]
    by_step = {line.step: line for line in trace}
    out: list[str] = []
    for s in exp.steps or ():
        out += _step_reasons(s, by_step.get(s.at_step), result)
    for s in exp.stats or ():
        out += _stats_reasons(s, trace)
    return out


def has_decisions(exp) -> bool:
    """Whether an ``Expect`` has ``steps`` or ``stats``."""
    return exp is not None and bool(getattr(exp, "steps", None) or getattr(exp, "stats", None))


__all__ = ["decision_reasons", "has_decisions", "check_value", "finish_name", "FINISH_NAMES"]
