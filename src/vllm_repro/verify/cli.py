"""``vllm-repro verify --patch FIX.diff SCENARIO --vllm VERSION``."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def verify(
        scenario: Path = typer.Argument(..., help="The scenario the patch should fix."),
        patch: Path = typer.Option(..., "--patch", help="Unified diff with vllm/... paths."),
        vllm: str = typer.Option(..., "--vllm", help="The release to patch (one that reproduces)."),
        reports: Path = typer.Option(Path("reports"), help="The bundle goes to reports/verify/<id>/."),
        catalog: Path = typer.Option(Path("scenarios"), help="Catalog whose other entries must keep their verdicts."),
    ) -> None:
        """Prove a fix on CPU: reproduced before, clean after, other entries unchanged."""
        from rich.table import Table

        from ..cli import _say, out
        from ..errors import EXIT_MISMATCH, InputError
        from .core import verify as run_verify
        from .patch import require_patch_file

        require_patch_file(patch)
        ver = run_verify(scenario, patch, vllm, reports.resolve(), catalog=catalog, say=_say)
        t = Table(box=None, header_style="bold")
        for col in ("scenario", "vllm", "before", "after"):
            t.add_column(col, no_wrap=True)
        t.add_row(ver.scenario, ver.version, ver.before["observed"], ver.after["observed"])
        for o in ver.others:
            t.add_row(o["scenario"], ver.version, o["before"], o["after"])
        out.print(t)
        if ver.verified:
            out.print(f"[green]verified[/green]: reproduced before, clean after; bundle {ver.bundle}")
            raise typer.Exit(0)
        out.print(f"[red]not verified[/red]: {'; '.join(ver.reasons)}; bundle {ver.bundle}")
        raise typer.Exit(EXIT_MISMATCH)
