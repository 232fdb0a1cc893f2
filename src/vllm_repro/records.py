"""The lab's typed records: what a run observed (``result.json``), one step of it (a line of
``trace.jsonl``), and the parts they are made of.

Standard library only: the engine worker builds these inside a release environment, where
neither pydantic nor the lab's host dependencies exist. Every record is a dataclass with
``to_dict()`` and ``from_dict()``; a field whose value is ``None`` is left out of the JSON
(absent and null read the same), so ``result.json`` keeps only what the run had. The schema,
field by field, is ``docs/records.md``; :func:`schema` prints it.

Who writes what:

- the worker (:mod:`vllm_repro.engine.worker`) writes ``trace.jsonl`` only, a :class:`TraceLine`
  a line as the step loop emits them, and sends its :class:`RunResult` over the pipe;
- the host writes ``result.json`` once, through :class:`ReportDir`, after the verdict is known.

Layout of a report (``ReportDir``): ``<reports>/<scenario>/<release>/{result.json,
trace.jsonl, timeline.png, engine.log, scenario.yaml, index.html}`` (the last two:
:mod:`vllm_repro.report.pages`), staged in ``.<release>.partial-<pid>`` until whole; the
workers' whole logs under ``<reports>/_engine/``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

#: the outcomes of a run (``RunResult.outcome``); ``incomplete``: ``limits.max_steps`` reached
#: with requests unfinished and nothing else wrong (never clean); ``hang``: a step (or start-up)
#: did not return within the watchdog's time (``RunResult.hang``); ``refused``: vLLM refused the
#: scenario's configuration or a request, where the scenario expects that (``RunResult.refusal``;
#: on a release where the scenario expects a run, a refusal stays an input ``error``)
OUTCOMES = ("clean", "crash", "violation", "stall", "incomplete", "hang", "refused", "error")


class RecordError(ValueError):
    """A record's JSON does not have the record's shape (a field of the wrong type, a missing
    required field). The message names the record and the field."""


def _is_record(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Record)


class Record:
    """Base of every record: JSON in and out by the dataclass fields.

    Nested records are found from the field annotations (``Frame``, ``list[Frame]``,
    ``Crash | None``); anything else (str, int, dict of plain values) passes as it is.
    Unknown keys are kept in ``extra`` where the record has that field, else refused.
    """

    _hints: ClassVar[dict[str, Any] | None] = None

    @classmethod
    def _types(cls) -> dict[str, Any]:
        if cls.__dict__.get("_hints") is None:
            cls._hints = typing.get_type_hints(cls)
        return cls._hints

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready data, ``None`` fields left out."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = _dump(value)
        extra = getattr(self, "extra", None)
        if extra:
            out.update(extra)
        return out

    @classmethod
    def from_dict(cls, data: Any):
        """The record from :meth:`to_dict`'s shape. Raises :class:`RecordError`."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise RecordError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
        types = cls._types()
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if key not in names or key == "extra":
                extra[key] = value
                continue
            kwargs[key] = _load(types[key], value, f"{cls.__name__}.{key}")
        if extra:
            if "extra" not in names:
                raise RecordError(f"{cls.__name__}: unknown field(s) {', '.join(sorted(extra))}")
            kwargs["extra"] = extra
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise RecordError(f"{cls.__name__}: {exc}") from None

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    @classmethod
    def from_json(cls, text: str):
        """Raises :class:`RecordError` (also for text that is not JSON)."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise RecordError(f"{cls.__name__}: not JSON: {exc}") from None
        return cls.from_dict(data)


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


def _load(tp: Any, value: Any, where: str) -> Any:
    """``value`` as the annotated type ``tp`` (records built, lists of records mapped)."""
    if value is None:
        return None
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        recs = [a for a in inner if _is_record(a) or typing.get_origin(a) in (list, dict)]
        return _load(recs[0], value, where) if recs else value
    if _is_record(tp):
        return tp.from_dict(value)
    if origin is list and args and _is_record(args[0]):
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
        return [args[0].from_dict(v) for v in value]
    if origin is dict and len(args) == 2 and _is_record(args[1]):
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected a mapping, got {type(value).__name__}")
        return {k: args[1].from_dict(v) for k, v in value.items()}
    return value


# ---- the parts -------------------------------------------------------------------------------
@dataclass
class Frame(Record):
    """One traceback frame inside the vLLM package: ``file`` as ``vllm/v1/...py`` (relative to
    the package's parent), ``function``, ``line`` (1-based)."""

    file: str
    function: str
    line: int | None = None

    def where(self) -> str:
        """``vllm/v1/core/sched/scheduler.py:schedule``, the form ``expect.where`` takes."""
        return f"{self.file}:{self.function}"


@dataclass
class CrashContext(Record):
    """What the innermost vLLM frame held when it raised (``engine/explain.py``), bounded:
    ``statement`` the full text of the statement that raised (``file``:``line`` of
    :attr:`Crash.where`), ``locals`` its local variables (name -> ``repr`` cut to 200
    characters, at most 40 of them), ``operands`` for a failed ``assert``: each operand of its
    test evaluated again in that frame, as pytest's assertion rewriting shows them (``len(self.
    running)`` -> ``1``; at most 12), ``operand_error`` why they could not be evaluated."""

    statement: str | None = None
    locals: dict[str, str] | None = None
    operands: dict[str, str] | None = None
    operand_error: str | None = None


@dataclass
class Hang(Record):
    """A step (or start-up, ``step`` 0) that had not returned after ``limit_s`` seconds (the
    watchdog: ``engine/watchdog.py``, ``VLLM_REPRO_STEP_TIMEOUT_S`` or the scenario's
    ``limits.step_timeout_s``): ``phase`` (the vLLM call: ``engine-build``, ``schedule``,
    ``step``...), ``where`` the innermost vLLM frame the run's thread sat in when the time ran
    out (``None``: none of its frames was vLLM's), ``vllm_frames`` (its last 8 vLLM frames,
    outermost first), ``stacks`` the Python stacks of every thread of the worker as
    ``faulthandler`` dumps them (the last 20,000 characters), ``stopped``: how the run ended
    (``interrupted``: the step was interrupted with an exception and the worker lived on;
    ``exited``: the step never let go, the worker sent this and exited)."""

    step: int
    limit_s: float
    phase: str | None = None
    where: Frame | None = None
    vllm_frames: list[Frame] | None = None
    stacks: str | None = None
    stopped: str | None = None


@dataclass
class Crash(Record):
    """vLLM raised: the exception's ``type`` name and first ``message`` line, ``where`` (the
    innermost vLLM frame, ``None`` when no frame is vLLM's), ``vllm_frames`` (the last 8 vLLM
    frames, outermost first), ``step`` (0: ``EngineCore`` start-up) and ``phase`` (the vLLM call:
    ``schedule``, ``update_from_output``, ``engine-build``...), ``traceback`` (its last 6,000
    characters). Mirrors what ``vllm/v1/engine/core.py:run_engine_core`` logs."""

    type: str
    message: str = ""
    where: Frame | None = None
    vllm_frames: list[Frame] | None = None
    step: int | None = None
    phase: str | None = None
    traceback: str | None = None
    #: why, where the lab could see it (:class:`CrashContext`): the innermost vLLM frame's
    #: statement, locals and, for a failed ``assert``, its operands' values
    context: "CrashContext | None" = None

    def brief(self) -> "Crash":
        """The trace line's copy: type, message, where and phase."""
        return Crash(self.type, self.message, self.where, phase=self.phase)

    @classmethod
    def front_door(cls, request_id: str, text: str) -> "Crash":
        """The release's front-door refusal of one request (``RunResult.refused``: request id
        -> ``"Type: message"``) as a refusal record, phase ``add_request``; a text with no
        exception type before its ``": "`` is typed ``Refused``."""
        kind, sep, rest = text.partition(": ")
        if not sep or not re.fullmatch(r"[A-Za-z_][\w.]*", kind):
            kind, rest = "Refused", text
        return cls(kind, f"{request_id}: {rest}", phase="add_request")


@dataclass
class Stall(Record):
    """No progress for ``stall_steps`` steps: the ``step`` it was called at, ``since`` (the first
    step without progress), the ``unfinished`` request ids, the ``waiting`` / ``running`` queues
    (request ids) and ``free_blocks`` (KV blocks) at that step; ``message``: where each
    unfinished request is stuck, one clause per request separated by ``; ``
    (:func:`vllm_repro.engine.state.stall_clauses`: its queue, the KV blocks it needs to finish
    when that is more than the pool can give, a KV load in flight or never promoted, the blocks
    it waits for and who holds them, a 0-token step, its output placeholders); what a
    scenario's ``expect.message`` is matched against for ``outcome: stall`` ("" from older
    labs); ``cause`` the most specific of those as a tag."""

    step: int
    since: int
    unfinished: list[str] = field(default_factory=list)
    waiting: list[str] | None = None
    running: list[str] | None = None
    free_blocks: int | None = None
    message: str = ""
    #: what holds it, as a tag (``engine/state.py:STALL_CAUSES``: ``kv-load-in-flight``,
    #: ``no-free-blocks``, ``zero-tokens``, ...); the fuzz signature's ``stall:CAUSE``
    cause: str | None = None


#: the mechanism tags the audit gives, by violation code (:attr:`Violation.mechanism`): what a
#: scenario's ``expect.mechanism`` may name
MECHANISMS: dict[str, tuple[str, ...]] = {
    "KV_PREFIX_MAP": ("fresh-block", "uncomputed-hit"),
    "REQ_RESIDUE": ("finished", "aborted", "ignored"),
}


def violation_label(code: str, mechanism: str | None = None) -> str:
    """A violation code with its mechanism where it has one: ``KV_PREFIX_MAP/fresh-block``,
    ``KV_LEAK`` (the fuzz signature's form, ``violation:LABEL``; the verdict table's)."""
    return f"{code}/{mechanism}" if mechanism else code


@dataclass
class Violation(Record):
    """One broken invariant (codes: :mod:`vllm_repro.audit.codes`, docs/audit.md).

    ``message`` says what was expected and what was found; ``requests`` are request ids,
    ``blocks`` KV block ids; ``step`` the engine step, ``phase`` the vLLM call it was found in or
    after (``after schedule``, ``in free_blocks``...), ``stack`` the caller's stack for one caught
    inside a call (block-pool hooks); ``repeats`` and ``last_step`` count later findings of the
    same violation (same code, requests and blocks); ``mechanism``, where the audit tells two
    ways to the same code apart, a short tag of the way (V0 ``KV_PREFIX_MAP``: ``fresh-block``
    or ``uncomputed-hit``; ``REQ_RESIDUE``: ``finished``, ``aborted`` or ``ignored``:
    :data:`MECHANISMS`), part of the fuzzer's failure signature
    (``violation:KV_PREFIX_MAP/fresh-block``), of the verdict table's ``observed`` text
    (``KV_PREFIX_MAP/fresh-block @12``) and matched by a scenario's ``expect.mechanism``."""

    code: str
    message: str = ""
    step: int | None = None
    phase: str | None = None
    requests: list[str] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    stack: list[str] | None = None
    repeats: int | None = None
    last_step: int | None = None
    mechanism: str | None = None

    def brief(self) -> "Violation":
        """The trace line's copy: code, phase, message, requests, blocks and mechanism."""
        return Violation(self.code, self.message, None, self.phase, list(self.requests),
                         list(self.blocks), mechanism=self.mechanism)

    def label(self) -> str:
        """:func:`violation_label` of this violation."""
        return violation_label(self.code, self.mechanism)

    def at(self) -> str:
        """``KV_LEAK @9``, ``REQ_RESIDUE/finished @6``: :meth:`label` and step."""
        return f"{self.label()} @{self.step}"


@dataclass
class RunError(Record):
    """The run did not happen as a run of vLLM: ``kind`` ``input`` (the scenario, or the release
    refusing its configuration: exit 2), ``lab`` (a bug or failure of the lab: exit 3) or ``env``
    (the release's environment could not be made or started: exit 3); ``message`` one line;
    ``traceback`` the lab's own, for ``lab``; ``lacks_level``, for ``input``: the scenario's
    ``level`` when the release has no engine of that level at all (``v0-engine`` on 0.33.0:
    the engine's ``LevelMissing``), which ``catalog run --also-on`` and ``matrix`` read as a
    release the scenario says nothing about, not as a refused run."""

    kind: str
    message: str
    traceback: str | None = None
    lacks_level: str | None = None


@dataclass
class Timing(Record):
    """Seconds: ``build_s`` (configs, scheduler or EngineCore), ``run_s`` and ``run_cpu_s`` (the
    step loop, wall and CPU), ``steps_per_s`` (of the loop alone)."""

    build_s: float | None = None
    run_s: float | None = None
    run_cpu_s: float | None = None
    steps_per_s: float | None = None


@dataclass
class AuditSummary(Record):
    """The ``audit`` section: ``keep_going`` (collect every violation), ``stopped`` (``{step,
    code, phase}`` where the audit stopped the run, else ``None``: the one field written even
    when ``None``, to say so), ``checks`` (how many),
    ``by_code`` (code -> distinct violations), ``distinct``, ``dropped`` (over the record cap),
    ``hooks`` (block-pool methods hooked), ``hook_calls`` (method -> calls) and ``unread`` (books
    the audit could not read on this release, e.g. ``EmbeddingModelBlockSpaceManager`` at level
    v0-engine: a clean run says so in its verdict) and ``off`` (the checks that did not run
    because the release lacks a book they read, one line each naming the attribute and the
    checks: ``Capabilities.audit_off``; a clean run's verdict then reads ``clean (audit
    partial: KV hash checks off; ...)``)."""

    keep_going: bool = False
    stopped: dict | None = None
    checks: int = 0
    by_code: dict[str, int] = field(default_factory=dict)
    distinct: int = 0
    dropped: int = 0
    hooks: list[str] = field(default_factory=list)
    hook_calls: dict[str, int] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)
    off: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.setdefault("stopped", None)  # "the audit did not stop the run", said explicitly
        for k in ("unread", "off"):
            if not d.get(k):
                d.pop(k, None)  # nothing unread / off: left out, as absent reads the same
        return d


