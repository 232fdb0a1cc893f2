"""Compare what a run observed with what the scenario expects on that release.

A scenario's ``expect`` applies on the releases it ``reproduces_on``; on ``clean_on`` releases
the expectation is ``clean``; elsewhere there is none (observed only, ``ok`` is ``None``).

Audit findings that are not the scenario's bug (issue #3): ``clean_on`` requires no crash, no
stall, a run to its end and none of the expected signature (``expect.code`` when the scenario
expects a violation); other violations do not flip ``ok``: they are shown as ``also: CODE @step``
(each distinct finding once, with its mechanism and a count: :func:`violations_at`) in the
observed column, listed in ``result.json`` and counted in a summary line under the table
(:func:`findings_lines`). Likewise a crash or stall expected on ``reproduces_on`` is judged on
the crash or stall, with the audit's earlier findings shown as ``also``. For these verdicts the
lab audits in keep-going mode (:func:`audit_keeps_going`): a verdict about the end of a run needs
the run to reach it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import EXIT_ENV, EXIT_INPUT, EXIT_MISMATCH, EXIT_OK
from pathlib import Path

from .decisions import decision_reasons, has_decisions
from .records import (Crash, Frame, RecordError, RunResult, TraceLine, Violation, read_trace,
                      violation_label)
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
    also: list[Violation] | None = None  # audit findings that are not the scenario's bug

    @property
    def ok_text(self) -> str:
        if self.outcome == "error":
            return "ERROR"
        return {True: "yes", False: "NO", None: "-"}[self.ok]

    def as_dict(self) -> dict:
        d = {"scenario": self.scenario, "vllm": self.vllm, "expected": self.expected,
             "observed": self.observed, "ok": self.ok, "outcome": self.outcome,
             "reason": self.reason}
        if self.also:
            d["also"] = [{"code": v.code, "step": v.step, "requests": v.requests,
                          "blocks": v.blocks, "message": v.message}
                         | ({"mechanism": v.mechanism} if v.mechanism else {})
                         for v in self.also]
        return d


def violations_at(violations: list[Violation], limit: int = 3) -> str:
    """The findings as the ``observed`` column says them: each distinct (code, mechanism,
    step) once, in the order found, with ``×N`` when N records share it (the children of one
    request, several blocks), at most ``limit`` of them and ``(+M)`` counting the distinct ones
    left out: ``REQ_RESIDUE/finished @6 ×2, KV_LEAK @9 (+2)``. Empty for no violations."""
    groups: dict[str, int] = {}
    for v in violations:
        groups[v.at()] = groups.get(v.at(), 0) + 1
    shown = ", ".join(at + (f" ×{n}" if n > 1 else "") for at, n in list(groups.items())[:limit])
    extra = f" (+{len(groups) - limit})" if len(groups) > limit else ""
    return shown + extra


def _ran(result: RunResult) -> str:
    n = len(result.finished or {})
    if result.unfinished:
        return f"max_steps {result.steps} reached, {n} finished"
    return f"{n} finished, {result.steps} steps"


def audit_keeps_going(scenario: Scenario, version: str) -> bool:
    """Whether the audit must collect violations and let the run go on (rather than stop at
    the first) for the verdict on ``version`` to be about the run's end: a ``clean_on`` release,
    or a ``reproduces_on`` release whose expected outcome is a crash or a stall, or that has
    ``steps`` / ``stats`` to check."""
    kind = scenario.vllm.expectation_for(version)
    if kind == "clean":
        return True
    exp = scenario.expect
    # a step or stats expectation reads the steps after the first finding too
    return kind == "reproduce" and exp is not None and (exp.outcome != "violation"
                                                        or has_decisions(exp))


def _is_expected_kind(exp, x: Violation) -> bool:
    """Whether violation ``x`` has the ``code`` and ``mechanism`` an ``Expect`` gives (either
    left out matches any)."""
    return ((not exp.code or x.code == exp.code)
            and (not exp.mechanism or x.mechanism == exp.mechanism))


def _signature(scenario: Scenario, violations: list[Violation]) -> list[Violation]:
    """The violations that are the scenario's own bug: its ``expect`` is a violation (with
    ``code``, ``mechanism``, ``message`` where given)."""
    exp = scenario.expect
    if exp is None or exp.outcome != "violation":
        return []
    return [x for x in violations if _is_expected_kind(exp, x)
            and (not exp.message or re.search(exp.message, x.message or ""))]


def findings_lines(verdicts: list["Verdict"]) -> list[str]:
    """The summary printed under the verdict table: how many runs have audit findings that are
    not their scenario's bug, and each finding (code, step, message)."""
    runs = [v for v in verdicts if v.also]
    if not runs:
        return []
    total = sum(len(v.also) for v in runs)
    lines = [f"also: {total} audit finding(s) in {len(runs)} run(s) outside the scenarios' own "
             "bugs (reported, not counted against ok; see result.json):"]
    for v in runs:
        for x in v.also[:5]:
            lines.append(f"  {v.scenario} on {v.vllm}: {x.at()}: {x.message}")
        if len(v.also) > 5:
            lines.append(f"  {v.scenario} on {v.vllm}: ... {len(v.also) - 5} more")
    return lines


