"""A run's page, ``reports/<scenario>/<release>/index.html``, from its typed records.

Written by the lab next to ``result.json`` (:func:`write_run_page`, from the
:class:`~vllm_repro.records.RunResult` and the :class:`~vllm_repro.records.TraceLine` records of
``trace.jsonl``), before the report is committed. The page holds: the verdict; what happened, in
sentences (:func:`explain`: the crash, each audit finding's own sentence, the stall); the
traceback; the timeline at full width as an inline SVG whose bars and marks carry ``<title>``
elements (request id, state, steps: shown on hover, :func:`timeline_svg`); the step table
(:func:`step_rows`); and relative links to ``scenario.yaml`` (the scenario file as the lab read
it), ``result.json``, ``trace.jsonl``, ``engine.log`` and ``timeline.png``; the scenario as
written (its description, the issue and fix links, ``config`` and ``requests``:
:func:`scenario_section`); the engine log's last lines (:func:`log_tail_section`); and the same
scenario's pages on the other releases (:func:`releases_nav`, rewritten by
:func:`vllm_repro.report.index.write_index` once every release's run is there).

The page is a list of sections, each built by one function from a :class:`PageContext`
(:data:`SECTIONS`, in page order); a new section is one more function in that list. Standard
library and PyYAML only.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..records import RecordError, ReportDir, RunResult, TraceLine, read_trace
from .crash import why_section

#: the step table shows at most this many rows (steps where something changed come first)
MAX_TABLE_ROWS = 400
#: the timeline draws at most this many requests (the first added)
MAX_TIMELINE_REQUESTS = 60
SCENARIO_FILE = "scenario.yaml"
PAGE = "index.html"
#: the engine log's last lines the page shows (engine.log has them all)
LOG_TAIL_LINES = 40
#: the most bytes of engine.log read for its tail
LOG_TAIL_BYTES = 64 * 1024
#: the other releases' links sit between these comments; :func:`set_releases_nav` rewrites them
NAV_START, NAV_END = "<!-- releases -->", "<!-- /releases -->"

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.2em 2em;color:#222;max-width:none}
h1{font-size:1.35em;margin-bottom:.2em} h2{font-size:1.1em;margin-top:1.4em}
.nav{font-size:.9em} .nav a{margin-right:1em}
.verdict{font-size:1.05em;padding:.5em .8em;border-radius:4px;display:inline-block}
.ok{background:#e6f4e6;border:1px solid #7b7} .bad{background:#fbe9e9;border:1px solid #d77}
.none{background:#eee;border:1px solid #bbb}
pre{background:#f6f6f6;border:1px solid #ddd;padding:.6em;overflow-x:auto;font-size:.85em}
table.steps{border-collapse:collapse;font-size:.85em;width:100%}
table.steps td,table.steps th{border-bottom:1px solid #e3e3e3;padding:2px 6px;text-align:left;
vertical-align:top;font-family:ui-monospace,monospace}
tr.mark td{background:#fff3e0} tr.crash td{background:#fde4e4}
svg.timeline{width:100%;height:auto;display:block;border:1px solid #ddd}
svg.timeline text{font-family:ui-monospace,monospace}
.legend span{display:inline-block;margin-right:1.2em;font-size:.9em}
.legend i{display:inline-block;width:1.1em;height:.8em;margin-right:.3em;vertical-align:middle}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:.15em 1em;font-size:.92em}
dl.facts dt{color:#555} dl.facts dd{margin:0}
.releases a{margin-right:.6em;padding:1px 6px;border-radius:3px;text-decoration:none}
.releases a.yes{background:#e6f4e6} .releases a.NO,.releases a.ERROR{background:#fbe9e9}
.releases a.here{outline:2px solid #555}
.description{max-width:70em;line-height:1.4} .issue a{margin-right:1em}
table.requests{border-collapse:collapse;font-size:.85em}
table.requests td,table.requests th{border-bottom:1px solid #e3e3e3;padding:2px 8px;text-align:left;
font-family:ui-monospace,monospace}
table.operands,table.locals{border-collapse:collapse;font-size:.85em}
table.operands td,table.locals td{border-bottom:1px solid #e3e3e3;padding:2px 8px;vertical-align:top}
"""

