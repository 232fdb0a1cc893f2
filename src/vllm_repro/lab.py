"""Orchestration: releases -> environments -> workers -> results -> verdicts.

``run_pairs`` runs a set of (scenario, release) pairs, one worker process per release, tree
and platform (vLLM imported once per worker; the scenario's ``platform:`` is what the worker
presents to vLLM, ``engine/adapter/platform.py``), releases in parallel up to ``jobs``
processes, and returns the verdicts in input order. Releases are made ready by
:func:`vllm_repro.sources.prepare.prepare_release` (re-exported here).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .engine.host import WorkerHandle
from .errors import EXIT_INPUT, EnvError, InputError, LabError
from .records import ReportDir, RunResult, _alive
from .scenario.schema import Scenario
from .sources.env import ReleaseEnv
from .sources.installed import check_release, installed
from .sources.prepare import TREES, prepare_release, resolve_tree
from .sources.sdist import validate_version
from .verdict import Verdict, audit_keeps_going, judge

Say = Callable[[str], None]
#: called with each run item as soon as its run has ended (a progress bar's step); from the
#: release's worker thread
OnRun = Callable[["RunItem"], None]


@dataclass
class RunItem:
    """One (scenario, release) pair and, after the run, its result, its verdict and its report
    (``report``; ``None`` when the run never started)."""

    scenario: Scenario
    version: str
    result: RunResult | None = None
    verdict: Verdict | None = None
    report: ReportDir | None = None
    #: an ``--also-on`` release (``catalog run``), not one the entry names
    also_on: bool = False
    #: the release (or the tree asked of it) could not be prepared: its error is about the
    #: release, not about the scenario file (``console.input_error_lines`` names no file)
    release_failed: bool = False

    @property
    def report_dir(self) -> Path | None:
        """``<reports>/<scenario>/<release>/``, once the run started."""
        return self.report.path if self.report is not None else None

    def fail(self, kind: str, message: str) -> None:
        """Mark the item ``error`` (``kind``: input, env) unless it already has a result."""
        if self.result is None:
            self.result = RunResult.failed(kind, message, scenario=self.scenario.name,
                                           vllm=self.version)

    def fail_from(self, exc: LabError) -> None:
        """:meth:`fail` with a lab exception: an input error (exit 2) stays one, anything else
        is the environment's (exit 3)."""
        self.fail("input" if exc.exit_code == EXIT_INPUT else "env", str(exc))


def _run_release(version: str, env: ReleaseEnv, items: list[RunItem], reports: Path,
                 audit: bool, keep_going: bool, say: Say, log_name: str | None = None,
                 platform: str | None = None, on_run: OnRun | None = None) -> None:
    with _claimed_log(ReportDir.engine_log(reports, log_name or version)) as log:
        _run_release_logged(version, env, items, reports, log, audit, keep_going, say, platform,
                            on_run)


@contextmanager
def _claimed_log(log: Path):
    """The worker's log for this process: ``log`` itself, or ``<name>.<pid>.log`` beside it
    while another process (a concurrent run into the same reports folder) holds ``log``, so
    that two runs never write one log and each run's ``engine.log`` is its own. Held with
    ``flock`` on ``.<name>.lock`` until the release's runs end."""
    from .inputs import open_append

    if log.parent.is_symlink():  # the logs' folder is the lab's: never a way out of --reports
        raise InputError(f"{log.parent}: is a symlink (to {os.readlink(log.parent)}), not the "
                         "folder of the workers' logs; remove the link")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open_append(log.parent / f".{log.stem}.lock", "log's lock file") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by another run
            mine = log.with_name(f"{log.stem}.{os.getpid()}.log")
            try:
                yield mine
            finally:  # each run's part is in its report's engine.log: nothing is left behind
                if not mine.is_symlink():
                    mine.unlink(missing_ok=True)
            return
        for old in log.parent.glob(f"{log.stem}.*.log"):  # those of runs that have ended
            pid = old.name[len(log.stem) + 1:-len(".log")]
            if pid.isdigit() and not _alive(int(pid)):
                old.unlink(missing_ok=True)
        _rotate(log)
        try:
            yield log
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _rotate(log: Path) -> None:
    """Keep a worker's log under ``VLLM_REPRO_MAX_LOG_MB``: one over it becomes
    ``<name>.log.1`` (replacing the one before), and the run starts a new one."""
    from .limits import max_log_bytes

    try:
        if not log.is_symlink() and log.stat().st_size > max_log_bytes():
            os.replace(log, log.with_name(log.name + ".1"))
    except FileNotFoundError:
        pass