def audit_partial(result: RunResult) -> str:
    """``audit partial: KV hash checks off; `` where checks did not run on the release
    (``AuditSummary.off``: its lines name the checks after the last ``: ``), else ``""``."""
    off = result.audit.off if result.audit is not None else []
    if not off:
        return ""
    return f"audit partial: {', '.join(line.rsplit(': ', 1)[-1] for line in off)}; "


def describe_observed(result: RunResult) -> str:
    """The table's ``observed`` text, e.g.
    ``crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3``."""
    outcome = result.outcome
    if outcome == "crash":
        c = result.crash
        loc = c.where.where() if c.where else "(no vLLM frame)"
        return f"crash {c.type} {loc} @{c.step}"
    if outcome == "violation":
        vs = result.all_violations()
        return f"violation {violations_at(vs, 1)}" if vs else "violation"
    if outcome == "stall":
        s = result.stall
        return f"stall @{s.step} ({len(s.unfinished)} unfinished)"
    if outcome == "hang":
        h = result.hang
        loc = h.where.where() if h.where else "(no vLLM frame)"
        return f"hang {loc} @{h.step} (over {h.limit_s:g} s in {h.phase})"
    if outcome == "refused":
        r = result.refusal
        return f"refused {r.type}: {r.message[:120]} ({r.phase})" if r else "refused"
    if outcome == "clean":
        refused = f", {len(result.refused)} refused" if result.refused else ""
        ignored = sum(1 for s in (result.finished or {}).values() if s == "FINISHED_IGNORED")
        if ignored:  # V0: the scheduler ignored them (a prompt too long), vLLM finished them
            refused += f", {ignored} ignored by the scheduler"
        unread = result.audit.unread if result.audit is not None else []
        caveat = f"; audit: KV books unread: {', '.join(unread)}" if unread else ""
        return (f"clean ({audit_partial(result)}{len(result.finished or {})} finished{refused}, "
                f"{result.steps} steps{caveat})")
    if outcome == "incomplete":
        return (f"incomplete (max_steps {result.steps} reached, {len(result.unfinished or [])} "
                f"unfinished, {len(result.finished or {})} finished)")
    return f"error: {result.error.message if result.error else 'unknown'}"


def _matches_where(expected: str, where: Frame | None) -> bool:
    if where is None:
        return False
    file_part, _, func = expected.partition(":")
    if where.file != file_part:
        return False
    return not func or where.function == func


def _expected(scenario: Scenario, kind: str | None) -> str:
    """The table's ``expected`` text for a release the scenario says ``kind`` of."""
    if kind == "reproduce":
        return scenario.expect.outcome if scenario.expect is not None else "not clean"
    return "clean" if kind == "clean" else "-"


def judge(scenario: Scenario, version: str, result: RunResult,
          trace: Path | list[TraceLine] | None = None) -> Verdict:
    """The verdict for one (scenario, release) run (see the module's rules for audit
    findings that are not the scenario's bug). A run on a tree that differs from the release's
    sdist (``result.tree_changes``) says so in ``observed``: it observed the edit. ``trace``:
    the run's ``trace.jsonl`` (or its lines), read only where the scenario has step or stats
    expectations (:mod:`vllm_repro.decisions`)."""
    v = _judge(scenario, version, result, _Trace(trace))
    if result.tree_changes:
        v.observed += f" (on an edited tree: {len(result.tree_changes)} file(s))"
    return v