#: request state -> (colour, label) in the timeline
STATES = {
    "waiting": ("#9ecae1", "waiting"),
    "running": ("#31a354", "running"),
    "preempted": ("#e6550d", "preempted (waiting)"),
    "finished": ("#756bb1", "finished at this step"),
}
MARK_COLOURS = {"crash": "#d62728", "violation": "#ff7f0e", "stall": "#555555"}


def _e(value) -> str:
    return html.escape(str(value))


# ---- sentences --------------------------------------------------------------------------------
def explain(result: RunResult) -> list[str]:
    """What the run observed, in plain sentences: the crash (exception, vLLM call, step and
    innermost vLLM frame), each audit finding (its code, step, phase and its own sentence), the
    stall, the step limit or the lab's error; for a clean run, how it ended."""
    out: list[str] = []
    c = result.crash
    if c is not None:
        where = (f" in {c.where.file}:{c.where.line} ({c.where.function})"
                 if c.where is not None and c.where.line else
                 f" in {c.where.where()}" if c.where is not None else " outside vLLM's code")
        when = "while EngineCore was being built" if c.step == 0 else \
            f"at step {c.step}" if c.step is not None else ""
        call = f" during {c.phase}()" if c.phase and c.phase != "engine-build" else ""
        msg = f": {c.message}" if c.message else " (no message)"
        out.append(f"vLLM raised {c.type}{msg}{where}, {when}{call}.".replace(", .", "."))
    for v in result.all_violations():
        step = f"at step {v.step}" if v.step is not None else "at the end of the run"
        phase = f" ({v.phase})" if v.phase else ""
        again = ""
        if v.repeats:
            again = f" Seen {v.repeats} more time(s)" + (f", last at step {v.last_step}" if
                                                          v.last_step is not None else "") + "."
        sentence = v.message.rstrip(".") + "." if v.message else "no message."
        out.append(f"The audit found {v.code} {step}{phase}: {sentence}{again}")
    s = result.stall
    if result.outcome == "stall" and s is not None:
        out.append(f"The run stalled: no request made progress from step {s.since} to step "
                   f"{s.step}; unfinished: {', '.join(s.unfinished) or 'none'} (waiting: "
                   f"{', '.join(s.waiting or []) or 'none'}; running: "
                   f"{', '.join(s.running or []) or 'none'}; free KV blocks: {s.free_blocks}).")
    if result.outcome == "incomplete":
        out.append(f"The run reached limits.max_steps ({result.steps} steps) with requests "
                   f"unfinished: {', '.join(result.unfinished or [])}; a run that did not "
                   "finish is not clean.")
    if result.error is not None:
        kinds = {"input": "Bad input (exit 2)", "lab": "The lab failed (exit 3)",
                 "env": "The release's environment failed (exit 3)"}
        out.append(f"{kinds.get(result.error.kind, result.error.kind)}: {result.error.message}")
    if result.outcome == "clean":
        out.append(f"Every request finished ({len(result.finished or {})}) in {result.steps} "
                   "steps, with no crash and no broken invariant.")
        unread = result.audit.unread if result.audit is not None else []
        if unread:
            out.append(f"The audit could not read the KV books of {', '.join(unread)}: only "
                       "the queues were checked, so the KV cache's invariants are unknown.")
    elif result.outcome in ("crash", "violation") and not result.unfinished and result.finished \
            and c is None:
        out.append(f"The run went on to its end: {len(result.finished)} request(s) finished in "
                   f"{result.steps} steps.")
    return out


# ---- the timeline -----------------------------------------------------------------------------
def _marks(trace: list[TraceLine], result: RunResult) -> list[tuple[int, str, str]]:
    """``(step, kind, sentence)`` for the crash, each violation and the stall."""
    out: list[tuple[int, str, str]] = []
    seen: set[tuple[int, str]] = set()
    for line in trace:
        if line.crash:
            out.append((line.step, "crash", f"step {line.step}: {line.crash.type} in "
                        f"{line.crash.phase}(): {line.crash.message or '(no message)'}"))
        for v in line.violations or ():
            if (line.step, v.code) not in seen:
                seen.add((line.step, v.code))
                out.append((line.step, "violation", f"step {line.step}: {v.code}: {v.message}"))
    for v in result.all_violations():
        if v.step is not None and (v.step, v.code) not in seen:
            seen.add((v.step, v.code))
            out.append((v.step, "violation", f"step {v.step}: {v.code}: {v.message}"))
    if result.outcome == "stall" and result.stall is not None:
        s = result.stall
        out.append((s.step, "stall", f"step {s.step}: stall, no progress since step {s.since}"))
    return sorted(out)


