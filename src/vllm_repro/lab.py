"""Orchestration: releases -> environments -> workers -> results -> verdicts.

``prepare_release`` gets a release ready (sdist, tree, environment); ``run_matrix`` runs a set
of (scenario, release) pairs, one worker process per release (vLLM imported once per release),
releases in parallel up to ``jobs`` processes, and returns the verdicts in input order.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .engine.host import Worker
from .errors import EnvError, InputError, LabError
from .scenario.schema import Scenario
from .settings import cache_dir
from .sources.env import ReleaseEnv, prepare_env
from .sources.installed import check_release, installed
from .sources.sdist import extract_tree, fetch_sdist, validate_version
from .verdict import Verdict, audit_keeps_going, judge

Say = Callable[[str], None]


@dataclass
class RunItem:
    """One (scenario, release) pair and, after the run, its result and verdict."""

    scenario: Scenario
    version: str
    result: dict = field(default_factory=dict)
    verdict: Verdict | None = None
    report_dir: Path | None = None


#: ``--tree`` choices: the whole sdist tree in the full environment, the committed slice
#: (``slices/<version>.json``) in its own environment, or ``auto``: the slice where one is
#: committed and recorded as equivalent to the full tree, else the full tree.
TREES = ("full", "slice", "auto")


def default_tree() -> str:
    """``VLLM_REPRO_TREE`` if set, else ``full``. Natively the full tree is the default: a
    slice saves disk, not import time (torch dominates), and costs a second environment; the
    CPU image sets ``auto`` to run the committed, proven-equivalent slices."""
    tree = os.environ.get("VLLM_REPRO_TREE") or "full"
    if tree not in TREES:
        from .errors import InputError

        raise InputError(f"VLLM_REPRO_TREE={tree!r}: expected one of {', '.join(TREES)}")
    return tree


def resolve_tree(version: str, tree: str | None, level: str = "scheduler") -> str:
    """``full`` or ``slice`` for ``version`` (``auto`` looks for an equivalent committed slice).

    A slice is traced from scheduler-level runs (``vllm-repro slice``): it holds the scheduler
    and KV-cache files, not the EngineCore, executor and config code that ``level:
    engine-core`` runs, so ``auto`` gives engine-core runs the full tree."""
    tree = tree or default_tree()
    if tree != "auto":
        return tree
    if level != "scheduler":
        return "full"
    from .slicing.spec import spec_path

    try:
        spec = json.loads(spec_path(version).read_text())
    except (OSError, ValueError):
        return "full"
    return "slice" if spec.get("equivalence", {}).get("equal") is True else "full"


def prepare_release(version: str, say: Say = lambda s: None,
                    progress: Callable[[int, int | None], None] | None = None,
                    tree: str | None = None) -> ReleaseEnv:
    """Fetch (cached, sha256-checked), extract and build the CPU environment of ``version``.

    ``tree``: ``full``, ``slice`` or ``auto`` (see :data:`TREES`; default :func:`default_tree`).
    A slice takes only its files out of the sdist and installs only its traced requirements.
    Raises :class:`~vllm_repro.errors.InputError` for a release the index does not have (or
    ``slice`` without a committed slice) and :class:`~vllm_repro.errors.EnvError` for network,
    hash or install failures.
    """
    version = validate_version(version)
    inst = installed()
    if inst is not None:  # VLLM_REPRO_VLLM=installed: no sdist, tree or environment to build
        check_release(inst, version)
        return ReleaseEnv(version, None, inst.python.parent.parent, interpreter=inst.python)
    t = time.perf_counter()
    kind = resolve_tree(version, tree)
    try:
        with release_lock(version):
            release = fetch_sdist(version, progress=progress)
            if kind == "slice":
                from .slicing.spec import load_spec, materialise, slice_env

                spec = load_spec(version)
                env = slice_env(spec, materialise(spec, release), say)
            else:
                tree_dir = extract_tree(release)
                require_v1_scheduler(version, tree_dir)
                env = prepare_env(release, tree_dir)
    except PermissionError as exc:  # e.g. the CPU image's cache, read-only with its baked releases
        raise EnvError(f"vLLM {version} ({kind} tree) is not ready in the cache {cache_dir()} and it "
                       f"cannot be written ({exc.strerror}: {exc.filename}); in the CPU image only the "
                       "releases baked into it run (make images VLLM_VERSIONS=...)") from None
    say(f"vLLM {version}: {kind} tree ready in {time.perf_counter() - t:.1f}s ({env.root})")
    return env


#: Where a release keeps the V1 engine's scheduler (one of them) and KV-cache manager: 0.6.5 to
#: 0.7.x ``vllm/v1/core/scheduler.py``, later ``vllm/v1/core/sched/scheduler.py``.
V1_SCHEDULER_FILES = ("vllm/v1/core/sched/scheduler.py", "vllm/v1/core/scheduler.py")
V1_KV_CACHE_MANAGER = "vllm/v1/core/kv_cache_manager.py"


def require_v1_scheduler(version: str, tree: Path) -> None:
    """Probe the extracted sdist for the V1 scheduler and KV-cache manager the lab drives, before
    an environment is built for it. Raises :class:`InputError` for a release without them
    (vLLM before 0.6.5: only the V0 engine)."""
    if (tree / V1_KV_CACHE_MANAGER).is_file() and any((tree / f).is_file() for f in V1_SCHEDULER_FILES):
        return
    raise InputError(f"--vllm {version}: this release has no V1 engine scheduler "
                     f"({V1_SCHEDULER_FILES[0]} or {V1_SCHEDULER_FILES[1]}, with {V1_KV_CACHE_MANAGER}), "
                     "which the lab drives; pick a release with the V1 engine (0.6.5 or later)")


@contextmanager
def release_lock(version: str):
    """An exclusive lock per release (``flock``), so that two lab processes sharing the cache
    never build the same release's tree or environment at once."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{version}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run_release(version: str, env: ReleaseEnv, items: list[RunItem], reports: Path,
                 audit: bool, keep_going: bool, say: Say, log_name: str | None = None) -> None:
    log = reports / "_engine" / f"{log_name or version}.log"
    try:
        with Worker(env, log) as worker:
            say(f"vLLM {version}: imported in {worker.hello.get('import_s')}s")
            for item in items:
                out = reports / item.scenario.name / version
                item.report_dir = out
                # a verdict about a run's end (clean, or an expected crash/stall) needs the run
                # to reach it: the audit then collects violations instead of stopping
                item.result = worker.run(item.scenario.child_payload(), out, audit=audit,
                                         keep_going=keep_going or audit_keeps_going(
                                             item.scenario, version))
                item.result["engine_log"] = str(log)
    except LabError as exc:
        for item in items:
            if not item.result:
                item.result = {"outcome": "error", "error": {"kind": "env", "message": str(exc)},
                               "scenario": item.scenario.name, "vllm": version}