class _Trace:
    """The judged run's trace (``judge``'s ``trace``: a path or the lines), read once and only
    where an expectation has ``steps`` / ``stats``."""

    def __init__(self, source: Path | list[TraceLine] | None):
        self._source = source
        self._lines: list[TraceLine] | None = source if isinstance(source, list) else None

    def lines(self) -> list[TraceLine] | None:
        if self._lines is None and self._source is not None and not isinstance(self._source, list):
            try:
                self._lines = read_trace(Path(self._source))
            except (OSError, RecordError):
                self._lines = None
            self._source = None
        return self._lines

    def reasons(self, exp, result: RunResult) -> list[str]:
        """Why ``exp``'s ``steps`` / ``stats`` do not hold on the run (empty: they do)."""
        return decision_reasons(exp, self.lines(), result) if has_decisions(exp) else []


_NO_TRACE = _Trace(None)


def refusal_of(result: RunResult) -> Crash | None:
    """vLLM's refusal of the scenario in ``result``, as a :class:`Crash` record, or ``None``:
    its configuration refused where the configs are built (an input error with
    ``result.refusal``: a ``ValidationError`` of ``VllmConfig`` / ``SchedulerConfig``, an
    assert in ``VllmConfig.__post_init__``), at ``EngineCore`` start-up (a crash in phase
    ``engine-build``), or requests refused at ``add_request`` (``result.refused``: the first
    one, its text ``Type: message``)."""
    if result.outcome == "error" and result.error is not None and result.error.kind == "input":
        return result.refusal
    if result.outcome == "crash" and result.crash is not None \
            and result.crash.phase == "engine-build":
        return result.crash
    if result.outcome == "refused":
        return result.refusal
    if result.refused and result.outcome in ("clean", "incomplete"):
        return Crash.front_door(*next(iter(result.refused.items())))
    return None


def _expectation(scenario: Scenario, kind: str | None):
    """The ``Expect`` that applies on a release the scenario says ``kind`` of: ``expect`` on
    ``reproduces_on``, ``fixed`` on ``clean_on`` (None: run clean, or nothing expected)."""
    if kind == "reproduce":
        return scenario.expect
    if kind == "clean":
        return getattr(scenario, "fixed", None)
    return None


def _settle_refusal(scenario: Scenario, kind: str | None, result: RunResult) -> None:
    """Where the release's expectation is ``outcome: refused`` and vLLM refused
    (:func:`refusal_of`), the result becomes ``refused`` (its ``refusal`` set, an input
    error's ``error`` dropped): the expected outcome observed, not an input error. Elsewhere
    a refusal stays what it was (an input error: exit 2)."""
    exp = _expectation(scenario, kind)
    if exp is None or exp.outcome != "refused":
        return
    refusal = refusal_of(result)
    if refusal is None:
        return
    result.outcome = "refused"
    result.refusal = refusal
    result.error = None


def _judge(scenario: Scenario, version: str, result: RunResult, tr: _Trace = _NO_TRACE) -> Verdict:
    kind = scenario.vllm.expectation_for(version)
    if not result.planted:
        _settle_refusal(scenario, kind, result)
    outcome = result.outcome
    v = Verdict(scenario.name, version, _expected(scenario, kind), describe_observed(result),
                None, outcome)
    if outcome == "error":
        v.ok = False
        v.error_kind = result.error.kind if result.error else "lab"
        v.reason = "the lab or the input failed; not a reproduction"
        return v
    if result.planted:
        v.ok = False
        v.reason = (f"faults were planted into vLLM by a test plug-in ({result.planted}); "
                    "not an observation of the release")
        return v
    if outcome == "violation" and result.violations and not result.stopped:
        # the audit collected violations and the run went on to its end
        end = "did not finish" if result.unfinished else "ran to the end"
        v.observed = f"violation {violations_at(result.violations)}, {end} ({_ran(result)})"
    if kind is None:
        if outcome != "clean":
            v.reason = (f"{version} is in neither vllm.reproduces_on nor clean_on, so the "
                        f"scenario expects nothing there: {'an' if outcome[0] in 'aeiou' else 'a'} "
                        f"{outcome} where none was expected "
                        f"(add {version} to reproduces_on to judge it against expect)")
        return v
    if kind == "clean" and getattr(scenario, "fixed", None) is not None:
        # the fix does something other than run clean (e.g. refuses the config at start-up)
        v.expected = scenario.fixed.outcome
        reasons = _compare(scenario.fixed, result, tr)
        if not has_decisions(scenario.fixed):
            reasons += _bug_decisions_show(scenario, version, result, tr)
        v.ok = not reasons
        v.reason = "; ".join(f"fixed release: {r}" for r in reasons)
        return v
    if kind == "clean":
        return _judge_clean(v, scenario, version, result, tr)
    return _judge_reproduce(v, scenario, result, tr)


