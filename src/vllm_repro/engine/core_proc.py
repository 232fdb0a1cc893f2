"""``level: engine-core`` in the production shape (``config.multiprocess_mode: true``): the
release's own ``EngineCoreProc`` in its own process, started by the release's own client.

What runs, all of it vLLM's but the worker (the same :class:`~vllm_repro.engine.executor.
FakeWorker` or rank processes as at the in-process level)::

    lab worker process (the front end)              engine core process (forked by vLLM)
    EngineCoreClient.make_client(                   EngineCoreProc.run_engine_core
        multiprocess_mode=True, asyncio_mode=False,   EngineCoreProc.__init__: handshake, ZMQ
        vllm_config, executor_class=FakeExecutor)       input / output threads, EngineCore
      -> SyncMPClient -> launch_core_engines            (KV cache start-up, Scheduler, batch queue)
         -> CoreEngineProcManager (fork)              the busy loop, one turn a step:
    client.add_request(EngineCoreRequest)   --ZMQ-->    input thread -> input_queue ->
    client.abort_requests(ids)                          _handle_client_request (ADD / ABORT /
    client.reset_prefix_cache()                         UTILITY), _process_engine_step
    client.get_output() (output thread)     <--ZMQ--    output thread
    EngineDeadError where the core died                 run_engine_core: "EngineCore encountered a
                                                        fatal error.", _send_engine_dead()

The lab's side: the front end sends the scenario's requests and events through the client in
step order (a thread), and reads, over a pipe made before the fork, the trace lines and the
:class:`~vllm_repro.records.RunResult` that the engine core process sends. In the engine core
process the run is the in-process level's (:class:`~vllm_repro.engine.core_loop.EngineCoreLoop`,
inherited through the fork with the auditor): its scheduler observed, the audit after each
step, the trace; what differs is where requests and events come from: each step takes the
client's messages for that step off vLLM's own ``input_queue`` (as vLLM's input thread decoded
them from the client's socket) and hands them to vLLM's ``_handle_client_request``, then runs
vLLM's ``_process_engine_step``; the step's outputs go to vLLM's output thread (the lab reads a
copy for the stats). The one lab hook is ``EngineCoreProc.__init__`` wrapped for the duration of
``make_client`` in the front end (restored after; it acts only in a forked engine core
process): after vLLM's own ``__init__`` it points the instance's ``run_busy_loop`` at the lab's
start, which runs vLLM's own ``run_busy_loop`` with the instance's ``_process_input_queue`` a
no-op (the step takes its messages) and ``_process_engine_step`` one step of the run. A vLLM
exception in a step is re-raised out of vLLM's ``run_busy_loop`` once the result is sent, so
vLLM's ``run_engine_core`` logs it and tells the client, whose ``get_output`` raises
``EngineDeadError`` (``result.engine.client_error``); a start-up crash is vLLM's "EngineCore
failed to start." and the client's "Engine core initialization failed".

Runs inside the release environment (standard library + vLLM).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass

from ..records import EngineInfo, Hang, RunResult, Timing, TraceLine
from .adapter import AdapterError, RefusedByRelease, _import, call_supported
from . import state
from .core_loop import EngineCoreLoop, _raised_in_lab
from .events import Abort, Pause, ResetPrefixCache, Resume
from .loop import OverLimit, describe_exception, vllm_frames
from .spec import ScenarioRequest

#: seconds the engine core process waits for a client message its step needs
CLIENT_WAIT_S = 60.0
#: seconds an engine core waits, after another DP rank's run ended badly or after the front
#: end's end, for the rest of the DP group
DP_GRACE_S = 10.0
#: the one address a DP group and its coordinator may use
LOOPBACK = "127.0.0.1"
#: seconds without a word from the engine core process before the front end calls it a hang
#: (the scenario's ``limits.step_timeout_s`` where it gives one)
SILENCE_S = 300.0


def loop_class(scenario: dict) -> type[EngineCoreLoop]:
    """The engine-core driver a scenario asks for: :class:`CoreProcLoop` with
    ``config.multiprocess_mode: true``, else the in-process :class:`EngineCoreLoop`."""
    return CoreProcLoop if (scenario.get("config") or {}).get("multiprocess_mode") \
        else EngineCoreLoop


@dataclass
class _Pending:
    """What a forked engine core process takes from the front end: the run's loop (with its
    fake worker and auditor), the engine cores' ends of their pipes (one per DP rank: an
    engine core keeps its rank's, closes the others), the front end's pid and ends (closed in
    the child)."""

    loop: "CoreProcLoop"
    conns: list
    parent_conns: list
    parent: int


#: set by the front end while ``make_client`` forks the engine core process
_PENDING: _Pending | None = None


class _Line:
    """A trace line as the engine core process sent it (its JSON): what ``trace`` writes."""

    def __init__(self, step: int, text: str):
        self.step = step
        self.text = text

    def to_json(self) -> str:
        return self.text


class _ClientStopped(Exception):
    """Put on the client's output queue to end the lab's output thread."""


class CoreProcLoop(EngineCoreLoop):
    """One scenario run with the engine core in its own process (see the module docstring).
    In the front end it starts the release's client and relays; in the forked engine core
    process the same object (a copy) runs the steps."""

    # ---- the front end ----------------------------------------------------------------------
    def _run(self, t0: float) -> RunResult:
        self._refuse_unsent()
        self.client = None
        self._client_error: BaseException | None = None
        self._client_tb = ""
        self._client_finished: dict[str, str] = {}
        from .topology import topology

        n = max(1, topology(self.cfg).dp)  # engine cores: one per DP rank
        #: request id -> the DP rank it is sent to: the scenario's requests in order,
        #: round-robin (vLLM's DP client honours EngineCoreRequest.data_parallel_rank)
        self._dp_owner = {r.id: i % n for i, r in enumerate(self.requests)} if n > 1 else {}
        self.dp_rank: int | None = None
        # DP rank -> the last step whose client messages that engine core asked for
        self._wanted = dict.fromkeys(range(n), 0)
        self._want = threading.Condition()
        self._stopping = False
        ctx = multiprocessing.get_context("fork")
        pairs = [ctx.Pipe(duplex=True) for _ in range(n)]
        self._conns = [p[0] for p in pairs]
        self._conn = self._conns[0]
        child_conns = [p[1] for p in pairs]
        global _PENDING
        _PENDING = _Pending(self, child_conns, self._conns, os.getpid())
        # a write to a process that is gone is an error to handle here (and in the forked
        # engine core), not the worker's death by SIGPIPE (a warm worker has SIG_DFL)
        pipe_before = _set_sigpipe(signal.SIG_IGN)
        try:
            try:
                built = self._watched(0, "engine-build",
                                      lambda: self._build_engine(self.runner) or True, lambda: None)
            except _ClientStartFailed as failed:
                return self._start_failed(failed.__cause__, time.perf_counter() - t0)
            finally:
                _PENDING = None
                for c in child_conns:
                    c.close()
            if built is None:
                return self._build_hung(time.perf_counter() - t0)
            build_s = time.perf_counter() - t0
            outputs = threading.Thread(target=self._read_outputs, daemon=True,
                                       name="vllm-repro-client-outputs")
            outputs.start()
            for rank in range(n):  # one sender per engine core: no rank waits on another's step
                threading.Thread(target=self._send_inputs, args=(rank if n > 1 else None,),
                                 daemon=True, name=f"vllm-repro-client-inputs-{rank}").start()
            result = self._relay()
            if result.outcome == "crash":  # the client's side of the engine's death
                outputs.join(10.0)
            result.timing = result.timing or Timing(0.0)
            result.timing.build_s = round(build_s, 4)  # make_client: the process's start-up
            result.engine = result.engine or EngineInfo()
            result.engine.client = type(self.client).__name__
            if n > 1:
                resources = getattr(self.client, "resources", None)
                result.engine.coordinator = getattr(resources, "coordinator", None) is not None
            if self._client_error is not None:
                err = self._client_error
                result.engine.client_error = f"{type(err).__name__}: {err}"
                # what the front end prints where LLMEngine.step meets the dead engine
                logging.getLogger("vllm.v1.engine.core_client").error(
                    "The client's get_output() raised:\n%s", self._client_tb)
            return result
        finally:
            self._close_client()
            _set_sigpipe(pipe_before)

    def _refuse_unsent(self) -> None:
        """Refuse, before anything starts, a release without this shape (its capabilities
        record) and what this shape does not send through the client yet (exit 2, naming the
        field)."""
        caps = self.adapter.caps
        if caps.engine_core and not caps.engine_core_proc:
            raise RefusedByRelease(f"config.multiprocess_mode: {caps.refusal('engine core process')}")
        for e in (e for es in self.events_by_step.values() for e in es):
            if isinstance(e, Abort) and e.when == "in_flight":
                raise RefusedByRelease(f"{e.where('when')}: in_flight with "
                                       "config.multiprocess_mode: an abort reaches the engine core "
                                       "process through the client between steps; use when: "
                                       "before_step")
            if isinstance(e, (Pause, Resume)):
                raise RefusedByRelease(f"{e.where(e.action)} with config.multiprocess_mode: not "
                                       "sent through the client yet; drop multiprocess_mode")

    def _data_parallel(self, build_cfg: dict) -> dict:
        """``config.data_parallel_size`` > 1: one engine core process per DP rank, the release's
        ``DPEngineCoreProc`` (for an MoE model: ``config.model: mixtral-moe``) with its DP
        coordinator, started by its ``DPLBAsyncMPClient`` (``asyncio_mode: true``); the DP
        group on 127.0.0.1 (``data_parallel_master_ip``). Refused (exit 2, naming the field)
        where the release lacks it, without ``asyncio_mode``, with events, or with a DP rank
        off this host."""
        caps, topo = self.adapter.caps, self.topology
        where = f"config.data_parallel_size: {topo.dp}"
        if not caps.dp_engine_core_proc:
            raise RefusedByRelease(f"{where}: {caps.refusal('data parallel engine cores')}")
        if not self.cfg.get("asyncio_mode"):
            raise RefusedByRelease(f"{where}: vLLM's client for data parallelism is the asyncio "
                                   "one (make_async_mp_client: DPLBAsyncMPClient); add "
                                   "asyncio_mode: true")
        if self.events_by_step:
            raise RefusedByRelease(f"{where}: events are not sent through the DP client yet; "
                                   "drop events")
        if topo.dp_local != topo.dp:
            raise RefusedByRelease(f"config.data_parallel_size_local: {topo.dp_local}: every DP "
                                   "rank runs on this host; drop it")
        extra = dict(build_cfg.get("passthrough") or {})
        ip = extra.get("data_parallel_master_ip", LOOPBACK)
        if ip != LOOPBACK:
            raise RefusedByRelease(f"config.data_parallel_master_ip: {ip!r}: the lab's DP group "
                                   f"and coordinator stay on {LOOPBACK}; drop it")
        extra["data_parallel_master_ip"] = LOOPBACK
        # EngineArgs.create_engine_config's default (ParallelConfig's own is 1: a DP rank
        # elsewhere, whose handshake rank 0's client would wait for)
        extra["data_parallel_size_local"] = topo.dp
        return {**build_cfg, "passthrough": extra}

    def _dp_rank_of(self, r: ScenarioRequest) -> int | None:
        return self._dp_owner.get(r.id) if getattr(self, "_dp_owner", None) else None

    def _make_engine(self, vllm_config, executor_cls):
        """Start the engine core process the release's way (its client), with the lab's hook
        on ``EngineCoreProc.__init__`` for the fork; returns None (the engine is elsewhere).
        Raises :class:`_ClientStartFailed` where ``make_client`` raised."""
        client_cls = _import("vllm.v1.engine.core_client:EngineCoreClient")
        proc_cls = _import("vllm.v1.engine.core:EngineCoreProc")
        original = proc_cls.__dict__["__init__"]
        parent = os.getpid()

        @functools.wraps(original)
        def __init__(engine, *args, **kwargs):
            if os.getpid() == parent:
                return original(engine, *args, **kwargs)
            return _child_init(original, engine, *args, **kwargs)

        proc_cls.__init__ = __init__
        asyncio_mode = bool(self.cfg.get("asyncio_mode"))
        self._calls = _AsyncCalls() if asyncio_mode else _SyncCalls()

        def make():
            return call_supported(client_cls.make_client, multiprocess_mode=True,
                                  asyncio_mode=asyncio_mode, vllm_config=vllm_config,
                                  executor_class=executor_cls, log_stats=True)
        try:
            self.client = self._calls.start(make)
        except Exception as exc:  # noqa: BLE001 - the engine core process failed to start
            raise _ClientStartFailed() from exc
        finally:
            proc_cls.__init__ = original
        return None

    def _start_failed(self, exc: BaseException, build_s: float) -> RunResult:
        """``make_client`` raised: the engine core process's own account of its start-up (a
        crash at step 0, or a lab error) where it sent one, else a lab error."""
        got = self._drain(timeout=5.0)
        if got is not None:
            got.timing = got.timing or Timing(round(build_s, 4))
            got.engine = got.engine or EngineInfo()
            got.engine.client_error = f"{type(exc).__name__}: {exc}"
            return got
        raise AdapterError(f"vLLM {self.adapter.version}'s client could not start the engine "
                           f"core process: {type(exc).__name__}: {exc}") from exc

    def _client_steps(self, rank: int | None = None) -> list[int]:
        """The steps that send the client something (requests, aborts, reset_prefix_cache);
        with ``rank``, those of the requests sent to that DP rank."""
        if rank is not None:
            return sorted({r.at_step for r in self.requests if self._dp_owner[r.id] == rank})
        return sorted(set(self.requests_by_step) | {
            step for step, es in self.events_by_step.items()
            if any(isinstance(e, (Abort, ResetPrefixCache)) for e in es)})

    def _send_inputs(self, rank: int | None = None) -> None:
        """The scenario's requests and events through the client, each step's once the engine
        core process reached that step and asked for them (as a front end whose users send
        them then: sent earlier, vLLM's input thread would hand an abort to the engine's
        ``aborts_queue`` steps before it is due); with ``rank`` (data parallelism) the
        requests sent to that DP rank, once its engine core asked."""
        client = self.client
        try:
            for step in self._client_steps(rank):
                with self._want:
                    while self._wanted[rank or 0] < step and not self._stopping:
                        self._want.wait(0.5)
                    if self._stopping:
                        return
                for r in self.requests_by_step.get(step, []):
                    if rank is not None and self._dp_owner[r.id] != rank:
                        continue
                    ecr = self._engine_core_request(r)
                    self.order += 1
                    if r.structured_outputs or r.allowed_token_ids is not None:
                        refused = self._front_door_verdict(r, ecr.sampling_params)
                        self._conn.send(("front_door", r.id, refused))
                        if refused is not None:
                            continue  # the front door's 400: never sent
                    self._calls.call(client, "add_request", ecr)
                for e in self.events_by_step.get(step, []):
                    if isinstance(e, Abort):
                        self._calls.call(client, "abort_requests", list(e.ids))
                    elif isinstance(e, ResetPrefixCache):
                        kwargs = {"reset_running_requests": True} \
                            if e.reset_running_requests else {}
                        if e.reset_connector:
                            kwargs["reset_connector"] = True
                        self._calls.call(client, "reset_prefix_cache", **kwargs)
        except Exception:  # noqa: BLE001 - the engine died: the relay reports it
            return

    def _read_outputs(self) -> None:
        """The front end's output handler (``LLMEngine.step``'s ``get_output``): finished
        requests noted, the client's error (``EngineDeadError``) kept."""
        while True:
            try:
                outs = self._calls.call(self.client, "get_output")
            except _ClientStopped:
                return
            except Exception as exc:  # noqa: BLE001 - vLLM's client raised: what a user sees
                self._client_error = exc
                self._client_tb = "".join(traceback.format_exception(type(exc), exc,
                                                                     exc.__traceback__))
                return
            for o in getattr(outs, "outputs", None) or ():
                if getattr(o, "finish_reason", None) is not None:
                    self._client_finished[o.request_id] = str(o.finish_reason)

    def _relay(self) -> RunResult:
        """Trace lines written as they come, until the engine core process's result."""
        got = self._drain(timeout=None)
        if got is not None:
            return got
        codes = self._exit_codes()
        raise AdapterError(f"vLLM {self.adapter.version}'s engine core process ended without "
                           f"the lab's result (exit codes {codes})")

    def _drain(self, timeout: float | None) -> RunResult | None:
        """Read the engine core processes' messages: trace lines written, a lab error raised
        here, the result returned (with data parallelism, once every engine core sent its own:
        :func:`_merged`; after one that is not clean, what the others sent in
        :data:`DP_GRACE_S`); None when the processes are gone (or ``timeout`` s passed) without
        one. Silence past :data:`SILENCE_S` is a ``hang``."""
        limit = float(self.limits.step_timeout_s or SILENCE_S)
        start = last = time.monotonic()
        last_step = 0
        results: dict[int, RunResult] = {}
        gone: set[int] = set()
        grace: float | None = None
        while True:
            waiting = [c for i, c in enumerate(self._conns) if i not in results and i not in gone]
            if results and (not waiting or (grace is not None and time.monotonic() > grace)):
                return _merged(results, len(self._conns) > 1)
            if not waiting:
                return None
            ready = multiprocessing.connection.wait(waiting, 0.2)
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    gone.add(rank)
                    continue
                last = time.monotonic()
                kind = msg[0]
                if kind == "want":
                    with self._want:
                        self._wanted[rank] = msg[1]
                        self._want.notify_all()
                elif kind == "trace":
                    last_step = max(last_step, msg[1])
                    self.trace(_Line(msg[1], msg[2]))
                elif kind == "result":
                    results[rank] = RunResult.from_dict(msg[1])
                    if results[rank].outcome != "clean" and grace is None:
                        grace = time.monotonic() + DP_GRACE_S
                elif kind == "error":
                    raise _ERRORS.get(msg[1], AdapterError)(msg[2])
            if ready:
                continue
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                return None
            if self._exit_codes() and all(c is not None for c in self._exit_codes()):
                if results:
                    return _merged(results, len(self._conns) > 1)
                return None if not any(c.poll(0.5) for c in waiting) else self._drain(timeout=1.0)
            if now - last > limit:
                return RunResult("hang", hang=Hang(last_step + 1, limit, "engine core process",
                                                   stopped="interrupted"),
                                 steps=last_step, level=self.level)

    def _exit_codes(self) -> list:
        """Exit codes of the client's engine core processes (None: alive); [] when the release's
        client does not say."""
        resources = getattr(self.client, "resources", None)
        manager = getattr(resources, "engine_manager", None)
        return [p.exitcode for p in getattr(manager, "processes", None) or ()]

    def _close_client(self) -> None:
        """The end of the run, the release's way: the engine core process told to leave its
        loop, the client's ``shutdown`` (vLLM stops its processes: SIGTERM, then SIGKILL), the
        lab's output thread let go, pending utility calls failed."""
        with self._want:
            self._stopping = True
            self._want.notify_all()
        for conn in getattr(self, "_conns", ()):
            try:
                conn.send(("end",))
            except (OSError, ValueError, AttributeError):
                pass
        client = self.client
        calls = getattr(self, "_calls", None)
        if client is not None:
            calls.stop(client)
        if calls is not None:
            calls.close()
        for conn in getattr(self, "_conns", ()):
            try:
                conn.close()
            except (OSError, AttributeError):
                pass
        if self.ranks is not None:
            self.ranks.close()

    def _close_engine(self) -> None:
        """Nothing here: the engine core process is the client's (:meth:`_close_client`)."""

    # ---- the engine core process --------------------------------------------------------------
    def _child_run(self, engine, conn) -> None:
        """The engine core process's busy loop for this run: vLLM's own ``run_busy_loop``, whose
        ``_process_input_queue`` and ``_process_engine_step`` are the run's on the instance:
        the first does nothing (the step takes its client messages), the second runs one step
        of the in-process level (:meth:`_steps`: the step's client messages off the input queue,
        then vLLM's own ``_process_engine_step``, the audit). Sends each trace line and, at the
        run's end, the result to the front end; then re-raises vLLM's exception out of vLLM's
        busy loop (``run_engine_core`` logs it and tells the client) or waits for the front
        end's end and leaves as on SIGTERM (``SystemExit``)."""
        self.watchdog = None  # its thread stayed in the front end
        _no_device_caches()
        rank = self.dp_rank
        if rank is not None:  # this DP rank's requests only (the client sends it those)
            self.requests = tuple(r for r in self.requests if self._dp_owner[r.id] == rank)
            self.requests_by_step = {}
            for r in self.requests:
                self.requests_by_step.setdefault(r.at_step, []).append(r)
        self._done = False

        def send_line(line):
            line.dp_rank = rank
            conn.send(("trace", line.step, line.to_json()))
        self.trace = send_line
        self._child_conn = conn
        self._asks = set(self._client_steps())
        self._fatal: BaseException | None = None
        self._outputs: list = []
        t0 = time.perf_counter()
        try:
            self._adopt(engine)
            q = engine.output_queue
            real_put = q.put_nowait

            def put_nowait(item, _real=real_put):  # a copy of what goes to the output thread
                self._outputs.append(item)
                return _real(item)

            q.put_nowait = put_nowait
            self._preproc_errors: dict[str, BaseException] = {}
            real_pre = getattr(engine, "preprocess_add_request", None)
            if real_pre is not None:
                def preprocess_add_request(request, _real=real_pre):  # on vLLM's input thread
                    try:
                        return _real(request)
                    except Exception as exc:  # vLLM answers it per request (an error output)
                        self._preproc_errors[request.request_id] = exc
                        raise
                engine.preprocess_add_request = preprocess_add_request
            self._check_events()
            record_stats = self._front_door_and_stats(self.vllm_config)
        except Exception as exc:  # noqa: BLE001 - a lab error or refusal before any step
            self._send_lab_error(conn, exc)
            self._leave(engine, conn)
        steps = self._steps(time.perf_counter() - t0, record_stats)

        def _process_input_queue():
            """The step's client messages are taken in the step (:meth:`_take_client_message`).
            A DP rank whose run is over serves vLLM's input queue (the coordinator's waves) and
            leaves on the front end's end once its wave is over (:meth:`_dp_idle`)."""
            if self._done:
                self._dp_idle(engine, conn)

        def _process_engine_step():
            if self._done:
                return False
            try:
                next(steps)
                return bool(self._scheduled_so)
            except StopIteration:
                pass
            except Exception as exc:  # noqa: BLE001 - a lab error or refusal in a step
                self._send_lab_error(conn, exc)
                self._leave(engine, conn)
            result = self._result
            result.engine = EngineInfo(
                getattr(self.vllm_config.cache_config, "num_gpu_blocks", None),
                getattr(engine, "batch_queue_size", 1),
                getattr(engine.step_fn, "__name__", str(engine.step_fn)),
                type(self.scheduler).__name__, topology=self.topology.describe(),
                executor=type(engine.model_executor).__name__, process=type(engine).__name__)
            if self.ranks is not None:
                result.faults = [f.brief() for f in self.ranks.fired] or None
            conn.send(("result", result.to_dict()))
            if self._fatal is not None:
                raise self._fatal  # out of vLLM's busy loop: run_engine_core logs it
            if rank is None:
                self._leave(engine, conn)
            # a DP rank goes on in vLLM's DP busy loop (dummy batches, the DP all-reduce) while
            # another rank has requests, as DPEngineCoreProc does
            self._done = True
            self._end_asked = None
            return False

        engine._process_input_queue = _process_input_queue
        engine._process_engine_step = _process_engine_step
        return type(engine).run_busy_loop(engine)  # vLLM's own

    def _steps(self, build_s: float, record_stats):
        """:meth:`StepLoop._run_steps` as a generator: one step per ``next`` (one turn of vLLM's
        busy loop); at the end ``self._result`` is the run's result."""
        max_steps, stall_steps, last_add = self._limits_and_attach()
        result = RunResult("clean")
        step = 0
        t1, c1 = time.perf_counter(), time.process_time()
        self.ran_out = False
        for step in range(1, max_steps + 1):
            self.step = step
            line = TraceLine.begin(step, {})
            ended, sched_out = self._engine_step(step, line, record_stats)
            done = ended is not None
            if not done:
                ended, done = self._end_of_step(step, line, sched_out, last_add, stall_steps)
            if done:
                result = ended or result
                break
            yield
        else:
            self.ran_out = max_steps > 0
        self._result = self.finish_result(result, step, build_s, time.perf_counter() - t1,
                                          time.process_time() - c1)

    @staticmethod
    def _send_lab_error(conn, exc: BaseException) -> None:
        """A lab error or refusal in the engine core process, sent to the front end (which
        raises it again there)."""
        if isinstance(exc, (RefusedByRelease, AdapterError, OverLimit)):
            conn.send(("error", type(exc).__name__, str(exc)))
        else:
            conn.send(("error", "AdapterError", f"the lab failed in the engine core process: "
                       f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"))

    def _dp_idle(self, engine, conn) -> None:
        """A DP rank after its run: what vLLM's ``_process_input_queue`` would hand
        ``_handle_client_request`` (``START_DP_WAVE``) handed it; leaves vLLM's busy loop as on
        SIGTERM once the front end said end and the wave is over (``engines_running`` false:
        the other ranks passed the same all-reduce), or :data:`DP_GRACE_S` after the end, or
        when the front end is gone."""
        if self._end_asked is None and conn.poll(0):
            try:
                conn.recv()
            except (EOFError, OSError):
                pass
            self._end_asked = time.monotonic()
        if os.getppid() == 1:
            raise SystemExit(0)
        if self._end_asked is not None and (
                not getattr(engine, "engines_running", False)
                or time.monotonic() - self._end_asked > DP_GRACE_S):
            raise SystemExit(0)
        try:
            item = engine.input_queue.get(timeout=0.02)
        except queue.Empty:
            return
        engine._handle_client_request(*item)

    @staticmethod
    def _leave(engine, conn):
        """Wait for the front end's end (or its death, or vLLM's shutdown state), then leave
        vLLM's busy loop as on SIGTERM. Leaving earlier, the client may still wait for the
        input thread's first message (0.10.2's MPClient start-up)."""
        while True:
            if conn.poll(0.2):
                try:
                    conn.recv()
                except (EOFError, OSError):
                    pass
                break
            if os.getppid() == 1 or getattr(getattr(engine, "shutdown_state", None), "name",
                                            "RUNNING") != "RUNNING":
                break
        raise SystemExit(0)

    def _engine_step(self, step: int, line: TraceLine, record_stats):
        """The in-process level's step, after asking the front end for this step's client
        messages where it has some."""
        if step in self._asks:
            self._child_conn.send(("want", step))
        return super()._engine_step(step, line, record_stats)

    def _take_client_message(self, kind: str, rid: str | None = None):
        """The next client message of ``kind`` (``ADD``, ``ABORT``, ``UTILITY``) off vLLM's
        input queue, handed to vLLM's ``_handle_client_request`` (with whatever came before it).
        For an ``ADD`` of request ``rid`` that vLLM's input thread refused in its
        ``preprocess_add_request`` (it answers the client with an error output and queues
        nothing), returns that exception; else None. Raises :class:`AdapterError` where the
        message does not come in :data:`CLIENT_WAIT_S`."""
        engine = self.engine
        deadline = time.monotonic() + CLIENT_WAIT_S
        while True:
            if rid is not None and rid in self._preproc_errors:
                return self._preproc_errors.pop(rid)
            if time.monotonic() > deadline:
                raise AdapterError(f"step {self.step}: the client's {kind} message did not reach "
                                   f"EngineCoreProc's input queue in {CLIENT_WAIT_S:.0f} s")
            try:
                item = engine.input_queue.get(timeout=0.05)
            except queue.Empty:
                continue
            request_type = item[0]
            engine._handle_client_request(*item)
            if getattr(request_type, "name", str(request_type)) == kind:
                return None

    def _add(self, r: ScenarioRequest) -> str | None:
        """The client's ``add_request`` of ``r``, handled by vLLM (its input thread decoded
        and preprocessed it; ``_handle_client_request`` adds it); a structured-output request
        the front door refuses (as the front end judged it too, and did not send) is refused,
        and so is one whose ``allowed_token_ids`` it refuses."""
        if r.structured_outputs or r.allowed_token_ids is not None:
            refused = self._front_door_answer(r.id)
            if refused is not None:
                self.order += 1
                return refused
        failed = self._take_client_message("ADD", r.id)
        self.order += 1
        if failed is not None:  # vLLM's input thread refused it and told the client
            first = " ".join(str(failed).strip().splitlines()[:1])
            return f"{type(failed).__name__}: {first} (EngineCore.preprocess_add_request)"
        req = self.created[r.id] = self.scheduler.requests.get(r.id)
        fut = state.grammar_future(req)
        if fut is not None:  # compilation time zero, as in-process: runs are deterministic
            concurrent.futures.wait([fut])
        return None

    def _front_door_answer(self, rid: str) -> str | None:
        """The front end's judgement of request ``rid`` (structured outputs or
        ``allowed_token_ids``: its refusal, or None: sent), read off the pipe. Raises
        :class:`AdapterError` where it does not come in :data:`CLIENT_WAIT_S` or is another
        request's."""
        conn = self._child_conn
        if not conn.poll(CLIENT_WAIT_S):
            raise AdapterError(f"step {self.step}: the front end's front-door answer for request "
                               f"{rid} did not come in {CLIENT_WAIT_S:.0f} s")
        kind, got, refused = conn.recv()
        if (kind, got) != ("front_door", rid):
            raise AdapterError(f"step {self.step}: the front end answered {kind} {got}, not the "
                               f"front door of request {rid}")
        return refused

    def _front_tokenizer(self):
        """In the engine core process the engine's; in the front end, the tokenizer of a
        ``StructuredOutputManager`` of the release built from the same config (what the
        front end's processor holds)."""
        if self.engine is not None:
            return super()._front_tokenizer()
        if getattr(self, "_front_manager", None) is None:
            manager = _import("vllm.v1.structured_output:StructuredOutputManager")
            self._front_manager = manager(self.vllm_config)
        return getattr(self._front_manager, "tokenizer", None)

    # aborts and reset_prefix_cache as the client sent them (engine/events.py's dispatch);
    # faults as in-process
    def do_abort(self, e: Abort, line: TraceLine) -> None:
        self._take_client_message("ABORT")
        line.aborted.extend(e.ids)

    def do_reset_prefix_cache(self, e: ResetPrefixCache, line: TraceLine) -> None:
        self._marks = self._lab(state.preemption_marks, self.scheduler)
        mark = len(self._outputs)
        self._take_client_message("UTILITY")
        line.reset_prefix_cache = _utility_result(self._outputs[mark:])
        self._note_preemptions(line, "reset_prefix_cache")

    def _step_outputs(self, engine):
        """The copy of what this step put on the output queue (vLLM's output thread sends the
        items themselves to the client)."""
        items, self._outputs[:] = list(self._outputs), []
        return items

    def _log_fatal(self, exc: BaseException, sched_out) -> None:
        """Kept to re-raise: vLLM's ``run_engine_core`` logs it here (its crash dump was
        written by ``EngineCore.step``'s own ``log_error_detail`` where the release has it)."""
        self._fatal = exc


class _SyncCalls:
    """The client's calls as ``SyncMPClient`` takes them (``asyncio_mode: false``)."""

    def start(self, make):
        return make()

    def call(self, client, name: str, *args, **kwargs):
        return call_supported(getattr(client, name), **kwargs) if kwargs and not args \
            else getattr(client, name)(*args, **kwargs)

    def stop(self, client) -> None:
        """vLLM's ``shutdown``, then the lab's output thread and pending utility calls let go."""
        try:
            client.shutdown()
        except Exception:  # noqa: BLE001 - shutdown after the run: nothing left to judge
            pass
        outputs_queue = getattr(client, "outputs_queue", None)
        if outputs_queue is not None:
            outputs_queue.put_nowait(_ClientStopped())
        for fut in list((getattr(client, "utility_results", None) or {}).values()):
            if not fut.done():
                fut.set_exception(_ClientStopped())

    def close(self) -> None:
        pass


class _AsyncCalls(_SyncCalls):
    """The client's calls as ``AsyncMPClient`` takes them (``asyncio_mode: true``, what
    ``AsyncLLM`` builds): its ``*_async`` methods, awaited on an event loop of the lab's own
    thread, where the client is made (its output task runs there)."""

    def __init__(self):
        import asyncio

        self.asyncio = asyncio
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="vllm-repro-client-loop")
        self.thread.start()

    def _run(self, coro_fn, timeout: float | None = None):
        return self.asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def start(self, make):
        async def made():
            return make()
        return self._run(made)

    def call(self, client, name: str, *args, **kwargs):
        fn = getattr(client, f"{name}_async")

        async def awaited():
            if kwargs and not args:
                return await call_supported(fn, **kwargs)
            return await fn(*args, **kwargs)
        return self._run(awaited)

    def stop(self, client) -> None:
        async def stopped():
            try:
                client.shutdown()
            except Exception:  # noqa: BLE001 - shutdown after the run: nothing left to judge
                pass
            outputs_queue = getattr(client, "outputs_queue", None)
            if outputs_queue is not None:
                outputs_queue.put_nowait(_ClientStopped())
            for fut in list((getattr(client, "utility_results", None) or {}).values()):
                if not fut.done():
                    fut.set_exception(_ClientStopped())
        try:
            self._run(stopped, timeout=60.0)
        except Exception:  # noqa: BLE001 - the loop is closed below either way
            pass

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        if not self.thread.is_alive():
            self.loop.close()


class _ClientStartFailed(Exception):
    """``make_client`` raised (its ``__cause__``): the engine core process did not start."""


#: lab errors the engine core process reports, raised again in the front end
_ERRORS = {"RefusedByRelease": RefusedByRelease, "AdapterError": AdapterError,
           "OverLimit": OverLimit}


def _no_device_caches() -> None:
    """On leaving, vLLM's ``run_engine_core`` shuts the engine down through
    ``vllm/distributed/parallel_state.py:cleanup_dist_env_and_memory``, which on a non-CPU
    platform (the emulated GPU) empties the device's caches: ``torch.accelerator.empty_cache()``
    raises "Cannot access accelerator device when none is available" on this host, and its
    traceback in ``engine.log`` read as the run's crash to triage. There is no device cache to
    empty: the calls do nothing in the engine core process (where a real accelerator is there,
    they are left as they are)."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is None or acc.is_available():
        return
    for name in ("empty_cache", "empty_host_cache"):
        if hasattr(acc, name):
            setattr(acc, name, lambda: None)


def _merged(results: dict[int, RunResult], dp: bool) -> RunResult:
    """One run's result from its engine cores' (DP rank -> :class:`RunResult`; ``dp``: data
    parallelism, else the one engine core's as it sent it): the first
    rank's that is not clean (else rank 0's), with every rank's finished, refused and
    unfinished requests, violations, audit checks and the most steps; ``engine.engine_cores``
    says how many sent one."""
    if not dp:
        return next(iter(results.values()))
    order = sorted(results)
    base = next((results[i] for i in order if results[i].outcome != "clean"), results[order[0]])
    others = [results[i] for i in order if results[i] is not base]
    for r in others:
        base.finished = {**(base.finished or {}), **(r.finished or {})}
        if r.refused:
            base.refused = {**(base.refused or {}), **r.refused}
        base.unfinished = [*(base.unfinished or []), *(r.unfinished or [])]
        if r.violations:
            base.violations = [*(base.violations or []), *r.violations]
        if base.audit is not None and r.audit is not None:
            base.audit.checks += r.audit.checks
        base.steps = max(base.steps or 0, r.steps or 0)
    base.engine = base.engine or EngineInfo()
    base.engine.engine_cores = len(results)
    return base


def _set_sigpipe(handler):
    """Set SIGPIPE's handler where this is the main thread; returns the one before (None
    elsewhere, and ``handler`` None sets nothing)."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGPIPE, handler)


