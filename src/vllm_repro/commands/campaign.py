"""``vllm-repro campaign [--releases RANGE] [--seeds N] [--features default,...] [--ray auto|ADDRESS]``:
the fuzzer over releases x seeds x feature sets (:mod:`vllm_repro.campaign`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import COLD_HELP, Level, Policy, value, warm_setting
from ..task_executor import RAY_HELP, RAY_REMOTE_HELP  # standard library only at import: --help stays light


def campaign(
    releases: str | None = typer.Option(None, "--releases", help="Release range on the index, a packaging specifier set such as '>=0.10,<0.34' (default: every final V1 release)."),
    seeds: int = typer.Option(2, "--seeds", min=1, help="Seeds per release: 0 .. N-1 (one task per release and seed)."),
    features: str = typer.Option("default", "--features", help="Feature sets, comma-separated: default, single, concurrent, long, mixed (each searched in every task)."),
    level: Level = typer.Option(Level.scheduler, "--level", help="The level the scenarios run at (scheduler or engine-core)."),
    policy: Optional[Policy] = typer.Option(None, "--policy", help="Fix the scheduling policy."),
    spec: Optional[bool] = typer.Option(None, "--spec/--no-spec", help="Force spec decode on or off."),
    target: Optional[str] = typer.Option(None, "--target", help="Only count failures whose signature contains this text."),
    examples: int = typer.Option(200, "--examples", min=1, help="Examples per task and feature set: the bound that makes a campaign repeatable."),
    time_: str = typer.Option("10m", "--time", help="Safety cap per task and feature set (a search it ends is marked bound: time)."),
    ray: Optional[str] = typer.Option(None, "--ray", help=RAY_HELP),
    ray_remote: bool = typer.Option(False, "--ray-remote", help=RAY_REMOTE_HELP),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="Tasks at once: local processes (default: CPUs, at most 4), or the CPUs of a cluster --ray auto starts."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="The campaign's folder (default: <reports>/_campaign/<campaign id>); run again to resume."),
    reports: Path = typer.Option(Path("reports"), help="Reports folder (the default --out is under it)."),
    audit: bool = typer.Option(True, "--audit/--no-audit"),
    shrink: bool = typer.Option(True, "--shrink/--no-shrink", help="Shrink each failure (most of a finding's cost); --no-shrink keeps the failing example as drawn."),
    db: Optional[str] = typer.Option(None, "--db", help="An example database folder to replay and store failures (default: none: a campaign then depends only on its options)."),
    as_json: bool = typer.Option(False, "--json", help="Print campaign.json instead of the table."),
    cold: bool = typer.Option(False, "--cold", help=COLD_HELP),
) -> None:
    """Fuzz a matrix of releases x seeds x feature sets, locally or on Ray; merge the findings.

    Prints a release x signature table, the first and last release of each signature and where
    it is gone; writes campaign.json, heatmap.png and each finding's shrunk scenario
    (findings/<release>/<signature>.yaml, replayable with `vllm-repro run`) to the campaign's
    folder. Run the same command again to resume an interrupted campaign.

    Exit codes: 0 nothing found, 1 findings, 2 bad input, 3 a task could not run (lab or
    environment failure; the report is written, and a resume runs those tasks again).
    """
    from ..extras import require

    require("hypothesis", "vllm-repro campaign")
    warm_setting(cold)
    policy, level = value(policy), value(level)
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..campaign.report import span_lines, table
    from ..campaign.run import run_campaign
    from ..campaign.spec import CampaignSpec, parse_features, parse_range, select_releases
    from ..console import err, out, say
    from ..errors import EXIT_ENV, EXIT_MISMATCH, InputError
    from ..task_executor import check_ray, open_executor
    from ..fuzz.search import parse_duration
    from ..inputs import folder, reports_dir
    from ..sources.index import list_releases
    from ..sources.installed import installed
    from ..sources.prepare import FIRST_V1

    t0 = time.perf_counter()
    if policy not in (None, "fcfs", "priority"):
        raise InputError(f"--policy {policy!r}: use fcfs or priority")
    if level not in ("scheduler", "engine-core"):
        raise InputError(f"--level {level!r}: use scheduler or engine-core")
    from ..limits import MAX_EXAMPLES, MAX_SEEDS, check_count, max_processes

    check_count("--seeds", seeds, MAX_SEEDS)
    check_count("--examples", examples, MAX_EXAMPLES)
    if jobs is not None:
        check_count("--jobs", jobs, max_processes(), setting="VLLM_REPRO_MAX_PROCESSES")
    check_ray(ray, ray_remote)
    parse_range(releases)
    names = parse_features(features)
    seconds = parse_duration(time_)
    if db is not None:
        db = str(folder(Path(db), "--db folder", "give --db a folder you can write",
                        creatable=True).resolve())
    if installed() is not None:
        raise InputError("campaign runs each release from its sdist; unset VLLM_REPRO_VLLM "
                         "(installed mode runs only the installed vLLM)")
    cspec = CampaignSpec(releases_range=releases or "", seeds=list(range(seeds)), features=names,
                         level=level, policy=policy, spec_decode=spec, target=target,
                         examples=examples, time_s=seconds, audit=audit, db=db,
                         shrink=shrink)
    if out_dir is not None:  # a file there (or a link loop) is exit 2, before the index is read
        out_dir = folder(out_dir, "--out folder", "give --out a folder (made if missing; an "
                         "existing one resumes its campaign)", creatable=True)
    versions = select_releases(list_releases(), releases, FIRST_V1)
    from ..limits import MAX_CAMPAIGN_TASKS

    if len(versions) * seeds > MAX_CAMPAIGN_TASKS:
        raise InputError(f"--seeds {seeds:,} x {len(versions)} releases: "
                         f"{len(versions) * seeds:,} tasks, over {MAX_CAMPAIGN_TASKS:,} (the "
                         "lab's limit); give fewer --seeds or a narrower --releases")
    reports = reports_dir(reports, create=False)
    where = (out_dir or reports / "_campaign" / cspec.campaign_id()).resolve()
    say(f"campaign {cspec.campaign_id()}: {len(versions)} releases ({versions[0]} .. "
        f"{versions[-1]}) x {seeds} seed(s) x {', '.join(names)}; {where}")
    with open_executor(ray, jobs, ray_remote) as executor:
        say(f"tasks run on {executor.name}")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.fields[note]}"), console=err,
                      transient=False, disable=not err.is_terminal) as bar:
            task = bar.add_task("campaign", total=len(versions) * seeds, note="")

            def on_event(p):
                note = f"{len(p.findings)} signature(s)"
                if p.last is not None:
                    note += (f"; last: {p.last.release} seed {p.last.seed} {p.last.status}, "
                             f"{p.last.examples} examples, {len(p.last.findings)} finding(s)")
                bar.update(task, completed=p.skipped + p.finished, note=note)

            report = run_campaign(cspec, versions, where, executor, on_event)
    if as_json:
        print(report.to_json(indent=1))
    else:
        out.print(table(report))
        for line in span_lines(report):
            out.print(line, highlight=False, markup=False)
        for t in report.tasks:
            if t.status != "done":
                out.print(f"{t.release} seed {t.seed}: {t.status}: {t.message}", highlight=False,
                          markup=False)
    say(f"campaign done in {time.perf_counter() - t0:.1f}s: {where / 'campaign.json'}, "
        f"{where / 'heatmap.png'}")
    if any(t.status == "error" for t in report.tasks):
        raise typer.Exit(EXIT_ENV)
    if not report.table:  # nothing found: a verdict only where something was checked
        checked = sum(t.examples - t.by_outcome.get("refused", 0) - t.by_outcome.get("error", 0)
                      for t in report.tasks if t.status == "done")
        refused = sum(t.status == "refused" for t in report.tasks)
        say(f"no failure found in {checked} examples checked ({refused} of {len(report.tasks)} "
            "task(s) refused; examples a release refused are not counted)")
        if checked <= 0:
            raise InputError(f"campaign: nothing checked: {refused} of {len(report.tasks)} "
                             "task(s) refused and every example of the others refused or "
                             "failed; give --releases / --level / --features the releases run")
    raise typer.Exit(EXIT_MISMATCH if report.table else 0)