@dataclass
class EngineInfo(Record):
    """``level: engine-core``: what vLLM's ``EngineCore`` built: ``num_gpu_blocks`` (its KV
    sizing), ``batch_queue_size``, ``step_fn`` (``step`` or ``step_with_batch_queue``) and the
    ``scheduler`` class name (``Scheduler``, ``AsyncScheduler``); with rank processes
    (``distributed_executor_backend: mp``) the ``topology`` (``TP=2 PP=1 DP=1 (mp)``) and the
    ``executor`` class vLLM ran (``MultiprocExecutor``); with ``multiprocess_mode``
    (``engine/core_proc.py``) the engine core's ``process`` class (``EngineCoreProc``), the
    ``client`` that started it (``SyncMPClient``) and ``client_error``, what the client raised
    (``EngineDeadError: EngineCore encountered an issue. ...``); with ``data_parallel_size`` > 1
    ``engine_cores``, how many engine core processes sent a result (one per DP rank), and
    ``coordinator``, whether the release's DP coordinator process ran; with
    ``config.reasoning_parser`` the class of vLLM's reasoning parser its
    ``StructuredOutputManager`` built from the config (``reasoning_parser``:
    ``DeepSeekR1ReasoningParser``; its ``reasoner_cls``, or the ``reasoner`` it holds on 0.9
    to 0.11)."""

    num_gpu_blocks: int | None = None
    batch_queue_size: int | None = None
    step_fn: str | None = None
    scheduler: str | None = None
    topology: str | None = None
    executor: str | None = None
    process: str | None = None
    client: str | None = None
    client_error: str | None = None
    engine_cores: int | None = None
    coordinator: bool | None = None
    reasoning_parser: str | None = None


