"""``vllm-repro fuzz --vllm VERSION [--level scheduler|engine-core|v0-engine] [--time 60s] [--seed N]
[--workers 2] [--ladder] [--db DIR|none]``; the search is :mod:`vllm_repro.fuzz`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer

from . import COLD_HELP, Level, Policy, value, warm_setting

#: ``--shrink-runs``' default: 0, hypothesis's own limits (the smallest reproducer). Measured on
#: the catalog (bench/fuzz.py, 2 workers, 2 shared cores), shrinking took 26 to 64 s of the
#: time-to-find after the first failing example (#11562 25 -> 89 s, #23347 24 -> 78 s, #23215
#: 32 -> 58 s); ``--shrink-runs 150`` cut that to 3-14 s, at the price of a larger reproducer
#: now and then (#23347: 6 requests where the unbounded shrinker reaches 5)
SHRINK_RUNS = 0


def fuzz(
    vllm: str = typer.Option(..., "--vllm", help="The release to fuzz."),
    time_: str = typer.Option("60s", "--time", help="Search time (per ladder level with --ladder)."),
    seed: int = typer.Option(0, "--seed", help="Campaign seed: the same seed gives the same run."),
    workers: int = typer.Option(2, "--workers", min=1, help="Search processes (one vLLM worker each)."),
    policy: Optional[Policy] = typer.Option(None, "--policy", help="Fix the scheduling policy."),
    spec: Optional[bool] = typer.Option(None, "--spec/--no-spec", help="Force spec decode on or off."),
    ladder: bool = typer.Option(False, "--ladder", help="Escalate single -> concurrent -> long -> mixed; stop at the first level that fails."),
    first: bool = typer.Option(False, "--first", help="Stop at the first (shrunk) failure."),
    target: Optional[str] = typer.Option(None, "--target", help="Only count failures whose signature contains this text."),
    shrink_runs: int = typer.Option(SHRINK_RUNS, "--shrink-runs", min=0, help="The most scenario runs the shrinker makes per finding; the smallest failing scenario by then is the finding (default 0: hypothesis's own limits, the smallest reproducer)."),
    target_message: Optional[str] = typer.Option(None, "--target-message", help="Only count failures whose message matches this regular expression (re.search, as a scenario's expect.message)."),
    out_dir: Path = typer.Option(Path("scenarios/found"), "--out", help="Where found scenarios and regression tests go."),
    reports: Path = typer.Option(Path("reports"), help="Worker logs go to reports/_fuzz/."),
    audit: bool = typer.Option(True, "--audit/--no-audit"),
    level: Level = typer.Option(Level.scheduler, "--level", help="The level the scenarios run at (v0-engine: the release's V0 LLMEngine, a subset of the draws)."),
    db: Optional[str] = typer.Option(None, "--db", help="The example database folder (default: <cache>/fuzz/examples); 'none' runs without one."),
    cold: bool = typer.Option(False, "--cold", help=COLD_HELP),
) -> None:
    """Search workloads until vLLM raises or an invariant breaks; shrink; write reproducers."""
    from ..extras import require

    require("hypothesis", "vllm-repro fuzz")
    warm_setting(cold)
    policy, level = value(policy), value(level)
    from rich.console import Group
    from rich.live import Live
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    from ..console import out, say
    from ..errors import EXIT_ENV, EXIT_MISMATCH, InputError
    from ..fuzz.search import Campaign, SearchConfig, parse_duration, run_campaign, write_finding
    from ..fuzz.strategies import DEFAULT, LADDER
    from ..inputs import folder, release_name, reports_dir
    from ..sources.prepare import prepare_release, resolve_tree

    if policy not in (None, "fcfs", "priority"):
        raise InputError(f"--policy {policy!r}: use fcfs or priority")
    if level not in ("scheduler", "engine-core", "v0-engine"):
        raise InputError(f"--level {level!r}: use scheduler, engine-core or v0-engine")
    if target_message is not None:
        try:
            re.compile(target_message)
        except re.error as exc:
            raise InputError(f"--target-message {target_message!r}: not a regular expression "
                             f"({exc}); give one such as 'root rule'") from None
    use_db = db is None or db.lower() != "none"
    if use_db and db is not None:
        db = str(folder(Path(db), "--db folder", "give --db a folder you can write, or none",
                        creatable=True))
    from ..limits import MAX_EXAMPLES, check_count, max_processes

    check_count("--workers", workers, max_processes(), setting="VLLM_REPRO_MAX_PROCESSES")
    check_count("--shrink-runs", shrink_runs, MAX_EXAMPLES, low=0)
    vllm = release_name(vllm)
    seconds = parse_duration(time_)
    reports = reports_dir(reports, create=False)
    folder(out_dir, "--out folder", "give --out a folder you can write", writable=True)
    env = prepare_release(vllm, say, tree=resolve_tree(vllm, None, level))
    levels = list(LADDER) if ladder else [DEFAULT]
    found_any = False
    for profile in levels:
        profile = profile.with_policy(policy).with_spec(spec)
        cfg = SearchConfig(version=vllm, profile=profile, seed=seed, time_s=seconds,
                           stop_on_first=first or ladder, target=target, audit=audit,
                           spec_forced=bool(spec), level=level, database=db,
                           use_database=use_db, target_message=target_message,
                           shrink_runs=shrink_runs or None)

        def view(camp, profile=profile):
            t = Table(box=None, title=f"fuzz vLLM {vllm} · {level} · {profile.name} · seed {seed}")
            t.add_column("elapsed")
            t.add_column("examples")
            t.add_column("examples/s")
            t.add_column("outcomes")
            rate = camp.examples / camp.elapsed_s if camp.elapsed_s else 0
            t.add_row(f"{camp.elapsed_s:.0f}s", str(camp.examples), f"{rate:.1f}",
                      ", ".join(f"{k} {v}" for k, v in sorted(camp.by_outcome.items())))
            for sig, f in camp.findings.items():
                t.add_row("", "", "", f"[red]{sig}[/red] ({len(f.scenario['requests'])} requests)")
            # the search's time as a bar (it stops at --time, or at the first finding)
            return Group(t, ProgressBar(total=seconds, completed=min(camp.elapsed_s, seconds),
                                        width=60))

        # on a terminal only: piped or logged, the final table is printed once (no redraws)
        with Live(view(Campaign()), console=out, refresh_per_second=2, transient=False,
                  auto_refresh=out.is_terminal) as live:
            camp = run_campaign(cfg, env, workers, reports.resolve() / "_fuzz",
                                on_update=lambda c: live.update(view(c)))
        out.print()
        for note in dict.fromkeys(camp.notes):
            say(note)
        if camp.input_errors:
            raise InputError(camp.input_errors[0])
        if camp.fatal:
            out.print(f"[red]a search process failed[/red]: {camp.fatal[0].splitlines()[0]}")
            raise typer.Exit(EXIT_ENV)
        n_errors = camp.by_outcome.get("error", 0)
        if n_errors:
            kept = reports.resolve() / "_fuzz" / "lab-errors.txt"
            kept.write_text("".join(f"{e}\n" for e in camp.errors))
            say(f"{n_errors} lab errors (not findings; the first few in {kept}), "
                 f"e.g. {(camp.errors or ['?'])[0][:200]}")
        if camp.examples == 0 and not camp.findings:
            out.print(f"[red]searched nothing[/red]: 0 examples ran in {seconds:g}s; "
                      "give --time more")
            raise typer.Exit(EXIT_ENV)
        refused = camp.by_outcome.get("refused", 0)
        checked = camp.examples - refused - n_errors
        if checked <= 0 and not camp.findings:
            # every example refused (or an error): nothing of vLLM was checked, so no verdict
            raise InputError(f"fuzz --vllm {vllm} --level {level}: nothing checked: vLLM {vllm} "
                             f"refused {refused} and the lab failed {n_errors} of the "
                             f"{camp.examples} examples; give a --level (or --vllm) that "
                             "release runs")
        for sig, f in camp.findings.items():
            path, test = write_finding(f, vllm, out_dir)
            out.print(f"[red]{sig}[/red]: {len(f.scenario['requests'])} requests after shrinking, "
                      f"found after {f.found_after_s:.0f}s / {f.examples} examples"
                      + (f" (first failing example at {f.first_failure_s:.0f}s)"
                         if f.first_failure_s is not None else "")
                      + f" -> {path} (+ {test.name})")
            found_any = True
        unshrunk = camp.unshrunk()
        if unshrunk:
            say(unshrunk)
        if ladder:
            if camp.findings:
                out.print(f"ladder: level [bold]{profile.name}[/bold] fails; stopping there")
                break
            out.print(f"ladder: level {profile.name} clean after {camp.examples} examples")
    if not found_any:
        refused = camp.by_outcome.get("refused", 0)
        n_errors = camp.by_outcome.get("error", 0)
        out.print(f"no failure found in {camp.examples - refused - n_errors} examples checked "
                  f"({refused} refused by the release, {n_errors} lab errors, not checked)")
    raise typer.Exit(EXIT_MISMATCH if found_any else 0)