def _states(trace: list[TraceLine]) -> tuple[list[str], dict[str, dict[int, str]]]:
    """The request ids in the order they were added, and per request its state at each step."""
    order: dict[str, None] = {}
    states: dict[str, dict[int, str]] = {}
    for line in trace:
        for rid in line.added or ():
            order.setdefault(rid)
        pre = set(line.preempted or ())
        for rid in line.waiting or ():
            order.setdefault(rid)
            states.setdefault(rid, {})[line.step] = "preempted" if rid in pre else "waiting"
        for rid in line.running or ():
            order.setdefault(rid)
            states.setdefault(rid, {})[line.step] = "running"
        for rid in line.finished or ():
            order.setdefault(rid)
            states.setdefault(rid, {})[line.step] = "finished"
    return list(order), states


def timeline_svg(trace: list[TraceLine], result: RunResult) -> str:
    """The run as an SVG, one row per request (its state at each step: waiting, running,
    preempted, finished) and a line per crash, violation or stall; every bar and mark has a
    ``<title>`` (request id, state, steps, tokens scheduled; the finding's sentence) that a
    browser shows on hover. Empty string when the trace has no step."""
    if not trace:
        return ""
    steps = [ln.step for ln in trace]
    lo, hi = min(steps), max(steps)
    order, states = _states(trace)
    shown = order[:MAX_TIMELINE_REQUESTS]
    sched: dict[str, dict[int, int]] = {}
    for line in trace:
        for rid, n in (line.scheduled or {}).items():
            sched.setdefault(rid, {})[line.step] = n
    label_w, row_h, top, width = 110, 18, 26, 1200
    plot_w = width - label_w - 10
    span = max(1, hi - lo + 1)
    x = lambda step: label_w + (step - lo) * plot_w / span  # noqa: E731
    height = top + row_h * max(1, len(shown)) + 30
    parts = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} '
             f'{height}" role="img" aria-label="timeline of {_e(result.scenario)} on vLLM '
             f'{_e(result.vllm)}">']
    # step axis
    tick = max(1, span // 20)
    for s in range(lo, hi + 1, tick):
        parts.append(f'<line x1="{x(s):.1f}" x2="{x(s):.1f}" y1="{top - 4}" y2="{height - 26}" '
                     'stroke="#eee"/>')
        parts.append(f'<text x="{x(s) + plot_w / span / 2:.1f}" y="{height - 12}" '
                     f'font-size="11" text-anchor="middle" fill="#555">{s}</text>')
    parts.append(f'<text x="{label_w}" y="14" font-size="12" fill="#333">step (n-th '
                 'schedule() call) &#8594; hover a bar for the request and its steps</text>')
    for row, rid in enumerate(shown):
        y = top + row * row_h
        parts.append(f'<text x="{label_w - 6}" y="{y + row_h - 5}" font-size="12" '
                     f'text-anchor="end">{_e(rid)}<title>request {_e(rid)}</title></text>')
        runs: list[tuple[str, int, int]] = []
        for s in sorted(states.get(rid, {})):
            st = states[rid][s]
            if runs and runs[-1][0] == st and runs[-1][2] == s - 1:
                runs[-1] = (st, runs[-1][1], s)
            else:
                runs.append((st, s, s))
        for st, a, b in runs:
            colour, label = STATES[st]
            toks = sum(sched.get(rid, {}).get(s, 0) for s in range(a, b + 1))
            when = f"step {a}" if a == b else f"steps {a}-{b}"
            tip = f"{rid}: {label}, {when}" + (f"; {toks} token(s) scheduled" if toks else "")
            parts.append(f'<rect x="{x(a):.1f}" y="{y + 2}" width="{max(1.5, x(b + 1) - x(a)):.1f}" '
                         f'height="{row_h - 4}" fill="{colour}"><title>{_e(tip)}</title></rect>')
    for step, kind, sentence in _marks(trace, result):
        xm = x(step) + plot_w / span / 2
        parts.append(f'<line x1="{xm:.1f}" x2="{xm:.1f}" y1="{top - 6}" y2="{height - 26}" '
                     f'stroke="{MARK_COLOURS[kind]}" stroke-width="{3 if kind == "crash" else 2}" '
                     f'stroke-dasharray="{"none" if kind == "crash" else "5,3"}">'
                     f'<title>{_e(sentence)}</title></line>')
    parts.append("</svg>")
    more = ""
    if len(order) > len(shown):
        more = (f"<p>{len(order) - len(shown)} more request(s) are not drawn; "
                "trace.jsonl has them all.</p>")
    legend = "".join(f'<span><i style="background:{c}"></i>{_e(label)}</span>'
                     for c, label in STATES.values())
    legend += "".join(f'<span><i style="background:{c}"></i>{k}</span>'
                      for k, c in MARK_COLOURS.items())
    return "\n".join(parts) + f'\n<div class="legend">{legend}</div>{more}'


# ---- the step table ---------------------------------------------------------------------------
def _ids(xs) -> str:
    return " ".join(xs) if xs else ""


def step_rows(trace: list[TraceLine]) -> tuple[list[TraceLine], int]:
    """The trace lines the table shows: every line when there are at most
    :data:`MAX_TABLE_ROWS`, else the lines where the queues or free blocks changed or something
    happened (a crash, a violation, requests added, aborted or finished), first ones first.
    Returns them and how many were left out."""
    if len(trace) <= MAX_TABLE_ROWS:
        return trace, 0
    keep, last = [], None
    for line in trace:
        state = (tuple(line.waiting or ()), tuple(line.running or ()),
                 tuple(line.preempted or ()), line.free_blocks)
        if state != last or line.crash or line.violations or line.added or line.aborted \
                or line.finished:
            keep.append(line)
        last = state
    keep = keep[:MAX_TABLE_ROWS]
    return keep, len(trace) - len(keep)


def step_table(trace: list[TraceLine]) -> str:
    rows, left = step_rows(trace)
    out = ["<table class='steps'><tr><th>step</th><th>added</th><th>scheduled (tokens)</th>"
           "<th>finished</th><th>waiting</th><th>running</th><th>preempted</th>"
           "<th>free blocks</th><th>events</th></tr>"]
    for ln in rows:
        events = []
        if ln.phase:
            events.append(ln.phase)
        if ln.crash:
            events.append(f"CRASH {ln.crash.type} in {ln.crash.phase}")
        for v in ln.violations or ():
            events.append(f"{v.code}: {v.message}")
        if ln.aborted:
            events.append("aborted " + _ids(ln.aborted))
        if ln.refused:
            events.append("refused " + _ids(ln.refused))
        if ln.idle:
            events.append("idle")
        if ln.state_error:
            events.append(ln.state_error)
        sched = " ".join(f"{k}:{n}" for k, n in (ln.scheduled or {}).items())
        cls = " class='crash'" if ln.crash else " class='mark'" if ln.violations else ""
        cells = [ln.step, _ids(ln.added), sched, _ids(ln.finished), _ids(ln.waiting),
                 _ids(ln.running), _ids(ln.preempted),
                 "" if ln.free_blocks is None else ln.free_blocks, "; ".join(events)]
        out.append(f"<tr{cls}>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    if left:
        out.append(f"<p>{left} step(s) where nothing changed are left out; trace.jsonl has "
                   "every step.</p>")
    return "\n".join(out)


# ---- the page ---------------------------------------------------------------------------------
def _verdict_block(result: RunResult) -> str:
    v = result.verdict or {}
    ok = v.get("ok")
    if result.outcome == "error":
        cls, word = "bad", "ERROR"
    else:
        cls, word = {True: ("ok", "ok"), False: ("bad", "MISMATCH"), None: ("none", "no expectation")}[ok]
    reason = f"<br>{_e(v['reason'])}" if v.get("reason") else ""
    return (f"<div class='verdict {cls}'><b>{word}</b>: expected <b>{_e(v.get('expected', '-'))}"
            f"</b>, observed <b>{_e(v.get('observed', result.outcome))}</b>{reason}</div>")


@dataclass
class PageContext:
    """What a run page is built from: the run's ``result``, its ``trace`` lines, the report's
    ``files`` present (linked relative to the page), the scenario file as written (``scenario``:
    its YAML mapping, ``None`` when there is no readable scenario.yaml) and the engine log's
    last lines (``log_tail``, oldest first; empty when there is no engine.log)."""

    result: RunResult
    trace: list[TraceLine]
    files: list[str]
    scenario: dict | None = None
    log_tail: list[str] = field(default_factory=list)
    log_lines: int = 0  # how many lines engine.log has in all (0 when unknown)


def _issue_url(ref) -> str | None:
    """``owner/repo#N`` (a scenario's ``vllm.issue`` / ``vllm.fixed_by``) as a GitHub URL
    (``issues/N``: GitHub sends a pull request's number on to the pull request)."""
    m = re.fullmatch(r"\s*([\w.-]+/[\w.-]+)#(\d+)\s*", str(ref or ""))
    return f"https://github.com/{m.group(1)}/issues/{m.group(2)}" if m else None


def header_section(ctx: PageContext) -> str:
    """The way back to the index, the report's files, the title, the issue and fix links, the
    other releases' pages (a placeholder until the index fills it) and the verdict."""
    result = ctx.result
    links = " ".join(f"<a href='{_e(f)}'>{_e(f)}</a>" for f in ctx.files)
    vllm = (ctx.scenario or {}).get("vllm") if isinstance(ctx.scenario, dict) else None
    refs = []
    for key, word in (("issue", "issue"), ("fixed_by", "fixed by")):
        ref = vllm.get(key) if isinstance(vllm, dict) else None
        url = _issue_url(ref)
        if url:
            refs.append(f"<a href='{_e(url)}'>{word} {_e(ref)}</a>")
        elif ref:
            refs.append(f"<span>{word} {_e(ref)}</span>")
    title = f"{result.scenario} on vLLM {result.vllm}"
    return "\n".join([
        f"<p class='nav'><a href='../../{PAGE}'>&#8592; all runs</a> {links}</p>",
        f"<h1>{_e(title)}</h1>",
        f"<p class='issue'>{' '.join(refs)}</p>" if refs else "",
        f"{NAV_START}{NAV_END}",
        _verdict_block(result)])


def happened_section(ctx: PageContext) -> str:
    """What happened, in sentences (:func:`explain`), and the run's facts."""
    result = ctx.result
    facts = [("outcome", result.outcome), ("level", result.level), ("platform", result.platform),
             ("steps", result.steps), ("python", result.python),
             ("tree", result.tree and result.tree + (" (warm)" if result.warm else ""))]
    if result.timing is not None and result.timing.run_s is not None:
        facts.append(("timing", f"build {result.timing.build_s} s, run {result.timing.run_s} s"))
    if result.substitutions:
        facts.append(("substitutions", "; ".join(result.substitutions)))
    if result.tree_changes:
        facts.append(("tree changes", "; ".join(result.tree_changes)))
    if result.finished:
        facts.append(("finished", ", ".join(f"{k} ({v})" for k, v in result.finished.items())))
    if result.unfinished:
        facts.append(("unfinished", ", ".join(result.unfinished)))
    dl = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in facts if v not in (None, ""))
    return ("<h2>What happened</h2>"
            + ("".join(f"<p class='sentence'>{_e(s)}</p>" for s in explain(result)) or "<p>-</p>")
            + f"<dl class='facts'>{dl}</dl>")


def crash_section(ctx: PageContext) -> str:
    """The crash's vLLM frames (outermost first) and the traceback (or the lab error's)."""
    result, out = ctx.result, []
    c = result.crash
    if c is not None and c.vllm_frames:
        frames = "".join(f"<li><code>{_e(f.file)}:{_e(f.line)}</code> {_e(f.function)}</li>"
                         for f in c.vllm_frames)
        out.append(f"<h2>vLLM frames (outermost first)</h2><ol>{frames}</ol>")
    tb = (c.traceback if c is not None else None) or (result.error.traceback if result.error else None)
    if tb:
        out.append(f"<h2>Traceback</h2><pre class='traceback'>{_e(tb.rstrip())}</pre>")
    return "\n".join(out)


def _cell(value) -> str:
    if isinstance(value, (dict, list)):
        import json

        return json.dumps(value, separators=(", ", ": "))
    return "" if value is None else str(value)


def scenario_section(ctx: PageContext) -> str:
    """The scenario as its file says: the description, ``level``, ``config`` (vLLM's names),
    ``requests`` (one row each, a column per field any request sets) and how many ``events``;
    empty when there is no readable scenario.yaml."""
    sc = ctx.scenario
    if not isinstance(sc, dict):
        return ""
    out = ["<h2>Scenario</h2>"]
    if sc.get("description"):
        out.append(f"<p class='description'>{_e(' '.join(str(sc['description']).split()))}</p>")
    config = sc.get("config")
    facts = [("level", sc.get("level", "scheduler"))]
    if isinstance(config, dict):
        facts += [(f"config.{k}", _cell(v)) for k, v in config.items()]
    for key in ("platform", "model", "limits", "kv_transfer_config", "expect", "fixed"):
        if sc.get(key) not in (None, {}, []):
            facts.append((key, _cell(sc[key])))
    out.append("<dl class='facts'>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>"
                                             for k, v in facts) + "</dl>")
    requests = [r for r in sc.get("requests") or [] if isinstance(r, dict)]
    if requests:
        cols = list(dict.fromkeys(k for r in requests for k in r))
        rows = "".join("<tr>" + "".join(f"<td>{_e(_cell(r.get(c)))}</td>" for c in cols) + "</tr>"
                       for r in requests[:MAX_TABLE_ROWS])
        more = (f"<p>{len(requests) - MAX_TABLE_ROWS} more request(s): scenario.yaml has them "
                "all.</p>" if len(requests) > MAX_TABLE_ROWS else "")
        out.append(f"<h3>requests ({len(requests)})</h3><table class='requests'><tr>"
                   + "".join(f"<th>{_e(c)}</th>" for c in cols) + f"</tr>{rows}</table>{more}")
    events = sc.get("events") or []
    if events:
        out.append(f"<p>{len(events)} event(s): see <a href='{SCENARIO_FILE}'>{SCENARIO_FILE}</a>."
                   "</p>")
    return "\n".join(out)