def _utility_result(items: list):
    """The value of the first utility call's answer among output-queue ``items`` (vLLM's
    ``UtilityOutput.result``, unwrapped from ``UtilityResult``); None where it failed."""
    for item in items:
        outs = item[1] if isinstance(item, tuple) else item
        uo = getattr(outs, "utility_output", None)
        if uo is not None:
            res = getattr(uo, "result", None)
            return getattr(res, "result", res)
    return None


def _child_init(original, engine, *args, **kwargs) -> None:
    """vLLM's ``EngineCoreProc.__init__`` in a forked engine core process, then the instance's
    ``run_busy_loop`` set to the run's (:meth:`CoreProcLoop._child_run`). A vLLM exception in
    the start-up is sent to the front end as the run's crash (step 0, ``engine-build``) and
    raised on: vLLM's ``run_engine_core`` logs "EngineCore failed to start."."""
    pending = _PENDING
    if pending is None:  # not a lab run's engine core
        return original(engine, *args, **kwargs)
    for c in pending.parent_conns:
        try:
            c.close()
        except OSError:
            pass
    loop = pending.loop
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    if len(pending.conns) > 1:  # one engine core per DP rank: this one's pipe
        pc = vllm_config.parallel_config
        # EngineCoreProc's engine_index (DPEngineCoreProc passes its data_parallel_rank; a
        # non-MoE model's independent DP ranks get theirs from run_engine_core)
        rank = kwargs.get("engine_index")
        loop.dp_rank = rank = pc.data_parallel_rank if rank is None else rank
        for i, c in enumerate(pending.conns):
            if i != rank:
                c.close()
    conn = pending.conns[loop.dp_rank or 0]
    from . import ranks

    if ranks._SETUP is not None:  # the ranks are this process's children now
        ranks._SETUP.parent = os.getpid()
    try:
        original(engine, *args, **kwargs)
    except Exception as exc:
        a = loop.adapter
        if _raised_in_lab(exc) or not vllm_frames(exc.__traceback__, a.vllm_file):
            conn.send(("error", "AdapterError", f"building vLLM {a.version}'s EngineCoreProc "
                       f"failed in the lab: {type(exc).__name__}: {exc}"))
        else:
            crash = describe_exception(exc, a.vllm_file, 0, "engine-build")
            conn.send(("trace", 0, TraceLine(0, phase="engine-build",
                                             crash=crash.brief()).to_json()))
            conn.send(("result", RunResult(
                "crash", crash=crash, steps=0, finished={},
                unfinished=[r.id for r in loop.requests], limit_reached=False,
                level=loop.level, engine=EngineInfo(process=type(engine).__name__)).to_dict()))
        raise
    engine.run_busy_loop = functools.partial(loop._child_run, engine, conn)


__all__ = ["CoreProcLoop", "loop_class", "CLIENT_WAIT_S"]
