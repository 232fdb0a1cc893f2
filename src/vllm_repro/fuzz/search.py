"""Search workloads until vLLM raises or an invariant breaks, then shrink to a minimal reproducer.

Each search process owns one engine worker (vLLM imported once) and runs hypothesis's state
machine (:mod:`vllm_repro.fuzz.machine`: each example a sequence of engine calls, run as one
scenario) in chunks of examples, each chunk with a seed derived from the campaign seed, the
process index and the chunk number, until the time is up. The first chunk replays the failures
the example database (:mod:`vllm_repro.fuzz.database`) holds for the level before drawing new
ones. The first failure a process sees fixes its target *signature*
(exception type + innermost vLLM frame, or violation code, or stall); from then on only that
signature counts as failing, so hypothesis's shrinker is judged on the same signature, never on
any failure. Lab errors (outcome ``error``) are counted, never reported as findings; nor are
scenarios the release refuses (counted as ``refused``).

Entry points (kept for ``commands/fuzz.py`` and later callers): :class:`SearchConfig`
(``level``, ``database`` and ``use_database`` were added with defaults, so older callers get
the scheduler level with the cache's database), :func:`run_campaign`, :func:`write_finding`,
:func:`signature`, :func:`failure_message`, :func:`slug`, :func:`parse_duration`, :func:`refused_features`,
:func:`fit_profile` (``level`` added, keyword with a default).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import queue as queue_mod
import re
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

from hypothesis import Phase, Verbosity, seed, settings
from hypothesis.stateful import run_state_machine_as_test

from ..errors import InputError
from ..records import RunResult
from .machine import machine_class
from .strategies import Profile

#: examples per hypothesis run (a chunk: one seed); a process runs chunks until its time is up
CHUNK = 40
#: the most calls (rules) one example makes before its scenario runs (hypothesis's
#: stateful_step_count). Tried on #23347 (0.10.1.1, 2 seeds each, first failing example): 12
#: calls 54/64 s, 24 calls 41-66 s (bench, 3 seeds), 40 calls 125/35 s: 24 kept
STATEFUL_STEPS = 24


def parse_duration(text: str) -> float:
    """``120``, ``120s``, ``2m``, ``1h`` -> seconds. Raises InputError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m:
        raise InputError(f"--time {text!r}: give a duration like 60s, 2m or 1h")
    from ..limits import MAX_TIME_S

    if len(m.group(1)) > 20:
        raise InputError(f"--time: a number of {len(m.group(1)):,} characters; give a duration "
                         "like 60s, 2m or 1h")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if seconds <= 0:
        raise InputError(f"--time {text!r}: the search needs some time; give e.g. 60s")
    if seconds > MAX_TIME_S:
        raise InputError(f"--time {text.strip()!r}: at most {MAX_TIME_S / 3600:g}h (a week, the "
                         "lab's limit); give a shorter --time")
    return seconds


def signature(result: RunResult) -> str | None:
    """The failure signature of a run, or None for ``clean`` and ``error``.

    ``crash:AssertionError@vllm/v1/core/sched/scheduler.py:schedule``,
    ``violation:REQ_STATE``, ``stall:kv-load-in-flight`` (the stall's cause, :class:`~vllm_repro.
    records.Stall`: ``--target stall`` matches every stall, ``--target stall:kv-load`` the
    loads'), ``hang@vllm/...:schedule``; a violation whose record names its mechanism (two ways
    to one code: :attr:`~vllm_repro.records.Violation.mechanism`) carries it,
    ``violation:KV_PREFIX_MAP/fresh-block``, so that a search, its database and a campaign's
    table keep the two apart (``--target violation:KV_PREFIX_MAP`` still matches both).
    """
    outcome = result.outcome
    if outcome == "crash":
        c = result.crash
        return f"crash:{c.type}@{c.where.where() if c.where else '<no vLLM frame>'}"
    if outcome == "violation":
        vs = result.all_violations()
        if not vs:
            return "violation"
        return f"violation:{vs[0].label()}"
    if outcome == "stall":
        cause = result.stall.cause if result.stall is not None else None
        return f"stall:{cause}" if cause else "stall"
    if outcome == "hang":
        h = result.hang
        return f"hang@{h.where.where() if h is not None and h.where else '<no vLLM frame>'}"
    return None


