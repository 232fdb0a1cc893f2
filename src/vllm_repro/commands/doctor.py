"""``vllm-repro doctor VERSION... | --newest``: prepare each release, run the smoke set
(:mod:`vllm_repro.doctor`), print the table mode / works / degraded / n/a / fails."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from . import COLD_HELP, warm_setting


def doctor(
    versions: List[str] = typer.Argument(None, help="Releases to check, e.g. 0.34.0."),
    newest: bool = typer.Option(False, "--newest", help="Also the newest final release on the "
                                "package index."),
    directory: Path = typer.Option(Path("scenarios"), help="The scenarios folder the smoke "
                                   "set's workloads come from."),
    reports: Path = typer.Option(Path("reports"), help="Where each smoke run's report goes."),
    jobs: Optional[int] = typer.Option(None, min=1, help="Releases run in parallel (default: "
                                       "CPUs, max 4)."),
    cold: bool = typer.Option(False, "--cold", help=COLD_HELP),
) -> None:
    """Prepare each release and run the lab's smoke set on it (the flagship, a stress workload
    at each level, async scheduling, spec decode, prefix caching, hybrid KV groups, structured
    outputs, a KV connector, the V0 engine); print mode -> works / degraded (what) / n/a (why)
    / finding (vLLM did something else than where the workload is clean) / fails (the seam, one
    line). Exit 0 only when every mode the release has works, 3 when one fails, else 1
    (docs/new-releases.md says what to change)."""
    warm_setting(cold)
    from .. import doctor as doc
    from ..console import out, say
    from ..errors import InputError
    from ..inputs import reports_dir, release_name

    from ..lab import checked_releases

    # each a release of vLLM before anything runs (cache, else the index): a name that is none
    # is exit 2 with the nearest releases, as run gives it, never twelve n/a rows and exit 0
    chosen = checked_releases([release_name(v, "VERSION") for v in versions or []], "VERSION")
    if newest:
        from ..matrix import index_releases, parse_range

        latest = index_releases(parse_range(None))[-1]
        say(f"doctor: the index's newest release is {latest}")
        chosen += [latest] if latest not in chosen else []
    if not chosen:
        raise InputError("doctor: give a VERSION (e.g. 0.34.0) or --newest")
    report = doc.run(chosen, directory, reports_dir(reports), say=say, jobs=jobs)
    out.print(doc.table(report))
    bad = sum(r.status not in ("works", "n/a") for r in report.rows)
    say(f"doctor: {len(chosen)} release(s), {len(report.rows)} rows, {bad} not working, in "
        f"{report.seconds:.1f}s")
    raise typer.Exit(report.exit_code())