def _judge_clean(v: Verdict, scenario: Scenario, version: str, result: RunResult,
                 tr: _Trace = _NO_TRACE) -> Verdict:
    """A ``clean_on`` release: no crash, no stall, the whole run, none of the scenario's own
    signature; other audit findings are shown as ``also``."""
    outcome, stopped = result.outcome, result.stopped
    violations = result.all_violations()
    sig = _signature(scenario, violations)
    shows = _bug_decisions_show(scenario, version, result, tr)
    if shows and outcome in ("clean", "violation"):
        v.ok = False
        v.reason = shows[0]
        return v
    if outcome == "clean":
        v.ok = True
        return v
    if outcome == "violation" and not stopped and not sig and not result.unfinished:
        v.ok = True
        v.also = violations
        v.observed = f"ran to the end ({_ran(result)}); also: {violations_at(violations)}"
        return v
    v.ok = False
    if outcome == "violation" and sig:
        v.reason = (f"the scenario's own bug ({violations_at(sig)}) shows on {version}, a "
                    "clean_on release")
    elif outcome == "violation" and stopped:
        v.reason = (f"the audit stopped the run at step {stopped['step']} ({stopped['code']}) "
                    "before its end; a clean verdict needs the whole run (--keep-going)")
    elif outcome == "incomplete" or (outcome == "violation" and result.unfinished):
        v.reason = _incomplete_reason(result)
    else:
        v.reason = f"expected clean on {version}, observed {outcome}"
    if violations and outcome != "violation":
        v.also = violations
        v.observed = f"{v.observed}; also: {violations_at(violations)}"
    return v


def _bug_decisions_show(scenario: Scenario, version: str, result: RunResult,
                        tr: _Trace) -> list[str]:
    """On a ``clean_on`` release: where ``expect`` has ``steps`` / ``stats`` (the bug is a
    wrong decision) and they all hold here too, the reason why that is the bug showing (one
    item); else empty."""
    exp = scenario.expect
    if not has_decisions(exp) or tr.lines() is None or tr.reasons(exp, result):
        return []
    said = [f"step {s.at_step}" for s in exp.steps or ()] + \
        [f"stats{' at step ' + str(s.at_step) if s.at_step else ''}" for s in exp.stats or ()]
    return [f"the scenario's own wrong decision ({', '.join(said)} as expect says) shows on "
            f"{version}, a clean_on release"]


def _judge_reproduce(v: Verdict, scenario: Scenario, result: RunResult,
                     tr: _Trace = _NO_TRACE) -> Verdict:
    """A ``reproduces_on`` release: the run must show ``expect`` (any non-clean outcome when
    the scenario gives none); findings other than an expected crash or stall are ``also``."""
    exp = scenario.expect
    outcome = result.outcome
    if outcome == "incomplete":  # neither clean nor evidence of the bug
        v.ok = False
        v.reason = _incomplete_reason(result)
        return v
    if exp is None:
        v.ok = outcome != "clean"
        if not v.ok:
            v.reason = (f"{v.vllm} is in vllm.reproduces_on and the scenario gives no expect, so "
                        "any outcome but clean shows the bug; the run was clean (add expect, or "
                        f"drop {v.vllm} from reproduces_on if the bug cannot show here)")
        return v
    violations = result.all_violations()
    if exp.outcome == "stall" and outcome == "stall":
        # the audit's NO_PROGRESS record is the stall itself, not another finding
        violations = [x for x in violations if x.code != "NO_PROGRESS"]
    if exp.outcome != "violation" and violations and outcome != "violation":
        v.also = violations
        v.observed = f"{v.observed}; also: {violations_at(violations)}"
    reasons = _compare(exp, result, tr)
    v.ok = not reasons
    v.reason = "; ".join(reasons)
    return v