# ---- a run -----------------------------------------------------------------------------------
@dataclass
class RunResult(Record):
    """What one run of a scenario on one release observed: ``result.json``.

    ``outcome`` is one of ``clean``, ``crash``, ``violation``, ``stall``, ``incomplete``,
    ``hang``, ``refused`` or ``error`` (:data:`OUTCOMES`); its evidence is in ``crash``,
    ``violations``, ``stall``, ``hang``, ``refusal`` or ``error``. ``refusal`` (a
    :class:`Crash` record: vLLM's exception, its innermost vLLM frame, ``phase`` ``config``,
    ``engine-build`` or ``add_request``) is kept with an input ``error`` too, where vLLM's own
    code refused the scenario: the verdict turns such a run into ``refused`` where the scenario
    expects a refusal. ``steps`` engine steps ran; ``finished`` maps request id -> vLLM's
    finish status (``FINISHED_STOPPED``...; at ``level: v0-engine`` the finish reason of its
    ``RequestOutput``, ``stop`` / ``length`` / ``abort``, and ``FINISHED_IGNORED`` for a request
    the V0 scheduler ignored, whose reason vLLM gives as ``length``), ``refused`` maps the requests the release's front
    door refused (never added) -> its error, ``unfinished`` lists the rest; ``limit_reached``:
    the run stopped at ``limits.max_steps`` with requests unfinished (outcome ``incomplete``
    when nothing else went wrong: a run that did not finish is not clean). ``level`` is
    ``scheduler``, ``engine-core`` or ``v0-engine``; ``vllm`` the release; ``python`` the worker's interpreter;
    ``platform`` the platform vLLM saw (``cuda 9.0 (emulated NonNvmlCudaPlatform)``, ``cpu
    (vLLM's CpuPlatform)``: ``engine/adapter/platform.py``); ``substitutions`` what the run has
    in place of the release's own: the release's pinned requirements its environment has as
    another version, because the index no longer has the pinned one (``xgrammar==0.1.16 ->
    xgrammar==0.1.17 ...``; ``sources/env.py``), and vLLM's sources taken from a wheel where the
    index has no sdist (``vllm sources from vllm-0.15.1-...whl ...``; ``sources/sdist.py``);
    ``tree_changes`` how the release's tree differs from what was extracted from its sdist
    (``edited vllm/v1/core/sched/scheduler.py``, ``added ...``, ``removed ...``;
    ``sources/manifest.py``): a run on an edited tree is an observation of the edit.
    ``tree`` which tree ran: ``full`` (the sdist's), ``slice`` (a committed slice proven
    equivalent to it: docs/slices.md) or ``installed`` (an installed vLLM); ``warm`` whether
    the worker was forked by a warm parent (docs/warm-runs.md) rather than started cold.
    ``worker_state`` which worker-side request state the fake worker drove (docs/levels.md):
    the release's ``InputBatch (...)``, its V2 runner's ``RequestState + BlockTables (...)``,
    or the lab's ``PersistentBatch (...)``; None where no fake runner ran (``v0-engine``).
    ``planted`` (tests only) names a fault planted into vLLM; ``faults`` the rank faults that
    fired (``events[].fault``, multi-process ranks); ``engine_log`` the worker's log;
    ``verdict`` the host's verdict (``vllm_repro.verdict.Verdict.as_dict``), added when the
    report is written.
    """

    outcome: str
    scenario: str | None = None
    vllm: str | None = None
    level: str | None = None
    python: str | None = None
    platform: str | None = None
    substitutions: list[str] | None = None
    tree_changes: list[str] | None = None
    tree: str | None = None
    warm: bool | None = None
    worker_state: str | None = None
    crash: Crash | None = None
    stall: Stall | None = None
    hang: Hang | None = None
    refusal: Crash | None = None
    violations: list[Violation] | None = None
    audit: AuditSummary | None = None
    error: RunError | None = None
    steps: int | None = None
    finished: dict[str, str] | None = None
    refused: dict[str, str] | None = None
    unfinished: list[str] | None = None
    limit_reached: bool | None = None
    timing: Timing | None = None
    engine: EngineInfo | None = None
    planted: dict | None = None
    #: the rank faults that fired (``events[].fault``): ``{rank, kind, seconds | exit_code,
    #: execute_model}`` each, in firing order
    faults: list[dict] | None = None
    engine_log: str | None = None
    verdict: dict | None = None

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise RecordError(f"RunResult.outcome: {self.outcome!r} is not one of {', '.join(OUTCOMES)}")

    @classmethod
    def failed(cls, kind: str, message: str, *, traceback: str | None = None,
               scenario: str | None = None, vllm: str | None = None,
               lacks_level: str | None = None) -> "RunResult":
        """An ``error`` result (:class:`RunError` ``kind``: input, lab or env; ``lacks_level``:
        the level whose engine the release lacks, for ``input``)."""
        return cls("error", scenario=scenario, vllm=vllm,
                   error=RunError(kind, message, traceback, lacks_level))

    @property
    def stopped(self) -> dict | None:
        """Where the audit stopped the run (``{step, code, phase}``), else ``None``."""
        return self.audit.stopped if self.audit is not None else None

    def all_violations(self) -> list[Violation]:
        return list(self.violations or ())