def failure_message(result: RunResult) -> str:
    """The text ``--target-message`` is matched against: a crash's message, every
    violation's message (one a line), or a stall's (where each unfinished request is stuck:
    :class:`~vllm_repro.records.Stall`); empty for other outcomes."""
    if result.outcome == "crash" and result.crash is not None:
        return result.crash.message or ""
    if result.outcome == "stall" and result.stall is not None:
        return result.stall.message or ""
    if result.outcome == "violation":
        return "\n".join(v.message or "" for v in result.all_violations())
    return ""


def slug(sig: str) -> str:
    """A file-name form of a signature: ``crash-AssertionError-scheduler.schedule``."""
    kind, _, rest = sig.partition(":")
    if kind == "crash":
        exc, _, where = rest.partition("@")
        file, _, func = where.rpartition(":")
        mod = Path(file).stem
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"crash-{exc}-{mod}.{func}").strip("-")
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", sig.replace(":", "-")).strip("-")


def size(sc: dict) -> tuple:
    """How big a scenario is (for picking the smallest reproducer)."""
    return (len(sc["requests"]), len(sc.get("events", [])),
            sum(r["prompt_len"] + r["max_tokens"] for r in sc["requests"]))


class _Found(Exception):
    pass


class _ShrinkBound(BaseException):
    """Past ``--shrink-runs``: ends hypothesis's shrinker at once. A BaseException, because
    hypothesis takes any Exception as the test failing, and a candidate that merely passes
    (not run) lets the shrinker go on through every candidate of its passes: with the machine's
    examples of 24 calls that was up to two minutes after the bound, no scenario run."""


@dataclass
class Finding:
    """A shrunk failure: its signature, the minimal scenario dict and the run's result."""

    signature: str
    scenario: dict
    result: RunResult
    found_after_s: float  # seconds from the search process's start to the shrunk finding
    examples: int
    worker: int
    #: seconds from the search process's start to the first example with this signature
    #: (before shrinking); None where unknown
    first_failure_s: float | None = None
    #: how many examples had run when the first example with this signature failed
    first_failure_example: int | None = None


@dataclass
class SearchConfig:
    version: str
    profile: Profile
    seed: int
    time_s: float
    stop_on_first: bool = False
    target: str | None = None  # only count failures whose signature contains this
    audit: bool = True
    spec_forced: bool = False  # --spec: refused spec decode is an input error, not dropped
    #: the scenarios' level (``scheduler``, ``engine-core`` or ``v0-engine``); added after 0.1,
    #: default kept
    level: str = "scheduler"
    #: where the example database lives: None for ``<cache>/fuzz/examples``
    #: (:mod:`vllm_repro.fuzz.database`); ``use_database=False`` runs without memory
    database: str | None = None
    use_database: bool = True
    #: stop after this many examples drawn (None: only ``time_s`` bounds the search). A campaign
    #: bounds each task by examples so that the same (release, seed) finds the same thing on
    #: any machine, however loaded (:mod:`vllm_repro.campaign`); ``time_s`` stays a safety cap
    max_examples: int | None = None
    #: shrink each failure (hypothesis's ``shrink`` phase); a campaign may skip it
    #: (``campaign --no-shrink``: the failing example as drawn, at a fraction of the cost)
    shrink: bool = True
    #: a regular expression (``re.search``) a failure's message must match to count, as a
    #: scenario's ``expect.message`` is matched (:func:`failure_message`); None: any message.
    #: Two bugs may share ``exception@frame`` (#23215's empty grammar and #43920's tuple-style
    #: ``items`` both raise RuntimeError in ``backend_xgrammar.py:compile_grammar``); the
    #: message tells them apart, for the search and for the shrinker alike
    target_message: str | None = None
    #: the most scenario runs the shrinker makes for one finding (its candidates, each a whole
    #: scenario run in the worker), counted from the first failing example; after that the
    #: shrinker's best failing scenario so far is the finding and its remaining candidates
    #: are not run. None: hypothesis's own limits (a campaign's default, so its findings do
    #: not change). A count, not seconds, so the same seed shrinks to the same scenario
    #: however loaded the machine is
    shrink_runs: int | None = None

    def example_database(self):
        """The :class:`~vllm_repro.fuzz.database.FindingsDatabase` of this campaign's level,
        or None without one."""
        if not self.use_database:
            return None
        from .database import FindingsDatabase, default_path

        return FindingsDatabase(Path(self.database) if self.database else default_path(),
                                self.level)