def _run_release_logged(version: str, env: ReleaseEnv, items: list[RunItem], reports: Path,
                        log: Path, audit: bool, keep_going: bool, say: Say,
                        platform: str | None, on_run: OnRun | None = None) -> None:
    from .scenario.release_fields import unknown_passthrough

    for item in items:  # a config field the release lacks: refused before vLLM is imported
        refusal = unknown_passthrough(item.scenario.config, version, env.tree,
                                      item.scenario.level)
        if refusal:
            item.fail("input", refusal)
    items = [item for item in items if item.result is None]
    if not items:
        return
    changed = _tree_changes(version, env, say)
    try:
        with WorkerHandle(env, log, platform=platform) as worker:
            say(f"vLLM {version}: imported in {worker.import_time}" + warm_note(worker))
            v1 = audit and any(item.scenario.level != "v0-engine" for item in items)
            for line in worker.capabilities.audit_off() if v1 else ():
                say(f"vLLM {version}: audit partial: {line}")
            for item in items:
                item.report = ReportDir(reports, item.scenario.name, version)
                start = _size(log)
                # a verdict about a run's end (clean, or an expected crash/stall) needs the run
                # to reach it: the audit then collects violations instead of stopping
                item.result = worker.run(item.scenario.child_payload(), item.report.begin(),
                                         audit=audit, keep_going=keep_going or audit_keeps_going(
                                             item.scenario, version))
                item.result.engine_log = str(_run_log(log, start, item.report))
                item.result.substitutions = env.substitutions() or None
                item.result.tree_changes = changed
                item.result.tree = env.tree_kind
                item.result.warm = bool(worker.warm_started)
                if on_run is not None:
                    on_run(item)
    except LabError as exc:  # an input error (the worker's limits) stays one: exit 2, not 3
        for item in items:
            item.fail_from(exc)
            item.result.tree_changes = changed  # an edit may be what broke the start


def warm_note(worker) -> str:
    """How the worker started, after its import time: ``" (warm)"`` (forked by a serving warm
    parent), ``" (warm), after starting its warm parent (9.8 s)"`` (this run started the
    environment's parent: about a cold start, docs/warm-runs.md), ``""`` (cold)."""
    if not worker.warm_started:
        return ""
    if worker.parent_start_s is None:
        return " (warm)"
    return f" (warm), after starting its warm parent ({worker.parent_start_s:.1f} s)"


def _tree_changes(version: str, env: ReleaseEnv, say: Say) -> list[str] | None:
    """How the release's tree differs from its manifest (``sources/manifest.py``), said in one
    line when it does; ``None`` when it does not or has no manifest."""
    from .sources import manifest

    if env.tree is None:
        return None
    found = manifest.changes(env.tree)
    marker = env.tree / ".patched"  # verify's patched copy (verify/patch.py:patched_tree)
    if found and marker.is_file():
        found = [c for c in found if c.path != ".patched"]  # (the lab's own record of the patch)
        if found:  # (what the patch did: nothing to put back)
            say(f"vLLM {version}: the patched copy differs from the release's sdist in "
                f"{len(found)} file(s), as the patch makes it: {manifest.summary(found)}")
            return [str(c) for c in found]
    if not found:
        return None
    say(f"vLLM {version}: its tree differs from the release's sdist in {len(found)} file(s): "
        f"{manifest.summary(found)}; these runs observe the edit (`vllm-repro prepare {version} "
        f"--restore` puts the release back; {env.tree})")
    return [str(c) for c in found]