@dataclass
class DraftRecord(Record):
    """What a model-based drafter (``eagle``, ``eagle3``, ``mtp``, ``draft_model``) did after one
    step's forward pass (``engine/drafter.py``): ``method`` (the release's
    ``SpeculativeConfig.method``), ``num_lookahead_tokens`` (the scheduler's own: KV slots it
    reserves past each request's scheduled tokens), ``rule`` (the release's code that decided:
    ``GPUModelRunner._input_fits_in_drafter``, or None where the release has no such method),
    ``max_seq_len`` (the batch's longest sequence after this step, draft positions included: what
    that rule reads) and ``drafter_max_model_len`` (the drafter's limit:
    ``effective_drafter_max_model_len``), ``proposed`` (request id -> draft tokens proposed for
    the next step) and ``skipped`` (request id -> why it got no real drafts)."""

    method: str
    num_lookahead_tokens: int | None = None
    rule: str | None = None
    max_seq_len: int | None = None
    drafter_max_model_len: int | None = None
    proposed: dict[str, int] | None = None
    skipped: dict[str, str] | None = None


@dataclass
class TraceLine(Record):
    """One engine step: a line of ``trace.jsonl``.

    ``step`` (0: ``EngineCore`` start-up, with ``phase: engine-build``); the request ids
    ``added`` and ``aborted`` before it, and ``refused`` (request id -> the release's
    front-door error: the request never reached EngineCore); ``scheduled`` (request id ->
    tokens scheduled in this step's ``schedule()``); ``drafts`` (request id -> draft tokens
    scheduled for verification in it, spec decode); ``drafter`` (a model-based drafter's
    :class:`DraftRecord`: which requests drafted how many tokens, which were skipped and why);
    ``preemptions`` (request id -> what
    preempted it in this step: ``schedule`` (the scheduler, for blocks), ``reset_prefix_cache``
    or ``pause``, the engine-core events before it); ``stats`` (the release's ``SchedulerStats``
    of this step, flattened: ``num_running_reqs``, ``prefix_cache_stats.hits``,
    ``spec_decoding_stats.num_draft_tokens``, ...: what ``expect.stats`` reads); ``sampled``
    (structured-output requests: request id -> the token ids the fake worker sampled through the grammar bitmask in this
    step); ``reasoning_ended`` (with ``config.reasoning_parser``: request id -> the release's
    ``StructuredOutputRequest.reasoning_ended`` after the step's ``update_from_output``, for the
    structured-output requests it scheduled: false while the request reasons and its grammar is
    held back, true from the step whose tokens ended reasoning; null before the manager looked);
    ``kv_connector`` (with a scripted KV connector: what its worker half did in this
    step, event -> request ids: ``load`` started, ``recv`` reported in ``finished_recving``,
    ``load_failed`` reported as a failed load, ``send`` reported in ``finished_sending``,
    ``not_ready``: the scheduler half's lookup answered "not yet", ``None``);
    ``idle`` (nothing to schedule: vLLM's early return), ``applied`` (engine-core: how
    many batches ``update_from_output`` applied, which with async scheduling or a batch queue
    is not the one just scheduled), with a batch queue ``applied_from`` (the steps that
    scheduled them) and ``in_flight`` (batches in flight at the step's peak); events
    (``reset_prefix_cache``: what it returned,
    ``paused``: the mode or true, ``resumed``); after the step the request ids
    ``finished``, the scheduler's ``waiting``, ``running`` and ``preempted`` queues and
    ``free_blocks`` (the block pool's free count), or ``state_error`` when they could not be
    read (after a crash); ``crash`` (:meth:`Crash.brief`) on the step that crashed; the audit's
    ``audit`` figures (free, used, total, refs_held, cached_free, hash_entries, in blocks) and
    this step's ``violations`` (:meth:`Violation.brief`). With ``data_parallel_size`` > 1
    (``engine/core_proc.py``) each engine core writes its own lines: ``dp_rank`` says whose,
    and ``throttle_prefills`` is true on a step whose ``schedule()`` the release's
    ``DPEngineCoreProc`` called with ``throttle_prefills=True`` (DP prefill balancing)."""

    step: int
    phase: str | None = None
    dp_rank: int | None = None
    throttle_prefills: bool | None = None
    added: list[str] | None = None
    aborted: list[str] | None = None
    refused: dict[str, str] | None = None
    scheduled: dict[str, int] | None = None
    drafts: dict[str, int] | None = None
    #: a model-based drafter's record of this step (:class:`DraftRecord`)
    drafter: DraftRecord | None = None
    preemptions: dict[str, str] | None = None
    stats: dict | None = None
    sampled: dict[str, list[int]] | None = None
    reasoning_ended: dict[str, bool | None] | None = None
    kv_connector: dict[str, list[str]] | None = None
    idle: bool | None = None
    applied: int | None = None
    #: engine-core with a batch queue (``max_concurrent_batches`` > 1): the steps whose batches
    #: ``update_from_output`` applied in this step, and the batches in flight at the step's
    #: peak (in the queue after its ``schedule()``, before its updates took them out)
    applied_from: list[int] | None = None
    in_flight: int | None = None
    #: a rank fault the step's events armed (``events[].fault``: rank, kind, ...)
    fault: dict | None = None
    reset_prefix_cache: Any = None
    paused: Any = None
    resumed: bool | None = None
    finished: list[str] | None = None
    waiting: list[str] | None = None
    running: list[str] | None = None
    preempted: list[str] | None = None
    free_blocks: int | None = None
    state_error: str | None = None
    crash: Crash | None = None
    audit: dict | None = None
    violations: list[Violation] | None = None

    @classmethod
    def begin(cls, step: int, scheduled: dict[str, int] | None = None) -> "TraceLine":
        """A step's line before the step: nothing added or aborted yet; ``scheduled`` stays
        absent until a ``schedule()`` returns (a crash inside it leaves it absent), unless
        given."""
        return cls(step, added=[], aborted=[], scheduled=scheduled)

    def progressed(self) -> bool:
        """A request finished or a token was scheduled in this step."""
        return bool(self.finished) or any(n > 0 for n in (self.scheduled or {}).values())


