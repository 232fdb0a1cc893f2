"""``vllm-repro triage LOG``: read a vLLM crash log like a vLLM debugger would.

Prints a short report (or ``--json``), and with ``--scenario OUT.yaml`` drafts a replay
scenario from what vLLM dumped at the crash. Exit codes: 0 a crash was triaged; 2 the input
is not a readable text log or shows no crash (one-line message, no traceback). The triage
itself is :mod:`vllm_repro.triage`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from ..triage.analyze import TriageReport


def state_text(state: dict | None) -> str:
    """The scheduler state the log shows, in a line: queues, KV cache, preemption warnings."""
    if not state:
        return "not visible in the log"
    parts = []
    for key, label in (("running", "running"), ("waiting", "waiting"), ("pending", "pending"),
                       ("swapped", "swapped")):
        if key in state:
            parts.append(f"{label} {state[key]}")
    if "kv_cache_usage_pct" in state:
        parts.append(f"KV cache {state['kv_cache_usage_pct']}%")
    if "prefix_cache_hit_rate_pct" in state:
        parts.append(f"prefix hits {state['prefix_cache_hit_rate_pct']}%")
    if "num_gpu_blocks" in state:
        parts.append(f"{state['num_gpu_blocks']} GPU blocks")
    if state.get("preemption_warnings"):
        parts.append(f"{state.get('preemption_warning_count')} preemption warning(s)")
    src = state.get("source")
    return ", ".join(parts) + (f"  ({src})" if src else "")


def render(report: TriageReport, console: Console) -> None:
    """The short human report: root cause, where, stage, exit, release, scheduler state."""
    from rich.table import Table
    from rich.text import Text

    console.print(Text(f"vLLM crash triage: {report.source} ({report.lines} line{'' if report.lines == 1 else 's'})", style="bold"))
    if report.cut_off:  # first: everything below is what the lines before the cut show
        console.print(Text(f"cut off: {report.cut_off}; what follows is read from the lines "
                           "before the cut", style="bold yellow"))
    t = Table.grid(padding=(0, 2))
    t.add_column(style="cyan", no_wrap=True)
    t.add_column()
    exc = report.exception_type or ("(not in the log: the log is cut off)" if report.truncated
                                    else "(no Python exception)")
    if report.exception_message:
        exc += f": {report.exception_message}"
    rc = report.root_cause or {}
    where_line = f"  [log line {rc['log_line']}" + (f", {rc['process']}" if rc.get("process") else "") \
        + "]" if rc else ""
    t.add_row("root cause", Text(exc + where_line))
    f = report.last_vllm_frame
    t.add_row("vLLM frame", Text(f"{f['module']}:{f['function']}" + (f" line {f['line']}" if f.get("line")
                                                                       else "") if f else "none visible"))
    if report.plugin_frame:
        pf = report.plugin_frame
        t.add_row("plugin frame", Text(f"{pf['module']}:{pf['function']}"))
    t.add_row("stage", Text(f"{report.stage or 'unknown'}  ({report.stage_reason})"))
    exit_text = report.exit_kind or "unknown"
    if report.signal and report.exit_kind and report.exit_kind.startswith("signal"):
        s = report.signal
        exit_text += f"  ({s['source']}, log line {s['log_line']}" + \
            (f", {s['process']}" if s.get("process") else "") + ")"
    t.add_row("exit", Text(exit_text))
    vs = report.version_source
    t.add_row("vLLM release", Text(report.vllm_version + (f"  (log line {vs['log_line']})" if vs else "")
                                   if report.vllm_version else "not named in the log"))
    t.add_row("scheduler", Text(state_text(report.scheduler_state)))
    for c in report.cause_chain[:3]:
        w = c.get("last_vllm_frame")
        t.add_row("caused by", Text(f"{c['type']}" + (f": {c['message']}" if c["message"] else "")
                                    + (f"  at {w['module']}:{w['function']}" if w else "")))
    if report.wrapper_exceptions:
        names = sorted({w["type"].rsplit(".", 1)[-1] for w in report.wrapper_exceptions})
        t.add_row("wrappers", Text(", ".join(names) + " (consequences, not the cause)"))
    if report.crash_path:
        path = report.crash_path[-4:]
        t.add_row("path", Text((" ... -> " if len(report.crash_path) > 4 else "")
                               + " -> ".join(p.split(":")[-1] for p in path)))
    if report.dump:
        t.add_row("dump", Text(f"dump_input.py at log line {report.dump['log_line']}: "
                               "--scenario OUT.yaml drafts a replay from it"))
    for n in report.notes:
        if n.startswith("warning: "):
            t.add_row(Text("warning", style="bold yellow"), Text(n.removeprefix("warning: ")))
        else:
            t.add_row("note", Text(n))
    console.print(t)


def _replay(report, sc, vllm, reports: Path, scenario: Optional[Path], force: bool,
            as_json: bool) -> None:
    """``--replay``: the draft (into ``--scenario`` or ``<reports>/triage/<name>.yaml``), its run,
    the comparison table; exits with the run's verdict code (0: the replay shows the log's
    crash as the draft expects; 1: it does not; 2 / 3: input / lab error)."""
    from rich.console import Console
    from rich.table import Table

    from ..console import say
    from ..inputs import folder, output_file
    from ..triage.replay import replay
    from ..triage.scenario import _scenario_name

    reports = folder(reports, "--reports folder", "give a folder the lab may write", create=True,
                     writable=True)
    if scenario is None:
        scenario = reports / "triage" / f"{_scenario_name(report.source)}.yaml"
        scenario.parent.mkdir(parents=True, exist_ok=True)
        output_file(scenario, "scenario file", "--scenario", force=True)
    rep = replay(report, sc, version=vllm, reports=reports, scenario_path=scenario, say=say)
    if as_json:
        data = report.as_dict()
        data["replay"] = rep.as_dict()
        print(json.dumps(data, indent=1, ensure_ascii=False, default=str))
    else:
        out = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
        render(report, out)
        out.print(f"replay: {rep.scenario} on vLLM {rep.release}: {rep.observed}"
                  f" ({'the log' + chr(39) + 's crash reproduced' if rep.reproduced else 'not the log' + chr(39) + 's crash'})",
                  markup=False)
        t = Table("field", "dumped", "replayed", "", title=None)
        for r in rep.rows:
            mark = {True: "same", False: "differs", None: "-"}[r.agree]
            t.add_row(r.field, str(r.dumped if r.dumped is not None else "-"),
                      str(r.replayed if r.replayed is not None else "-"), mark)
        out.print(t)
        if rep.report_dir:
            out.print(f"report: {rep.report_dir}", markup=False)
    raise typer.Exit(rep.exit_code)


def triage(
    log: str = typer.Argument(..., help="The crash log (a file, or - to read stdin)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    scenario: Optional[Path] = typer.Option(
        None, "--scenario", help="Also draft a replay scenario from the crash dump into this "
                                 "YAML file (guessed values marked in comments)."),
    vllm: Optional[str] = typer.Option(
        None, "--vllm", help="Release for the scenario when the log names none (or another)."),
    force: bool = typer.Option(False, "--force", help="Let --scenario overwrite an existing file."),
    do_replay: bool = typer.Option(
        False, "--replay", help="Draft the scenario and run it on the logged release (or --vllm); "
                                "print how the replay's last step compares with the dump."),
    reports: Path = typer.Option(Path("reports"), "--reports",
                                 help="With --replay: where the run's report goes."),
) -> None:
    """Triage a vLLM crash log: root cause, innermost vLLM frame, stage, exit, release,
    scheduler state; optionally a replay scenario."""
    from rich.console import Console
    from rich.text import Text

    from ..inputs import input_file, output_file, release_name
    from ..triage.core import triage_log, write_draft
    from ..triage.scenario import draft_release, draft_scenario

    if log != "-":
        input_file(log, "crash log", "give the path of a vLLM crash log (or - for stdin)",
                   fifo_ok=True)
    if vllm is not None:
        from ..console import say
        from ..sources.sdist import checked_release

        vllm = checked_release(release_name(vllm), "--vllm", needed=do_replay, say=say)
    if scenario is not None:  # refused before the log is read: nothing is overwritten
        output_file(scenario, "scenario file", "--scenario", force=force)
    report, sc = triage_log(log)
    if do_replay:
        _replay(report, sc, vllm, reports, scenario, force, as_json)
    written = None
    if scenario is not None:
        text, sc_obj = draft_scenario(report, sc, version=vllm)
        write_draft(scenario, text)
        written = {"path": str(scenario), "name": sc_obj.name,
                   "requests": len(sc_obj.requests),
                   "guesses": text.count("# guess"),
                   "vllm": draft_release(report, vllm),
                   "expects": sc_obj.expect.outcome if sc_obj.expect else None}
    if as_json:
        data = report.as_dict()
        if written:
            data["scenario"] = written
        print(json.dumps(data, indent=1, ensure_ascii=False))
    else:
        out = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
        render(report, out)
        if written:
            if written["expects"]:
                aim = f"expects the log's {written['expects']}"
            elif report.cut_off:
                aim = ("no expect: the log is cut off before its crash, so where it crashed is "
                       "unknown; the replay shows whether the scheduler side stays sound")
            else:
                aim = ("no expect: the log's crash is outside the code the lab drives; the replay "
                       "shows whether the scheduler side stays sound")
            lead = " (drafted from a log cut off before its crash)" if report.cut_off else ""
            out.print(Text(f"scenario{lead}: {written['path']} ({written['requests']} requests, "
                           f"{written['guesses']} guessed values marked; {aim}) -> vllm-repro run "
                           f"{written['path']} --vllm {written['vllm']}"))
    raise typer.Exit(0)