def why_crash_section(ctx: PageContext) -> str:
    """Why the run ended as it did (``report/crash.py``): the raising statement, a failed
    assert's operands and the frame's locals, vLLM's refusal, or where a hang sat; above the
    traceback. The scenario itself is :func:`scenario_section`'s."""
    return why_section(ctx.result)


def by_engine_core(trace: list[TraceLine]) -> list[tuple[str, list[TraceLine]]]:
    """``[(heading suffix, lines)]``: the whole trace (suffix empty), or with data parallelism
    (lines with a ``dp_rank``: one engine core process per DP rank) one entry per DP rank,
    ``": DP rank N"``, in rank order."""
    ranks = sorted({ln.dp_rank for ln in trace if ln.dp_rank is not None})
    if not ranks:
        return [("", trace)]
    return [(f": DP rank {r}", [ln for ln in trace if ln.dp_rank == r]) for r in ranks]


def timeline_section(ctx: PageContext) -> str:
    """One timeline per engine core (:func:`by_engine_core`)."""
    out = []
    for suffix, lines in by_engine_core(ctx.trace):
        svg = timeline_svg(lines, ctx.result)
        if svg:
            out.append(f"<h2>Timeline{html.escape(suffix)}</h2>{svg}")
    return "\n".join(out)


def steps_section(ctx: PageContext) -> str:
    """One step table per engine core (:func:`by_engine_core`)."""
    return "\n".join(f"<h2>Steps{html.escape(suffix)}</h2>{step_table(lines)}"
                     for suffix, lines in by_engine_core(ctx.trace) if lines)


