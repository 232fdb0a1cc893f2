"""``vllm-repro slice VERSION...``: trace a release and write ``slices/<version>.json``; the
slicer is :mod:`vllm_repro.slicing`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def slice_cmd(
    versions: List[str] = typer.Argument(..., help="Release(s) to slice, e.g. 0.33.0."),
    include: List[str] = typer.Option([], "--include", help="vllm.* module(s) to add to the slice by hand."),
    out: Optional[Path] = typer.Option(None, help="Folder for <version>.json (default: slices/)."),
    base: Path = typer.Option(Path("."), help="Lab checkout whose scenario files are traced."),
    fresh: bool = typer.Option(False, "--fresh", help="Re-trace the full tree even if its inputs are unchanged."),
) -> None:
    """Trace RELEASE's scheduling paths (scenarios + vLLM's core CPU tests), choose stubs,
    build the slice environment, check equivalence with the full tree, write the spec."""
    from ..console import out as console
    from ..console import say
    from ..slicing.slicer import make_slice
    from ..inputs import folder, release_name
    from ..sources.sdist import validate_version

    versions = [release_name(v, "VERSION") for v in versions]
    base = folder(base, "--base folder", "give --base the lab checkout whose scenarios are traced")
    if out is not None:
        folder(out, "--out folder", "give --out a folder you can write", writable=True)
    code = 0
    for v in versions:
        validate_version(v)
        path, spec = make_slice(v, base.resolve(), tuple(include), out=out, say=say,
                                reuse_full=not fresh)
        eq = spec["equivalence"]
        s = spec["summary"]
        console.print(
            f"vLLM {v}: {s['vllm_files']} of {spec['package']['vllm_files']} vLLM files, "
            f"{s['requirements']} of {s['full_environment_distributions']} distributions, "
            f"stubs: {', '.join(s['stubs']) or 'none'}; tests passing full/slice "
            f"{eq['tests_passed_full']}/{eq['tests_passed_slice']}, scenarios differing: "
            f"{len(eq['scenarios_differing'])}; equivalent: {eq['equal']} -> {path}",
            highlight=False)
        if not eq["equal"]:
            code = 1
    raise typer.Exit(code)
