"""Ranks as processes: the release's own ``MultiprocExecutor`` with the lab's fake worker in each
rank, and faults injected into them (``distributed_executor_backend: mp``).

vLLM builds and runs everything here but the worker: ``EngineCore(vllm_config,
executor_class=MultiprocExecutor)`` starts its own ``WorkerProc`` per rank (forked: vLLM's
default ``VLLM_WORKER_MULTIPROC_METHOD=fork``, so each rank inherits the engine process's emulated
platform and the lab), its shared-memory broadcast queue (``shm_broadcast.MessageQueue``) carries
every ``collective_rpc`` to all ranks, each rank answers on its own response queue, the output
rank (TP rank 0 of the last PP stage, ``_get_output_rank``) gives the step's output, futures
(``FutureWrapper``) and the RPC timeout (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``) are vLLM's.
Each rank's worker is :class:`RankWorker`, named through the release's own setting
(``ParallelConfig.worker_cls``, resolved by ``WorkerWrapperBase.init_worker``): no vLLM file is
patched.

What a GPU computes is the fake's, as at the in-process level: the engine process's
:class:`~vllm_repro.engine.fake_executor.FakeWorker` computes each answer at the moment vLLM hands the
batch to its executor (where the in-process fake computes it, reading the same scheduler
state), and :class:`RankSet` sends it to every rank over a side queue before vLLM broadcasts the
RPC; the rank returns it through vLLM's response queue. The forward pass's collectives (TP
all-reduce, PP send / receive), which a GPU runs, are a barrier of the world's ranks in
``execute_model``: a rank that does not get there holds the others, as NCCL would, and vLLM's
``collective_rpc`` times out.

Faults (scenario ``events[].fault``, :class:`Fault`): a rank hangs or answers late (sleeps
``seconds`` before its forward pass), raises, or exits, on the first ``execute_model`` after the
event's step or on the run's N-th ``execute_model``.

Runs inside the release environment (standard library + vLLM).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .adapter import AdapterError, _try_import

#: the RPCs whose answers the engine process computes and sends to every rank
STEP_METHODS = ("execute_model", "sample_tokens", "take_draft_token_ids")
#: fault kinds: hang / late (sleep before the forward pass), raise, exit
FAULT_KINDS = ("hang", "late", "raise", "exit")


@dataclass
class Fault:
    """One injected rank fault (a scenario's ``events[].fault``): ``rank`` (global rank),
    ``kind`` (:data:`FAULT_KINDS`), ``seconds`` (hang / late: how long the rank sleeps before its
    forward pass), ``exit_code`` (exit), ``on_execute_model`` (fire on the run's N-th
    ``execute_model``; None: the first one after the event's step ``at_step``). ``fired``: the
    ``execute_model`` count it fired on."""

    rank: int
    kind: str
    at_step: int = 1
    seconds: float = 60.0
    exit_code: int = 1
    on_execute_model: int | None = None
    fired: int | None = None

    def brief(self) -> dict:
        """The trace's and the result's record of it."""
        out: dict[str, Any] = {"rank": self.rank, "kind": self.kind}
        if self.kind in ("hang", "late"):
            out["seconds"] = self.seconds
        if self.kind == "exit":
            out["exit_code"] = self.exit_code
        if self.fired is not None:
            out["execute_model"] = self.fired
        return out


@dataclass
class _Setup:
    """What a forked rank inherits from the engine process: the fake worker (its start-up
    answers), one side queue per rank, the world's barrier."""

    worker: Any
    queues: list
    barrier: Any
    world_size: int
    parent: int = field(default_factory=os.getpid)


#: set by :meth:`RankSet.start` in the engine process before vLLM forks the ranks
_SETUP: _Setup | None = None


def _die_with_parent() -> None:
    """``PR_SET_PDEATHSIG``: the kernel kills this rank when the process that forked it dies,
    so that no rank outlives its engine (a SIGKILLed engine runs no shutdown). Linux only; a
    no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class RankWorker:
    """The worker of one rank process (``ParallelConfig.worker_cls``), built by the release's
    ``WorkerWrapperBase.init_worker`` with ``vllm_config``, ``local_rank``, ``rank``,
    ``distributed_init_method``, ``is_driver_worker`` (and whatever else the release passes).

    Start-up calls (``get_kv_cache_spec``, ``determine_available_memory``,
    ``initialize_from_config``, ...) are answered as the in-process fake worker answers them;
    :data:`STEP_METHODS` return what the engine process sent for this call, after the fault
    for it (if any) and, for ``execute_model``, the world's barrier (the forward pass's
    collectives). Raises :class:`AdapterError` where it was not forked from a lab engine
    process (no setup) or its side queue is out of step with vLLM's RPCs."""

    def __init__(self, vllm_config=None, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = False,
                 **kwargs):
        if _SETUP is None:
            raise AdapterError("RankWorker built outside a lab run (no rank setup inherited: "
                               "the ranks must be forked, VLLM_WORKER_MULTIPROC_METHOD=fork)")
        _die_with_parent()
        if os.getppid() != _SETUP.parent:  # the engine died before the prctl took hold
            os._exit(1)
        self.vllm_config = vllm_config
        self.local_rank = local_rank
        self.rank = rank
        self.is_driver_worker = is_driver_worker
        self._init_method = distributed_init_method
        self.executed = 0
        self._queue = _SETUP.queues[rank]
        self._barrier = _SETUP.barrier
        self._fake = _SETUP.worker
        if getattr(self._fake, "vllm_config", None) is None:
            # what the release's WorkerBase methods read in this rank (0.34's
            # disable_extensible_kv_cache), set by the executor only in the engine process
            self._fake.vllm_config = vllm_config

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._fake, name)

    def init_device(self) -> None:
        """Where the release's ``WorkerProc`` reads vLLM's parallel groups right after
        ``init_device`` without asking whether they exist (``setup_proc_title_and_log_prefix``
        before ``model_parallel_is_initialized`` guards it), the groups are made as the GPU
        worker makes them (``init_worker_distributed_environment``: vLLM's
        ``init_distributed_environment`` and ``ensure_model_parallel_initialized``), on the
        ``gloo`` backend, CPU collectives only; elsewhere nothing (no device to set up)."""
        import inspect

        proc = _try_import("vllm.v1.executor.multiproc_executor:WorkerProc")
        setup = getattr(proc, "setup_proc_title_and_log_prefix", None)
        try:
            guarded = setup is None or "model_parallel_is_initialized" in inspect.getsource(setup)
        except (OSError, TypeError):
            guarded = True
        if guarded:
            return
        from vllm.distributed import parallel_state as ps

        pc = self.vllm_config.parallel_config
        ps.init_distributed_environment(pc.world_size, self.rank, self._init_method,
                                        self.local_rank, "gloo")
        sizes = [pc.tensor_parallel_size, pc.pipeline_parallel_size]
        if "decode_context_parallel_size" in inspect.signature(
                ps.ensure_model_parallel_initialized).parameters:
            sizes.append(getattr(pc, "decode_context_parallel_size", 1))
        ps.ensure_model_parallel_initialized(*sizes, backend="gloo")

    def _answer(self, method: str):
        got, answer, fault = self._queue.get()
        if got != method:
            raise AdapterError(f"rank {self.rank}: vLLM called {method}, the lab sent the "
                               f"answer of {got} (side queue out of step)")
        if fault is not None:
            self._inject(fault)
        return answer

    def _inject(self, fault: dict) -> None:
        kind = fault["kind"]
        if kind in ("hang", "late"):
            time.sleep(float(fault.get("seconds", 60.0)))
        elif kind == "raise":
            raise RuntimeError(f"vllm-repro fault: rank {self.rank} raised in execute_model "
                               f"#{self.executed} (events[].fault kind: raise)")
        elif kind == "exit":
            os._exit(int(fault.get("exit_code", 1)))

    def execute_model(self, *args, **kwargs):
        self.executed += 1
        answer = self._answer("execute_model")
        # the forward pass's collectives: every rank of the world meets here, as in NCCL's
        # all-reduce / PP send-receive; a rank that never comes holds the others
        self._barrier.wait()
        return answer

    def sample_tokens(self, *args, **kwargs):
        return self._answer("sample_tokens")

    def take_draft_token_ids(self, *args, **kwargs):
        return self._answer("take_draft_token_ids")