def log_tail_section(ctx: PageContext) -> str:
    """The engine log's last :data:`LOG_TAIL_LINES` lines (vLLM's own logging of this run)."""
    if not ctx.log_tail:
        return ""
    shown = len(ctx.log_tail)
    of = f" of {ctx.log_lines}" if ctx.log_lines > shown else ""
    return (f"<h2>Engine log (last {shown}{of} lines)</h2>"
            f"<p><a href='{ReportDir.ENGINE_LOG}'>{ReportDir.ENGINE_LOG}</a> has them all.</p>"
            f"<pre class='log'>{_e(chr(10).join(ctx.log_tail))}</pre>")


#: the page's sections, in order: each takes the :class:`PageContext` and returns HTML (empty
#: when it has nothing to show). More sections (e.g. why a crash happened) go in this list.
SECTIONS: list[Callable[[PageContext], str]] = [
    header_section,
    happened_section,
    why_crash_section,
    crash_section,
    scenario_section,
    timeline_section,
    steps_section,
    log_tail_section,
]


def run_page(result: RunResult, trace: list[TraceLine], files: list[str],
             scenario: dict | None = None, log_tail: list[str] | None = None,
             log_lines: int = 0) -> str:
    """The page's HTML: each of :data:`SECTIONS` in order. ``files``: the report's files
    present, linked relative to the page; ``scenario``: the scenario file's mapping;
    ``log_tail``: the engine log's last lines."""
    ctx = PageContext(result, trace, files, scenario, list(log_tail or ()), log_lines)
    title = f"{result.scenario} on vLLM {result.vllm}"
    body = [html_ for html_ in (section(ctx) for section in SECTIONS) if html_]
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            "<link rel='icon' href='data:,'>"
            f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> tuple[list[str], int]:
    """The last ``lines`` lines of the log at ``path`` (at most :data:`LOG_TAIL_BYTES` read)
    and how many lines it has in all; ``([], 0)`` when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return [], 0
    total = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    text = data[-LOG_TAIL_BYTES:].decode("utf-8", errors="replace")
    tail = text.splitlines()
    if len(data) > LOG_TAIL_BYTES:
        tail = tail[1:]  # the first line read may be cut
    return tail[-lines:], total


def read_scenario(text: str | None) -> dict | None:
    """The scenario file's mapping, or ``None`` when ``text`` is missing or not a YAML mapping."""
    if not text:
        return None
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return doc if isinstance(doc, dict) else None


