"""``vllm-repro prepare VERSION...``: fetch and build releases ahead of a run."""

from __future__ import annotations

from typing import List, Optional

import typer


def prepare(versions: List[str] = typer.Argument(..., help="Release(s) to fetch and build."),
            tree: Optional[str] = typer.Option(None, "--tree", help="full | slice | auto")) -> None:
    """Fetch, verify and extract release(s) and build their CPU environments."""
    from ..console import out, say
    from ..inputs import release_name
    from ..sources.prepare import check_tree, prepare_release

    check_tree(tree)
    versions = [release_name(v, "VERSION") for v in versions]
    for v in versions:
        env = prepare_release(v, say, tree=tree)
        out.print(f"vLLM {env.version}: {env.python} (tree {env.tree})")
