"""One campaign task: (release, seed), every feature set of the campaign in turn.

:func:`run_task` is what the executor (:mod:`vllm_repro.task_executor`) runs, in a local worker
process or on a Ray node: it prepares the release in that machine's own cache
(:func:`vllm_repro.sources.prepare.prepare_release`, locked per release, so tasks of one
release on one node build it once), then runs the fuzzer's search
(:func:`vllm_repro.fuzz.search.search`, one engine worker of the release) once per feature set,
and returns a :class:`~vllm_repro.records.CampaignTaskResult` as a dict.

Why a bound on examples (``CampaignSpec.examples``) rather than only on time: a search bounded
by time runs as many examples as the machine manages, so a loaded laptop and an idle Ray node
would search different prefixes of the same seeded sequence and could find different things.
Bounded by examples, a (release, seed, feature set) runs the same examples everywhere: the
state machine is seeded per chunk from the campaign seed (``fuzz/search.py:_chunk_seed``),
the scheduler level runs deterministically, and the example database is off unless asked
(``--db``: replaying stored failures makes a campaign depend on what that machine's cache holds).
``time_s`` stays as a safety cap; a search it ended says ``bound: time`` in its record.
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from pathlib import Path

from ..errors import InputError, LabError
from ..records import CampaignFinding, CampaignTaskResult


def profile_for(name: str, policy: str | None, spec_decode: bool | None):
    """The fuzzer's :class:`~vllm_repro.fuzz.strategies.Profile` of a feature set."""
    from ..fuzz.strategies import DEFAULT, LADDER

    by_name = {p.name: p for p in (DEFAULT, *LADDER)}
    return by_name[name].with_policy(policy).with_spec(spec_decode)


def run_task(arg: dict) -> dict:
    """``arg``: ``{"spec": CampaignSpec dict, "release", "seed", "log_dir": absolute path}``.
    Returns :class:`CampaignTaskResult`'s dict; raises nothing for a lab or input failure
    (its ``status`` says it), so a task outcome with an error means the task's process died."""
    from ..fuzz.search import SearchConfig, search
    from ..sources.prepare import prepare_release, resolve_tree
    from .spec import CampaignSpec

    spec = CampaignSpec.from_dict(arg["spec"])
    release, seed = arg["release"], int(arg["seed"])
    log_dir = Path(arg["log_dir"])
    t0 = time.perf_counter()
    res = CampaignTaskResult(release=release, seed=seed, status="done", node=socket.gethostname())
    try:
        env = prepare_release(release, tree=resolve_tree(release, None, spec.level))
    except InputError as exc:  # not a V1 release, a release the index lacks
        res.status, res.message = "refused", str(exc)
        return _done(res, t0)
    except LabError as exc:
        res.status, res.message = "error", f"preparing vLLM {release}: {exc}"
        return _done(res, t0)
    log_dir.mkdir(parents=True, exist_ok=True)
    for features in spec.features:
        cfg = SearchConfig(version=release, profile=profile_for(features, spec.policy, spec.spec_decode),
                           seed=seed, time_s=spec.time_s, target=spec.target, audit=spec.audit,
                           spec_forced=bool(spec.spec_decode), level=spec.level,
                           database=spec.db, use_database=spec.db is not None,
                           max_examples=spec.examples, shrink=spec.shrink)
        got: dict = {"input": [], "fatal": [], "error": []}

        def emit(kind, payload, got=got, features=features):
            if kind == "finding":
                res.findings.append(CampaignFinding(
                    signature=payload.signature, release=release, seed=seed, features=features,
                    scenario=payload.scenario, result=payload.result, examples=payload.examples,
                    first_example=payload.first_failure_example,
                    found_after_s=payload.found_after_s))
            elif kind == "note":
                res.notes.append(f"{features}: {payload}")
            elif kind in got:
                got[kind].append(payload)

        try:
            worker = _worker(env, log_dir / f"{release}-{socket.gethostname()}-{os.getpid()}.log")
        except LabError as exc:
            res.status, res.message = "error", f"starting vLLM {release}'s worker: {exc}"
            break
        stats = search(0, cfg, env, worker.log_path, emit, worker=worker)
        res.examples += stats["examples"]
        for k, v in stats["by_outcome"].items():
            res.by_outcome[k] = res.by_outcome.get(k, 0) + v
        res.bound = stats.get("bound") or res.bound
        if got["input"]:
            res.status, res.message = "refused", f"{features}: {got['input'][0]}"
            break
        if got["fatal"]:
            res.status = "error"
            res.message = f"{features}: {got['fatal'][0].splitlines()[0]} (worker log {worker.log_path})"
            _drop_worker()
            break
        if got["error"] and not res.message:
            res.notes.append(f"{features}: lab errors, e.g. {got['error'][0][:300]}")
    return _done(res, t0)


#: this process's engine worker: (release, tree) -> the started WorkerHandle; one at a time (a
#: worker holds a release's vLLM imported, several hundred MB). The executor's processes run
#: task after task (a ProcessPoolExecutor's workers, Ray's worker processes), and the tasks are
#: ordered so that a slot's next task is often the same release's next seed: the worker is then
#: reused instead of importing vLLM again (most of a short task's time). A worker runs each
#: scenario afresh (a new scheduler or EngineCore per run), so reuse changes no result.
_CACHED: dict = {}


def _worker(env, log: Path):
    """The started :class:`~vllm_repro.engine.host.WorkerHandle` of ``env`` in this process: the
    cached one while it lives, else a new one (the old one closed)."""
    from ..engine.host import WorkerHandle

    key = (env.version, str(env.tree))
    w = _CACHED.get(key)
    if w is not None and w.proc is not None and w.proc.poll() is None:
        return w
    _drop_worker()
    w = WorkerHandle(env, log)
    w.start()
    _CACHED[key] = w
    return w


def _drop_worker() -> None:
    for w in _CACHED.values():
        try:
            w.close()
        except Exception:  # noqa: BLE001 - a worker already gone
            pass
    _CACHED.clear()


atexit.register(_drop_worker)


def _done(res: CampaignTaskResult, t0: float) -> dict:
    res.elapsed_s = round(time.perf_counter() - t0, 2)
    return res.to_dict()
