"""``vllm-repro diff SCENARIO --vllm A --vllm B [--json]``: the same scenario on two releases,
aligned step by step; the first step where the scheduler's decisions differ, side by side
(:mod:`vllm_repro.diff`). Exit 0: no step differs; 1: one does; 2 / 3: an input / lab error."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from . import COLD_HELP, warm_setting
from .run import DEFAULT_REPORTS


def diff(
    scenario: Path = typer.Argument(..., help="A scenario YAML file."),
    vllm: List[str] = typer.Option(..., "--vllm", help="The two releases, A then B."),
    reports: Path = typer.Option(DEFAULT_REPORTS, help="Where reports/<scenario>/<version>/ go."),
    as_json: bool = typer.Option(False, "--json", help="Print the diff as JSON."),
    tree: Optional[str] = typer.Option(None, "--tree", help="full | slice | auto (as run's)."),
    cold: bool = typer.Option(False, "--cold", help=COLD_HELP),
) -> None:
    """Run a scenario on two releases and show the first step where their decisions differ."""
    warm_setting(cold)
    from ..console import err, out, say, table
    from ..diff import diff_lines, release_diff
    from ..errors import InputError
    from ..inputs import release_name, reports_dir
    from ..lab import RunItem, checked_releases, run_pairs
    from ..records import ReportDir, read_trace
    from ..report.diff_page import write_diff_page
    from ..report.index import write_index
    from ..scenario.load import unique_scenarios
    from ..sources.prepare import check_tree
    from ..verdict import exit_code

    versions = checked_releases([release_name(v) for v in vllm], "--vllm")
    if len(versions) != 2 or len(vllm) != 2:  # a third --vllm was dropped without a word
        raise InputError(f"--vllm: give two different releases, A and B (got {len(vllm)}); "
                         "e.g. --vllm 0.10.1.1 --vllm 0.10.2")
    check_tree(tree)
    sc = unique_scenarios([scenario])[0]
    reports = reports_dir(reports)
    items = [RunItem(sc, v) for v in versions]
    # both runs to their end: a finding of the audit does not stop either
    run_pairs(items, reports, audit=True, keep_going=True, say=say, tree=tree)
    errors = [i for i in items if i.result.outcome == "error"]
    if errors:
        write_index(reports)
        for i in errors:
            err.print(f"{sc.name} on {i.version}: {i.result.error.message}", markup=False)
        raise typer.Exit(exit_code([i.verdict for i in errors]))
    runs = []
    for i in items:
        path = i.report.path / ReportDir.TRACE
        runs.append((i.version, i.result, read_trace(path) if path.is_file() else [],
                     str(i.report.path)))
    result = release_diff(sc.name, runs)
    # the diff's page beside the two runs; the index links both run pages to it
    page = write_diff_page(items[0].report.path.parent, result)
    write_index(reports)
    if as_json:
        out.print_json(result.to_json())
    else:
        head, rows, notes = diff_lines(result)
        for line in head:
            out.print(line, markup=False, highlight=False)
        if rows:
            t = table(["", versions[0], versions[1]], no_wrap=False)
            for row in rows:
                t.add_row(*row)
            out.print(t)
        for line in notes:
            out.print(line, markup=False, highlight=False)
        out.print(f"page: {page}", markup=False, highlight=False)
    raise typer.Exit(0 if result.step is None else 1)