def write_run_page(run_dir: Path, result: RunResult, scenario_text: str | None = None) -> Path:
    """Write ``run_dir/index.html`` (and ``run_dir/scenario.yaml`` from ``scenario_text``, the
    scenario file as the lab read it) from ``result``, ``run_dir/trace.jsonl``, the scenario
    file and ``run_dir/engine.log``; returns the page's path. A damaged trace is drawn up to its
    damage. Raises ``OSError``."""
    run_dir = Path(run_dir)
    if scenario_text is not None:
        (run_dir / SCENARIO_FILE).write_text(scenario_text, encoding="utf-8")
    elif (run_dir / SCENARIO_FILE).is_file():
        scenario_text = (run_dir / SCENARIO_FILE).read_text(encoding="utf-8", errors="replace")
    trace: list[TraceLine] = []
    if (run_dir / ReportDir.TRACE).is_file():
        try:
            trace = read_trace(run_dir / ReportDir.TRACE)
        except RecordError:
            from .timeline import read_trace as read_until_damage

            trace = read_until_damage(run_dir / ReportDir.TRACE)
    names = [SCENARIO_FILE, ReportDir.RESULT, ReportDir.TRACE, ReportDir.ENGINE_LOG,
             ReportDir.TIMELINE]
    files = [n for n in names if (run_dir / n).is_file() or n == ReportDir.RESULT]
    tail, total = read_log_tail(run_dir / ReportDir.ENGINE_LOG)
    path = run_dir / PAGE
    path.write_text(run_page(result, trace, files, read_scenario(scenario_text), tail, total),
                    encoding="utf-8")
    return path