#: Features a release may refuse (vLLM 0.6.x has no priorities in its V1 Request, 0.6.x/0.7.0 no
#: draft tokens and one sampled token per request; async scheduling and KV cache groups came
#: later), read from its capabilities record. The engine-core events and structured outputs
#: are preconditions of the machine's rules (:mod:`vllm_repro.fuzz.machine`), read from the
#: same record.
FUZZ_FEATURES = ("priority", "spec decode", "empty outputs", "async scheduling", "kv cache groups")


#: what a campaign at ``--level v0-engine`` does not draw: the V1-only lab fields the V0 level
#: refuses (spec decode, async scheduling, KV cache groups, empty outputs), EngineCore's own
#: calls (grammars, connectors, engine events) and priorities; it draws pools, batch limits,
#: chunked prefill, prefix caching, requests with shared prefixes, EOS and aborts between steps
V0_PROFILE = dict(policies=("fcfs",), spec_decode=False, empty_outputs=False,
                  async_scheduling=False, kv_cache_groups=False, structured_outputs=False,
                  engine_events=False, pool_override=False, kv_connectors=False)
V0_NOTE = ("fuzz at --level v0-engine draws pools, batch limits, prefix caching, shared "
           "prefixes, EOS and aborts between steps (fcfs); not priorities, spec decode, empty "
           "outputs, async scheduling, KV cache groups or EngineCore's own calls")


def refused_features(worker) -> dict[str, str]:
    """``{feature: the release's refusal}`` for the :data:`FUZZ_FEATURES` the release lacks,
    from the capabilities record the worker probed at start-up
    (:class:`~vllm_repro.engine.capabilities.Capabilities`; the same refusals ``vllm-repro
    run`` gives, exit 2), so that a campaign does not spend its time on scenarios the release
    cannot run."""
    caps = worker.capabilities
    out = {f: caps.refusal(f) for f in FUZZ_FEATURES if not caps.supports(f)}
    if not caps.supports("engine-core"):
        out["engine-core"] = caps.refusal("engine-core")
    return out


def fit_profile(profile: Profile, refused: dict[str, str], spec_forced: bool = False,
                level: str = "scheduler") -> Profile:
    """``profile`` without what the release refuses. Raises :class:`InputError` when what is left
    cannot be drawn (``--policy priority`` on a release without priorities, ``--spec`` on one
    without draft tokens, ``--level engine-core`` on a release whose EngineCore cannot run)."""
    if level == "engine-core" and "engine-core" in refused:
        raise InputError(f"--level engine-core: {refused['engine-core']}")
    if level == "v0-engine":
        if spec_forced:
            raise InputError("--spec: fuzz at --level v0-engine draws no speculative decoding "
                             "(the level does not drive it); drop --spec")
        if "priority" in profile.policies and len(profile.policies) == 1:
            raise InputError("--policy priority: fuzz at --level v0-engine draws fcfs only; "
                             "use --policy fcfs or leave it out")
        return replace(profile, **V0_PROFILE)
    if spec_forced and "spec decode" in refused:
        raise InputError(f"--spec: {refused['spec decode']}")
    if "priority" in refused:
        policies = tuple(p for p in profile.policies if p != "priority")
        if not policies:
            raise InputError(f"--policy priority: {refused['priority']}")
        profile = replace(profile, policies=policies)
    if "spec decode" in refused:
        profile = replace(profile, spec_decode=False)
    if "empty outputs" in refused:
        profile = replace(profile, empty_outputs=False)
    if "async scheduling" in refused:
        profile = replace(profile, async_scheduling=False)
    if "kv cache groups" in refused:
        profile = replace(profile, kv_cache_groups=False)
    return profile


