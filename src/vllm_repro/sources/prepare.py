"""Getting a release ready to run: the one place the lab, the slicer and the image bake share.

``prepare_release(version, tree=...)`` = fetch the sdist (cached, sha256-checked) -> choose the
tree (:func:`resolve_tree`: the full sdist tree, or the committed slice where one is recorded
equivalent) -> extract it (or materialise the slice) -> build its environment -> a
:class:`~vllm_repro.sources.env.ReleaseEnv`; all under a per-release lock (:func:`release_lock`)
so that two lab processes sharing the cache never build the same release at once.

Imports only ``errors``, ``settings``, ``sources`` and ``slicing.spec`` (the CPU image bakes its
releases with just these: ``images/cpu/bake.py``).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..errors import EnvError, InputError
from ..settings import cache_dir
from .env import ReleaseEnv, prepare_env
from .installed import check_release, installed
from .sdist import cached_release, extract_tree, fetch_sdist, validate_version

Say = Callable[[str], None]

#: ``--tree`` choices: the whole sdist tree in the full environment, the committed slice
#: (``slices/<version>.json``) in its own environment, or ``auto``: the slice where one is
#: committed and recorded as equivalent to the full tree, else the full tree.
TREES = ("full", "slice", "auto")

#: Where a release keeps the V1 engine's scheduler (one of them) and KV-cache manager: 0.6.5 to
#: 0.7.x ``vllm/v1/core/scheduler.py``, later ``vllm/v1/core/sched/scheduler.py``.
V1_SCHEDULER_FILES = ("vllm/v1/core/sched/scheduler.py", "vllm/v1/core/scheduler.py")
V1_KV_CACHE_MANAGER = "vllm/v1/core/kv_cache_manager.py"
#: The first release whose sdist has them (:func:`require_v1_scheduler` decides per tree; this
#: bounds which releases a campaign even fetches: ``campaign/spec.py:select_releases``)
FIRST_V1 = "0.6.5"


def check_tree(tree: str | None) -> None:
    """Raise :class:`InputError` unless ``tree`` (``--tree``) is ``None`` or one of :data:`TREES`."""
    if tree is not None and tree not in TREES:
        raise InputError(f"--tree {tree!r}: expected one of {', '.join(TREES)}")


def default_tree() -> str:
    """``VLLM_REPRO_TREE`` if set, else ``full``. Natively the full tree is the default: a
    slice saves disk, not import time (torch dominates), and costs a second environment; the
    CPU image sets ``auto`` to run the committed, proven-equivalent slices."""
    tree = os.environ.get("VLLM_REPRO_TREE") or "full"
    if tree not in TREES:
        raise InputError(f"VLLM_REPRO_TREE={tree!r}: expected one of {', '.join(TREES)}")
    return tree


def slice_levels(version: str) -> tuple[str, ...]:
    """The levels a committed ``slices/<version>.json`` is proven equivalent at: ``()`` without
    one or where it records ``equivalence.equal`` other than true; else ``traced.levels`` (a
    slice traced before levels were recorded: ``("scheduler",)``, the only level it ran)."""
    from ..slicing.spec import spec_path

    try:
        spec = json.loads(spec_path(version).read_text())
    except (OSError, ValueError):
        return ()
    if spec.get("equivalence", {}).get("equal") is not True:
        return ()
    return tuple(spec.get("traced", {}).get("levels") or ("scheduler",))


def slice_is_equivalent(version: str, level: str = "scheduler") -> bool:
    """Whether a committed ``slices/<version>.json`` records ``equivalence.equal: true`` (the
    slice ran the slicer's scenarios exactly as the full tree did) for runs at ``level``."""
    return level in slice_levels(version)


def resolve_tree(version: str, tree: str | None, level: str | None = "scheduler") -> str:
    """``full`` or ``slice`` for ``version`` (``auto`` looks for an equivalent committed slice).

    A slice holds what its traced runs imported: the scheduler and KV-cache files from
    scheduler-level runs, and EngineCore's, the executor's and the config code from
    ``level: engine-core`` runs where the slicer traced those too (``traced.levels``; slices
    traced before that record only the scheduler level). ``auto`` gives a run the slice only
    where the slice was proven at the run's level, else the full tree (``v0-engine`` runs
    too, since 2026-12-06, where the slicer traced the V0 engine). ``slice`` asked for a level
    its proven slice never ran at raises
    :class:`InputError` naming the levels it serves (and the option as it was given: ``--tree``,
    or ``VLLM_REPRO_TREE`` for commands without the option, such as verify). ``level`` None:
    no run's level to check (building an environment, :func:`prepare_release`: the runs were
    resolved at their levels before); ``auto`` then resolves as for the scheduler level."""
    given, tree = tree, tree or default_tree()
    if tree == "slice":
        from ..slicing.spec import spec_path

        asked, fix = (("--tree slice", "--tree auto or --tree full") if given else
                      ("VLLM_REPRO_TREE=slice", "VLLM_REPRO_TREE=auto or full"))
        if not spec_path(version).is_file():  # (an unproven one is run as asked)
            raise InputError(f"{asked}: vLLM {version} has no slice ({spec_path(version)}); "
                             f"use {fix}, or slice it (vllm-repro slice {version})")
        levels = slice_levels(version)
        if levels and level is not None and level not in levels:
            # asked for a slice that was never run at this level: its files are not all there
            # (the run would fail inside vLLM, blamed on the release), so say so now; re-slicing
            # helps only where the slicer did not try the level (a slice from before it did)
            tried = json.loads(spec_path(version).read_text()).get("traced", {}).get("levels_tried") or ()
            if level in tried:  # its scenarios at this level were all refused: no such engine
                raise InputError(
                    f"level: {level}: vLLM {version} has no engine of that level (the slicer's "
                    f"{level} scenarios were refused on it; its slice, slices/{version}.json, "
                    f"serves {' and '.join(levels)} runs); run the scenario on a release that has one")
            raise InputError(
                f"{asked}: vLLM {version}'s slice serves {' and '.join(levels)} runs "
                f"(slices/{version}.json), not level: {level}; use {fix}, or re-slice it "
                f"(vllm-repro slice {version})")
        return tree
    if tree != "auto":
        return tree
    return "slice" if slice_is_equivalent(version, level or "scheduler") else "full"


#: Where a release keeps the V0 engine the lab drives at ``level: v0-engine`` (0.4 to 0.10):
#: its ``LLMEngine`` and its ``Scheduler`` (with the block space managers beside it).
V0_ENGINE_FILES = ("vllm/engine/llm_engine.py", "vllm/core/scheduler.py")


def engines_of(tree: Path) -> tuple[str, ...]:
    """The engine generations an extracted tree has, probed by file: ``v1`` (the V1 scheduler
    and KV-cache manager) and ``v0`` (:data:`V0_ENGINE_FILES`)."""
    found = []
    if (tree / V1_KV_CACHE_MANAGER).is_file() and any((tree / f).is_file() for f in V1_SCHEDULER_FILES):
        found.append("v1")
    if all((tree / f).is_file() for f in V0_ENGINE_FILES):
        found.append("v0")
    return tuple(found)


def require_v1_scheduler(version: str, tree: Path) -> None:
    """Probe the extracted sdist for an engine the lab drives, before an environment is built
    for it: the V1 scheduler and KV-cache manager, or the V0 ``LLMEngine`` and ``Scheduler``
    (``level: v0-engine``). Raises :class:`InputError` for a tree with neither."""
    if engines_of(tree):
        return
    raise InputError(f"--vllm {version}: this release has no V1 engine scheduler "
                     f"({V1_SCHEDULER_FILES[0]} or {V1_SCHEDULER_FILES[1]}, with {V1_KV_CACHE_MANAGER}) "
                     f"and no V0 engine ({' + '.join(V0_ENGINE_FILES)}), which the lab drives; "
                     f"pick a release with the V1 engine ({FIRST_V1} or later) or the V0 engine")


@contextmanager
def release_lock(version: str):
    """An exclusive lock per release (``flock`` on ``<cache>/locks/<version>.lock``), so that
    two lab processes sharing the cache never build the same release's tree or environment at
    once."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{version}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def restore_trees(version: str) -> list[Path]:
    """Remove the release's extracted trees (the full tree and its slices), so that the next
    prepare extracts them again from the hash-checked sdist, without any edit made to them.
    Returns the folders removed. Raises :class:`EnvError` when one cannot be removed, or,
    before removing anything, when the sdist they would be made from again was dropped (the
    CPU image's trees: :func:`~vllm_repro.sources.sdist.drop_sdist`)."""
    import shutil

    from .sdist import cached_release, tree_dir

    gone = []
    with release_lock(version):
        release = cached_release(version)
        if release is not None:
            release.require_sdist()
        for d in [tree_dir(version), *sorted((cache_dir() / "slices").glob(f"{version}-*"))]:
            if d.is_dir():
                try:
                    shutil.rmtree(d)
                except OSError as exc:
                    raise EnvError(f"cannot remove {d} to restore vLLM {version}: {exc}") from exc
                gone.append(d)
    return gone


def build_tree_env(version: str, kind: str, say: Say = lambda s: None,
                   progress: Callable[[int, int | None], None] | None = None) -> ReleaseEnv:
    """Fetch ``version`` and build its ``kind`` (``full`` or ``slice``) of tree and environment,
    under :func:`release_lock`. No installed-mode shortcut and no tree choice: the image bake
    asks for exactly the kind it bakes. Raises :class:`InputError` for a release the index does
    not have, without a V1 scheduler, or ``slice`` without a committed slice;
    :class:`EnvError` for network, hash or install failures."""
    with release_lock(version):
        release = fetch_sdist(version, progress=progress)
        if kind == "slice":
            from ..slicing.spec import load_spec, materialise, slice_env

            spec = load_spec(version)
            return slice_env(spec, materialise(spec, release), say)
        tree_dir = extract_tree(release)
        require_v1_scheduler(version, tree_dir)
        return prepare_env(release, tree_dir)


def _writable(folder: Path) -> bool:
    """Whether this user may write in ``folder``, or, where it is not made yet, in the nearest
    folder above it that is."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return os.access(folder, os.W_OK)


def _read_only(version: str, kind: str, why: str) -> EnvError:
    """The one-line error for a release a read-only cache lacks (the CPU image's: only its baked
    releases run there)."""
    return EnvError(f"vLLM {version} ({kind} tree) is not ready in the cache {cache_dir()}, and that "
                    f"cache is read-only here ({why}; in the CPU image only the releases baked into "
                    f"it run): prepare it on the host (vllm-repro prepare {version}), or build the "
                    f'image with it (make images VLLM_VERSIONS="catalog {version}")')


def prepare_release(version: str, say: Say = lambda s: None,
                    progress: Callable[[int, int | None], None] | None = None,
                    tree: str | None = None) -> ReleaseEnv:
    """Fetch (cached, sha256-checked), extract and build the CPU environment of ``version``.

    ``tree``: ``full``, ``slice`` or ``auto`` (see :data:`TREES`; default :func:`default_tree`).
    A slice takes only its files out of the sdist and installs only its traced requirements.
    In installed mode (``VLLM_REPRO_VLLM=installed``) there is nothing to build: the installed
    vLLM must be ``version``. Raises :class:`~vllm_repro.errors.InputError` for a release the
    index does not have (or ``slice`` without a committed slice) and
    :class:`~vllm_repro.errors.EnvError` for network, hash or install failures, or a cache that
    cannot be written (one without the release's sdist or record: before the index is asked).
    """
    version = validate_version(version)
    inst = installed()
    if inst is not None:  # VLLM_REPRO_VLLM=installed: no sdist, tree or environment to build
        check_release(inst, version)
        return ReleaseEnv(version, None, inst.python.parent.parent, interpreter=inst.python)
    t = time.perf_counter()
    kind = resolve_tree(version, tree, None)
    if not _writable(cache_dir() / "sdists") and cached_release(version) is None:
        # nothing of it here and nowhere to fetch it to: said before asking the index
        raise _read_only(version, kind, f"{cache_dir() / 'sdists'} is not writable")
    try:
        env = build_tree_env(version, kind, say, progress)
    except PermissionError as exc:
        raise _read_only(version, kind, f"{exc.strerror}: {exc.filename}") from None
    say(f"vLLM {version}: {kind} tree ready in {time.perf_counter() - t:.1f}s ({env.root})")
    return env


__all__ = ["TREES", "check_tree", "default_tree", "resolve_tree", "slice_is_equivalent", "slice_levels",
           "require_v1_scheduler", "engines_of", "V0_ENGINE_FILES", "release_lock", "build_tree_env", "prepare_release"]
