"""The ``vllm-repro`` command line (typer).

Exit codes (DESIGN.md): 0 observations match ``expect``; 1 mismatch or reproduction found;
2 usage or input error; 3 environment error (fetch, import, docker, ssh).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import EXIT_INPUT, LabError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Reproduce vLLM engine crashes on CPU with vLLM's real scheduler code.")
out = Console(width=None if sys.stdout.isatty() else 400)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 400)

DEFAULT_REPORTS = Path("reports")


def _say(msg: str) -> None:
    err.print(f"[dim]{msg}[/dim]", highlight=False)


def verdict_table(verdicts) -> Table:
    """The verdict table: scenario, vllm, expect, observed, ok."""
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for col in ("scenario", "vllm", "expect", "observed", "ok"):
        t.add_column(col, no_wrap=True)
    for v in verdicts:
        style = {"yes": "green", "NO": "red", "ERROR": "red", "-": "yellow"}[v.ok_text]
        t.add_row(v.scenario, v.vllm, v.expected, v.observed, f"[{style}]{v.ok_text}[/{style}]")
    return t


def _print_results(items, as_json: bool, sched_log: bool) -> int:
    from .report.sched_log import sched_log_lines
    from .verdict import exit_code, findings_lines

    verdicts = [i.verdict for i in items]
    if sched_log:
        for i in items:
            if i.report_dir and (i.report_dir / "trace.jsonl").is_file():
                out.print(f"[bold]{i.scenario.name} on vLLM {i.version}[/bold]")
                for line in sched_log_lines(i.report_dir / "trace.jsonl"):
                    out.print(line, highlight=False, markup=False)
    if as_json:
        print(json.dumps([v.as_dict() for v in verdicts], indent=1))
    else:
        out.print(verdict_table(verdicts))
        for line in findings_lines(verdicts):
            out.print(line, highlight=False, markup=False)
        for v in verdicts:
            if v.reason and v.ok is False:
                err.print(f"[red]{v.scenario} on {v.vllm}: {v.reason}[/red]", highlight=False)
    return exit_code(verdicts)


@app.command()
def run(
    scenarios: List[Path] = typer.Argument(..., help="Scenario YAML files."),
    vllm: List[str] = typer.Option([], "--vllm", help="Release(s) to run; default: the scenario's own."),
    reports: Path = typer.Option(DEFAULT_REPORTS, help="Where reports/<scenario>/<version>/ go."),
    audit: bool = typer.Option(True, "--audit/--no-audit", help="Check invariants every step."),
    keep_going: bool = typer.Option(False, "--keep-going", help="Collect all violations, not just the first."),
    sched_log: bool = typer.Option(False, "--sched-log", help="Print [SCHED] state lines when the state changes."),
    jobs: Optional[int] = typer.Option(None, min=1, help="Releases run in parallel (default: CPUs, max 4)."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON."),
    tree: Optional[str] = typer.Option(None, "--tree", help="full | slice | auto (default: "
                                       "VLLM_REPRO_TREE, else full; auto: the committed slice "
                                       "where it is proven equivalent)."),
) -> None:
    """Run scenario(s) on vLLM release(s) and print the verdict table."""
    from .lab import RunItem, releases_for, run_matrix
    from .report.index import write_index

    t0 = time.perf_counter()
    loaded = unique_scenarios(scenarios)
    items = [RunItem(sc, v) for sc in loaded for v in releases_for(sc, vllm)]
    _check_tree(tree)
    run_matrix(items, reports, audit=audit, keep_going=keep_going, jobs=jobs, say=_say, tree=tree)
    write_index(reports)
    code = _print_results(items, as_json, sched_log)
    _say(f"done in {time.perf_counter() - t0:.1f}s; reports in {reports}/")
    raise typer.Exit(code)


def _check_tree(tree: Optional[str]) -> None:
    from .errors import InputError
    from .lab import TREES

    if tree is not None and tree not in TREES:
        raise InputError(f"--tree {tree!r}: expected one of {', '.join(TREES)}")


def unique_scenarios(paths: List[Path]) -> list:
    """Load each scenario file once (a file given twice runs once). Raises :class:`InputError`
    when two files share a ``name:``: their reports (reports/<name>/<version>/) would collide."""
    from .errors import InputError
    from .scenario import load_scenario

    by_name: dict[str, tuple[Path, object]] = {}
    seen: set[Path] = set()
    for p in paths:
        if Path(p).resolve() in seen:
            continue
        seen.add(Path(p).resolve())
        sc = load_scenario(p)
        if sc.name in by_name:
            raise InputError(f"{p}: name: {sc.name!r} is also the name of {by_name[sc.name][0]}; "
                             "reports/<name>/<version>/ would collide; rename one")
        by_name[sc.name] = (p, sc)
    return [sc for _, sc in by_name.values()]


@app.command()
def prepare(versions: List[str] = typer.Argument(..., help="Release(s) to fetch and build."),
            tree: Optional[str] = typer.Option(None, "--tree", help="full | slice | auto")) -> None:
    """Fetch, verify and extract release(s) and build their CPU environments."""
    from .lab import prepare_release

    _check_tree(tree)
    for v in versions:
        env = prepare_release(v, _say, tree=tree)
        out.print(f"vLLM {env.version}: {env.python} (tree {env.tree})")


#: Feature modules that add their commands with ``register(app)`` (imports stay lazy inside).
COMMAND_MODULES = (
    "vllm_repro.catalog",
    "vllm_repro.triage.cli",
    "vllm_repro.fuzz.cli",
    "vllm_repro.slicing.cli",
    "vllm_repro.verify.cli",
    "vllm_repro.remote.cli",
    "vllm_repro.bisect.cli",
)


def _register_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # feature not built in this checkout
            raise
        mod.register(app)


_register_commands()


def main() -> None:
    """Entry point: one-line messages and DESIGN.md's exit codes for lab and input errors."""
    try:
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except LabError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:
        # usage errors from click (bundled inside typer in newer releases): they know how to
        # show themselves and carry their exit code (2 for usage)
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(EXIT_INPUT)
        raise


if __name__ == "__main__":
    main()