# ---- release diffs (vllm-repro diff: src/vllm_repro/diff.py) ------------------------------------
@dataclass
class StepDecisions(Record):
    """What the scheduler decided in one step of one run (from its :class:`TraceLine`), the
    fields ``vllm-repro diff`` compares: ``scheduled`` (request id -> tokens; ``None``: no
    ``schedule()`` returned in that step), ``preempted`` (request id -> cause),
    ``finished``, ``free_blocks``, ``crash`` (``Type file:line``), ``waiting`` and
    ``running`` (shown, not compared); ``present``: the run had this step."""

    step: int
    present: bool = True
    scheduled: dict[str, int] | None = None
    preempted: dict[str, str] | None = None
    finished: list[str] | None = None
    free_blocks: int | None = None
    crash: str | None = None
    waiting: list[str] | None = None
    running: list[str] | None = None


@dataclass
class ReleaseDiff(Record):
    """``vllm-repro diff``: one scenario on two releases, aligned step by step. ``releases``
    (the two, in the order given), ``outcomes`` and ``reports`` (release -> the run's outcome /
    report folder), ``step`` the first step where their decisions differ (``None``: none
    does), ``differs`` which fields differ there (``scheduled``, ``preempted``, ``finished``,
    ``free_blocks``, ``crash``, ``present``), ``decisions`` (release -> its
    :class:`StepDecisions` at that step), ``scheduled_and_preempted`` (release -> the requests
    both scheduled and preempted in that step, one ``schedule()`` call)."""

    scenario: str
    releases: list[str]
    outcomes: dict[str, str] = field(default_factory=dict)
    reports: dict[str, str] = field(default_factory=dict)
    step: int | None = None
    differs: list[str] = field(default_factory=list)
    decisions: dict[str, StepDecisions] = field(default_factory=dict)
    scheduled_and_preempted: dict[str, list[str]] = field(default_factory=dict)


