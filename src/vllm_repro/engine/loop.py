"""The step loop: a scenario driven through the release's real ``Scheduler``.

Mirrors ``vllm/v1/engine/core.py:EngineCore.step`` with the executor replaced by
:class:`~vllm_repro.engine.fake_runner.FakeModelRunner`::

    requests at_step n added (EngineCore.add_request), aborts applied (abort_requests)
    if nothing is left to schedule: the step is idle          # EngineCore.step's early return
    scheduler_output = scheduler.schedule()                  # step n
    model_output = fake_runner.execute(scheduler_output)
    scheduler.update_from_output(scheduler_output, model_output)
    stat_loggers.record(scheduler_stats)                     # disable_log_stats: false
    scheduler.update_draft_token_ids(drafts)                 # spec decode, 0.10.2+

Runs inside the release environment (standard library + vLLM only). Returns a
:class:`~vllm_repro.records.RunResult` and writes one :class:`~vllm_repro.records.TraceLine` per
step; ``result.json`` is the host's to write (:class:`~vllm_repro.records.ReportDir`).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any, Callable

from ..records import Crash, Frame, Hang, RunResult, Stall, Timing, TraceLine
from .adapter import (AdapterError, RefusedByRelease, V1Adapter, refused_by_vllm,
                      token_stream)
from .fake_runner import FakeModelRunner, PersistentBatch
from .drafter import check_scripted_skips, release_drafter
from .events import Abort, Event, by_step, perform, supported
from .interfaces import Observer
from .spec import LabLimits, ScenarioLimits, ScenarioRequest
from .input_batch import WORKER_STATE_ATTR, worker_state
from .state import (flat_stats, preempted_since, preemption_marks, stall_cause, stall_clauses,
                    worker_max_num_reqs)
from .explain import crash_context
from .watchdog import StepTimeout


def vllm_frames(tb, vllm_root: Path) -> list[Frame]:
    """Frames of a traceback that lie in the vLLM package, outermost first (``file`` as
    ``vllm/v1/...py``)."""
    frames = []
    root = str(vllm_root.resolve())
    for fs in traceback.extract_tb(tb):
        try:
            path = str(Path(fs.filename).resolve())
        except OSError:
            continue
        if path.startswith(root + "/"):
            frames.append(Frame("vllm/" + path[len(root) + 1:], fs.name, fs.lineno))
    return frames


def describe_exception(exc: BaseException, vllm_root: Path, step: int, phase: str) -> Crash:
    """The :class:`~vllm_repro.records.Crash` record: type, first message line, innermost vLLM
    frame, step, phase, and its :class:`~vllm_repro.records.CrashContext` (``engine/explain.py``:
    the statement, its frame's locals, an assert's operands)."""
    frames = vllm_frames(exc.__traceback__, vllm_root)
    msg = str(exc).strip().splitlines()
    try:  # why: the innermost vLLM frame's statement, locals and an assert's operands
        context = crash_context(exc.__traceback__, vllm_root)
    except Exception:  # noqa: BLE001 - never in the way of the crash itself
        context = None
    return Crash(type(exc).__name__, msg[0] if msg else "", frames[-1] if frames else None,
                 frames[-8:], step, phase,
                 "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-6000:],
                 context)


class _NeverRaised(BaseException):
    """Stands in for an observer's ``stop_exception`` when it has none."""


