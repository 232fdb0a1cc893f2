"""The catalog: real vLLM bugs, one scenario file each in ``scenarios/`` (not ``found/`` nor
``stress/``). ``vllm-repro catalog`` lists them with their releases and last verdicts;
``vllm-repro catalog run`` runs each on its ``reproduces_on`` and ``clean_on`` releases.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import typer

DEFAULT_DIR = Path("scenarios")


def log_signature(path: Path) -> tuple[str | None, dict | None, bool]:
    """The triage signature of a catalog ``<name>.log`` (:func:`vllm_repro.triage.triage_log`):
    ``(exception type, innermost vLLM frame {"module", "function", "line"}, cut)``. ``cut`` is
    True when the excerpt marks elided frames with ``[...]`` (the issue's traceback was not
    available whole): its innermost frame is then an outer frame of the crash. Raises
    :class:`~vllm_repro.errors.InputError` when triage finds no crash in it."""
    from .triage import triage_log

    report, _ = triage_log(path)
    cut = any(line.strip().endswith("[...]") for line in Path(path).read_text().splitlines()
              if not line.lstrip().startswith("#"))
    return report.exception_type, report.last_vllm_frame, cut


def catalog_files(directory: Path = DEFAULT_DIR) -> list[Path]:
    """The catalog's scenario files, sorted by name (sub-folders excluded)."""
    return sorted(p for p in directory.glob("*.yaml") if p.is_file())


def last_verdict(reports: Path, name: str, version: str) -> str:
    res = reports / name / version / "result.json"
    try:
        data = json.loads(res.read_text())
    except (OSError, ValueError):
        return "never run"
    v = data.get("verdict") or {}
    ok = {True: "ok", False: "MISMATCH", None: "-"}.get(v.get("ok"), "-")
    return f"{v.get('observed', data.get('outcome'))} [{ok}]"


def register(app: typer.Typer) -> None:
    """Add ``catalog`` (list) and ``catalog run`` to the CLI."""
    cat = typer.Typer(help="The catalog of real vLLM bugs.", invoke_without_command=True)

    @cat.callback()
    def catalog(ctx: typer.Context,
                directory: Path = typer.Option(DEFAULT_DIR, help="Catalog folder."),
                reports: Path = typer.Option(Path("reports"), help="Reports folder for last verdicts.")):
        """List the catalog: entry, issue, releases and the last verdict on each."""
        if ctx.invoked_subcommand:
            return
        from rich.markup import escape
        from rich.table import Table

        from .cli import out
        from .scenario import load_scenario

        t = Table(box=None, header_style="bold")
        for col in ("entry", "issue", "reproduces_on", "clean_on", "last verdicts"):
            t.add_column(col)
        for p in catalog_files(directory):
            sc = load_scenario(p)
            concrete = sc.vllm.concrete()
            lasts = "; ".join(f"{v}: {last_verdict(reports, sc.name, v)}" for v in concrete)
            t.add_row(sc.name, sc.vllm.issue or "-", ", ".join(sc.vllm.reproduces_on),
                      ", ".join(sc.vllm.clean_on), escape(lasts))
        out.print(t)

    @cat.command("run")
    def catalog_run(
        directory: Path = typer.Option(DEFAULT_DIR, help="Catalog folder."),
        reports: Path = typer.Option(Path("reports"), help="Where reports go."),
        only: List[str] = typer.Option([], "--only", help="Entry names to run (default: all)."),
        extra: List[str] = typer.Option([], "--also-on", help="Also run every entry on these releases."),
        audit: bool = typer.Option(True, "--audit/--no-audit"),
        jobs: Optional[int] = typer.Option(None, min=1, help="Releases run in parallel (default: CPUs, max 4)."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Run every catalog entry on its own releases (and --also-on ones); print the table."""
        from .cli import _print_results, _say
        from .errors import InputError
        from .lab import RunItem, releases_for, run_matrix
        from .report.index import write_index
        from .scenario import load_scenario

        t0 = time.perf_counter()
        files = catalog_files(directory)
        if not files:
            raise InputError(f"{directory}: no catalog entries (*.yaml) found")
        items = []
        for p in files:
            sc = load_scenario(p)
            if only and sc.name not in only:
                continue
            versions = releases_for(sc, [], covering=True)
            if not versions:
                _say(f"{sc.name}: not run; its releases and ranges say nothing about the "
                     "installed vLLM")
            versions += [v for v in extra if v not in versions]
            items += [RunItem(sc, v) for v in versions]
        run_matrix(items, reports, audit=audit, jobs=jobs, say=_say)
        write_index(reports)
        code = _print_results(items, as_json, False)
        _say(f"catalog done in {time.perf_counter() - t0:.1f}s")
        raise typer.Exit(code)

    app.add_typer(cat, name="catalog")
