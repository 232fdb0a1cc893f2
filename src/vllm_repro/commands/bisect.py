"""``vllm-repro bisect SCENARIO [--good VERSION] [--bad VERSION]``: the first bad (or first
fixed) vLLM release, by binary search over the releases on the index (:mod:`vllm_repro.bisect`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from . import COLD_HELP, warm_setting
from ..task_executor import RAY_HELP, RAY_REMOTE_HELP  # standard library only at import: --help stays light


def bisect(
    scenario: Path = typer.Argument(..., help="The scenario whose expected reproduction marks a bad release."),
    good: Optional[str] = typer.Option(None, "--good", help="A release where the scenario runs clean "
                                       "(default: its first concrete vllm.clean_on)."),
    bad: Optional[str] = typer.Option(None, "--bad", help="A release that reproduces it "
                                      "(default: its first concrete vllm.reproduces_on)."),
    reports: Path = typer.Option(Path("reports"), help="Where reports/<scenario>/<version>/ go."),
    cold: bool = typer.Option(False, "--cold", help=COLD_HELP),
    ray: Optional[str] = typer.Option(None, "--ray", help=RAY_HELP + " With --ray, each round classifies as many releases at once as the back end has slots."),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="With --ray auto: the local cluster's CPUs (releases classified at once)."),
    ray_remote: bool = typer.Option(False, "--ray-remote", help=RAY_REMOTE_HELP),
    on: str = typer.Option("expect", "--on", help="What tells the releases apart: 'expect' (the scenario's expected reproduction) or 'diff' (the scheduler's decisions: --good is the reference release, a release whose decisions differ from it at any step is bad; finds the release that changed a behaviour)."),
) -> None:
    """Find the first bad (or first fixed) release between --bad and --good by binary search.

    Good older than bad: the first bad release (a regression); bad older than good: the first fixed one.
    Releases that show neither (an error, another failure) are skipped and stepped around.

    With --on diff, a release is bad when its scheduler decisions differ from --good's at some
    step (vllm-repro diff), good when they are the same: the release that changed a behaviour.

    Exit codes: 0 a boundary found (pinned, or between which two releases when skips hide it);
    2 bad input, or an endpoint that does not show its state; 3 environment error.
    """
    warm_setting(cold)
    from ..bisect.run import ReleaseClassifier, classify_on, default_endpoints, require_expectation
    from ..bisect.search import bisect_releases, release_span
    from ..console import out, say
    from ..errors import InputError
    from ..task_executor import check_ray, open_executor
    from ..inputs import release_name, reports_dir
    from ..report.index import write_index
    from ..scenario import load_scenario
    from ..sources.index import list_releases
    from ..sources.installed import installed

    t0 = time.perf_counter()
    if jobs is not None:
        from ..limits import check_count, max_processes

        check_count("--jobs", jobs, max_processes(), setting="VLLM_REPRO_MAX_PROCESSES")
    check_ray(ray, ray_remote)
    good = release_name(good, "--good") if good is not None else None
    bad = release_name(bad, "--bad") if bad is not None else None
    reports = reports_dir(reports, create=False)
    if on not in ("expect", "diff"):
        raise InputError(f"--on {on[:40]!r}: expected expect or diff")
    sc = load_scenario(scenario)
    if on == "expect":
        require_expectation(sc, scenario)
    elif ray is not None:
        raise InputError("--on diff runs one release at a time against its reference; drop --ray")
    bad_v, good_v = default_endpoints(sc, scenario, bad, good)
    if installed() is not None:
        raise InputError("bisect runs each release from its sdist; unset VLLM_REPRO_VLLM "
                         "(installed mode runs only the installed vLLM)")
    reports = reports_dir(reports)
    bad_v, good_v, span = release_span(list_releases(), bad_v, good_v)
    say(f"bisect: {len(span)} releases from {span[0]} to {span[-1]} on the index")
    if on == "diff":
        from ..bisect.run import DiffClassifier

        say(f"bisect --on diff: bad = the scheduler's decisions differ from {good_v}'s at some "
            f"step, good = the same at every step")
        classify = DiffClassifier(sc, good_v, reports, say=say)
    else:
        classify = ReleaseClassifier(sc, reports, say=say)
    try:
        if ray is None:
            result = bisect_releases(span, bad_v, good_v, classify, say=say)
        else:
            with open_executor(ray, jobs, ray_remote) as executor:
                say(f"bisect: releases classified on {executor.name}")
                result = bisect_releases(span, bad_v, good_v, classify, say=say,
                                         classify_many=classify_on(executor, sc, reports),
                                         width=executor.slots)
    finally:
        if reports.is_dir():
            write_index(reports)
    out.print(result_table(result))
    line = result.summary()
    if on == "diff":  # bad / good mean "differs from" / "the same as" the reference here
        line = (line.replace("first fixed release", f"first release with {good_v}'s decisions")
                .replace("first bad release", f"first release whose decisions differ from {good_v}'s")
                .replace("last bad", "last differing").replace("first bad", "first differing")
                .replace("last good", "last the same").replace("first good", "first the same"))
    out.print(line, highlight=False, markup=False)
    say(f"bisect done in {time.perf_counter() - t0:.1f}s; reports in {reports}/")
    raise typer.Exit(0)


def result_table(result):
    """Every release run, oldest first: release, observed, classification."""
    from packaging.version import Version
    from rich.markup import escape

    from ..console import table

    t = table(("release", "observed", "classification"), edge=False)
    for release in sorted(result.tested, key=Version):
        obs = result.tested[release]
        style = {"bad": "red", "good": "green", "skip": "yellow"}[obs.state]
        t.add_row(release, escape(obs.observed), f"[{style}]{obs.state}[/{style}]")
    return t