class StepLoop:
    """One scenario run. ``observer`` (the auditor, :class:`vllm_repro.audit.Auditor`; the
    contract: :class:`vllm_repro.engine.interfaces.Observer`) gets ``attach(loop)``,
    ``after_schedule(step, so, scheduled)``, ``after_update(step, so, line)`` and
    ``finish(loop, outcome)`` calls and may stop the run by returning True. Optional here:
    ``annotate(line)`` adds fields to each trace line before it is written; ``stop_exception``
    (a ``BaseException`` it raises from inside a vLLM call to stop there); ``violations`` and
    ``summary()`` go into the result. A level's loop subclasses this one and is built by its
    driver in :data:`vllm_repro.engine.run.LEVELS`."""

    level = "scheduler"

    def __init__(self, adapter: V1Adapter, scenario: dict,
                 trace: Callable[[TraceLine], None] | None = None,
                 observer: Observer | None = None):
        self.adapter = adapter
        self.scenario = scenario
        self.trace = trace or (lambda line: None)
        self.observer = observer
        self.cfg = scenario["config"]
        #: the scenario's requests, in its order
        self.requests: tuple[ScenarioRequest, ...] = tuple(
            map(ScenarioRequest.from_mapping, scenario["requests"]))
        self.requests_by_step: dict[int, list[ScenarioRequest]] = {}
        for r in self.requests:
            self.requests_by_step.setdefault(r.at_step, []).append(r)
        #: the scenario's events (engine/events.py's dataclasses) by step
        self.events_by_step: dict[int, list[Event]] = by_step(scenario.get("events"))
        self.created: dict[str, Any] = {}
        self.finished: dict[str, str] = {}
        #: request id -> the release's front-door error, for requests it refused (never added)
        self.refused: dict[str, str] = {}
        self.order = 0
        #: the lab's limits (run_scenario's; none outside a run)
        self.lab_limits: LabLimits = LabLimits()
        #: the scenario's own ``limits:``
        self.limits: ScenarioLimits = ScenarioLimits.from_mapping(scenario.get("limits"))
        self._idle = 0  # steps in a row without progress
        self._paused = False  # the scenario paused the scheduler (engine-core events)

    # ---- events (engine/events.py's dispatch calls these) -------------------------------------
    def do_abort(self, e: Abort, line: TraceLine) -> None:
        """``EngineCore.abort_requests`` on the scheduler: finish the requests as aborted."""
        self.adapter.abort(self.scheduler, list(e.ids))
        line.aborted.extend(e.ids)

    def prompt_of(self, spec: ScenarioRequest) -> list[int]:
        n = spec.prompt_len
        if spec.prefix:
            k = spec.prefix_len or n
            return token_stream("prefix:" + spec.prefix, k) + token_stream("req:" + spec.id, n - k)
        return token_stream("req:" + spec.id, n)

    def run(self) -> RunResult:
        """Build the scheduler, then step until every request finished, the audit stopped the
        run, vLLM raised, the run stalled or ``limits.max_steps`` was reached. Raises
        :class:`RefusedByRelease` (the release refuses the scenario) and :class:`AdapterError`
        (the lab failed)."""
        a = self.adapter
        t0 = time.perf_counter()
        try:
            built = self._watched(0, "engine-build", lambda: a.build(self.cfg), lambda: None)
        except (AdapterError, RefusedByRelease, MemoryError):
            raise
        except Exception as exc:
            raise self.refusal(exc) from exc
        if built is None:  # the watchdog: the build never returned
            return self._build_hung(time.perf_counter() - t0)
        _, self.scheduler = built
        model = self.scenario.get("model") or {}
        if model.get("empty_at") and not a.caps.empty_outputs:
            raise RefusedByRelease(f"model.empty_at: {a.caps.refusal('empty outputs')}")
        record_stats = self._front_door_and_stats(a.vllm_config)
        build_s = time.perf_counter() - t0
        runner = FakeModelRunner(self.scenario.get("model") or {}, self.cfg.get("num_speculative_tokens"))
        self.runner = runner
        return self._run_steps(build_s, lambda step, line: self._step(step, line, runner, record_stats))

    def _run_steps(self, build_s: float, step_fn, scheduled: dict | None = None) -> RunResult:
        """The step loop both levels share: ``step_fn(step, line)`` (this level's step, returning
        ``(result or None, scheduler output or None)``), then :meth:`_end_of_step`, until the run
        ends or ``limits.max_steps``; then :meth:`finish_result`. ``scheduled``: what a line's
        ``scheduled`` starts as (``None``: absent until ``schedule()`` returns)."""
        max_steps, stall_steps, last_add = self._limits_and_attach()
        result = RunResult("clean")
        step = 0
        t1, c1 = time.perf_counter(), time.process_time()
        #: whether the loop ran out of ``limits.max_steps`` (no step ended the run)
        self.ran_out = False
        for step in range(1, max_steps + 1):
            self.step = step
            line = TraceLine.begin(step, None if scheduled is None else dict(scheduled))
            ended, sched_out = self._watched(step, "step", lambda s=step, ln=line: step_fn(s, ln),
                                      lambda ln=line: (self._hung(ln), None))
            done = ended is not None
            if not done:
                ended, done = self._end_of_step(step, line, sched_out, last_add, stall_steps)
            if done:
                result = ended or result
                break
        else:
            self.ran_out = max_steps > 0
        return self.finish_result(result, step, build_s, time.perf_counter() - t1,
                                  time.process_time() - c1)

    def _watched(self, step: int, phase: str, call, on_hang):
        """``call()`` timed by the run's watchdog (``self.watchdog``, none: untimed), armed for
        ``step`` in ``phase``; where it runs out of time (:class:`~.watchdog.StepTimeout`),
        ``on_hang()`` instead."""
        wd = getattr(self, "watchdog", None)
        if wd is None:
            return call()
        try:
            wd.arm(step, phase)
            out = call()
        except StepTimeout:
            wd.disarm()
            return on_hang()
        except BaseException:
            wd.disarm()
            raise
        wd.disarm()
        return out

    def _hung(self, line: TraceLine | None) -> RunResult:
        """The watchdog interrupted this step (or start-up: no ``line``): the line written, with
        the state as it was left, outcome ``hang``."""
        hang = self.watchdog.hang or Hang(getattr(self, "step", 0), self.watchdog.limit_s,
                                          getattr(self, "_phase", None), stopped="interrupted")
        if line is not None:
            line.phase = "hang"
            self._state(line)
            self._emit(line)
        return RunResult("hang", hang=hang)

    def _step(self, step: int, line: TraceLine, runner: FakeModelRunner, record_stats):
        """One ``EngineCore.step`` at the scheduler level: this step's requests added, aborts
        applied, then ``schedule()``, the fake runner, ``update_from_output``, stats and drafts.
        Returns ``(result, scheduler_output)``: ``result`` is the run's end when the step ended
        it (the audit stopped it, or vLLM raised: a ``crash``), else ``None``."""
        a = self.adapter
        sched = self.scheduler
        sched_out = None
        phase = self._phase = "add_request"
        try:
            for r in self.requests_by_step.get(step, []):
                req = self._lab(a.make_request, r.id, self.prompt_of(r), r.max_tokens,
                                r.priority,
                                r.arrival_time if r.arrival_time is not None
                                else float(self.order))
                self.order += 1
                self.created[r.id] = req
                sched.add_request(req)
                line.added.append(r.id)
            phase = self._phase = "abort"
            for e in self.events_by_step.get(step, []):
                if supported(self, e):  # (the schema allows only aborts at this level)
                    perform(self, e, line)
            if not a.has_work(sched):
                line.scheduled = {}
                line.idle = True  # EngineCore.step returns without scheduling: nothing to do
                return None, None
            phase = self._phase = "schedule"
            self._marks = self._lab(preemption_marks, sched)
            sched_out = sched.schedule()
            scheduled = self._lab(a.scheduled, sched_out)
            self._note_schedule(line, scheduled)
            if self.observer is not None and self._lab(self.observer.after_schedule, step, sched_out,
                                                       scheduled):
                return self._stopped(line), sched_out
            phase = self._phase = "execute_model"
            req_ids, sampled, drafts = self._lab(runner.execute, step, scheduled, sched.requests,
                                                 getattr(sched_out, "finished_req_ids", ()), sched_out)
            line.drafter = runner.draft_record
            mro = self._lab(a.model_output, req_ids, sampled, drafts)
            phase = self._phase = "update_from_output"
            engine_core_outputs = sched.update_from_output(sched_out, mro)
            all_stats = self._stats_of(engine_core_outputs, record_stats is not None)
            self._note_stats(line, all_stats)
            if record_stats is not None:
                # AsyncLLM's output handler: logger_manager.record(scheduler_stats, ...)
                phase = self._phase = "record_stats"
                for stats in all_stats:
                    record_stats(stats)
            phase = self._phase = "update_draft_token_ids"
            a.deliver_drafts(sched, req_ids, drafts)
        except (RefusedByRelease, AdapterError):
            raise
        except self._stop_exception():  # the observer stopped the run inside a vLLM call
            return self._stopped(line), sched_out
        except MemoryError:  # the worker's memory limit, not vLLM's failure
            raise
        except Exception as exc:  # vLLM raised: the reproduction's main kind of evidence
            return self._crashed(exc, step, phase, line), sched_out
        return None, sched_out

    def _build_hung(self, build_s: float) -> RunResult:
        """The build of the scheduler or engine never returned: ``hang`` at step 0, phase
        ``engine-build``, with a step-0 trace line."""
        self.trace(TraceLine(0, phase="hang"))
        hang = self.watchdog.hang or Hang(0, self.watchdog.limit_s, "engine-build",
                                          stopped="interrupted")
        return RunResult("hang", hang=hang, steps=0, finished={},
                         unfinished=[r.id for r in self.requests], limit_reached=False,
                         level=self.level, timing=Timing(round(build_s, 4)))

    def _note_schedule(self, line: TraceLine, scheduled) -> None:
        """What ``schedule()`` decided, into ``line``: tokens and draft tokens scheduled per
        request, and the requests it preempted (against the marks taken before it)."""
        line.scheduled = {s.req_id: s.num_scheduled for s in scheduled}
        drafts = {s.req_id: len(s.spec_tokens) for s in scheduled if s.spec_tokens}
        line.drafts = drafts or line.drafts
        self._note_preemptions(line, "schedule")

    def _note_preemptions(self, line: TraceLine, cause: str) -> None:
        """The requests preempted since ``self._marks`` (taken before the call that ``cause``
        names: ``schedule``, ``reset_prefix_cache``, ``pause``), into ``line.preemptions``."""
        before = getattr(self, "_marks", None)
        if before is None:
            return
        self._marks = None
        for rid in self._lab(preempted_since, self.scheduler, before):
            line.preemptions = {**(line.preemptions or {}), rid: cause}

    def _stats_of(self, engine_core_outputs, needed: bool) -> list:
        """The ``SchedulerStats`` in ``engine_core_outputs`` (the adapter's read). Where the
        stat loggers need them (``needed``) a failure to read them is a lab error; where only
        the trace would record them, the step goes on without."""
        if needed:
            return self._lab(self.adapter.scheduler_stats, engine_core_outputs)
        try:
            return list(self.adapter.scheduler_stats(engine_core_outputs) or ())
        except Exception:  # noqa: BLE001 - the trace's stats are extra, never the run's end
            return []

    def _note_stats(self, line: TraceLine, all_stats) -> None:
        """The step's ``SchedulerStats`` (the last one made), flattened, its non-zero numbers
        into ``line.stats``."""
        for stats in all_stats or ():
            if stats is not None:  # zeros left out (absent reads 0): the trace stays small
                try:
                    line.stats = {k: v for k, v in flat_stats(stats).items() if v}
                except Exception:  # noqa: BLE001 - a stats object of another shape
                    pass

    def _stop_exception(self) -> type[BaseException]:
        """The observer's ``stop_exception`` (raised from inside a vLLM call), or one never
        raised."""
        return getattr(self.observer, "stop_exception", None) or _NeverRaised

    def _stopped(self, line: TraceLine) -> RunResult:
        """The audit stopped the run in this step: the line written, outcome ``violation``."""
        self._state(line)
        self._emit(line)
        return RunResult("violation")

    def _crashed(self, exc: BaseException, step: int, phase: str, line: TraceLine) -> RunResult:
        """vLLM raised ``exc`` in ``phase`` of ``step``: the line written, outcome ``crash``."""
        crash = describe_exception(exc, self.adapter.vllm_file, step, phase)
        line.crash = crash.brief()
        if phase == "schedule":  # what it had preempted before it raised
            try:
                self._note_preemptions(line, "schedule")
            except Exception:  # noqa: BLE001 - the books after a crash may be unreadable
                pass
        self._state(line)
        self._emit(line)
        return RunResult("crash", crash=crash)

    def _end_of_step(self, step: int, line: TraceLine, sched_out, last_add: int,
                     stall_steps: int) -> tuple[RunResult | None, bool]:
        """After a step that did not end the run: finished requests collected, the state read,
        the observer's ``after_update``, the line written; then whether the run is over.
        Returns ``(result, done)``: ``result`` a ``violation`` (the audit stopped it) or a
        ``stall`` (no progress for ``stall_steps`` steps), or ``None`` when the run ends
        because every request finished (``done``) or goes on. Shared by both levels."""
        newly = self._collect_finished()
        line.finished = newly
        self._state(line)
        if self.observer is not None and sched_out is not None \
                and self._lab(self.observer.after_update, step, sched_out, line):
            self._emit(line)
            return RunResult("violation"), True
        self._emit(line)
        unfinished = [rid for rid in self.created if rid not in self.finished]
        if step >= last_add and not unfinished and not self._busy():
            return None, True
        progress = bool(newly) or self._progressed(line)
        # a pause the scenario asked for is not the engine stalling
        self._idle = 0 if (progress or not unfinished or self._paused) else self._idle + 1
        if self._idle < stall_steps:
            return None, False
        self.stall_since = step - stall_steps + 1
        clauses = self._stall_clauses(unfinished, line)
        return RunResult("stall", stall=Stall(step, self.stall_since, unfinished, line.waiting,
                                              line.running, line.free_blocks,
                                              "; ".join(text for text, _ in clauses),
                                              stall_cause(clauses))), True

    def _stall_clauses(self, unfinished: list[str], line: TraceLine) -> list[tuple[str, str]]:
        """Where each unfinished request is stuck and why, ``(clause, cause)``
        (:func:`~vllm_repro.engine.state.stall_clauses` over the live scheduler): the stall's
        ``message`` and ``cause``."""
        return stall_clauses(self.scheduler, unfinished, line.waiting, line.running,
                             int(self.cfg.get("block_size") or 16), line.scheduled)

    def _progressed(self, line: TraceLine) -> bool:
        """Progress at the scheduler level: some request had tokens scheduled."""
        return any(n > 0 for n in (line.scheduled or {}).values())

    def _busy(self) -> bool:
        """Whether the engine would still step with every request finished (never, here)."""
        return False

    def _front_door_and_stats(self, vllm_config):
        """Every request through the release's front door (its refusals are input errors);
        returns the stat logger's ``record(scheduler_stats)`` when the scenario logs stats
        (``disable_log_stats: false``), else None. Shared by both levels."""
        a = self.adapter
        for r in self.requests:
            a.front_door(r.id, self.prompt_of(r), r.max_tokens, r.priority)
        if self.cfg.get("disable_log_stats", True):
            return None
        return self._lab(a.stat_logger, vllm_config)

    def _limits_and_attach(self) -> tuple[int, int, int]:
        """``(max_steps, stall_steps, the last step that adds a request or has an event)``,
        with the observer attached to the built loop. Shared by both levels."""
        last_add = max([*self.requests_by_step, *self.events_by_step, 0])
        self._track_worker_batch()
        if self.observer is not None:
            self.observer.attach(self)
        return self.limits.max_steps, self.limits.stall_steps, last_add

    def _track_worker_batch(self) -> None:
        """Give the fake runner the worker's persistent batch (``max_num_seqs`` slots), which
        the audit reads (``WORKER_BATCH_OVERFLOW``): the release's own ``InputBatch`` where it builds
        on CPU (:func:`~vllm_repro.engine.input_batch.worker_state`), else the lab's
        :class:`PersistentBatch`. Shared by both levels."""
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.slots = worker_state(self.scheduler, self.cfg) or PersistentBatch(
                worker_max_num_reqs(self.scheduler))
            # a model-based drafter (EAGLE, MTP, draft model): the release's own decisions
            runner.drafter = release_drafter(getattr(self.adapter, "vllm_config", None),
                                             self.scheduler)
            check_scripted_skips(runner, self.cfg.get("speculative_method"), self.adapter.version)

    def finish_result(self, result: RunResult, step: int, build_s: float, run_s: float,
                      run_cpu_s: float) -> RunResult:
        """The end of a run at either level: the observer's end-of-run checks (a clean run
        with violations becomes ``violation``; one that reached ``limits.max_steps`` with
        requests unfinished becomes ``incomplete``), then ``steps``, ``finished`` (request id
        -> finish status), ``unfinished``, ``limit_reached`` (the loop ran out of
        ``max_steps`` with requests unfinished, whatever the outcome) and ``timing`` (seconds; steps/s
        of the loop alone) set on ``result``, which is returned."""
        if self.observer is not None:
            fin = self.observer.finish(self, result.outcome)
            if fin and result.outcome == "clean":
                result.outcome = "violation"
            if getattr(self.observer, "violations", None):
                result.violations = list(self.observer.violations)
            if hasattr(self.observer, "summary"):
                result.audit = self.observer.summary()
        unfinished = [r.id for r in self.requests
                      if r.id not in self.finished and r.id not in self.refused]
        result.steps = step
        result.finished = dict(self.finished)
        result.refused = dict(self.refused) or None
        result.unfinished = unfinished
        if result.outcome == "clean" and unfinished:
            result.outcome = "incomplete"  # the run did not finish: never clean
        if result.outcome == "clean" and self.refused and not self.finished:
            # the release's front door refused every request: nothing ran, nothing was checked,
            # so never clean; its first refusal is the evidence
            result.outcome = "refused"
            result.refusal = Crash.front_door(*next(iter(self.refused.items())))
        # a run the audit let go on (``--keep-going``) to ``max_steps`` with requests unfinished
        # reached the limit as much as a clean one did
        result.limit_reached = result.outcome == "incomplete" or (
            getattr(self, "ran_out", False) and bool(unfinished))
        result.level = self.level
        slots = getattr(getattr(self, "runner", None), "slots", None)
        result.worker_state = getattr(slots, "describe", None)
        result.timing = Timing(round(build_s, 4), round(run_s, 4), round(run_cpu_s, 4),
                               round(step / run_s, 1) if run_s > 0 else None)
        return result

    def refusal(self, exc: Exception) -> Exception:
        """What a failure to build the release's configs or scheduler means. Raised inside
        vLLM (config validation, the CPU platform's checks): the release refuses this
        configuration, an input error (:class:`RefusedByRelease`, quoting vLLM). Raised in the
        lab: a lab error (:class:`AdapterError`)."""
        a = self.adapter
        tb = traceback.extract_tb(exc.__traceback__)
        innermost = tb[-1].filename if tb else ""
        first = " ".join(" ".join(str(exc).strip().splitlines()[:3]).split())
        # vLLM's config classes are pydantic dataclasses: their validators' errors come out
        # of pydantic as a ValidationError naming the vLLM config class
        refused_by_config = (type(exc).__name__ == "ValidationError"
                             and type(exc).__module__.startswith("pydantic"))
        if refused_by_config or vllm_frames(exc.__traceback__, a.vllm_file) and str(
                a.vllm_file.resolve()) in str(Path(innermost).resolve()):
            return refused_by_vllm(f"config: vLLM {a.version} refuses this configuration: "
                                   f"{type(exc).__name__}: {first}", exc)
        return AdapterError(f"building vLLM {a.version}'s scheduler failed: "
                            f"{type(exc).__name__}: {first}")

    def _emit(self, line: TraceLine) -> None:
        """Write one trace line, with the observer's fields (``annotate``) added."""
        annotate = getattr(self.observer, "annotate", None)
        if annotate is not None:
            annotate(line)
        self.trace(line)

    @staticmethod
    def _lab(fn, *args):
        """Run a lab-side step (the adapter, the fake runner): its failure is a lab error, never
        a vLLM crash."""
        try:
            return fn(*args)
        except (RefusedByRelease, AdapterError, MemoryError):
            raise
        except Exception as exc:
            if getattr(exc, WORKER_STATE_ATTR, False):
                raise  # the release's own worker-side state failed: vLLM's crash
            raise AdapterError(f"{getattr(fn, '__qualname__', fn)}: {type(exc).__name__}: {exc}") from exc

    def _collect_finished(self) -> list[str]:
        newly = []
        live = self.scheduler.requests
        for rid, req in self.created.items():
            if rid not in self.finished and rid not in live:
                status = getattr(req, "status", None)
                self.finished[rid] = getattr(status, "name", str(status))
                newly.append(rid)
        return newly

    def _state(self, line: TraceLine) -> None:
        """The scheduler's queues and the block pool's free count, read now, into ``line``."""
        try:
            line.waiting, line.running, line.preempted = self.adapter.queues(self.scheduler)
        except Exception as exc:  # noqa: BLE001 - after a crash the queues may be unreadable
            line.state_error = f"{type(exc).__name__}: {exc}"
            return
        line.free_blocks = self.adapter.num_free_blocks(self.scheduler)


class OverLimit(RefusedByRelease):
    """The run reached one of the lab's limits (:mod:`vllm_repro.limits`): an input error
    (exit 2) naming the setting, never a crash or a lab failure."""