def _log_name(version: str, kind: str | None, several_kinds: bool, platform: str,
              several_platforms: bool) -> str | None:
    """The worker log's name under ``_engine/`` when one release has more than one worker."""
    name = f"{version}-{kind}" if several_kinds and kind == "slice" else version
    if several_platforms:
        import hashlib

        name += "-" + hashlib.sha256(platform.encode()).hexdigest()[:8]
    return None if name == version else name


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _run_log(log: Path, start: int, report: ReportDir) -> Path:
    """This run's part of the worker's log (what vLLM logged from ``start`` on, its crash dump
    included) moved into the run's report as ``engine.log``: stored once (the worker's log is
    cut back to ``start`` after the copy), and at most ``VLLM_REPRO_MAX_LOG_MB``: over it, the
    first and last halves are kept with a line saying how much was left out between. Returns
    where it will be once the report is committed (the worker's whole log, ``log``, when it
    cannot be read)."""
    from .limits import max_log_bytes

    cap = max_log_bytes()
    try:
        with open(log, "rb") as f, open(report.current / ReportDir.ENGINE_LOG, "wb") as dst:
            size = os.fstat(f.fileno()).st_size
            f.seek(start)
            length = max(0, size - start)
            if length <= cap:
                shutil.copyfileobj(f, dst, 1 << 20)
            else:
                half = cap // 2
                _copy(f, dst, half)
                dst.write(f"\n==== vllm-repro: {length - 2 * half:,} bytes of the worker's output "
                          f"left out here (VLLM_REPRO_MAX_LOG_MB keeps {cap >> 20} MB) ====\n"
                          .encode())
                f.seek(size - half)
                _copy(f, dst, half)
        os.truncate(log, start)  # this run's part lives in its report now
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # the half-written report goes with the run: left, it kept the disk full
            shutil.rmtree(report.staging, ignore_errors=True)
            raise
        return log
    return report.path / ReportDir.ENGINE_LOG


def _copy(src, dst, n: int) -> None:
    while n > 0:
        block = src.read(min(n, 1 << 20))
        if not block:
            return
        dst.write(block)
        n -= len(block)