# ---- campaigns (vllm-repro campaign: src/vllm_repro/campaign/) ---------------------------------
@dataclass
class CampaignFinding(Record):
    """A shrunk failure one campaign task found: its ``signature`` (``fuzz``'s: exception type
    and innermost vLLM frame, a violation code, or ``stall``), on ``release`` with the campaign
    ``seed`` and the feature set ``features``; ``scenario`` the shrunk scenario (the scenario
    format, replayable with ``vllm-repro run``), ``result`` its run. ``examples``: examples the
    search had run when the shrunk finding was made; ``first_example``: when the first example
    with this signature failed (counts, the same on every machine with the same seed); seconds
    in ``found_after_s`` (they vary with the machine)."""

    signature: str
    release: str
    seed: int
    features: str
    scenario: dict
    result: RunResult
    examples: int = 0
    first_example: int | None = None
    found_after_s: float | None = None


@dataclass
class CampaignTaskResult(Record):
    """One campaign task, (``release``, ``seed``), every feature set of the campaign in turn.
    ``status``: ``done`` (searched to its bound), ``refused`` (the release refuses what the
    campaign asks: no V1 engine, a forced feature it lacks; ``message`` says which; never
    re-run), ``error`` (a lab or environment failure; re-run when the campaign resumes).
    ``examples`` and ``by_outcome`` count every feature set's examples; ``bound``: what ended
    the last search, ``examples`` (the campaign's bound: repeatable) or ``time`` (the safety
    cap: depends on the machine). ``node``: the host that ran it; ``elapsed_s`` seconds there,
    preparing the release included."""

    release: str
    seed: int
    status: str
    examples: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)
    bound: str | None = None
    findings: list[CampaignFinding] = field(default_factory=list)
    message: str | None = None
    notes: list[str] = field(default_factory=list)
    node: str | None = None
    elapsed_s: float = 0.0


@dataclass
class SignatureSpan(Record):
    """Where one signature appears in a campaign: its ``first`` and ``last`` release (oldest
    and newest with a finding), ``releases`` (all with one, oldest first) and ``gone_from``:
    the first release after ``last`` the campaign searched (a ``done`` task) without finding it
    (None when ``last`` is the newest release searched)."""

    signature: str
    first: str
    last: str
    releases: list[str] = field(default_factory=list)
    gone_from: str | None = None


@dataclass
class CampaignReport(Record):
    """A whole campaign, merged from its tasks: ``campaign.json``. ``spec`` is what was asked
    (the command's options), ``releases`` (oldest first) and ``seeds`` the matrix, ``tasks``
    every task's result; ``table`` maps signature -> release -> how many seeds found it there;
    ``spans`` the first / last release of each signature; ``scenarios`` maps signature ->
    release -> the shrunk scenario's YAML (relative to the campaign's folder; the smallest of
    the seeds' findings); ``backend`` says where the tasks ran (of the last invocation)."""

    spec: dict
    releases: list[str]
    seeds: list[int]
    tasks: list[CampaignTaskResult] = field(default_factory=list)
    table: dict[str, dict[str, int]] = field(default_factory=dict)
    spans: list[SignatureSpan] = field(default_factory=list)
    scenarios: dict[str, dict[str, str]] = field(default_factory=dict)
    backend: str | None = None


