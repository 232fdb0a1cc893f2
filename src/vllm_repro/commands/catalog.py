"""``vllm-repro catalog`` (list the entries) and ``vllm-repro catalog run`` (run them); what
they list and run is :mod:`vllm_repro.catalog`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer

from . import COLD_HELP, warm_setting

from ..catalog import DEFAULT_DIR  # standard library only at import: --help stays light
from ..task_executor import RAY_HELP, RAY_REMOTE_HELP

app = typer.Typer(help="The catalog of real vLLM bugs.", invoke_without_command=True)


@app.callback()
def catalog(ctx: typer.Context,
            directory: Path = typer.Option(DEFAULT_DIR, help="Catalog folder."),
            reports: Path = typer.Option(Path("reports"), help="Reports folder for last verdicts.")):
    """List the catalog: entry, issue, releases and the last verdict on each."""
    if ctx.invoked_subcommand:
        return
    from rich.markup import escape

    from ..catalog import catalog_rows
    from ..console import out, table
    from ..inputs import folder

    folder(directory, "catalog folder (--directory)", "give --directory a folder of scenario "
           "files such as scenarios/")
    folder(reports, "--reports folder", "give --reports the folder of earlier runs")

    t = table(("entry", "issue", "reproduces_on", "clean_on", "last verdicts"), no_wrap=False)
    for name, issue, reproduces_on, clean_on, lasts in catalog_rows(directory, reports):
        t.add_row(name, issue, reproduces_on, clean_on, escape(lasts))
    out.print(t)


@app.command("run")
def catalog_run(
    directory: Path = typer.Option(DEFAULT_DIR, help="Catalog folder."),
    reports: Path = typer.Option(Path("reports"), help="Where reports go."),
    only: List[str] = typer.Option([], "--only", help="Entry names to run (default: all)."),
    extra: List[str] = typer.Option([], "--also-on", help="Also run every entry on these releases."),
    audit: bool = typer.Option(True, "--audit/--no-audit"),
    jobs: Optional[int] = typer.Option(None, min=1, help="Releases run in parallel (default: CPUs, max 4)."),
    as_json: bool = typer.Option(False, "--json"),
    cold: bool = typer.Option(False, "--cold", help=COLD_HELP),
    ray: Optional[str] = typer.Option(None, "--ray", help=RAY_HELP),
    ray_remote: bool = typer.Option(False, "--ray-remote", help=RAY_REMOTE_HELP),
) -> None:
    """Run every catalog entry on its own releases (and --also-on ones); print the table."""
    warm_setting(cold)
    from ..catalog import catalog_items, run_catalog
    from ..console import print_results, progress
    from ..task_executor import check_ray
    from ..lab import checked_releases
    from ..inputs import folder, release_name, reports_dir

    from ..limits import check_jobs

    check_jobs(jobs)
    t0 = time.perf_counter()
    folder(directory, "catalog folder (--directory)", "give --directory a folder of scenario "
           "files such as scenarios/")
    check_ray(ray, ray_remote)
    extra = [release_name(v, "--also-on") for v in extra]
    reports = reports_dir(reports, create=False)
    with progress("catalog", None) as bar:
        items = catalog_items(directory, only, extra, say=bar.say)
        checked_releases(extra, "--also-on")  # before any run: a typo is one line, not a column
        reports = reports_dir(reports)
        bar.total(len(items))
        run_catalog(items, reports, audit=audit, jobs=jobs, say=bar.say, ray=ray,
                    ray_remote=ray_remote, on_run=lambda item: bar.advance())
    code = print_results(items, as_json, False)
    bar.say(f"catalog done in {time.perf_counter() - t0:.1f}s")
    raise typer.Exit(code)
