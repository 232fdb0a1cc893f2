"""The "why" part of a run's page: what the scenario is about and why vLLM raised, hung or
refused, above the traceback (:func:`why_section`, called from :mod:`.pages`).

- the scenario's description, its issue and fix as links (``vllm.issue`` / ``vllm.fixed_by``:
  ``owner/repo#N``), its ``config`` and ``requests`` as written;
- a crash: the statement that raised in full, a failed ``assert``'s operands with their values
  (``len(self.running)`` = ``1``) and the innermost vLLM frame's locals (what ``schedule()`` had
  built before it raised: ``scheduled_running_reqs``, ``preempted_reqs``, ...), from
  :class:`~vllm_repro.records.CrashContext`;
- a hang: the frame the run's thread sat in and every thread's stack;
- a refusal: vLLM's exception and where it refused.

Host side; the scenario's text is read with PyYAML where it is installed (else shown as is).
"""

from __future__ import annotations

import html
import re

from ..records import Crash, RunResult


def _e(value) -> str:
    return html.escape(str(value))


def _link(ref: str | None, kind: str) -> str:
    """``owner/repo#N`` as a link to its GitHub issue or pull request; other text as text."""
    if not ref:
        return ""
    m = re.fullmatch(r"([\w.-]+/[\w.-]+)#(\d+)", ref.strip())
    if not m:
        return _e(ref)
    return (f"<a href='https://github.com/{_e(m.group(1))}/{kind}/{m.group(2)}'>"
            f"{_e(ref)}</a>")


def _scenario_block(scenario_text: str | None) -> str:
    if not scenario_text:
        return ""
    try:
        import yaml

        data = yaml.safe_load(scenario_text)
    except Exception:  # noqa: BLE001 - no PyYAML, or a file the page cannot read: left out
        return ""
    if not isinstance(data, dict):
        return ""
    out = ["<h2>The scenario</h2>"]
    if data.get("description"):
        out.append(f"<p class='description'>{_e(' '.join(str(data['description']).split()))}</p>")
    refs = data.get("vllm") if isinstance(data.get("vllm"), dict) else {}
    links = [f"issue {_link(refs.get('issue'), 'issues')}" if refs.get("issue") else "",
             f"fixed by {_link(refs.get('fixed_by'), 'pull')}" if refs.get("fixed_by") else ""]
    links = [x for x in links if x]
    if links:
        out.append(f"<p class='links'>{' &middot; '.join(links)}</p>")
    shown = {k: data[k] for k in ("level", "config", "requests", "events", "expect", "fixed")
             if k in data}
    if shown:
        try:
            text = yaml.safe_dump(shown, sort_keys=False, default_flow_style=None, width=100)
        except Exception:  # noqa: BLE001
            text = ""
        if text:
            out.append(f"<pre class='scenario'>{_e(text.rstrip())}</pre>")
    return "\n".join(out)


def _table(rows: dict[str, str], cls: str, head: tuple[str, str]) -> str:
    body = "".join(f"<tr><td><code>{_e(k)}</code></td><td><code>{_e(v)}</code></td></tr>"
                   for k, v in rows.items())
    return (f"<table class='{cls}'><tr><th>{_e(head[0])}</th><th>{_e(head[1])}</th></tr>"
            f"{body}</table>")


def _crash_block(c: Crash, title: str) -> str:
    ctx = c.context
    where = f" at <code>{_e(c.where.file)}:{_e(c.where.line)}</code> in <code>" \
            f"{_e(c.where.function)}</code>" if c.where else ""
    out = [f"<h2>{_e(title)}</h2>",
           f"<p><b>{_e(c.type)}</b>{': ' + _e(c.message) if c.message else ''}{where}</p>"]
    if ctx is None:
        return "\n".join(out)
    if ctx.statement:
        out.append(f"<pre class='statement'>{_e(ctx.statement)}</pre>")
    if ctx.operands:
        out.append("<p>The assertion's operands, evaluated in that frame:</p>")
        out.append(_table(ctx.operands, "operands", ("operand", "value")))
    if ctx.operand_error:
        out.append(f"<p>{_e(ctx.operand_error)}</p>")
    if ctx.locals:
        out.append("<details open><summary>The frame's locals (what it had built before it "
                   "raised)</summary>" + _table(ctx.locals, "locals", ("name", "value"))
                   + "</details>")
    return "\n".join(out)


def why_section(result: RunResult, scenario_text: str | None = None) -> str:
    """The HTML of the scenario's block and the why of the run's end (see the module
    docstring); empty when there is nothing to say."""
    out = [_scenario_block(scenario_text)]
    if result.crash is not None:
        out.append(_crash_block(result.crash, "Why it raised"))
    if result.refusal is not None:
        out.append(_crash_block(result.refusal, f"vLLM refused it ({result.refusal.phase})"))
    h = result.hang
    if h is not None:
        where = (f"<code>{_e(h.where.file)}:{_e(h.where.line)}</code> in <code>"
                 f"{_e(h.where.function)}</code>") if h.where else "no vLLM frame"
        out.append(f"<h2>Where it hung</h2><p>Step {_e(h.step)} ({_e(h.phase)}) had not returned "
                   f"after {_e(h.limit_s)} s; the run's thread sat in {where} "
                   f"({_e(h.stopped)}).</p>")
        if h.stacks:
            out.append(f"<details open><summary>Every thread's stack (faulthandler, most recent "
                       f"call first)</summary><pre class='stacks'>{_e(h.stacks.rstrip())}</pre>"
                       "</details>")
    return "\n".join(x for x in out if x)


__all__ = ["why_section"]
