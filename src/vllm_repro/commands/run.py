"""``vllm-repro run SCENARIO... [--vllm VERSION]...``: run scenarios, print the verdict table."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import List, Optional

import typer

from . import COLD_HELP, Tree, value, warm_setting

DEFAULT_REPORTS = Path("reports")


def run(
    scenarios: List[Path] = typer.Argument(..., help="Scenario YAML files."),
    vllm: List[str] = typer.Option([], "--vllm", help="Release(s) to run; default: the scenario's own."),
    reports: Path = typer.Option(DEFAULT_REPORTS, help="Where reports/<scenario>/<version>/ go."),
    audit: bool = typer.Option(True, "--audit/--no-audit", help="Check invariants every step."),
    keep_going: bool = typer.Option(False, "--keep-going", help="Collect all violations, not just the first."),
    sched_log: bool = typer.Option(False, "--sched-log", help="Print [SCHED] state lines when the state changes."),
    jobs: Optional[int] = typer.Option(None, min=1, help="Releases run in parallel (default: CPUs, max 4)."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON."),
    tree: Optional[Tree] = typer.Option(None, "--tree", help="Which tree runs (default: "
                                        "VLLM_REPRO_TREE, else full; auto: the committed slice "
                                        "where it is proven equivalent)."),
    cold: bool = typer.Option(False, "--cold", help=COLD_HELP),
) -> None:
    """Run scenario(s) on vLLM release(s) and print the verdict table."""
    warm_setting(cold)
    tree = value(tree)
    from ..console import print_results, say
    from ..inputs import release_name, reports_dir
    from ..lab import RunItem, checked_releases, releases_for, run_pairs
    from ..report.index import write_index
    from ..scenario.load import unique_scenarios
    from ..sources.prepare import check_tree

    from ..limits import check_jobs

    check_jobs(jobs)
    t0 = time.perf_counter()
    vllm = [release_name(v) for v in vllm]
    reports = reports_dir(reports, create=False)
    loaded = unique_scenarios(scenarios)
    vllm = checked_releases(vllm, "--vllm")
    items = [RunItem(sc, v) for sc in loaded for v in releases_for(sc, vllm)]
    check_tree(tree)
    # what this run makes, removed again if every run refuses its input: the outermost missing
    # folder of --reports (in a folder already there, nothing is removed: another run may be
    # using its engine locks; the index is then left as it was)
    made = Path(reports).absolute()
    while not made.parent.exists():
        made = made.parent
    made = None if made.exists() else made
    reports = reports_dir(reports)
    run_pairs(items, reports, audit=audit, keep_going=keep_going, jobs=jobs, say=say, tree=tree)
    # every run refused its input before it started (a config field the release lacks...): as
    # a load error, a refused run leaves nothing behind (docs/inputs.md), only its lines below;
    # a run stopped by an input error once started (a trace over its limit) keeps its reports
    refused = bool(items) and all(i.verdict.error_kind == "input" and not (
        i.report_dir is not None and i.report_dir.exists()) for i in items)
    if refused:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    else:
        write_index(reports)
    code = print_results(items, as_json, sched_log)
    said = "no reports (every run refused its input)" if refused else f"reports in {reports}/"
    say(f"done in {time.perf_counter() - t0:.1f}s; {said}")
    raise typer.Exit(code)
