"""The lab's console: where the commands print (no typer here; the commands are in
:mod:`vllm_repro.commands`).

``out`` is stdout (tables, results), ``err`` is stderr (progress and errors); both are 400
columns wide when not a terminal, so that tables in logs and pipes are never wrapped.
:func:`say` is the dim progress line every long-running step prints; :func:`print_results`
prints the verdict table (or ``--json``) of a run and returns the exit code (README, "Exit codes");
:func:`progress` is the bar a long command shows on stderr (on a terminal only).

Colour and bars only on a terminal: piped or logged, the output is plain text (rich drops the
colour when its file is not a terminal, and honours ``NO_COLOR``), and no bar is drawn.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterable, Iterator

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from rich.table import Table

out = Console(width=None if sys.stdout.isatty() else 400)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 400)


def say(msg: str) -> None:
    """A progress line on stderr (dim): what the lab is doing now, printed as written (no
    markup: a path with ``[...]`` in it stays that)."""
    from rich.markup import escape

    err.print(f"[dim]{escape(msg)}[/dim]", highlight=False)


class Bar:
    """A running :func:`progress` bar: :meth:`advance` it, :meth:`note` what it is doing now;
    :meth:`say` prints a progress line above it (as :func:`say`). Thread-safe (rich's lock)."""

    def __init__(self, progress, task) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def note(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, note=" ".join(text.split())[:100])

    def total(self, total: int | None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def say(self, msg: str) -> None:
        say(msg)
        self.note(msg)


@contextmanager
def progress(description: str, total: int | None) -> Iterator[Bar]:
    """A bar on stderr while a long command works (``description``, done of ``total``, elapsed
    time, and the latest :meth:`Bar.note`); ``total=None``: a pulsing bar. Nothing is drawn when
    stderr is not a terminal (a log, a pipe, CI): the :meth:`Bar.say` lines are then the only
    output, as before. The bar stays on screen when it ends."""
    if not err.is_terminal:
        yield Bar(None, None)
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("[dim]{task.fields[note]}"), console=err,
                  transient=False) as bar:
        task = bar.add_task(description, total=total, note="")
        yield Bar(bar, task)


def error(msg: str) -> None:
    """A one-line error on stderr: ``error: MSG`` (``error:`` in red). ``msg`` is printed as
    written (no markup: a file named ``[x].yaml`` stays that), never wrapped."""
    from rich.markup import escape

    err.print(f"[red]error:[/red] {escape(' '.join(str(msg).split()))}", highlight=False,
              soft_wrap=True)


def table(columns: Iterable[str], *, no_wrap: bool = True, edge: bool = True) -> Table:
    """The lab's plain table: no box, bold header; ``edge=False`` also drops the padding at
    the left and right edges (the verdict and bisect tables)."""
    from rich.table import Table

    extra = {} if edge else {"pad_edge": False, "show_edge": False}
    t = Table(box=None, header_style="bold", **extra)
    for col in columns:
        t.add_column(col, no_wrap=no_wrap)
    return t


#: the widest ``observed`` cell of the verdict table, in characters: a longer one (an input
#: error's whole sentence) is cut with "..." there; its whole text is the line under the table
OBSERVED_WIDTH = 120


def verdict_table(verdicts) -> Table:
    """The verdict table: scenario, vllm, expect, observed (at most :data:`OBSERVED_WIDTH`
    characters, so that a long error keeps every column on the screen), ok."""
    t = table(("scenario", "vllm", "expect", "observed", "ok"), edge=False)
    for v in verdicts:
        style = {"yes": "green", "NO": "red", "ERROR": "red", "-": "yellow"}[v.ok_text]
        observed = str(v.observed)
        if len(observed) > OBSERVED_WIDTH:
            observed = observed[:OBSERVED_WIDTH - 3].rstrip() + "..."
        t.add_row(*(Text(str(c)) for c in (v.scenario, v.vllm, v.expected, observed)),
                  f"[{style}]{v.ok_text}[/{style}]")  # the cells as written, never markup
    return t


def stall_lines(items, most: int = 10) -> list[str]:
    """Under the verdict table, where each stalled run's requests are stuck
    (:attr:`vllm_repro.records.Stall.message`): ``stall: SCENARIO on VERSION @STEP: MESSAGE``,
    at most ``most`` lines (the rest counted)."""
    stalls = [(i, i.result.stall) for i in items
              if i.result is not None and i.result.outcome == "stall" and i.result.stall is not None
              and i.result.stall.message]
    lines = [f"stall: {i.scenario.name} on {i.version} @{s.step}: {s.message}"
             for i, s in stalls[:most]]
    if len(stalls) > most:
        lines.append(f"stall: ... {len(stalls) - most} more (see each result.json)")
    return lines


def input_error_lines(items) -> list[str]:
    """One line per input error a release refused the scenario with (a config field it lacks,
    ...), naming the file as a schema error at load does (``FILE: FIELD: problem; fix``, which
    :func:`print_results` prints as :func:`error` prints a load error: ``error: FILE: ...``);
    the same error on several releases (its text the same but for the release) is one line
    naming them all: ``x.yaml: config.blok_size: vLLM 0.10.1.1, 0.10.2 have no such field ...``.
    An error of the release itself (``RunItem.release_failed``: a release the index lacks, a
    slice that cannot be made) names no file, once for all its scenarios."""
    groups: dict[tuple[str, str], list[str]] = {}
    for i in items:
        v = i.verdict
        error = i.result.error if i.result is not None else None
        if v.error_kind != "input" or error is None:
            continue
        where = "" if i.release_failed else str(i.scenario.source_path or v.scenario)
        text = (error.message or "").replace(f"vLLM {v.vllm}", "vLLM \0")
        versions = groups.setdefault((where, text), [])
        if v.vllm not in versions:
            versions.append(v.vllm)
    lines = []
    for (where, text), versions in groups.items():
        if len(versions) > 1:
            text = (text.replace("\0 has ", "\0 have ") if "\0" in text
                    else f"{text} (on {', '.join(versions)})")
            text = text.replace("that release's", "those releases'") \
                .replace("for this release", "for these releases")
        text = text.replace(chr(0), ", ".join(versions))
        lines.append(f"{where}: {text}" if where else text)
    return lines


def print_results(items, as_json: bool, sched_log: bool) -> int:
    """Print the results of run items (:class:`vllm_repro.lab.RunItem`): with ``sched_log``
    each run's [SCHED] lines first; then the verdicts as JSON (on stderr, the input errors'
    ``error:`` lines and each lab error's cause), or the verdict table, the findings outside
    the scenarios' own bugs and, on stderr, why each mismatch is one.
    Returns the exit code of the verdicts (:func:`vllm_repro.verdict.exit_code`)."""
    from .report.sched_log import sched_log_lines
    from .verdict import exit_code, findings_lines

    verdicts = [i.verdict for i in items]
    if sched_log:
        for i in items:
            if i.report is not None and i.report.trace_path.is_file():
                out.print(f"[bold]{i.scenario.name} on vLLM {i.version}[/bold]")
                stall = i.result.stall if i.result is not None else None
                for line in sched_log_lines(i.report.trace_path, stall):
                    out.print(line, highlight=False, markup=False)
    if as_json:
        print(json.dumps([v.as_dict() for v in verdicts], indent=1))
        # stdout is the JSON; stderr still says, in one line each, why the exit code is 2 or 3
        for line in input_error_lines(items):
            error(line)
        for v in verdicts:
            if v.error_kind not in (None, "input"):
                err.print(f"{v.scenario} on {v.vllm}: {v.observed}", style="red",
                          highlight=False, markup=False, soft_wrap=True)
    else:
        out.print(verdict_table(verdicts))
        for line in findings_lines(verdicts):
            out.print(line, highlight=False, markup=False)
        for line in stall_lines(items):
            out.print(line, highlight=False, markup=False)
        for line in input_error_lines(items):  # as a load error is said: exit 2 either way
            error(line)
        for v in verdicts:  # input errors: above, once for the releases refusing alike
            if v.error_kind != "input" and v.reason and v.ok is False:
                err.print(f"{v.scenario} on {v.vllm}: {v.reason}", style="red", highlight=False,
                          markup=False, soft_wrap=True)
            if v.error_kind != "input" and len(str(v.observed)) > OBSERVED_WIDTH:
                # the table cut it: the whole of it (a lab error's cause) on a line of its own
                err.print(f"{v.scenario} on {v.vllm}: {v.observed}", style="red",
                          highlight=False, markup=False, soft_wrap=True)
    return exit_code(verdicts)
