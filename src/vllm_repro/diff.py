"""``vllm-repro diff``: one scenario on two releases, aligned step by step, and the first step
where the scheduler's decisions differ (docs/diff.md).

Each run's :class:`~vllm_repro.records.TraceLine` records give, per step, what ``schedule()``
decided (tokens per request), the requests preempted and by what, those finished, the free KV
blocks and a crash; :func:`first_difference` compares them step by step (the ``n``-th step of
one with the ``n``-th of the other) and :func:`release_diff` makes the
:class:`~vllm_repro.records.ReleaseDiff` the command prints (:func:`diff_lines`) or writes as
JSON.
"""

from __future__ import annotations

from .records import ReleaseDiff, RunResult, StepDecisions, TraceLine

#: the fields compared, in the order said
COMPARED = ("present", "scheduled", "preempted", "finished", "free_blocks", "crash")


def decisions_of(line: TraceLine | None, step: int) -> StepDecisions:
    """The decisions of ``line`` (``None``: the run had no step ``step``)."""
    if line is None:
        return StepDecisions(step, present=False)
    crash = None
    if line.crash is not None:
        where = f" {line.crash.where.file}:{line.crash.where.line}" if line.crash.where else ""
        crash = f"{line.crash.type}{where}"
    return StepDecisions(step, True, None if line.scheduled is None else dict(line.scheduled),
                         dict(line.preemptions or {}), sorted(line.finished or ()),
                         line.free_blocks, crash, line.waiting, line.running)


def _key(d: StepDecisions, name: str):
    value = getattr(d, name)
    if name == "scheduled" and value is not None:
        return {k: v for k, v in value.items() if v}  # a 0-token entry schedules nothing
    return value


def first_difference(a: list[TraceLine], b: list[TraceLine]) -> tuple[int | None, list[str]]:
    """The first step whose decisions differ between traces ``a`` and ``b`` and the fields
    that do (:data:`COMPARED`), or ``(None, [])``. Step 0 (an engine's start-up) counts."""
    by_a = {ln.step: ln for ln in a}
    by_b = {ln.step: ln for ln in b}
    for step in sorted(set(by_a) | set(by_b)):
        da, db = decisions_of(by_a.get(step), step), decisions_of(by_b.get(step), step)
        differs = [f for f in COMPARED if _key(da, f) != _key(db, f)]
        if differs:
            return step, differs
    return None, []


def both_scheduled_and_preempted(d: StepDecisions) -> list[str]:
    """Requests that one ``schedule()`` both scheduled (tokens > 0) and preempted."""
    return [rid for rid in (d.preempted or {}) if (d.scheduled or {}).get(rid)]


def release_diff(scenario: str, runs: list[tuple[str, RunResult, list[TraceLine], str]]) \
        -> ReleaseDiff:
    """The :class:`~vllm_repro.records.ReleaseDiff` of two runs, each ``(release, result,
    trace, report folder)``."""
    (va, ra, ta, pa), (vb, rb, tb, pb) = runs
    step, differs = first_difference(ta, tb)
    out = ReleaseDiff(scenario, [va, vb], {va: ra.outcome, vb: rb.outcome}, {va: pa, vb: pb},
                      step, differs)
    if step is not None:
        for v, trace in ((va, ta), (vb, tb)):
            d = decisions_of(next((ln for ln in trace if ln.step == step), None), step)
            out.decisions[v] = d
            both = both_scheduled_and_preempted(d)
            if both:
                out.scheduled_and_preempted[v] = both
    return out


def _show(d: StepDecisions, name: str) -> str:
    if not d.present:
        return "(no such step: the run had ended)"
    value = getattr(d, name)
    if name == "scheduled":
        if value is None:
            return "(schedule() did not return)" if d.crash else "-"
        return " ".join(f"{k}={v}" for k, v in value.items()) or "nothing"
    if name == "preempted":
        return " ".join(f"{k} ({c})" for k, c in value.items()) if value else "-"
    if isinstance(value, list):
        return " ".join(value) if value else "-"
    return "-" if value is None else str(value)


def diff_lines(diff: ReleaseDiff) -> tuple[list[str], list[list[str]], list[str]]:
    """What the command prints: the heading lines, the side-by-side rows (field, A, B) and the
    notes under them."""
    va, vb = diff.releases
    head = [f"{diff.scenario}: {va} {diff.outcomes.get(va)}, {vb} {diff.outcomes.get(vb)}"]
    if diff.step is None:
        head.append(f"no step differs: {va} and {vb} made the same decisions at every step")
        return head, [], []
    head.append(f"first difference at step {diff.step} ({', '.join(diff.differs)})")
    da, db = diff.decisions[va], diff.decisions[vb]
    rows = []
    for name, label in (("scheduled", "scheduled (tokens)"), ("preempted", "preempted (by)"),
                        ("finished", "finished"), ("free_blocks", "free KV blocks"),
                        ("crash", "crash"), ("waiting", "waiting after"),
                        ("running", "running after")):
        mark = "*" if name in diff.differs else " "
        rows.append([f"{mark} {label}", _show(da, name), _show(db, name)])
    notes = [f"on {v}: {', '.join(ids)} scheduled and preempted in one schedule() call"
             for v, ids in diff.scheduled_and_preempted.items()]
    notes += [f"{v}: {path}" for v, path in diff.reports.items()]
    return head, rows, notes


__all__ = ["first_difference", "release_diff", "diff_lines", "decisions_of", "COMPARED"]
