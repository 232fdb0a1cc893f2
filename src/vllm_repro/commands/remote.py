"""``vllm-repro gpu-verify`` (here) and ``vllm-repro gpu-judge`` (inside the CUDA image); the
shipping and judging are :mod:`vllm_repro.remote`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

PHASE_PREFIXES = ("[gpu-judge]", "[remote]")


def gpu_verify(
    scenario: Optional[Path] = typer.Argument(None, help="The scenario the patch fixes (not needed with --bundle)."),
    remote: str = typer.Option(..., "--remote", envvar="REMOTE", help="An ssh-config host name."),
    patch: Optional[Path] = typer.Option(None, "--patch", help="The fix, a unified diff of vllm/... files."),
    vllm: Optional[str] = typer.Option(None, "--vllm", help="The release to patch (default: the scenario's first reproduces_on release)."),
    bundle: Optional[Path] = typer.Option(None, "--bundle", help="Ship this `vllm-repro verify` bundle as it is (no CPU run here)."),
    gpu_image: Optional[str] = typer.Option(None, "--gpu-image", envvar="GPU_IMAGE", help="Run this image instead of building the CUDA image there."),
    gpu: str = typer.Option("all", "--gpu", envvar="GPU", help="all: check for and use the host's GPUs; none: neither (testing)."),
    model: Optional[str] = typer.Option(None, "--model", envvar="GPU_MODEL", help="A model folder on the GPU host (config.json, weights): the gpu replay tests run the real engine on it."),
    ssh_config: Optional[Path] = typer.Option(None, "--ssh-config", envvar="VLLM_REPRO_SSH_CONFIG", help="ssh config file (default ~/.ssh/config)."),
    accept_new_host_key: bool = typer.Option(False, "--accept-new-host-key", help="Trust and record an unknown host key (never a changed one)."),
    reports: Path = typer.Option(Path("reports"), help="Results go to reports/gpu/<host>/<run>/."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every line of remote output, not only the phases."),
) -> None:
    """Confirm a fix on a GPU host: verified on CPU here, then judged there by the shared suite
    on the full vLLM of the release (CUDA image), JUnit and logs brought back."""
    from ..extras import require

    require("fabric", "vllm-repro gpu-verify")
    from ..console import out
    from ..errors import EXIT_MISMATCH, InputError
    from ..inputs import release_name, reports_dir
    from ..remote.ship import Ship, local_dir, run_id

    if gpu not in ("all", "none"):
        raise InputError(f"--gpu {gpu!r}: expected all or none")
    from ..remote.ship import check_remote

    remote = check_remote(remote)
    vllm = release_name(vllm) if vllm is not None else None
    reports = reports_dir(reports, create=False)
    if ssh_config is not None:
        from ..inputs import input_file

        input_file(ssh_config, "ssh config file", "give --ssh-config an ssh config file (or "
                   "leave it out for ~/.ssh/config)")
    if bundle is None:
        bundle = verify_here(scenario, patch, vllm, reports)
    else:
        bundle, verdict = read_bundle(bundle)
        if not verdict.get("verified"):
            out.print(f"[red]not shipped[/red]: bundle {bundle} is not verified on CPU: "
                      f"{'; '.join(verdict.get('reasons', []))}")
            raise typer.Exit(EXIT_MISMATCH)
    rid = run_id(bundle)
    ship = Ship(host=remote, bundle=bundle, local=local_dir(reports.resolve(), remote, rid),
                gpu=gpu, gpu_image=gpu_image, model=model, ssh_config=ssh_config,
                accept_new_host_key=accept_new_host_key, run_id=rid)
    code = ship_with_progress(ship, verbose)
    print_outcome(ship, code)
    raise typer.Exit(code)


def read_bundle(bundle: Path) -> tuple[Path, dict]:
    """A verification bundle folder (``vllm-repro verify``'s) through the loading layer: the
    folder, its ``manifest.json`` and ``verdict.json`` as JSON objects. Returns ``(folder,
    verdict)``; :class:`~vllm_repro.errors.InputError` names what is missing or damaged."""
    from ..errors import InputError
    from ..inputs import folder, input_file, load_json_file

    fix = "give --bundle the folder `vllm-repro verify` wrote (reports/verify/<id>/)"
    bundle = folder(bundle, "--bundle folder", fix)
    if not bundle.is_dir():
        raise InputError(f"--bundle {bundle}: no such folder; {fix}")
    try:
        input_file(bundle / "manifest.json", "bundle manifest", fix)
    except InputError as exc:
        raise InputError(f"--bundle {bundle}: not a verification bundle ({exc})") from None
    for name in ("manifest.json", "verdict.json"):
        data = load_json_file(bundle / name, f"bundle {name}", fix)
        if not isinstance(data, dict):
            raise InputError(f"{bundle / name}: holds a {type(data).__name__}, not a JSON object; {fix}")
    return bundle, data


def gpu_judge(
    bundle: Path = typer.Argument(..., help="A verification bundle folder."),
    out_dir: Path = typer.Option(..., "--out", help="Where JUnit XML, reports and summary.json go."),
) -> None:
    """Inside the CUDA image: the shared suite before and after applying the bundle's patch
    to the installed vLLM (run by gpu-verify on the GPU host)."""
    from ..inputs import folder
    from ..remote.gpu_judge import judge

    bundle, _ = read_bundle(bundle)
    out_dir = folder(out_dir, "--out folder", "give --out a folder you can write", create=True,
                     writable=True)
    raise typer.Exit(judge(bundle, out_dir))


def verify_here(scenario, patch, vllm, reports) -> Path:
    """The CPU verification (``vllm-repro verify``), whose bundle is shipped; exits 1 when the
    patch is not verified on CPU (nothing is shipped then)."""
    from ..console import out, say
    from ..errors import EXIT_MISMATCH, InputError
    from ..scenario import load_scenario
    from ..verify.core import verify
    from ..verify.patch import require_patch_file

    if scenario is None or patch is None:
        raise InputError("give SCENARIO and --patch FIX.diff (or --bundle DIR from `vllm-repro verify`)")
    require_patch_file(patch)
    if vllm is None:
        sc = load_scenario(scenario)
        concrete = [v for v in sc.vllm.concrete() if sc.vllm.expectation_for(v) == "reproduce"]
        if not concrete:
            raise InputError(f"{scenario}: names no release it reproduces on; pass --vllm VERSION")
        vllm = concrete[0]
    say(f"verifying on CPU first: {scenario.name} on vLLM {vllm}")
    ver = verify(scenario, patch, vllm, reports.resolve(), say=say)
    if not ver.verified:
        out.print(f"[red]not shipped[/red]: not verified on CPU: {'; '.join(ver.reasons)}; bundle {ver.bundle}")
        raise typer.Exit(EXIT_MISMATCH)
    out.print(f"verified on CPU ({ver.before['observed']} -> {ver.after['observed']}); bundle {ver.bundle}")
    return ver.bundle


def ship_with_progress(ship, verbose: bool) -> int:
    """Ship the bundle and judge it there (:func:`vllm_repro.remote.ship.ship_bundle`), showing
    the phases: a spinner on a terminal, one plain line each otherwise (every remote line with
    ``verbose``). Returns the exit code."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..console import err
    from ..remote.ship import ship_bundle

    if not err.is_terminal:  # logs and CI: one plain line per phase
        def say(msg: str) -> None:
            err.print(f"gpu-verify: {msg}", highlight=False, markup=False)

        def on_line(line: str) -> None:
            if verbose or line.startswith(PHASE_PREFIXES):
                err.print(f"  {line}", highlight=False, markup=False)

        return ship_bundle(ship, say, on_line)
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task(f"gpu-verify on {ship.host}", total=None)

        def say(msg: str) -> None:
            progress.update(task, description=msg)
            progress.console.print(f"[dim]gpu-verify:[/dim] {msg}", highlight=False)

        def on_line(line: str) -> None:
            if line.startswith(PHASE_PREFIXES):
                progress.update(task, description=line.split("]", 1)[1].strip()[:100])
                progress.console.print(f"  {line}", highlight=False, markup=False)
            elif verbose:
                progress.console.print(f"  [dim]{line}[/dim]", highlight=False)

        return ship_bundle(ship, say, on_line)


def suite_cell(counts: dict) -> str:
    """The shared suite's counts, each kind apart: ``2 passed, 14 skipped, 0 failed, 0 errors
    of 16`` (a skipped test is not a passed one)."""
    tests, skipped = counts.get("tests", 0), counts.get("skipped", 0)
    failed, errors = counts.get("failures", 0), counts.get("errors", 0)
    passed = tests - skipped - failed - errors
    return f"{passed} passed, {skipped} skipped, {failed} failed, {errors} errors of {tests}"


def print_outcome(ship, code: int) -> None:
    """The judged table (scenario, vllm, image, before, after, suite after) and the outcome line;
    the messages of an error on stderr."""
    from ..console import err, error, out, table

    summary = {}
    try:
        summary = json.loads((ship.local / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    judged = summary.get("judge") or {}
    if judged.get("before") or judged.get("after"):
        t = table(("scenario", "vllm", "image", "before", "after", "suite after"))
        a = judged.get("after") or {}
        suite = suite_cell(a) if a else "-"
        t.add_row(judged.get("scenario", "-"), (judged.get("installed") or {}).get("version", "-"),
                  summary.get("image", "-"), (judged.get("before") or {}).get("observed", "-"),
                  a.get("observed", "-"), suite)
        out.print(t)
    where = f"results in {ship.local}"
    if code == 0:
        out.print(f"[green]verified on {ship.host}[/green]: reproduced before, clean after; {where}")
    elif code == 1:
        out.print(f"[red]NOT verified on {ship.host}[/red]: {'; '.join(ship.messages)}; {where}")
    else:
        for m in ship.messages:
            error(m)
        err.print(where, highlight=False)
