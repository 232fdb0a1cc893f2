"""``level: engine-core``: a scenario driven through the release's own ``EngineCore``.

vLLM builds and runs everything above the executor here; the lab only supplies the executor's
worker (:mod:`vllm_repro.engine.fake_executor`) and calls what vLLM's own engine process calls:

    EngineCore(vllm_config, executor_class=FakeExecutor, log_stats=True)   # start-up:
        # KV cache specs + free memory -> get_kv_cache_config(s) -> vLLM's capacity checks ->
        # num_gpu_blocks -> Scheduler (or AsyncScheduler) -> batch queue (max_concurrent_batches)
    per step n (what EngineCoreProc.run_busy_loop does between its input queue and its outputs):
        engine.add_request(*engine.preprocess_add_request(EngineCoreRequest(...)))  # at_step n
        engine.abort_requests(ids) / reset_prefix_cache() / pause_scheduler() ...    # events
        EngineCoreProc._process_engine_step(engine)   # step_fn = step | step_with_batch_queue,
                                                      # then post_step (drafts) where it exists

The scheduler's own ``schedule`` and ``update_from_output`` are observed (wrapped on the
instance, calling vLLM's methods unchanged) so that the audit sees every call, and the trace
records which batch was scheduled and which was applied in each engine step: with async
scheduling or a batch queue they differ.

A vLLM exception inside ``EngineCore.__init__`` is a ``crash`` with phase ``engine-build``;
a crash in a step writes vLLM's own crash dump (``dump_engine_exception``) and the
"EngineCore encountered a fatal error" log line to the engine log, as production does.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import queue
import time
import traceback

from .adapter import (AdapterError, LevelMissing, RefusedByRelease, _import, _try_import, call_supported,
                      fields_of, init_params, iter_queue)
from .fake_executor import (FakeWorker, available_memory, kv_cache_spec, make_executor_class,
                       unknown_call)
from ..records import EngineInfo, RunResult, Timing, TraceLine
from . import state
from .events import Abort, InjectFault, Pause, ResetPrefixCache, Resume, from_mapping, perform, refusal
from .fake_runner import FakeModelRunner
from .loop import OverLimit, StepLoop, describe_exception, vllm_frames
from .spec import ScenarioRequest


class EngineCoreLoop(StepLoop):
    """One scenario run at ``level: engine-core`` (see the module docstring). The observer
    protocol is :class:`~vllm_repro.engine.loop.StepLoop`'s; ``self.scheduler`` is the
    engine's own scheduler once it is built."""

    level = "engine-core"

    # ---- start-up ----------------------------------------------------------------------------
    def _build_engine(self, runner: FakeModelRunner):
        a = self.adapter
        cfg = self.cfg
        if not a.caps.engine_core:
            raise LevelMissing("engine-core", a.caps.refusal("engine-core"))
        self._structured = any(r.structured_outputs for r in self.requests)
        #: a reasoning parser configured: each step's line records where it left the requests
        self._reasoning = bool(self._structured and cfg.get("reasoning_parser"))
        if self._structured and not a.caps.structured_outputs:
            raise RefusedByRelease(f"requests[].structured_outputs: vLLM {a.version} has no V1 "
                                   "StructuredOutputManager (vllm/v1/structured_output)")
        kv = self.scenario.get("kv_transfer_config")
        self.kv_worker = self._kv_worker(kv) if kv else None
        build_cfg = {**cfg, "kv_transfer_config": kv} if kv else cfg
        from .topology import topology

        self.topology = topology(cfg)
        if self.topology.dp > 1:
            build_cfg = self._data_parallel(build_cfg)
        if self.topology.multiprocess:  # the ranks' worker, named through vLLM's own setting
            from . import ranks

            build_cfg = ranks.multiproc_config(a, build_cfg)
        if cfg.get("execute_model_timeout_seconds") is not None:
            from .ranks import check_rpc_timeout

            check_rpc_timeout(a.version, self.topology)
        vllm_config, _ = self._config_or_refusal(
            lambda: a.build_vllm_config(build_cfg, load_tokenizer=self._structured
                                        or bool(cfg.get("reasoning_parser"))))
        want = cfg.get("max_concurrent_batches")
        if want is not None and a.caps.batch_queue_from_config:
            # the release sizes its batch queue from VllmConfig.max_concurrent_batches, a
            # property of the parallel and scheduler configs: the scenario's depth is taken
            # where vLLM's own config gives it, else refused with what gives it
            got = getattr(vllm_config, "max_concurrent_batches", None)
            if got != want:
                raise RefusedByRelease(
                    f"config.max_concurrent_batches: {want}, where vLLM {a.version}'s "
                    f"VllmConfig.max_concurrent_batches is {got} for this config (its EngineCore "
                    "sizes the batch queue from it: pipeline_parallel_size, or 2 with "
                    f"async_scheduling); set pipeline_parallel_size: {want} instead")
        specs, bytes_per_block = self._lab(kv_cache_spec, a, cfg)
        memory = available_memory(cfg, bytes_per_block)
        cap = self.lab_limits.max_kv_blocks
        if cap and bytes_per_block and memory // bytes_per_block > cap:
            # vLLM's BlockPool makes a Python object per block at start-up: refuse before it does
            raise OverLimit(f"config.kv_cache_memory_bytes: {memory:,} bytes make "
                            f"{memory // bytes_per_block:,} KV blocks of {bytes_per_block:,} bytes, "
                            f"over this machine's limit of {cap:,} (VLLM_REPRO_MAX_KV_BLOCKS): "
                            "lower it, or raise VLLM_REPRO_MAX_KV_BLOCKS")
        split = a.caps.split_sampling
        self.worker = FakeWorker(specs, memory, self._make_output, self._on_execute, split)
        multiproc = _try_import("vllm.v1.executor.multiproc_executor:MultiprocExecutor")
        depth = cfg.get("max_concurrent_batches")
        if depth is None and multiproc is not None and isinstance(
                getattr(multiproc, "max_concurrent_batches", None), property):
            # what the deployment's executor (vLLM's MultiprocExecutor) reports for this config
            depth = multiproc.max_concurrent_batches.fget
        if self.topology.multiprocess:
            # the release's own MultiprocExecutor, unchanged: it forks a WorkerProc per rank
            self.ranks = self._lab(ranks.RankSet, self.worker, self.topology.world_size)
            self.ranks.start()
            executor_cls = self._lab(ranks.multiproc_executor)
        else:
            executor_cls = self._lab(make_executor_class, self.worker, depth)
        self.vllm_config = vllm_config
        engine = self._make_engine(vllm_config, executor_cls)
        if engine is not None:
            self._adopt(engine)

    def _make_engine(self, vllm_config, executor_cls):
        """The release's ``EngineCore`` built in this process with ``executor_cls`` (a vLLM
        exception there is :class:`_EngineBuildCrash`); :mod:`~vllm_repro.engine.core_proc`
        starts it in its own process behind the release's client instead (returns None)."""
        a = self.adapter
        engine_cls = _import("vllm.v1.engine.core:EngineCore")
        try:
            engine = call_supported(engine_cls, vllm_config=vllm_config,
                                    executor_class=executor_cls, log_stats=True,
                                    executor_fail_callback=None)
        except (AdapterError, RefusedByRelease, MemoryError):
            raise
        except Exception as exc:
            unknown = unknown_call(self.worker, exc, a.version)
            if unknown is not None:
                raise AdapterError(unknown) from exc
            if not vllm_frames(exc.__traceback__, a.vllm_file) or _raised_in_lab(exc):
                raise AdapterError(f"building vLLM {a.version}'s EngineCore failed in the lab: "
                                   f"{type(exc).__name__}: {exc}") from exc
            raise _EngineBuildCrash(exc) from exc
        return engine

    def _adopt(self, engine) -> None:
        """Take ``engine`` (the release's ``EngineCore``, or its ``EngineCoreProc`` in its own
        process) as this run's: its scheduler observed, its step function and batch queue read."""
        a = self.adapter
        cfg = self.cfg
        vllm_config = self.vllm_config
        self.engine = engine
        self.scheduler = engine.scheduler
        if self.ranks is not None:
            self.ranks.attach(engine.model_executor)
        if not hasattr(engine, "step_fn"):  # <= 0.10: EngineCoreProc.__init__ picks it
            engine.step_fn = (engine.step if getattr(engine, "batch_queue", None) is None
                              else engine.step_with_batch_queue)
        if not hasattr(engine, "output_queue"):
            engine.output_queue = queue.Queue()  # EngineCoreProc's, read by _process_engine_step
        want = cfg.get("max_concurrent_batches")
        got = getattr(engine, "batch_queue_size", 1)
        if want is not None and got != want:
            raise RefusedByRelease(
                f"config.max_concurrent_batches: vLLM {a.version}'s EngineCore sizes its batch "
                f"queue from its config ({got}), not from the executor; use "
                "pipeline_parallel_size / async_scheduling on this release")
        a.block_hasher = getattr(engine, "request_block_hasher", None)
        a.vllm_config = vllm_config
        self._proc_step = _process_engine_step()
        self._observe_scheduler()

    def _kv_worker(self, kv: dict):
        """The scripted connector's worker half for the scenario's ``kv_transfer_config``
        (:class:`~vllm_repro.engine.kv_worker.ScriptedWorker`); refused where the release has
        no KV connector seam, or no report of failed loads for a ``load_fails`` script."""
        a = self.adapter
        if not a.caps.kv_connectors:
            raise RefusedByRelease(f"kv_transfer_config: {a.caps.refusal('kv connectors')}")
        script = {rid: e for c in kv.get("connectors") or [kv]
                  for rid, e in (c.get("requests") or {}).items()}
        failing = [rid for rid, e in script.items() if e.get("load_fails")]
        if failing and not a.caps.kv_load_failures:
            raise RefusedByRelease(
                f"kv_transfer_config.requests.{failing[0]}.load_fails: vLLM {a.version}'s "
                "KVConnectorOutput has no report of failed loads (invalid_block_ids, "
                "failed_recving); drop load_fails for this release")
        waiting = [rid for rid, e in script.items() if e.get("not_ready_lookups")]
        if waiting and not a.caps.kv_lookup_not_ready:
            raise RefusedByRelease(
                f"kv_transfer_config.requests.{waiting[0]}.not_ready_lookups: vLLM {a.version}'s "
                "get_num_new_matched_tokens cannot answer None (\"not yet\", vLLM #23620, "
                "kv_connector/v1/base.py); drop not_ready_lookups for this release")
        from .kv_worker import ScriptedWorker

        if kv.get("kv_connector") == "MultiConnector":  # vLLM's own, scripted children
            from .connector import MultiWorkerHalf

            return MultiWorkerHalf(
                [c.get("requests") or {} for c in kv.get("connectors") or ()],
                set(a.caps.kv_load_failures),
                lambda cls, role: call_supported(
                    cls, vllm_config=self.vllm_config, role=role,
                    kv_cache_config=self.scheduler.kv_cache_config))

        def blocks_of(rid):
            # the request's blocks in the release's KV cache manager (KVCacheManager.get_block_ids)
            get = getattr(getattr(self.scheduler, "kv_cache_manager", None), "get_block_ids", None)
            try:
                return get(rid) if get is not None else []
            except Exception:  # noqa: BLE001 - a request the manager no longer holds
                return []

        return ScriptedWorker(script, set(a.caps.kv_load_failures), blocks_of)

    def _config_or_refusal(self, build):
        try:
            return build()
        except (AdapterError, RefusedByRelease, MemoryError):
            raise
        except Exception as exc:
            raise self.refusal(exc) from exc

    # ---- what the worker computes -------------------------------------------------------------
    def _make_output(self, sched_out):
        """``(sample, DraftTokenIds or None)`` for ``so``: the fake worker's computation, where
        ``sample(grammar_output)`` returns the ``ModelRunnerOutput`` with the step's grammar
        bitmask applied (``grammar_output``: what ``sample_tokens`` received; None: the bitmask
        on ``so`` where the release puts it there). A failure in either is a lab error, raised
        as :class:`AdapterError`."""
        return self._lab(self._compute_output, sched_out)

    def _compute_output(self, sched_out):
        a = self.adapter
        scheduled = a.scheduled(sched_out)
        req_ids, sampled, drafts = self.runner.execute(
            self.step, scheduled, self.scheduler.requests, getattr(sched_out, "finished_req_ids", ()), sched_out)
        if self.runner.draft_record is not None:
            self._line.drafter = self.runner.draft_record
        draft_ids = None
        if drafts is not None and a.DraftTokenIds is not None and "spec_token_ids" not in a._mro_fields:
            draft_ids = a.DraftTokenIds(req_ids, drafts)
        spec = {s.req_id: len(s.spec_tokens) for s in scheduled}
        kv = None
        if self.kv_worker is not None:
            # the worker's connector: the step's loads and sends from the scheduler's metadata,
            # what finished (GPUModelRunner: get_finished, get_block_ids_with_load_errors)
            mark = len(self.kv_worker.events)
            sending, recving, invalid, failed = self.kv_worker.step(
                self.step, getattr(sched_out, "kv_connector_metadata", None))
            kv = dict(finished_sending=sending, finished_recving=recving,
                      invalid_block_ids=invalid, failed_recving=failed,
                      completed_jobs=list(self.kv_worker.completed_jobs))
            line = self._line
            for _, rid, event in self.kv_worker.events[mark:]:
                line.kv_connector = line.kv_connector or {}
                line.kv_connector.setdefault(event, []).append(rid)

        def sample(grammar_output):
            def masked():
                rows = state.grammar_rows(grammar_output, sched_out, spec)
                tokens = self.runner.apply_grammar(req_ids, sampled, rows) if rows else sampled
                if rows:  # what the grammar let through, on the line of the step sampling it
                    line = self._line
                    line.sampled = {**(line.sampled or {}), **{
                        rid: list(t) for rid, t in zip(req_ids, tokens) if rid in rows}}
                return a.model_output(req_ids, tokens, drafts, kv)
            return self._lab(masked)
        return sample, draft_ids

    def _on_execute(self, sched_out) -> None:
        """A batch starts executing: in-flight aborts arrive now, as the engine's input thread
        would deliver them (``EngineCore.aborts_queue``, processed before ``update_from_output``)."""
        ids = self._in_flight.pop(self.step, None)
        if ids:
            self.engine.aborts_queue.put_nowait(list(ids))

    def _data_parallel(self, build_cfg: dict) -> dict:
        """``config.data_parallel_size`` > 1: refused here (one in-process EngineCore); the
        engine core processes' loop (:mod:`~vllm_repro.engine.core_proc`) runs it."""
        raise RefusedByRelease(
            f"config.data_parallel_size: {self.topology.dp}: data parallelism runs one engine "
            "core per DP rank (the release's DPEngineCoreProc and its coordinator), which this "
            "level's one in-process EngineCore is not; add multiprocess_mode: true and "
            "asyncio_mode: true (and model: mixtral-moe), or run the scenario at level: "
            "scheduler (one DP rank's scheduler)")

    # ---- observation of vLLM's own scheduler calls --------------------------------------------
    def _observe_scheduler(self) -> None:
        sched = self.scheduler
        schedule, update = sched.schedule, sched.update_from_output
        loop = self

        def observed_schedule(*args, **kwargs):
            loop._phase = "schedule"
            loop._marks = loop._lab(state.preemption_marks, sched)
            sched_out = schedule(*args, **kwargs)
            if (args[0] if args else kwargs.get("throttle_prefills")) is True:
                loop._line.throttle_prefills = True  # DPEngineCoreProc's DP prefill balancing
            scheduled = loop._lab(loop.adapter.scheduled, sched_out)
            not_ready = getattr(getattr(sched, "connector", None), "not_ready_log", None) if \
                loop.kv_worker is not None else None
            if not_ready:  # the scripted connector's "not yet" answers of this schedule()
                line = loop._line
                line.kv_connector = line.kv_connector or {}
                line.kv_connector.setdefault("not_ready", []).extend(not_ready)
                not_ready.clear()
            loop._note_schedule(loop._line, scheduled)
            loop._scheduled_so.append(sched_out)
            loop._so_step[id(sched_out)] = loop.step
            if loop.observer is not None and loop._lab(loop.observer.after_schedule, loop.step,
                                                       sched_out, scheduled):
                raise _ObserverStop()
            loop._phase = "execute_model"
            return sched_out

        def observed_update(sched_out, *args, **kwargs):
            loop._phase = "update_from_output"
            out = update(sched_out, *args, **kwargs)
            if loop._reasoning:  # where the release's reasoning parser left each request
                ended = loop._lab(state.reasoning_ended, sched.requests,
                                  list(sched_out.num_scheduled_tokens))
                if ended:
                    loop._line.reasoning_ended = {**(loop._line.reasoning_ended or {}), **ended}
            loop._updated_so.append(sched_out)
            loop._applied_from.append(loop._so_step.pop(id(sched_out), None))
            loop._phase = "step"
            return out

        sched.schedule = observed_schedule
        sched.update_from_output = observed_update

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Build vLLM's ``EngineCore`` (a crash there is a ``crash`` at step 0, phase
        ``engine-build``), then drive it step by step as its busy loop does (see the module
        docstring); the end of a run is :class:`~vllm_repro.engine.loop.StepLoop`'s."""
        t0 = time.perf_counter()
        self.runner = FakeModelRunner(self.scenario.get("model") or {}, self.cfg.get("num_speculative_tokens"))
        self.step = 0
        self._line = TraceLine(0)
        self._in_flight: dict[int, list[str]] = {}
        self._scheduled_so: list = []
        self._updated_so: list = []
        self._so_step: dict[int, int] = {}
        self._applied_from: list = []
        self._phase = "engine-build"
        self._reach: dict[str, int] = {}
        self.kv_worker = None
        self.ranks = None
        self.engine = None
        try:
            with _rank_env(self.cfg):
                return self._run(t0)
        finally:
            self._close_engine()

    def _close_engine(self) -> None:
        """vLLM's ``EngineCore.shutdown`` (with ranks: its executor stops their processes), then
        the lab's side of the ranks."""
        engine = self.engine
        if engine is not None and not getattr(self, "_shut", False):
            self._shut = True
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - shutdown after the run: nothing left to judge
                pass
        if self.ranks is not None:
            self.ranks.close()

    def _run(self, t0: float) -> RunResult:
        try:
            built = self._watched(0, "engine-build", lambda: self._build_engine(self.runner) or True,
                                  lambda: None)
        except _EngineBuildCrash as crash:
            return self._build_crashed(crash.__cause__, time.perf_counter() - t0)
        if built is None:  # the watchdog: EngineCore's start-up never returned
            return self._build_hung(time.perf_counter() - t0)
        self._check_events()
        record_stats = self._front_door_and_stats(self.vllm_config)
        build_s = time.perf_counter() - t0
        result = self._run_steps(build_s, lambda step, line: self._engine_step(step, line, record_stats),
                                 scheduled={})
        engine = self.engine
        result.engine = EngineInfo(
            getattr(self.vllm_config.cache_config, "num_gpu_blocks", None),
            getattr(engine, "batch_queue_size", 1),
            getattr(engine.step_fn, "__name__", str(engine.step_fn)), type(self.scheduler).__name__)
        if self.cfg.get("reasoning_parser"):
            result.engine.reasoning_parser = state.reasoning_parser_class(
                getattr(engine, "structured_output_manager", None))
        if self.ranks is not None:
            result.engine.topology = self.topology.describe()
            result.engine.executor = type(engine.model_executor).__name__
            result.faults = [f.brief() for f in self.ranks.fired] or None
        return result

    def _build_crashed(self, exc: BaseException, build_s: float) -> RunResult:
        """vLLM raised ``exc`` inside ``EngineCore.__init__``: a ``crash`` at step 0, logged as
        production logs it, with a step-0 trace line."""
        crash = describe_exception(exc, self.adapter.vllm_file, 0, "engine-build")
        self._log_fatal(exc, None)
        self.trace(TraceLine(0, phase="engine-build", crash=crash.brief()))
        return RunResult("crash", crash=crash, steps=0, finished={},
                         unfinished=[r.id for r in self.requests], limit_reached=False,
                         level=self.level, timing=Timing(round(build_s, 4)))

    def _engine_step(self, step: int, line: TraceLine, record_stats):
        """One turn of ``EngineCoreProc.run_busy_loop``: this step's requests added, events
        applied, then ``_process_engine_step`` when the engine has work, and the stats logged.
        Returns ``(result, the last scheduler output applied or scheduled)``; ``result`` is the
        run's end when the step ended it (the audit stopped it, or vLLM raised), else ``None``.
        Raises :class:`AdapterError` when the lab failed inside vLLM's step."""
        a = self.adapter
        engine = self.engine
        self._line = line
        self._scheduled_so, self._updated_so, self._applied_from = [], [], []
        self._phase = "add_request"
        try:
            for r in self.requests_by_step.get(step, []):
                refused = self._add(r)
                if refused is None:
                    line.added.append(r.id)
                else:
                    self.refused[r.id] = refused
                    line.refused = {**(line.refused or {}), r.id: refused}
            self._phase = "events"
            for e in self.events_by_step.get(step, []):
                perform(self, e, line)
            if not self._has_work():
                line.idle = True
                return None, None
            self._phase = "step"
            self._proc_step(engine)
            if not self._scheduled_so:
                line.idle = not self._updated_so
            line.applied = len(self._updated_so)
            queue_ = getattr(engine, "batch_queue", None)
            if queue_ is not None:  # which batches were applied, and what is still in flight
                line.applied_from = [s for s in self._applied_from if s is not None]
                # at the step's peak: queued after its schedule(), before its updates popped
                # a deque from 0.11; 0.10.x's batch queue is a queue.Queue (qsize)
                queued = queue_.qsize() if hasattr(queue_, "qsize") else len(queue_)
                line.in_flight = queued + len(line.applied_from)
            self._phase = "record_stats"
            for item in self._step_outputs(engine):
                # (client index, outputs) from 0.9; the EngineCoreOutputs alone in 0.8.x
                outs = item[1] if isinstance(item, tuple) else item
                all_stats = self._stats_of({0: outs}, record_stats is not None)
                self._note_stats(line, all_stats)
                if record_stats is not None:
                    for stats in all_stats:
                        record_stats(stats)
        except (RefusedByRelease, AdapterError):
            raise
        except (self._stop_exception(), _ObserverStop):
            return self._stopped(line), None
        except MemoryError:  # the worker's memory limit, not vLLM's failure
            raise
        except Exception as exc:  # vLLM raised: the reproduction's main kind of evidence
            unknown = unknown_call(getattr(self, "worker", None), exc, a.version)
            if unknown is not None:
                raise AdapterError(unknown) from exc
            if _raised_in_lab(exc):
                # the fake worker (called from inside vLLM's executor) or the observer
                # failed: a lab error, never a reproduction
                raise AdapterError(f"the lab failed inside vLLM {a.version}'s step "
                                   f"{step} ({self._phase}): {type(exc).__name__}: {exc}") from exc
            self._log_fatal(exc, (self._scheduled_so or [None])[-1])
            return self._crashed(exc, step, self._phase, line), None
        return None, (self._updated_so or self._scheduled_so or [None])[-1]

    def _step_outputs(self, engine):
        """What the step put on the engine's output queue (``EngineCoreProc.output_queue``),
        taken off it: ``(client index, EngineCoreOutputs)`` items, or ``EngineCoreOutputs``."""
        while not engine.output_queue.empty():
            yield engine.output_queue.get_nowait()

    def _progressed(self, line: TraceLine) -> bool:
        """Progress at the engine-core level: some request got further than it ever was
        (computed + output tokens above its high-water mark). Scheduled tokens alone are not:
        a prompt that is prefilled, preempted and prefilled again forever (a livelock) schedules
        tokens every step and never gets anywhere."""
        return self._advanced()

    def _busy(self) -> bool:
        return self._has_work()

    def _advanced(self) -> bool:
        """Whether any live request's computed + output tokens passed its high-water mark."""
        moved = False
        for rid, req in self.scheduler.requests.items():
            reach = (getattr(req, "num_computed_tokens", 0) or 0) + len(
                getattr(req, "output_token_ids", ()) or ())
            if reach > self._reach.get(rid, -1):
                self._reach[rid] = reach
                moved = True
        return moved

    def _has_work(self) -> bool:
        """Whether vLLM's busy loop would step now: unfinished requests (or finished ids still
        to send) in the scheduler, or a batch in flight in the batch queue."""
        if self.adapter.has_work(self.scheduler):
            return True
        return bool(getattr(self.engine, "batch_queue", None))

    def _add(self, r: ScenarioRequest) -> str | None:
        """Add request ``r`` as the engine's input thread does; returns the front door's error
        where the release refuses the request (its structured-output validation: an HTTP 400
        that never reaches EngineCore), else None."""
        a = self.adapter
        engine = self.engine
        ecr = self._lab(self._engine_core_request, r)
        self.order += 1
        refused = self._front_door_verdict(r, ecr.sampling_params)
        if refused is not None:
            return refused
        if hasattr(engine, "preprocess_add_request"):
            try:
                req, wave = engine.preprocess_add_request(ecr)
            except Exception as exc:
                # the engine process runs this in its input thread: where that thread answers
                # an exception with an error for the request, the request is refused and
                # EngineCore lives on; elsewhere it is a crash (add_request phase)
                if not a.caps.preprocess_errors_per_request or _raised_in_lab(exc) \
                        or not vllm_frames(exc.__traceback__, a.vllm_file):
                    raise
                first = " ".join(str(exc).strip().splitlines()[:1])
                return f"{type(exc).__name__}: {first} (EngineCore.preprocess_add_request)"
            engine.add_request(req, wave)
        else:  # <= 0.9: EngineCore.add_request takes the EngineCoreRequest itself
            engine.add_request(ecr)
            req = self.scheduler.requests.get(r.id)
        self.created[r.id] = req if req is not None else self.scheduler.requests.get(r.id)
        fut = state.grammar_future(self.created[r.id])
        if fut is not None:
            # the StructuredOutputManager compiles on its thread pool; the lab lets it finish
            # before the next step (compilation time zero), so runs are deterministic
            concurrent.futures.wait([fut])
        del a  # the adapter's request maker is the scheduler level's; here EngineCore makes it
        return None

    def _front_door_verdict(self, r: ScenarioRequest, sp) -> str | None:
        """What the release's front door says of request ``r`` (its ``SamplingParams`` ``sp``)
        where the lab asks it per request: a structured-output constraint (its grammar
        validation) and ``allowed_token_ids`` (the input processor's ``_validate_params``).
        ``"ExcType: message"`` where vLLM refuses it, else None."""
        if r.structured_outputs:
            refused = self._front_door_refuses(sp)
            if refused is not None:
                return refused
        if r.allowed_token_ids is not None:
            return self._front_door_refuses(sp, self.adapter.validate_sampling_params,
                                            "sampling-parameter")
        return None

    def _front_door_refuses(self, sp, validate=None, what: str = "structured-output") \
            -> str | None:
        """The release's own front-door validation of a request's ``SamplingParams``, on the
        engine's tokenizer: ``validate(sp, tokenizer)``, by default
        :meth:`~vllm_repro.engine.adapter.V1Adapter.validate_structured_outputs` (which also
        picks the request's grammar backend), or
        :meth:`~vllm_repro.engine.adapter.V1Adapter.validate_sampling_params` (the input
        processor's whole ``_validate_params``). ``"ExcType: message"`` where vLLM refuses it,
        None where it passes."""
        a = self.adapter
        tokenizer = self._front_tokenizer()
        validate = validate or a.validate_structured_outputs
        try:
            validate(sp, tokenizer)
        except (AdapterError, RefusedByRelease):
            raise
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal, or a lab failure
            if not vllm_frames(exc.__traceback__, a.vllm_file) or _raised_in_lab(exc):
                raise AdapterError(f"the front door's {what} validation failed in the "
                                   f"lab: {type(exc).__name__}: {exc}") from exc
            first = " ".join(str(exc).strip().splitlines()[:1])
            return f"{type(exc).__name__}: {first}"
        return None

    def _front_tokenizer(self):
        """The tokenizer the front door validates grammars with: the engine's structured-output
        manager's (vLLM's own, built from the config)."""
        return getattr(self.engine.structured_output_manager, "tokenizer", None)

    def _dp_rank_of(self, r: ScenarioRequest) -> int | None:
        """The DP rank request ``r`` is sent to (``EngineCoreRequest.data_parallel_rank``);
        None: the one engine core."""
        return None

    def _engine_core_request(self, r: ScenarioRequest):
        """An ``EngineCoreRequest`` (``vllm/v1/engine/__init__.py``) as the front end's
        ``Processor.process_inputs`` makes it for a token-id prompt."""
        a = self.adapter
        ecr_cls = _import("vllm.v1.engine:EngineCoreRequest")
        extra = {}
        if r.kv_transfer_params is not None:
            # the front end's place for them (serving: SamplingParams.extra_args), which
            # Request.__init__ reads into Request.kv_transfer_params
            if "extra_args" not in fields_of(a.SamplingParams):
                raise RefusedByRelease(f"requests[{r['id']}].kv_transfer_params: vLLM "
                                       f"{a.version}'s SamplingParams has no extra_args")
            extra["extra_args"] = {"kv_transfer_params": copy.deepcopy(r.kv_transfer_params)}
        if r.allowed_token_ids is not None:
            if "allowed_token_ids" not in fields_of(a.SamplingParams):
                raise RefusedByRelease(f"requests[{r.id}].allowed_token_ids: vLLM "
                                       f"{a.version}'s SamplingParams has no allowed_token_ids")
            extra["allowed_token_ids"] = list(r.allowed_token_ids)
        sp = call_supported(a.SamplingParams, max_tokens=r.max_tokens, ignore_eos=False,
                            temperature=0.0, **extra,
                            **a.structured_outputs_kwargs(r.id, r.structured_outputs))
        if hasattr(sp, "update_from_generation_config"):
            try:
                sp.update_from_generation_config({}, 2)
            except TypeError:
                pass
        arrival = r.arrival_time if r.arrival_time is not None else float(self.order)
        # prompt: the text prompt, a required field up to 0.8.4 that the front end sets to None
        # once the detokenizer has it ("set to None when it is added to EngineCoreClient")
        values = dict(
            request_id=r.id, prompt=None, prompt_token_ids=self.prompt_of(r), mm_features=None,
            mm_inputs=None, mm_kwargs=None, mm_hashes=None, mm_placeholders=None,
            sampling_params=sp, pooling_params=None, eos_token_id=2, arrival_time=arrival,
            lora_request=None, cache_salt=None, data_parallel_rank=self._dp_rank_of(r),
            prompt_embeds=None,
            client_index=0, current_wave=0, priority=r.priority, trace_headers=None,
            external_req_id=r.id, resumable=False, reasoning_ended=None)
        fields = getattr(ecr_cls, "__struct_fields__", None)
        if fields is None:
            return call_supported(ecr_cls, **values)
        if r.priority and "priority" not in fields:
            raise RefusedByRelease(f"requests[{r['id']}].priority: vLLM {a.version}'s "
                                   "EngineCoreRequest has no priority; use priority 0")
        return ecr_cls(**{k: values.get(k) for k in fields if k in values})

    # ---- events -----------------------------------------------------------------------------
    def _check_events(self) -> None:
        """Refuse, before the run, an event whose EngineCore call the release lacks."""
        engine = self.engine
        for e in map(from_mapping, self.scenario.get("events", [])):
            if isinstance(e, InjectFault) and self.ranks is None:
                raise RefusedByRelease(f"{e.where()}: a rank fault needs rank processes; add "
                                       "config.distributed_executor_backend: mp")
            if isinstance(e, Abort) and e.when == "in_flight" \
                    and not hasattr(engine, "aborts_queue") \
                    and getattr(engine, "batch_queue", None) is None:
                raise RefusedByRelease(
                    f"{e.where('when')}: in_flight: vLLM "
                    f"{self.adapter.version}'s EngineCore takes aborts only between steps (no "
                    "aborts_queue, no batch queue); use when: before_step on this release")
            why = refusal(e, self.adapter.caps.events, self.adapter.version)
            if why is not None:
                raise RefusedByRelease(why)

    # each event kind, performed on the release's EngineCore (engine/events.py's dispatch)
    def do_abort(self, e: Abort, line: TraceLine) -> None:
        if e.when == "in_flight" and hasattr(self.engine, "aborts_queue"):
            self._in_flight.setdefault(self.step, []).extend(e.ids)
        else:
            # before the step; with a batch queue the previous batch is still in flight
            self.engine.abort_requests(list(e.ids))
        line.aborted.extend(e.ids)

    def do_reset_prefix_cache(self, e: ResetPrefixCache, line: TraceLine) -> None:
        kwargs = {"reset_running_requests": True} if e.reset_running_requests else {}
        if e.reset_connector:
            kwargs["reset_connector"] = True
        self._marks = self._lab(state.preemption_marks, self.scheduler)
        line.reset_prefix_cache = self.engine.reset_prefix_cache(**kwargs)
        self._note_preemptions(line, "reset_prefix_cache")

    def do_pause(self, e: Pause, line: TraceLine) -> None:
        self._marks = self._lab(state.preemption_marks, self.scheduler)
        if e.mode:
            self.engine.pause_scheduler(mode=e.mode)
        else:
            call_supported(self.engine.pause_scheduler)
        self._note_preemptions(line, "pause")
        self._paused = True
        line.paused = e.mode or True

    def do_fault(self, e: InjectFault, line: TraceLine) -> None:
        from .ranks import Fault  # (multiprocessing, ctypes: only where a scenario has ranks)

        f = e.fault
        fault = Fault(rank=f.rank, kind=f.kind, at_step=e.at_step, seconds=f.seconds,
                      exit_code=f.exit_code, on_execute_model=f.on_execute_model)
        self.ranks.arm(fault)
        line.fault = fault.brief()

    def do_resume(self, e: Resume, line: TraceLine) -> None:
        self.engine.resume_scheduler()
        self._paused = False
        line.resumed = True

    # ---- the crash dump ----------------------------------------------------------------------
    def _log_fatal(self, exc: BaseException, sched_out) -> None:
        """What production logs when EngineCore dies: vLLM's ``dump_engine_exception`` (the
        "Dumping scheduler output ..." lines) and ``run_engine_core``'s "EngineCore encountered
        a fatal error." with the traceback, through vLLM's own logger (the engine log)."""
        logger = logging.getLogger("vllm.v1.engine.core")
        dump = _try_import("vllm.logging_utils.dump_input:dump_engine_exception")
        sched = getattr(self, "scheduler", None)
        if dump is not None and getattr(self, "vllm_config", None) is not None:
            try:
                stats = sched.make_stats() if sched is not None and sched_out is not None else None
                dump(self.vllm_config, sched_out, stats)
            except Exception:  # noqa: BLE001 - the dump is exception-free in vLLM; keep going
                pass
        logger.error("EngineCore encountered a fatal error.\n%s",
                     "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        for h in logging.getLogger("vllm").handlers:
            try:
                h.flush()
            except Exception:  # noqa: BLE001
                pass


class _rank_env:
    """The variables of vLLM's that a multi-process run sets for its duration (restored after):
    ``VLLM_WORKER_MULTIPROC_METHOD=fork`` (vLLM's default, said explicitly: the ranks inherit
    the emulated platform and the lab's setup) and, where the scenario gives
    ``config.execute_model_timeout_seconds``, the release's own
    ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (``MultiprocExecutor``'s RPC timeout)."""

    def __init__(self, cfg: dict):
        import os

        self.os = os
        self.want: dict[str, str] = {}
        if cfg.get("execute_model_timeout_seconds") is not None:
            self.want["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(
                int(cfg["execute_model_timeout_seconds"]))
        from .topology import topology

        try:
            if topology(cfg).multiprocess or cfg.get("multiprocess_mode"):
                self.want["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
            if topology(cfg).dp > 1:  # vLLM's own address of this host: loopback only
                self.want["VLLM_HOST_IP"] = "127.0.0.1"
        except ValueError:
            pass
        self.before: dict[str, str | None] = {}

    def __enter__(self):
        for k, v in self.want.items():
            self.before[k] = self.os.environ.get(k)
            self.os.environ[k] = v
        return self

    def __exit__(self, *exc):
        for k, v in self.before.items():
            if v is None:
                self.os.environ.pop(k, None)
            else:
                self.os.environ[k] = v


class _EngineBuildCrash(Exception):
    """vLLM raised inside ``EngineCore.__init__`` (its ``__cause__``): a start-up crash."""


class _ObserverStop(BaseException):
    """The observer asked to stop from inside an observed scheduler call."""


def _process_engine_step():
    """vLLM's ``EngineCoreProc._process_engine_step`` (``step_fn``, outputs to the output queue,
    ``post_step`` where the release has it), called on the plain ``EngineCore``."""
    proc = _import("vllm.v1.engine.core:EngineCoreProc")
    fn = getattr(proc, "_process_engine_step", None)
    if fn is None:
        raise AdapterError("vLLM's EngineCoreProc has no _process_engine_step")
    return fn


def _raised_in_lab(exc: BaseException) -> bool:
    """Whether ``exc`` is the fake's failure rather than vLLM's: raised in the lab's own package,
    or vLLM reaching for something the fake executor or worker lacks."""
    tb = traceback.extract_tb(exc.__traceback__)
    if tb and "/vllm_repro/" in tb[-1].filename:
        return True
    return isinstance(exc, (AttributeError, NotImplementedError)) and any(
        name in str(exc) for name in ("FakeExecutor", "FakeWorker", "is not implemented"))


__all__ = ["EngineCoreLoop", "iter_queue", "init_params"]
