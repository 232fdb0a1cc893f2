"""``vllm-repro matrix SCENARIO [--releases RANGE]``: one scenario on every final release in a
range, in each mode the releases allow; the table, its causes and a picture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from . import COLD_HELP, Mode, value, warm_setting

DEFAULT_REPORTS = Path("reports")


def matrix(
    scenario: Path = typer.Argument(..., help="Scenario YAML file."),
    releases: List[str] = typer.Option(
        [], "--releases", help="PEP 440 range of releases, e.g. '>=0.10,<0.34'; repeatable, the "
        "union (default: every final release on the index from 0.6.5, the first with a V1 "
        "scheduler)."),
    modes: List[Mode] = typer.Option([], "--mode", help="A mode to run (repeatable; default: "
                                     "all of them)."),
    reports: Path = typer.Option(DEFAULT_REPORTS, help="Where reports/_matrix/<scenario>/ and "
                                 "each run's reports/<scenario>[.<mode>]/<release>/ go."),
    jobs: Optional[int] = typer.Option(None, min=1, help="Releases run in parallel (default: "
                                       "CPUs, max 4)."),
    as_json: bool = typer.Option(False, "--json", help="Print matrix.json instead of the table."),
    timelines: bool = typer.Option(False, "--timelines", help="Draw each run's timeline.png too "
                                   "(about 2 s a run)."),
    cold: bool = typer.Option(False, "--cold", help=COLD_HELP),
) -> None:
    """Run a scenario on every final vLLM release in a range, in each mode (plain, async, spec,
    prefix caching) the release's capabilities allow; print the table (release x mode ->
    outcome) and the one-line cause of every cell that is not clean; write matrix.json and
    matrix.png under reports/_matrix/<scenario>/. Exit, the worst cell's as `run` judges it: 0
    all clean or as the scenario expects (n/a aside), 1 a run neither, 2 a release or the index
    refuses a run, 3 the lab or an environment failed."""
    warm_setting(cold)
    from ..console import out, progress, say
    from ..inputs import reports_dir
    from ..matrix import check_modes, index_releases, matrix_dir, parse_range, run, table
    from ..scenario.load import unique_scenarios

    from ..limits import check_jobs

    check_jobs(jobs)
    chosen_modes = check_modes(value(m) for m in modes)
    specs = [parse_range(r) for r in releases] or [parse_range(None)]
    text = " | ".join(str(s) for s in specs)
    reports = reports_dir(reports, create=False)
    sc = unique_scenarios([scenario])[0]
    versions = index_releases(specs)
    say(f"{sc.name}: {len(versions)} release(s) in {text!r} ({versions[0]} to {versions[-1]}), "
        f"modes {', '.join(chosen_modes)}")
    reports = reports_dir(reports)
    with progress("matrix", len(versions) * len(chosen_modes)) as bar:
        report = run(sc, versions, chosen_modes, reports, text, jobs=jobs, say=bar.say,
                     source=str(scenario), timelines=timelines,
                     on_run=lambda item: bar.advance())
    from ..report.index import write_index

    write_index(reports)  # the matrix's runs are runs like any other: the index links them
    if as_json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        from ..matrix import cause_lines

        out.print(table(report))
        for line in cause_lines(report):
            out.print(line, highlight=False, markup=False)
    where = matrix_dir(reports, sc.name)
    say(f"done in {report.seconds:.1f}s; {where}/matrix.json and matrix.png")
    raise typer.Exit(report.exit_code())
