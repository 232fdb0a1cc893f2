"""``vllm-repro verify --patch FIX.diff SCENARIO --vllm VERSION``; the verification is
:mod:`vllm_repro.verify`."""

from __future__ import annotations

from pathlib import Path

import typer

from . import COLD_HELP, warm_setting


def verify(
    scenario: Path = typer.Argument(..., help="The scenario the patch should fix."),
    patch: Path = typer.Option(..., "--patch", help="Unified diff with vllm/... paths."),
    vllm: str = typer.Option(..., "--vllm", help="The release to patch (one that reproduces)."),
    reports: Path = typer.Option(Path("reports"), help="The bundle goes to reports/verify/<id>/."),
    catalog: Path = typer.Option(Path("scenarios"), help="Catalog whose other entries must keep their verdicts."),
    cold: bool = typer.Option(False, "--cold", help=COLD_HELP),
) -> None:
    """Prove a fix on CPU: reproduced before, clean after, other entries unchanged."""
    warm_setting(cold)
    from ..console import out, say, table
    from ..errors import EXIT_ENV, EXIT_INPUT, EXIT_MISMATCH
    from ..verify.core import verify as run_verify
    from ..inputs import release_name, reports_dir
    from ..verify.patch import require_patch_file

    vllm = release_name(vllm)
    require_patch_file(patch)
    reports = reports_dir(reports, create=False)
    ver = run_verify(scenario, patch, vllm, reports.resolve(), catalog=catalog, say=say)
    t = table(("scenario", "vllm", "before", "after"))
    t.add_row(ver.scenario, ver.version, ver.before["observed"], ver.after["observed"])
    for o in ver.others:
        t.add_row(o["scenario"], ver.version, o["before"], o["after"])
    out.print(t)
    if ver.verified:
        out.print(f"[green]verified[/green]: reproduced before, clean after; bundle {ver.bundle}")
        raise typer.Exit(0)
    out.print(f"[red]not verified[/red]: {'; '.join(ver.reasons)}; bundle {ver.bundle}")
    # a run that did not happen as a run of vLLM proves nothing: the lab's failure (3) or the
    # input's (2), never the patch's (1)
    raise typer.Exit({None: EXIT_MISMATCH, "input": EXIT_INPUT}.get(ver.failed, EXIT_ENV))