def read_trace(path: Path) -> list[TraceLine]:
    """The lines of a ``trace.jsonl``. Raises :class:`RecordError` (naming the line) and
    ``OSError``."""
    lines = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    lines.append(TraceLine.from_json(raw))
                except RecordError as exc:
                    raise RecordError(f"{path}:{n}: {exc}") from None
    return lines


# ---- the report directory (host side) --------------------------------------------------------
@dataclass
class ReportDir:
    """One run's report folder, ``<reports>/<scenario>/<release>/``, and the only writer of its
    ``result.json`` (:meth:`write_result`, once the verdict is in: written to a temporary file
    and renamed, so a reader never sees half of one).

    A run is reported in a hidden staging folder beside it (:meth:`begin`: the worker's trace,
    then the result and the picture) that :meth:`commit` moves into place once the report is
    whole: an interrupted run leaves the previous run's report as it was, never a new trace next
    to an old result; its staging folder is cleared by the next :meth:`begin`."""

    reports: Path
    scenario: str
    release: str

    RESULT: ClassVar[str] = "result.json"
    TRACE: ClassVar[str] = "trace.jsonl"
    TIMELINE: ClassVar[str] = "timeline.png"
    ENGINE_LOG: ClassVar[str] = "engine.log"  # this run's part of the worker's vLLM log

    @property
    def path(self) -> Path:
        return Path(self.reports) / self.scenario / self.release

    @property
    def result_path(self) -> Path:
        return self.path / self.RESULT

    @property
    def trace_path(self) -> Path:
        return self.path / self.TRACE

    @staticmethod
    def engine_log(reports: Path, name: str) -> Path:
        """``<reports>/_engine/<name>.log``: a worker's vLLM log (one per release and tree)."""
        return Path(reports) / "_engine" / f"{name}.log"

    @classmethod
    def results_under(cls, reports: Path) -> list[Path]:
        """Every ``result.json`` below ``reports`` (``<scenario>/<release>/result.json``; runs
        still staged, or left staged by an interruption, are not reports)."""
        return sorted(p for p in Path(reports).glob(f"*/*/{cls.RESULT}")
                      if not p.parent.name.startswith("."))

    @property
    def staging(self) -> Path:
        """``<reports>/<scenario>/.<release>.partial-<pid>``: where this process reports a run
        in progress (one per process, so that two runs at once never share one)."""
        return self.path.parent / f".{self.release}.partial-{os.getpid()}"

    def begin(self) -> Path:
        """A fresh, empty staging folder for a run; stale ones, left by interrupted runs whose
        process is gone, are removed first. Returns it.

        ``<reports>/<scenario>`` given as a symlink is replaced by a folder (the link goes, its
        target is left alone): followed, it took the run's report out of the reports folder."""
        if self.path.parent.is_symlink():
            self.path.parent.unlink()
        for old in self.path.parent.glob(f".{self.release}.partial-*"):
            pid = old.name.rsplit("-", 1)[-1]
            if old != self.staging and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        return self.staging

    @property
    def current(self) -> Path:
        """Where the report is written now: the staging folder during a run, else the report."""
        return self.staging if self.staging.is_dir() else self.path

    def commit(self) -> Path:
        """Move the staged report into place (the previous run's report goes); returns the
        report's path. A no-op when nothing is staged."""
        if not self.staging.is_dir():
            return self.path
        old = self.path.parent / f".{self.release}.old.{os.getpid()}"
        if self.path.exists():
            os.replace(self.path, old)
        os.replace(self.staging, self.path)
        if old.is_symlink():  # a link given as the report folder: the link goes, not its target
            old.unlink()
        shutil.rmtree(old, ignore_errors=True)
        return self.path

    def exists(self) -> bool:
        return self.result_path.is_file()

    def write_result(self, result: RunResult) -> Path:
        """Write ``result.json`` (atomically) into :attr:`current`; returns its path."""
        where = self.current
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f".{self.RESULT}.{os.getpid()}.tmp"
        tmp.write_text(result.to_json(indent=1))
        os.replace(tmp, where / self.RESULT)
        return where / self.RESULT

    def read_result(self) -> RunResult:
        """Raises ``OSError`` and :class:`RecordError`."""
        return RunResult.from_json(self.result_path.read_text())


# ---- the release matrix (``vllm-repro matrix``) ---------------------------------------------
#: a matrix cell's outcomes beyond a run's (:data:`OUTCOMES`): ``refused`` (the release or the
#: index refuses the run: exit 2), ``n/a`` (the release's Capabilities lack the mode)
MATRIX_OUTCOMES = (*OUTCOMES, "n/a")  # (refused: OUTCOMES has it)