def run_pairs(items: list[RunItem], reports: Path, audit: bool = True, keep_going: bool = False,
               jobs: int | None = None, say: Say = lambda s: None,
               prepare: Callable[[str], ReleaseEnv] | None = None,
               tree: str | None = None, timelines: bool = True,
               prepare_tree: Callable[[str, str], ReleaseEnv] | None = None,
               resolve: Callable[[str, str], str] | None = None,
               on_run: OnRun | None = None) -> list[RunItem]:
    """Run every item; fill in ``result`` and ``verdict``; write each run's ``result.json``
    (with its verdict, through :class:`~vllm_repro.records.ReportDir`: its only writer) and,
    with ``timelines``, its ``timeline.png`` (about 2 s of matplotlib a run on a busy machine;
    the release matrix draws its own picture instead). ``on_run(item)``: called as each run
    ends (from its release's thread).

    Releases are prepared one after the other (network and disk), then run in parallel, one
    worker per release, at most ``jobs`` at a time (default: the number of CPUs, at most 4).
    An environment failure for one release marks its items ``error`` and does not stop the rest.

    ``prepare(version)``: one environment for every run of a release, whatever its level (an
    installed vLLM, a bisect step's); ``prepare_tree(version, kind)``: the environment of the
    tree each run's level resolves to (:func:`~vllm_repro.sources.prepare.resolve_tree`, or
    ``resolve(version, level)``: verify's pristine and patched copies of the full tree and of
    the slice).
    """
    custom = prepare is not None
    if jobs is not None:
        from .limits import check_count, max_processes

        check_count("--jobs", jobs, max_processes(), setting="VLLM_REPRO_MAX_PROCESSES")
    reports = reports.resolve()
    try:
        reports.mkdir(parents=True, exist_ok=True)
        if not os.access(reports, os.W_OK):
            raise PermissionError(13, "not writable", str(reports))
    except OSError:  # a bind mount in a container, most often: say so before any run
        raise EnvError(f"cannot write reports to {reports} as uid {os.getuid()} (in a container: "
                       "mount a folder that user may write, or run it with --user)") from None
    # one worker per (release, tree, platform): with --tree auto a release with a committed
    # slice runs its scheduler-level scenarios in the slice and its engine-core ones in the full
    # tree; a worker presents one platform (vLLM's modules bind it when they are imported)
    groups: dict[tuple[str, str | None], dict[str, list[RunItem]]] = {}
    for item in items:
        kind = None if custom else resolve(item.version, item.scenario.level) if resolve \
            else resolve_tree(item.version, tree, item.scenario.level)
        by_platform = groups.setdefault((item.version, kind), {})
        by_platform.setdefault(item.scenario.platform.key(), []).append(item)
    envs: dict[tuple[str, str | None], ReleaseEnv] = {}
    for key in groups:
        version, kind = key
        try:
            envs[key] = (prepare(version) if custom else prepare_tree(version, kind)
                         if prepare_tree is not None else prepare_release(version, say, tree=kind))
        except LabError as exc:
            for group in groups[key].values():
                for item in group:
                    item.fail_from(exc)
                    item.release_failed = True
    jobs = jobs or max(1, min(4, os.cpu_count() or 1))
    runnable = [k for k in groups if k in envs]
    if runnable and timelines:
        _prefetch_timeline()
    kinds_of: dict[str, int] = {}
    for version, _ in runnable:
        kinds_of[version] = kinds_of.get(version, 0) + 1
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(_run_release, v, envs[(v, k)], group, reports, audit,
                               keep_going, say,
                               _log_name(v, k, kinds_of[v] > 1, platform, len(groups[(v, k)]) > 1),
                               platform, on_run)
                   for v, k in runnable for platform, group in groups[(v, k)].items()]
        for f in futures:
            f.result()
    for item in items:
        item.fail("lab", "the run produced no result")  # never silently clean
        item.verdict = judge(item.scenario, item.version, item.result, _trace_path(item))
        err = item.result.error
        if item.report is None and err is not None and err.kind != "input":
            # a lab or environment failure before the run began (its worker did not start):
            # its report says so, so the previous run's verdict is not shown as this one's;
            # an input error leaves the previous report as it was (bad input loses nothing)
            item.report = ReportDir(reports, item.scenario.name, item.version)
            item.report.begin()
        if item.report is not None and item.report.current.is_dir():
            item.result.verdict = item.verdict.as_dict()
            try:
                item.report.write_result(item.result)
                if timelines:
                    _timeline(item, item.result, say)
                _page(item, item.result, say)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk: no half report left
                    shutil.rmtree(item.report.staging, ignore_errors=True)
                raise
            item.report.commit()  # the whole report replaces the previous run's
    return items


def run_release_task(arg: dict) -> list[dict]:
    """One release's items, run where the executor put this task (a local process, a Ray
    node): ``arg`` ``{"items": [(Scenario, release)], "reports": absolute path, "audit",
    "keep_going", "tree"}``; :func:`run_pairs` there (the release prepared in that machine's
    cache, reports written under ``reports`` there: on a cluster, a folder every node shares).
    Returns each item's :class:`RunResult` as a dict, in order."""
    items = [RunItem(sc, v) for sc, v in arg["items"]]
    run_pairs(items, Path(arg["reports"]), audit=arg["audit"], keep_going=arg["keep_going"],
               jobs=1, tree=arg.get("tree"))
    return [item.result.to_dict() for item in items]


def run_pairs_on(executor, items: list[RunItem], reports: Path, audit: bool = True,
                  keep_going: bool = False, tree: str | None = None,
                  say: Say = lambda s: None) -> list[RunItem]:
    """:func:`run_pairs` with one task per release on ``executor``
    (:mod:`vllm_repro.task_executor`: ``--ray``), each running that release's items; the verdicts
    are judged here from the results that come back. A task that failed (its process or node
    died) marks its items ``error`` of kind ``env``."""
    reports = reports.resolve()
    by_release: dict[str, list[RunItem]] = {}
    for item in items:
        by_release.setdefault(item.version, []).append(item)
    versions = list(by_release)
    args = [{"items": [(i.scenario, i.version) for i in by_release[v]], "reports": str(reports),
             "audit": audit, "keep_going": keep_going, "tree": tree} for v in versions]
    for n, outcome in executor.run(run_release_task, args):
        group = by_release[versions[n]]
        if outcome.error is not None:
            for item in group:
                item.fail("env", f"the task of vLLM {item.version} failed: "
                                 f"{outcome.error.splitlines()[0]}")
        else:
            for item, data in zip(group, outcome.value):
                item.result = RunResult.from_dict(data)
                item.report = ReportDir(reports, item.scenario.name, item.version)
        say(f"vLLM {versions[n]}: {len(group)} run(s) back from the executor")
    for item in items:
        item.fail("lab", "the run produced no result")  # never silently clean
        item.verdict = judge(item.scenario, item.version, item.result, _trace_path(item))
    return items


