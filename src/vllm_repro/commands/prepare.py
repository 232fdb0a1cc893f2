"""``vllm-repro prepare VERSION...``: fetch and build releases ahead of a run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import List, Optional

import typer

from . import Tree, value


def _own_tmp_folder(path: Path) -> bool:
    """``path`` made (mode 0700) where missing, and this user's alone: a folder (not a link)
    of this uid, mode 0700 (narrowed if it was wider), writable. ``False`` otherwise (another
    user made it first in a shared temporary folder) and on any ``OSError``."""
    import stat

    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        if stat.S_IMODE(st.st_mode) != 0o700:
            path.chmod(0o700)
        return os.access(path, os.W_OK | os.X_OK)
    except OSError:
        return False


def log_path(version: str) -> Path:
    """Where the prepare worker's log goes: ``<cache>/prepare/<version>.log``, or, where that
    folder cannot be written (the CPU image's cache, read-only to its user but for the folders
    runs write), ``<tmp>/vllm-repro-prepare-<uid>/<version>.log``: one folder per user (mode
    0700), reused by every prepare (the worker appends to its log), a new one only where another
    user holds that name. Raises :class:`EnvError` when none can be written."""
    from ..errors import EnvError
    from ..settings import cache_dir

    folder = cache_dir() / "prepare"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder / f"{version}.log"
    except OSError:
        pass
    own = Path(tempfile.gettempdir()) / f"vllm-repro-prepare-{os.getuid()}"
    if _own_tmp_folder(own):
        return own / f"{version}.log"
    try:
        return Path(tempfile.mkdtemp(prefix=f"{own.name}-")) / f"{version}.log"
    except OSError as exc:
        raise EnvError(f"no folder for the log of vLLM {version}'s worker can be written: not "
                       f"{folder}, nor {own}, nor the temporary folder ({exc})") from None


def prepare(versions: List[str] = typer.Argument(..., help="Release(s) to fetch and build."),
            tree: Optional[Tree] = typer.Option(None, "--tree", help="Which tree to build (default: VLLM_REPRO_TREE, else full)."),
            restore: bool = typer.Option(False, "--restore", help=(
                "Extract the release's trees again from its sdist, dropping any edit made "
                "to them (runs report an edited tree)."))) -> None:
    """Fetch, verify and extract release(s), build their CPU environments, and import each
    release's scheduler and engine-core path there (the worker's start-up) before saying ready.
    With --restore, the trees are extracted again first."""
    from ..console import out, progress
    from ..engine.host import WorkerHandle
    from ..inputs import release_name
    from ..sources.prepare import check_tree, prepare_release, restore_trees

    tree = value(tree)
    check_tree(tree)
    versions = [release_name(v, "VERSION") for v in versions]
    ready: list[str] = []
    try:
        with progress("prepare", len(versions)) as bar:
            for v in versions:
                if restore:
                    for d in restore_trees(v):
                        bar.say(f"vLLM {v}: removed {d}; extracting it again")

                def fetched(done: int, total: int | None, v=v) -> None:
                    size = f"{done / 1e6:.0f}" + (f" of {total / 1e6:.0f}" if total else "")
                    bar.note(f"vLLM {v}: sdist {size} MB")

                env = prepare_release(v, bar.say, progress=fetched, tree=tree)
                for line in env.substitutions():
                    bar.say(f"vLLM {env.version}: substituted {line}")
                # proven, not assumed: the worker imports vLLM's scheduler path and probes the
                # release (an import failure is exit 3 with its cause and the log)
                bar.note(f"vLLM {env.version}: importing its scheduler in a worker")
                with WorkerHandle(env, log_path(env.version)) as worker:
                    hello = worker.hello
                bar.advance()
                ready.append(f"vLLM {env.version}: ready, imported in {worker.import_time} under "
                             f"{hello.get('platform')} ({env.python}, tree {env.tree})")
    finally:  # the releases made ready, on stdout once the bar on stderr is done drawing
        for line in ready:
            out.print(line, highlight=False)