@dataclass
class MatrixCell(Record):
    """One (release, mode) of a matrix: ``outcome`` (:data:`MATRIX_OUTCOMES`; a lab or
    environment failure is ``error``), ``exit`` the exit code ``vllm-repro run`` of that run
    alone gives, by its verdict (0 clean, or what the scenario expects on that release:
    ``expected``; 1 a crash, violation, stall or incomplete it does not expect; 2 refused; 3
    error; absent for ``n/a``),
    ``cause`` one line: why it was not clean (the error, the refusal, the crash), or why the
    mode does not apply (the Capabilities' refusal); ``observed`` the verdict table's text;
    ``report`` the run's report folder, relative to the reports folder (``<scenario>[.<mode>]/
    <release>``); ``substitutions`` as in :class:`RunResult`; ``expected``: the run is what
    the scenario expects there (its ``expect`` on a ``reproduces_on`` release, its ``fixed`` on a
    ``clean_on`` one), exit 0; ``audit_findings``: on a release
    the scenario expects clean, a run judged clean (as ``vllm-repro run`` judges it: to its end,
    none of the scenario's own bug) whose audit found this many violations outside that bug:
    ``clean``, exit 0, ``cause`` naming them."""

    release: str
    mode: str
    outcome: str
    exit: int | None = None
    cause: str | None = None
    observed: str | None = None
    report: str | None = None
    substitutions: list[str] | None = None
    audit_findings: int | None = None
    expected: bool | None = None

    def label(self) -> str:
        """The cell as the table shows it: its outcome, ``clean (+N audit finding(s))`` for a
        clean run with findings outside the scenario's bug, ``crash (expected)`` for what the
        scenario expects on that release, ``clean (unexpected)`` for a clean run where it expects
        its bug (exit 1)."""
        if self.outcome == "clean" and self.audit_findings:
            n = self.audit_findings
            return f"clean (+{n} audit finding{'s' if n > 1 else ''})"
        if self.outcome == "clean" and self.exit == 1:
            return "clean (unexpected)"
        if self.expected and self.outcome != "clean":
            return f"{self.outcome} (expected)"
        return self.outcome

    def __post_init__(self) -> None:
        if self.outcome not in MATRIX_OUTCOMES:
            raise RecordError(f"MatrixCell.outcome: {self.outcome!r} is not one of "
                              f"{', '.join(MATRIX_OUTCOMES)}")


@dataclass
class MatrixReport(Record):
    """A whole matrix: ``reports/_matrix/<scenario>/matrix.json``. ``scenario`` its name,
    ``source`` its file; ``releases_range`` the PEP 440 specifier set the releases were chosen
    by (``--releases``), ``releases`` the releases on the index it held (post releases kept),
    oldest first; ``modes`` the modes asked for (``plain``, ``async``, ``spec``, ``prefix-caching``);
    ``cells`` one per release and mode; ``started`` when (ISO 8601, UTC) and ``seconds`` how
    long the whole matrix took (wall clock, preparing the releases included)."""

    scenario: str
    releases_range: str
    releases: list[str]
    modes: list[str]
    cells: list[MatrixCell]
    started: str
    seconds: float
    source: str | None = None

    def cell(self, release: str, mode: str) -> MatrixCell | None:
        """The cell of ``release`` in ``mode``, or None when the matrix has none."""
        return next((c for c in self.cells if c.release == release and c.mode == mode), None)

    def counts(self) -> dict[str, dict[str, int]]:
        """mode -> outcome -> how many releases."""
        out: dict[str, dict[str, int]] = {m: {} for m in self.modes}
        for c in self.cells:
            out.setdefault(c.mode, {})[c.outcome] = out.get(c.mode, {}).get(c.outcome, 0) + 1
        return out

    def exit_code(self) -> int:
        """The matrix's exit code, the worst of its cells' (each ``vllm-repro run``'s for that
        run): 3 if any cell is a lab or environment error, else 2 if any is refused, else 1 if any
        ran and was neither clean nor what the scenario expects there, else 0 (``n/a`` cells
        count as clean)."""
        codes = {c.exit for c in self.cells if c.exit is not None}
        for code in (3, 2, 1):
            if code in codes:
                return code
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def schema() -> str:
    """The records' fields as Markdown (``docs/records.md`` holds this text; a test checks it):
    per record its docstring and a table of field and type (``optional``: may be absent)."""
    import inspect

    out = []
    for cls in (RunResult, Crash, CrashContext, Frame, Stall, Hang, Violation, RunError, Timing,
                AuditSummary,
                EngineInfo, TraceLine, DraftRecord, StepDecisions, ReleaseDiff, MatrixReport, MatrixCell,
                CampaignReport,
                CampaignTaskResult, CampaignFinding, SignatureSpan):
        out.append(f"### `{cls.__name__}`\n")
        doc = inspect.cleandoc(cls.__doc__ or "")
        # Sphinx roles (:class:`~a.b.C`) read as code in Markdown
        doc = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", doc)
        out.append(doc + "\n")
        out.append("| field | type |\n|---|---|")
        for name, tp in cls._types().items():
            if name.startswith("_") or name == "extra":
                continue
            text = str(tp).replace("typing.", "").replace("vllm_repro.records.", "")
            text = text.replace("<class '", "").replace("'>", "")
            optional = text.endswith(" | None")
            text = text.removesuffix(" | None").replace(" | ", " or ")
            out.append(f"| `{name}` | `{text}`{', optional' if optional else ''} |")
        out.append("")
    return "\n".join(out)


__all__ = ["OUTCOMES", "Record", "RecordError", "Frame", "Crash", "CrashContext", "Stall", "Hang",
           "Violation", "RunError", "StepDecisions", "ReleaseDiff",
           "Timing", "AuditSummary", "EngineInfo", "RunResult", "TraceLine", "DraftRecord", "ReportDir",
           "read_trace", "schema", "MATRIX_OUTCOMES", "MatrixCell", "MatrixReport",
           "CampaignFinding", "CampaignTaskResult", "SignatureSpan", "CampaignReport"]