def _without_local_constants() -> None:
    """Make hypothesis's draws a function of the seed alone. Hypothesis (6.13x on) mixes
    "local constants" into its draws: the literals of every module of the project's own code
    loaded in the process (``hypothesis.internal.conjecture.providers._get_local_constants``,
    which scans ``sys.modules``; the lab is such code when installed editable). A search
    process then draws differently depending on which of the lab's modules it happened to
    import (a ``vllm-repro campaign`` task in a local process drew other examples than the same
    task on a Ray worker: found at example 8 there, 15 here) and on any edit to them. The pool
    of local constants is replaced by an empty one; hypothesis's global constants stay. A
    hypothesis without that function is left alone."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - another hypothesis layout
        return
    if not hasattr(providers, "_get_local_constants") or not hasattr(providers, "Constants"):
        return
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if cache is not None and hasattr(cache, "clear"):
        cache.clear()  # pools computed before, with local constants in them


def _chunk_seed(base: int, worker: int, chunk: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{base}:{worker}:{chunk}".encode()).digest()[:8], "big")


def _outcome_kind(result: RunResult) -> str:
    """The outcome a campaign counts: ``refused`` for a scenario the release refused as input
    (``error`` of kind ``input``: its config validation, a feature it lacks) or at start-up
    (a ValueError from ``EngineCore``'s start-up checks, phase ``engine-build``: what ``vllm
    serve`` says before it serves anything), or a request at the front door (a ValueError of
    phase ``add_request``: V0's ``LLMEngine._validate_model_inputs`` refusing a prompt over
    ``max_model_len`` from 0.8.4 on, what a server answers with an error while the engine lives
    on); else the run's outcome. No kind of refusal is a lab error or a finding."""
    oc = result.outcome
    if oc == "error" and result.error is not None and result.error.kind == "input":
        return "refused"
    if oc == "crash" and result.crash.phase in ("engine-build", "add_request") \
            and result.crash.type == "ValueError":
        return "refused"
    return oc


def _settings(cfg: SearchConfig, first_chunk: bool, database, examples: int = CHUNK) -> settings:
    """The hypothesis settings of one chunk. Health checks are all on; only ``deadline`` is
    off, because an example's time is one scenario run in the release's worker (0.05 s to
    several seconds, with the engine-core level's start-up), which is the work, not a sign of
    a slow test. Examples stored in the database are replayed (phase ``reuse``) in a search
    process's first chunk only: later chunks would replay the same ones again."""
    phases = (Phase.reuse, Phase.generate, Phase.shrink) if first_chunk else (Phase.generate,
                                                                               Phase.shrink)
    if not cfg.shrink:
        phases = tuple(p for p in phases if p is not Phase.shrink)
    return settings(max_examples=examples, database=database, deadline=None, derandomize=False,
                    phases=phases, report_multiple_bugs=False, print_blob=False,
                    verbosity=Verbosity.quiet, stateful_step_count=STATEFUL_STEPS)


def search_process(index: int, cfg: SearchConfig, env_dict: dict, out: mp.Queue, log_dir: str) -> None:
    """Body of one search process: posts ``("progress", ...)``, ``("finding", ...)``,
    ``("error", ...)``, ``("note", ...)`` and finally ``("done", index)`` messages on ``out``.
    A SIGTERM (the campaign's ``terminate()``) or SIGINT takes its worker down with it."""
    from .. import procs as lab_procs
    from ..sources.env import ReleaseEnv

    lab_procs.exit_on_signal()
    env = ReleaseEnv(env_dict["version"], Path(env_dict["tree"]), Path(env_dict["root"]))
    try:
        search(index, cfg, env, Path(log_dir) / f"fuzz-{cfg.version}-{index}.log",
               lambda kind, payload: out.put((kind, index, payload)))
    finally:
        out.put(("done", index, None))