def _incomplete_reason(result: RunResult) -> str:
    return (f"the run reached limits.max_steps ({result.steps}) with "
            f"{len(result.unfinished or [])} request(s) unfinished: it did not finish, so it is "
            "neither clean nor a reproduction (raise limits.max_steps)")


def _compare(exp, result: RunResult, tr: _Trace = _NO_TRACE) -> list[str]:
    """Why ``result`` does not show ``exp`` (an ``Expect``: the scenario's ``expect`` on its
    buggy releases, or its ``fixed`` on the fixed ones); empty when it does."""
    outcome = result.outcome
    if outcome != exp.outcome:
        return [f"outcome {outcome} != {exp.outcome}"]
    fault = getattr(exp, "fault", None)
    if fault and not any(f.get("kind") == fault for f in result.faults or ()):
        # the expected rank fault (events[].fault) never fired: the outcome is not its doing
        return [f"no rank fault of kind {fault} fired (fired: "
                f"{[f.get('kind') for f in result.faults or ()] or 'none'})"]
    return _compare_outcome(exp, result) + tr.reasons(exp, result)


def _compare_outcome(exp, result: RunResult) -> list[str]:
    """:func:`_compare` for a run of the expected outcome: its evidence."""
    outcome = result.outcome
    if outcome == "crash":
        return _compare_crash(exp, result.crash)
    if outcome == "refused":
        return _compare_crash(exp, result.refusal, "refusal")
    if outcome == "hang":
        return _compare_hang(exp, result.hang)
    reasons = []
    if outcome == "violation":
        found = result.all_violations()
        codes = [x.code for x in found]
        if exp.code and exp.code not in codes:
            reasons.append(f"no {exp.code} among the violations ({violations_at(found)})")
        elif exp.mechanism and not any(_is_expected_kind(exp, x) for x in found):
            seen = [x for x in found if x.code == exp.code]
            reasons.append(f"no {violation_label(exp.code, exp.mechanism)} among the violations "
                           f"({violations_at(seen)})")
        if exp.step and not any(x.step == exp.step for x in found if _is_expected_kind(exp, x)):
            kind = violation_label(exp.code, exp.mechanism) if exp.code else "violation"
            reasons.append(f"no {kind} at step {exp.step}")
    elif outcome == "stall":
        if exp.step and result.stall.step != exp.step:
            reasons.append(f"stall step {result.stall.step} != {exp.step}")
        # where the requests are stuck (Stall.message): two stalls of different mechanisms
        # are told apart by it, as two crashes by theirs
        if exp.message and not re.search(exp.message, result.stall.message or ""):
            reasons.append(f"stall {result.stall.message!r} does not match {exp.message!r}")
    return reasons


def _compare_hang(exp, h) -> list[str]:
    """Why hang ``h`` is not the expected one: the frame the run's thread sat in
    (``where``), the stacks (``message``: a regular expression searched in them), step and
    phase."""
    reasons = []
    if exp.where and not _matches_where(exp.where, h.where):
        reasons.append(f"hung in {h.where.where() if h.where else None}, not {exp.where}")
    if exp.message and not re.search(exp.message, h.stacks or ""):
        reasons.append(f"the stacks do not match {exp.message!r}")
    if exp.step and h.step != exp.step:
        reasons.append(f"step {h.step} != {exp.step}")
    if getattr(exp, "phase", None) and h.phase != exp.phase:
        reasons.append(f"phase {h.phase} != {exp.phase}")
    return reasons


def _compare_crash(exp, c: Crash, what: str = "crash") -> list[str]:
    """Why crash ``c`` (or a refusal: ``what``) is not the expected one: exception,
    innermost vLLM frame, message, step and phase."""
    reasons = []
    if exp.exception and c.type != exp.exception:
        reasons.append(f"exception {c.type} != {exp.exception}")
    if exp.where and not _matches_where(exp.where, c.where):
        reasons.append(f"innermost vLLM frame {c.where.where() if c.where else None} != {exp.where}")
    if exp.message and not re.search(exp.message, c.message or ""):
        reasons.append(f"message {c.message!r} does not match {exp.message!r}")
    if exp.step and c.step != exp.step:
        reasons.append(f"step {c.step} != {exp.step}")
    if getattr(exp, "phase", None) and c.phase != exp.phase:
        reasons.append(f"phase {c.phase} != {exp.phase}")
    return reasons


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