def _trace_path(item: RunItem) -> Path | None:
    """The run's ``trace.jsonl`` (staged, or committed), for ``expect.steps`` / ``stats``."""
    if item.report is None:
        return None
    for folder in (getattr(item.report, "current", None), item.report.path):
        if folder is not None and (folder / ReportDir.TRACE).is_file():
            return folder / ReportDir.TRACE
    return None


def _prefetch_timeline() -> None:
    """Import matplotlib (about a second, most of a warm re-run's host time) in a thread while
    the workers run, so ``timeline.png`` is drawn without waiting for it afterwards."""
    import threading

    def load() -> None:
        try:
            import matplotlib

            matplotlib.use("Agg", force=True)
            import matplotlib.pyplot  # noqa: F401
        except Exception:  # noqa: BLE001 - _timeline reports it when it draws
            pass

    threading.Thread(target=load, name="vllm-repro-timeline-import", daemon=True).start()


def _timeline(item: RunItem, result: RunResult, say: Say) -> None:
    """``timeline.png`` next to the run's trace (a failed picture never fails the run)."""
    from .report.timeline import write_timeline

    try:
        write_timeline(item.report.current, result)
    except Exception as exc:  # noqa: BLE001 - matplotlib (or its absence) or a damaged trace
        from .extras import why

        say(f"{item.scenario.name} on {item.version}: no timeline.png ({why(exc)})")


def _page(item: RunItem, result: RunResult, say: Say) -> None:
    """The run's page (``index.html``) and ``scenario.yaml`` next to its result (a failed page
    never fails the run)."""
    from .report.pages import write_run_page

    try:
        write_run_page(item.report.current, result, item.scenario.source_text)
    except Exception as exc:  # noqa: BLE001 - a damaged trace or a full disk
        say(f"{item.scenario.name} on {item.version}: no index.html ({type(exc).__name__}: {exc})")


def releases_for(scenario: Scenario, requested: list[str], covering: bool = False) -> list[str]:
    """The releases to run: ``--vllm`` values if given, else the scenario's concrete
    ``reproduces_on`` and ``clean_on`` releases; in installed mode the installed release (with
    ``covering``, as for a catalog run: only when the scenario's releases or ranges say what it
    does there, else none; an entry about other releases may use features this one lacks).
    Raises :class:`~vllm_repro.errors.InputError` when neither names one."""

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


def checked_releases(requested: list[str], flag: str = "--vllm") -> list[str]:
    """The releases named with ``flag`` (``--vllm``, ``--also-on``), each checked before anything
    runs as triage checks its ``--vllm`` (:func:`~vllm_repro.sources.sdist.checked_release`: the
    cache, else the index): a name that is no release of vLLM is
    :class:`~vllm_repro.errors.InputError` (exit 2, one line with the nearest releases), an
    index that cannot be read for one not cached :class:`~vllm_repro.errors.IndexUnreachable`
    (exit 3). In installed mode they are left to :func:`releases_for` (the installed release is
    the only one that runs)."""
    from .sources.sdist import checked_release

    if installed() is not None:
        return list(requested)
    return [checked_release(v, flag) for v in dict.fromkeys(requested)]


__all__ = ["RunItem", "prepare_release", "run_pairs", "run_pairs_on", "run_release_task",
           "releases_for", "checked_releases", "resolve_tree", "TREES", "EnvError"]