def run_matrix(items: list[RunItem], reports: Path, audit: bool = True, keep_going: bool = False,
               jobs: int | None = None, say: Say = lambda s: None,
               prepare: Callable[[str], ReleaseEnv] | None = None,
               tree: str | None = None) -> list[RunItem]:
    """Run every item; fill in ``result`` and ``verdict``; write ``result.json`` per run.

    Releases are prepared one after the other (network and disk), then run in parallel, one
    worker per release, at most ``jobs`` at a time (default: the number of CPUs, at most 4).
    An environment failure for one release marks its items ``error`` and does not stop the rest.
    """
    custom = prepare is not None
    reports = reports.resolve()
    try:
        reports.mkdir(parents=True, exist_ok=True)
        if not os.access(reports, os.W_OK):
            raise PermissionError(13, "not writable", str(reports))
    except OSError:  # a bind mount in a container, most often: say so before any run
        raise EnvError(f"cannot write reports to {reports} as uid {os.getuid()} (in a container: "
                       "mount a folder that user may write, or run it with --user)") from None
    # one worker per (release, tree): with --tree auto a release with a committed slice runs
    # its scheduler-level scenarios in the slice and its engine-core ones in the full tree
    groups: dict[tuple[str, str | None], list[RunItem]] = {}
    for item in items:
        kind = None if custom else resolve_tree(item.version, tree, item.scenario.level)
        groups.setdefault((item.version, kind), []).append(item)
    envs: dict[tuple[str, str | None], ReleaseEnv] = {}
    for key in groups:
        version, kind = key
        try:
            envs[key] = prepare(version) if custom else prepare_release(version, say, tree=kind)
        except LabError as exc:
            code = "input" if exc.exit_code == 2 else "env"
            for item in groups[key]:
                item.result = {"outcome": "error", "error": {"kind": code, "message": str(exc)},
                               "scenario": item.scenario.name, "vllm": version}
    jobs = jobs or max(1, min(4, os.cpu_count() or 1))
    runnable = [k for k in groups if k in envs]
    kinds_of: dict[str, int] = {}
    for version, _ in runnable:
        kinds_of[version] = kinds_of.get(version, 0) + 1
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(_run_release, v, envs[(v, k)], groups[(v, k)], reports, audit,
                               keep_going, say,
                               f"{v}-{k}" if kinds_of[v] > 1 and k == "slice" else None)
                   for v, k in runnable]
        for f in futures:
            f.result()
    for item in items:
        item.verdict = judge(item.scenario, item.version, item.result)
        if item.report_dir is not None and item.report_dir.is_dir():
            res = dict(item.result)
            res["verdict"] = item.verdict.as_dict()
            (item.report_dir / "result.json").write_text(json.dumps(res, indent=1, default=str))
            _timeline(item, res, say)
    return items


def _timeline(item: RunItem, result: dict, say: Say) -> None:
    """``timeline.png`` next to the run's trace (a failed picture never fails the run)."""
    from .report.timeline import write_timeline

    try:
        write_timeline(item.report_dir, result)
    except Exception as exc:  # noqa: BLE001 - matplotlib or a damaged trace
        say(f"{item.scenario.name} on {item.version}: no timeline.png ({type(exc).__name__}: {exc})")


def releases_for(scenario: Scenario, requested: list[str], covering: bool = False) -> list[str]:
    """The releases to run: ``--vllm`` values if given, else the scenario's concrete
    ``reproduces_on`` and ``clean_on`` releases; in installed mode the installed release (with
    ``covering``, as for a catalog run: only when the scenario's releases or ranges say what it
    does there, else none; an entry about other releases may use features this one lacks).
    Raises :class:`~vllm_repro.errors.InputError` when neither names one."""
    from .errors import InputError

    inst = installed()
    if inst is not None:  # installed mode runs the installed release, and only that one
        for v in requested:
            check_release(inst, validate_version(v))
        if covering and not requested and scenario.vllm.expectation_for(inst.release) is None:
            return []
        return [inst.release]
    if requested:
        return list(dict.fromkeys(validate_version(v) for v in requested))  # once each
    versions = scenario.vllm.concrete()
    if not versions:
        raise InputError(f"{scenario.name}: vllm.reproduces_on / clean_on name no release; "
                         "pass --vllm VERSION")
    return versions


__all__ = ["RunItem", "prepare_release", "run_matrix", "releases_for", "resolve_tree", "TREES",
           "EnvError"]