# ---- the other releases -----------------------------------------------------------------------
def releases_nav(here: str, runs: list[tuple[str, str]]) -> str:
    """The links to the same scenario's pages on every release: ``runs`` is ``(release,
    ok_text)`` in release order (ok_text: yes, NO, ERROR or -); ``here`` is this page's."""
    if len(runs) < 2:
        return ""
    links = " ".join(
        f"<a class='{_e(ok)}{' here' if r == here else ''}' href='../{_e(r)}/{PAGE}' "
        f"title='{_e(ok)}'>{_e(r)}</a>" for r, ok in runs)
    return f"<p class='releases'>this scenario on: {links}</p>"


def set_releases_nav(page: Path, nav: str) -> bool:
    """Put ``nav`` between the page's :data:`NAV_START` and :data:`NAV_END` (a page without
    them is left alone); True when the page changed. Raises ``OSError``."""
    text = page.read_text(encoding="utf-8")
    a, b = text.find(NAV_START), text.find(NAV_END)
    if a < 0 or b < a:
        return False
    new = text[:a + len(NAV_START)] + nav + text[b:]
    if new == text:
        return False
    tmp = page.with_name(f".{page.name}.nav.tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(page)
    return True


__all__ = ["explain", "timeline_svg", "step_rows", "step_table", "run_page", "write_run_page",
           "PageContext", "SECTIONS", "releases_nav", "set_releases_nav", "read_log_tail",
           "read_scenario", "SCENARIO_FILE", "PAGE"]