#: the qualified name vLLM's WorkerWrapperBase resolves (ParallelConfig.worker_cls)
WORKER_CLS = f"{__name__}.RankWorker"


class RankSet:
    """The engine process's side of the rank processes of one run: the side queues and the
    barrier (made before vLLM forks the ranks), the wrapping of the executor's step calls on
    the instance (each answer computed by ``worker``, the in-process fake, then sent to every
    rank, then vLLM's own call), the faults armed by the scenario's events."""

    def __init__(self, worker, world_size: int):
        self.worker = worker
        self.world_size = world_size
        ctx = multiprocessing.get_context("fork")
        self.queues = [ctx.Queue() for _ in range(world_size)]
        self.barrier = ctx.Barrier(world_size)
        self.armed: list[Fault] = []
        self.fired: list[Fault] = []
        self.executor = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Before ``EngineCore`` is built (vLLM forks the ranks in its executor's start-up)."""
        global _SETUP
        self._children_before = set(multiprocessing.active_children())
        _SETUP = _Setup(self.worker, self.queues, self.barrier, self.world_size)

    def attach(self, executor) -> None:
        """Wrap ``executor``'s :data:`STEP_METHODS` on the instance (vLLM's methods run
        unchanged after the answer is sent)."""
        self.executor = executor
        for method in STEP_METHODS:
            real = getattr(executor, method, None)
            if real is not None:
                setattr(executor, method, self._wrapped(method, real))

    def _wrapped(self, method: str, real):
        worker = self.worker

        def call(*args, **kwargs):
            if method == "execute_model":
                answer = worker.execute_model(args[0] if args else kwargs.get("scheduler_output"))
                faults = self._due(worker.executed)
            elif method == "sample_tokens":
                answer = worker.sample_tokens(args[0] if args else kwargs.get("grammar_output"))
                faults = {}
            else:
                answer = worker.take_draft_token_ids()
                faults = {}
            for rank, q in enumerate(self.queues):
                q.put((method, answer, faults.get(rank)))
            return real(*args, **kwargs)

        call.__name__ = method
        return call

    def arm(self, fault: Fault) -> None:
        """A scenario event armed ``fault`` (before its step)."""
        self.armed.append(fault)

    def _due(self, n: int) -> dict[int, dict]:
        """The faults that fire on the run's ``n``-th ``execute_model``: rank -> its record."""
        due: dict[int, dict] = {}
        for f in list(self.armed):
            if f.on_execute_model is None or f.on_execute_model == n:
                f.fired = n
                self.armed.remove(f)
                self.fired.append(f)
                due[f.rank] = {"kind": f.kind, "seconds": f.seconds, "exit_code": f.exit_code}
        return due

    def close(self) -> None:
        """After the engine's shutdown: the side queues' feeder threads let go (a rank that
        died leaves items unread), the setup forgotten."""
        global _SETUP
        for q in self.queues:
            q.cancel_join_thread()
            q.close()
        _SETUP = None
        self._reap()

    def _reap(self, grace_s: float = 5.0) -> list[int]:
        """Rank processes of this run still alive after vLLM's shutdown (an ``EngineCore`` that
        died in its start-up leaves its ``MultiprocExecutor`` to the garbage collector, whose
        finalizer would stop them some time later): terminated, then killed after ``grace_s``.
        Only children this process started since :meth:`start`. Returns their pids."""
        left = [p for p in multiprocessing.active_children()
                if p not in getattr(self, "_children_before", set())]
        for p in left:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in left:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        return [p.pid for p in left]


def multiproc_config(adapter, cfg: dict) -> dict:
    """``cfg`` with ``worker_cls`` (:data:`WORKER_CLS`) among its ``ParallelConfig`` fields, so
    that the release's ``WorkerWrapperBase`` builds :class:`RankWorker` in each rank. Raises
    :class:`~vllm_repro.engine.adapter.RefusedByRelease` where the release's ``ParallelConfig``
    has no ``worker_cls`` or the scenario names its own."""
    from .adapter import RefusedByRelease

    extra = dict(cfg.get("passthrough") or {})
    runtime = sys.modules.get("_vllm_slice")  # slicing/slice_runtime.py: a slice tree runs
    if runtime is not None:
        raise RefusedByRelease(f"config.distributed_executor_backend: mp: the slice of vLLM "
                               f"{adapter.version} was traced with the engine in one process; "
                               "rank processes need the full tree (--tree full)")
    if "worker_cls" in extra:
        raise RefusedByRelease("config.worker_cls: the lab names the ranks' worker itself "
                               f"({WORKER_CLS}); drop it")
    if "worker_cls" not in adapter.config_fields("ParallelConfig"):
        raise RefusedByRelease(f"config.distributed_executor_backend: mp: vLLM "
                               f"{adapter.version}'s ParallelConfig has no worker_cls to name the "
                               "lab's rank worker with; drop it for this release")
    extra["worker_cls"] = WORKER_CLS
    return {**cfg, "passthrough": extra}


#: the release's own variable for MultiprocExecutor's RPC timeout (vllm/envs.py)
RPC_TIMEOUT_VAR = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"


def check_rpc_timeout(version: str, topo) -> None:
    """Refuse ``config.execute_model_timeout_seconds`` where it would change nothing: without
    rank processes, or on a release whose ``vllm/envs.py`` has no :data:`RPC_TIMEOUT_VAR`
    (0.9.0's timeout is ``multiproc_executor.EXECUTE_MODEL_TIMEOUT_S``, a module constant the
    lab does not patch). Raises :class:`~vllm_repro.engine.adapter.RefusedByRelease`."""
    from .adapter import RefusedByRelease

    if not topo.multiprocess:
        raise RefusedByRelease("config.execute_model_timeout_seconds: the RPC timeout is "
                               "MultiprocExecutor's; add distributed_executor_backend: mp")
    envs = _try_import("vllm.envs")
    names = getattr(envs, "environment_variables", None) or {}
    if RPC_TIMEOUT_VAR not in names:
        executor = _try_import("vllm.v1.executor.multiproc_executor")
        fixed = getattr(executor, "EXECUTE_MODEL_TIMEOUT_S", None)
        what = (f"its timeout is multiproc_executor.EXECUTE_MODEL_TIMEOUT_S, {fixed} s, a "
                "constant" if fixed is not None else "its RPC timeout is not a setting")
        raise RefusedByRelease(
            f"config.execute_model_timeout_seconds: vLLM {version} has no {RPC_TIMEOUT_VAR} "
            f"({what}); drop it for this release"
            + (f", and make a hang longer than {fixed} s" if fixed is not None else ""))


def multiproc_executor():
    """The release's ``MultiprocExecutor`` class; raises :class:`AdapterError` where the release
    has none."""
    cls = _try_import("vllm.v1.executor.multiproc_executor:MultiprocExecutor")
    if cls is None:
        raise AdapterError("the release has no V1 MultiprocExecutor "
                           "(vllm/v1/executor/multiproc_executor.py)")
    return cls


__all__ = ["RankWorker", "RankSet", "Fault", "WORKER_CLS", "FAULT_KINDS", "STEP_METHODS",
           "multiproc_executor"]