def search(index: int, cfg: SearchConfig, env, log: Path, emit, worker=None) -> dict:
    """One search: its own engine worker of ``env`` (worker log ``log``), chunks of hypothesis's
    state machine until ``cfg.time_s`` seconds of search have passed or, with
    ``cfg.max_examples``, that many examples were drawn (``examples`` in the counts: those
    run; a scenario the search already ran without failing is not run again).
    ``emit(kind, payload)`` receives
    ``progress`` (the counts), ``finding`` (a :class:`Finding`), ``error`` (a lab error's
    message, the first three), ``note``, ``input`` (an :class:`InputError`'s message) and
    ``fatal`` (anything else that stopped the search); nothing is raised. Returns the final
    counts ``{"examples", "errors", "by_outcome", "bound", "others"}`` (``bound``: ``examples``
    or ``time``, whichever ended the search; None when it did not start; ``others``: signature
    -> runs, the failures seen while the search was shrinking another one, never shrunk
    themselves unless a later chunk found them again). ``worker``: an engine
    worker of ``env`` already started (left running), instead of starting one here.

    Each chunk of :data:`CHUNK` examples is one run of :func:`machine.machine_class`'s state
    machine (seeded from the campaign seed, the process index and the chunk number); every
    example's scenario runs once in the worker (``check``) and fails the example when its
    signature is the process's target. Used by ``vllm-repro fuzz``'s search processes
    (:func:`search_process`) and by a campaign's tasks (:mod:`vllm_repro.campaign.task`)."""
    from ..engine.host import WorkerHandle
    from ..scenario import parse_scenario

    _without_local_constants()
    t0 = time.perf_counter()
    stats = {"examples": 0, "errors": 0, "by_outcome": {}, "bound": None, "others": {}}
    try:
        database = cfg.example_database()
        with nullcontext(worker) if worker is not None else WorkerHandle(env, log) as worker:
            refused = refused_features(worker)
            profile = fit_profile(cfg.profile, refused, spec_forced=cfg.spec_forced,
                                  level=cfg.level)
            lacks = [f for f in refused if f != "engine-core"]
            if cfg.level == "v0-engine":
                lacks = []
                if index == 0:
                    emit("note", V0_NOTE)
            if lacks and index == 0:
                emit("note", "vLLM {} refuses {}: fuzz draws without {}".format(
                    cfg.version, ", ".join(lacks), "them" if len(lacks) > 1 else "it"))
            if database is not None and index == 0:
                n = database.stored()
                if n:
                    emit("note", f"replaying {n} stored failure(s) from {database.path} first")
            # a crash or stall target (any but a violation) is judged on the run's end, as the catalog judges an
            # expected crash or stall (verdict.audit_keeps_going): the audit collects its
            # findings and lets the run go on. Stopped at its first violation, a run never
            # reaches a crash the same bug causes later (#46066: REQ_STATE at the first
            # reset_prefix_cache, vLLM's own assert two resets later)
            keep_going = bool(cfg.target) and not cfg.target.startswith("violation")
            deadline = time.perf_counter() + cfg.time_s  # search time: from vLLM imported
            seen: set[str] = set()
            # digests of the scenarios this search ran that did not fail with its target: an
            # example that builds one of them again is not run again (it passes). The machine
            # maps many of hypothesis's choice sequences to one scenario (the calls past an
            # example's count change nothing, lengths are clamped to what the config admits,
            # and each chunk begins with hypothesis's simplest examples), so a third of the
            # examples drawn at engine-core level were scenarios the search had already run
            passed: set[bytes] = set()
            # examples drawn (run, or skipped as a scenario already run): what bounds an
            # example-bounded search, as every drawn example ran before the skip existed (the
            # same --examples searches the same draws; counting runs alone, a search whose
            # chunks began with an already-run example never reached its bound)
            drawn = {"n": 0}
            chunk = 0
            while True:
                if cfg.max_examples is not None and drawn["n"] >= cfg.max_examples:
                    stats["bound"] = "examples"
                    break
                if time.perf_counter() >= deadline:
                    stats["bound"] = "time"
                    break
                state: dict = {"target": None, "last": None}

                def check(sc: dict) -> None:
                    if state["target"] is None and time.perf_counter() >= deadline:  # noqa: B023
                        # --time is up and nothing is being shrunk: the chunk's other examples
                        # are drawn but not run (milliseconds each), so the search ends with
                        # the chunk, not 40 runs later (a --time 1s search ran 58 s). Not an
                        # exception: hypothesis would take it for a failure and store it
                        return
                    if (cfg.shrink_runs is not None and state["target"] is not None  # noqa: B023
                            and stats["examples"] - state["first_example"]  # noqa: B023
                            >= cfg.shrink_runs):
                        # past the shrink bound: no candidate is run, the shrinker stops here
                        # and the last failing scenario (its best so far) is the finding; the
                        # example database already holds it (hypothesis saves each smaller
                        # failing example as it finds it)
                        raise _ShrinkBound
                    drawn["n"] += 1  # noqa: B023
                    digest = hashlib.sha256(json.dumps(sc, sort_keys=True).encode()).digest()
                    if digest in passed:
                        return
                    payload = parse_scenario(sc, "<fuzz>").child_payload()  # defaults filled in
                    result = worker.run(payload, None, audit=cfg.audit, keep_going=keep_going)
                    stats["examples"] += 1
                    oc = _outcome_kind(result)
                    stats["by_outcome"][oc] = stats["by_outcome"].get(oc, 0) + 1
                    if oc == "error":
                        stats["errors"] += 1
                        if stats["errors"] <= 3:
                            emit("error", result.error.message if result.error else "")
                    if stats["examples"] % 20 == 0:
                        emit("progress", dict(stats))
                    sig = signature(result) if oc != "refused" else None
                    if sig is None or sig in seen:
                        passed.add(digest)
                        return
                    if cfg.target and cfg.target not in sig:
                        passed.add(digest)
                        return
                    if cfg.target_message and not re.search(cfg.target_message,
                                                            failure_message(result)):
                        passed.add(digest)
                        return
                    # check is called within this iteration (by the machine's teardown), never
                    # later: the loop's `state` is the one it means
                    if state["target"] is None:  # noqa: B023
                        state["target"] = sig  # noqa: B023
                        state["first_s"] = round(time.perf_counter() - t0, 2)  # noqa: B023
                        state["first_example"] = stats["examples"]  # noqa: B023
                    if sig == state["target"]:  # noqa: B023
                        state["last"] = (sc, result)  # noqa: B023
                        raise _Found(sig)
                    # another failure while shrinking this one: not followed now, but said
                    stats["others"][sig] = stats["others"].get(sig, 0) + 1

                machine = seed(_chunk_seed(cfg.seed, index, chunk))(
                    machine_class(profile, cfg.level, worker.capabilities, check, cfg.version))
                first = chunk == 0
                chunk += 1
                budget = CHUNK  # the last chunk of an example-bounded search: what is left
                if cfg.max_examples is not None:
                    budget = max(1, min(CHUNK, cfg.max_examples - drawn["n"]))
                try:
                    run_state_machine_as_test(machine, settings=_settings(cfg, first, database, budget))
                except (Exception, _ShrinkBound):
                    # _Found, or hypothesis's FlakyFailure around it when the shrunk example
                    # failed once and not on its final replay (engine-core threads): the last
                    # failing scenario (the shrinker's best) is kept either way
                    if state["last"] is None:
                        raise
                    sc, result = state["last"]
                    seen.add(state["target"])
                    emit("finding", Finding(state["target"], sc, result,
                                            round(time.perf_counter() - t0, 2),
                                            stats["examples"], index, state.get("first_s"),
                                            state.get("first_example")))
                    if cfg.stop_on_first:
                        break
            emit("progress", dict(stats))
    except InputError as exc:  # reported to the caller, which exits 2
        emit("input", str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the caller, which exits 3
        emit("fatal", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
    return stats


@dataclass
class Campaign:
    """What a campaign found: findings by signature (smallest kept), counts, errors."""

    findings: dict[str, Finding] = field(default_factory=dict)
    examples: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    fatal: list[str] = field(default_factory=list)
    input_errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    #: signature -> runs: failures seen while shrinking another (``search``'s ``others``)
    others: dict[str, int] = field(default_factory=dict)

    def unshrunk(self) -> str | None:
        """The line for the failures seen but not shrunk (none of them a finding): ``also
        failed, not shrunk: crash:AssertionError@scheduler.py:schedule (2 runs), stall (1 run);
        run again with --target SIGNATURE to search for one``; None when there are none."""
        left = {s: n for s, n in self.others.items() if s not in self.findings}
        if not left:
            return None
        listed = ", ".join(f"{s} ({n} run{'s' if n > 1 else ''})" for s, n in sorted(left.items()))
        return (f"also failed, not shrunk (seen while shrinking another finding): {listed}; run "
                "again with --target SIGNATURE to search for one")


def run_campaign(cfg: SearchConfig, env, workers: int, log_dir: Path, on_update=None) -> Campaign:
    """Run ``workers`` search processes for ``cfg.time_s`` seconds (plus shrinking time) and
    collect their findings. ``on_update(campaign)`` is called as messages arrive."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    env_dict = {"version": env.version, "tree": str(env.tree), "root": str(env.root)}
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = [ctx.Process(target=search_process, args=(i, cfg, env_dict, q, str(log_dir)), daemon=True)
             for i in range(workers)]
    t0 = time.perf_counter()
    from .. import procs as lab_procs

    started = []
    for p in procs:  # (a signal, or the search's time, ends the starting too)
        if lab_procs.aborting() or time.perf_counter() - t0 > cfg.time_s:
            break
        p.start()
        started.append(p)
    procs = started
    camp = Campaign()
    per_worker: dict[int, dict] = {}
    waiting = set(range(len(procs)))
    while waiting:
        try:
            kind, idx, payload = q.get(timeout=1.0)
        except queue_mod.Empty:
            waiting = {i for i in waiting if procs[i].is_alive()}
            camp.elapsed_s = time.perf_counter() - t0
            if on_update:
                on_update(camp)
            continue
        if kind == "progress":
            per_worker[idx] = payload
        elif kind == "finding":
            old = camp.findings.get(payload.signature)
            if old is None or size(payload.scenario) < size(old.scenario):
                camp.findings[payload.signature] = payload
            if cfg.stop_on_first:
                for i in list(waiting):
                    if i != idx:
                        procs[i].terminate()
                        waiting.discard(i)
        elif kind == "error":
            camp.errors.append(payload)
        elif kind == "fatal":
            camp.fatal.append(payload)
        elif kind == "input":
            camp.input_errors.append(payload)
        elif kind == "note":
            camp.notes.append(payload)
        elif kind == "done":
            waiting.discard(idx)
        camp.examples = sum(st["examples"] for st in per_worker.values())
        camp.by_outcome, camp.others = {}, {}
        for st in per_worker.values():
            for k, v in st["by_outcome"].items():
                camp.by_outcome[k] = camp.by_outcome.get(k, 0) + v
            for k, v in st.get("others", {}).items():
                camp.others[k] = camp.others.get(k, 0) + v
        camp.elapsed_s = time.perf_counter() - t0
        if on_update:
            on_update(camp)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    camp.elapsed_s = time.perf_counter() - t0
    return camp


def write_finding(finding: Finding, version: str, out_dir: Path) -> tuple[Path, Path]:
    """Write ``<out_dir>/<slug>.yaml`` (catalog-ready, ``reproduces_on`` set, ``expect`` what
    re-matches the finding's signature: a crash's exception and frame, a violation's code and
    its mechanism where it has one) and a pytest regression file beside it; returns both
    paths."""
    import yaml

    from ..scenario import parse_scenario

    name = slug(finding.signature)
    sc = json.loads(json.dumps(finding.scenario))
    sc["name"] = f"found-{name}"[:120]
    res = finding.result
    expect: dict = {"outcome": res.outcome}
    if res.outcome == "crash":
        expect["exception"] = res.crash.type
        if res.crash.where:
            expect["where"] = res.crash.where.where()
    elif res.outcome == "violation":
        expect["code"] = res.violations[0].code
        if res.violations[0].mechanism:  # the signature's /mechanism: the same way to the code
            expect["mechanism"] = res.violations[0].mechanism
    sc["expect"] = expect
    sc["vllm"] = {"reproduces_on": [version]}
    level = sc.get("level", "scheduler")
    sc["description"] = (f"Found by `vllm-repro fuzz --vllm {version} --level {level}` and "
                         "shrunk by hypothesis "
                         f"(signature {finding.signature}). Observed: "
                         + (f"{res.crash.type}: {res.crash.message}" if res.outcome == "crash"
                            else res.violations[0].message if res.violations
                            else f"stall: {res.stall.message}" if res.stall is not None
                            and res.stall.message else res.outcome))
    parse_scenario(sc, "<found>")  # it must load
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.yaml"
    path.write_text(f"# found by vllm-repro fuzz: {finding.signature}\n"
                    + yaml.safe_dump(sc, sort_keys=False, width=100))
    test = out_dir / f"test_{name.replace('-', '_').replace('.', '_')}.py"
    test.write_text(f'''"""Regression test for a failure found by `vllm-repro fuzz` ({finding.signature})."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIO = Path(__file__).with_name("{path.name}")


@pytest.mark.slow
def test_reproduces(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vllm_repro.cli", "run", str(SCENARIO), "--json",
                           "--reports", str(tmp_path)], capture_output=True, text=True)
    verdicts = json.loads(proc.stdout)
    assert verdicts and all(v["ok"] for v in verdicts), proc.stdout + proc.stderr
''')
    return path, test
