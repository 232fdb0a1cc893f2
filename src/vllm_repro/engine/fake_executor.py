"""The fake executor of ``level: engine-core``: where the lab's fakes stop under vLLM's EngineCore.

vLLM's ``EngineCore(vllm_config, executor_class, log_stats)`` builds ``executor_class(vllm_config)``
and talks to it only: KV cache specs and free memory at start-up (``_initialize_kv_caches``),
``initialize_from_config``, then ``execute_model`` (and ``sample_tokens`` where the release splits
sampling off), ``take_draft_token_ids``, ``max_concurrent_batches``, ``collective_rpc``,
``check_health`` and ``shutdown``.

The executor here is the release's own single-process executor (``UniProcExecutor``, found by
probing ``vllm/v1/executor/uniproc_executor.py`` or ``vllm/v1/executor/abstract.py``), so its
``collective_rpc``, its futures for ``non_block=True`` and its result handling are vLLM's code.
Only its worker is replaced: :class:`FakeWorker` answers the worker methods
(``vllm/v1/worker/gpu_worker.py:Worker``) with what a GPU would have reported or computed; a
call it does not define is answered by the release's own ``WorkerBase``
(``vllm/v1/worker/worker_base.py``) where that defines it, else it is a lab error naming the
call (:func:`unknown_call`: "the lab does not know vLLM X's worker call `name`"). Its
tokens come from :class:`~vllm_repro.engine.fake_runner.FakeModelRunner`, the same runner the
scheduler level uses, so both levels emit the same tokens.

Runs inside the release environment (standard library + vLLM).
"""

from __future__ import annotations

import inspect
from concurrent.futures import Future
from typing import Any, Callable

from .adapter import AdapterError, V1Adapter, _try_import
from .fake_runner import FakeModelRunner

#: worker methods a GPU worker answers with nothing the engine core reads (set-up, profiling)
_NO_OPS = ("init_worker", "init_device", "load_model", "initialize_cache", "profile", "sleep",
           "wake_up", "reset_mm_cache", "reset_encoder_cache", "execute_dummy_batch",
           "set_kv_cache_layout", "update_max_model_len", "shutdown", "check_health",
           "save_sharded_state", "init_kv_output_aggregator", "synchronize_device")


class FakeWorker:
    """What ``vllm/v1/worker/gpu_worker.py:Worker`` answers, without a GPU (the contract:
    :class:`vllm_repro.engine.interfaces.FakeWorker`).

    ``kv_cache_spec``: ``{layer name: KVCacheSpec}`` (the model's attention layers);
    ``available_memory``: bytes free for the KV cache after profiling (int);
    ``on_execute(scheduler_output)``: called when a batch starts executing (the lab's hook for
    in-flight events), before the output is computed; ``make_output(scheduler_output)`` returns
    ``(sample, DraftTokenIds or None)``: the logits are computed then, and
    ``sample(grammar_output)`` samples them into the ``ModelRunnerOutput``, through the grammar
    bitmask ``grammar_output`` (what the engine hands ``sample_tokens``: the scheduler's
    ``get_grammar_bitmask``), or None where sampling is not split off (the bitmask then rides on
    the scheduler output).
    ``split_sampling``: the release's executor has ``sample_tokens``: ``execute_model`` returns
    None and ``sample_tokens`` the output, as ``GPUModelRunner`` does there.
    """

    def __init__(self, kv_cache_spec: dict, available_memory: int,
                 make_output: Callable, on_execute: Callable | None, split_sampling: bool):
        self.kv_cache_spec = kv_cache_spec
        self.available_memory = available_memory
        self.make_output = make_output
        self.on_execute = on_execute
        self.split_sampling = split_sampling
        self.kv_cache_configs: Any = None
        self._pending: list = []
        self._drafts = None
        self.executed = 0
        #: worker calls vLLM asked for that neither this class nor the release's WorkerBase
        #: answers, in order (read by :func:`unknown_call`)
        self.unknown: list[str] = []
        #: the engine's config, for the release's WorkerBase methods (set by the executor)
        self.vllm_config: Any = None

    #: the release's ``WorkerBase`` (None: not looked up yet; False: the release has none)
    _base: Any = None

    def __getattr__(self, name: str):
        """A worker call the class does not define: a no-op (:data:`_NO_OPS`), else the
        release's ``WorkerBase`` method of that name bound to this worker (e.g. 0.34's
        ``extensible_kv_cache_unsupported_reason``: not supported by a worker that is not the
        GPU one, so EngineCore turns the extensible KV cache off; its
        ``disable_extensible_kv_cache``), else ``AttributeError`` (so ``hasattr`` answers as
        vLLM expects), the name kept in :attr:`unknown` for :func:`unknown_call`. A base
        method that raises ``NotImplementedError`` (what only a real device answers) is
        reported as an unknown call too."""
        if name.startswith("__") or name in ("unknown", "vllm_config"):
            raise AttributeError(name)
        if name in _NO_OPS:
            return lambda *a, **k: None
        base = type(self)._base
        if base is None:
            base = type(self)._base = _try_import("vllm.v1.worker.worker_base:WorkerBase") or False
        fn = getattr(base, name, None) if base else None
        if callable(fn) and not name.startswith("_"):
            bound = fn.__get__(self)

            def call(*args, **kwargs):
                try:
                    return bound(*args, **kwargs)
                except NotImplementedError:
                    self.unknown.append(name)
                    raise NotImplementedError(f"Method {name!r} is not implemented.") from None

            return call
        vars(self).setdefault("unknown", []).append(name)
        raise AttributeError(name)

    # ---- start-up (EngineCore._initialize_kv_caches) ----------------------------------------
    def get_kv_cache_spec(self) -> dict:
        return self.kv_cache_spec

    def determine_available_memory(self) -> int:
        return self.available_memory

    def get_supported_kv_cache_layouts(self):
        """Every layout the release defines (``vllm/v1/kv_cache_layout.py:KVCacheLayout``), in
        its order: the fake device stores nothing, so any layout fits; vLLM picks one."""
        layout = _try_import("vllm.v1.kv_cache_layout:KVCacheLayout")
        return [m.name for m in layout] if layout is not None else None

    def initialize_from_config(self, kv_cache_config) -> None:
        self.kv_cache_configs = kv_cache_config

    def compile_or_warm_up_model(self):
        ct = _try_import("vllm.v1.worker.worker_base:CompilationTimes",
                         "vllm.v1.outputs:CompilationTimes", "vllm.config:CompilationTimes")
        if ct is not None:
            try:
                return ct(language_model=0.0, encoder=0.0)
            except TypeError:
                return None
        return None

    def get_supported_tasks(self):
        return ("generate",)

    def get_kv_connector_handshake_metadata(self):
        return None

    # ---- steps -----------------------------------------------------------------------------
    def execute_model(self, scheduler_output, *args, **kwargs):
        self.executed += 1
        if self.on_execute is not None:
            self.on_execute(scheduler_output)
        sample, drafts = self.make_output(scheduler_output)
        self._drafts = drafts
        if self.split_sampling and getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0:
            # GPUModelRunner.execute_model returns None and keeps the logits for sample_tokens;
            # with nothing scheduled it returns its empty output at once
            self._pending.append(sample)
            return None
        return sample(None)

    def sample_tokens(self, grammar_output=None, *args, **kwargs):
        if not self._pending:
            raise AdapterError("sample_tokens called with no executed batch pending")
        return self._pending.pop(0)(grammar_output)

    def take_draft_token_ids(self):
        drafts, self._drafts = self._drafts, None
        return drafts


def unknown_call(worker: FakeWorker | None, exc: BaseException, version: str) -> str | None:
    """The one-line lab error for ``exc`` when it is vLLM calling a worker method the fake
    worker does not know (``run_method``'s ``NotImplementedError: Method 'x' is not
    implemented.``, or the ``AttributeError`` of a direct call), naming the call and the
    release; None for any other exception."""
    if worker is None or not worker.unknown or not isinstance(
            exc, (NotImplementedError, AttributeError)):
        return None
    text = str(exc)
    for name in reversed(worker.unknown):
        if name in text:
            return (f"the lab does not know vLLM {version}'s worker call `{name}` "
                    "(engine/fake_executor.py FakeWorker answers the calls it knows)")
    return None


def _params(fn) -> set[str]:
    """The parameter names of ``fn`` (empty where it has no signature)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def executor_base():
    """The release's single-process executor class (``UniProcExecutor``), whose worker the lab
    replaces. Raises :class:`AdapterError` where none is found."""
    cls = _try_import("vllm.v1.executor.uniproc_executor:UniProcExecutor",
                      "vllm.v1.executor.abstract:UniProcExecutor")
    if cls is None:
        raise AdapterError("the release has no V1 UniProcExecutor "
                           "(vllm/v1/executor/uniproc_executor.py or abstract.py)")
    return cls


def make_executor_class(worker: FakeWorker, max_concurrent_batches: int | Callable | None) -> type:
    """A subclass of the release's ``UniProcExecutor`` whose ``_init_executor`` installs
    ``worker`` as its driver worker (no device, no model load). ``max_concurrent_batches``
    overrides the executor's pipeline depth where given (EngineCore then uses its batch
    queue): a number, or a property getter such as vLLM's own
    ``MultiprocExecutor.max_concurrent_batches`` (2 with async scheduling, else the pipeline
    size), evaluated on this executor's config."""
    base = executor_base()

    def _init_executor(self) -> None:
        # what the release's _init_executor sets besides the worker, for a text-only model
        # whose worker returns finished outputs (no AsyncModelRunnerOutput to wait on)
        self.mm_receiver_cache = None
        self.async_output_thread = None
        worker.vllm_config = self.vllm_config  # what WorkerBase's methods read
        self.driver_worker = worker

    def check_health(self) -> None:
        return None

    def get_kv_connector_handshake_metadata(self) -> list:
        # no worker has a transport to hand its agent metadata to the decode side (the worker
        # half is the lab's): an empty list, so that EngineCore never has the scheduler's
        # connector serve it (NixlConnector's handshake listener binds a port on this host;
        # [None], what collective_rpc gathers from the fake worker, would start it)
        return []

    ns: dict[str, Any] = {"_init_executor": _init_executor, "check_health": check_health,
                          "get_kv_connector_handshake_metadata":
                              get_kv_connector_handshake_metadata,
                          "__doc__": "vllm-repro's fake executor: the release's UniProcExecutor "
                                     "with a FakeWorker (no GPU)."}
    if max_concurrent_batches is not None and "non_block" not in _params(base.execute_model):
        # a release whose executors decide blocking themselves (0.10's execute_model has no
        # non_block): its MultiprocExecutor hands EngineCore's batch queue a Future whenever
        # max_concurrent_batches > 1 (step_with_batch_queue calls .done() / .result() on it);
        # UniProcExecutor returns the output itself, so it comes back in a finished Future
        def execute_model(self, scheduler_output, *args, **kwargs):
            out = base.execute_model(self, scheduler_output, *args, **kwargs)
            if self.max_concurrent_batches > 1 and not isinstance(out, Future):
                done: Future = Future()
                done.set_result(out)
                return done
            return out

        ns["execute_model"] = execute_model
    if max_concurrent_batches is not None:
        ns["max_concurrent_batches"] = property(
            max_concurrent_batches if callable(max_concurrent_batches)
            else (lambda self: max_concurrent_batches))
    return type("FakeExecutor", (base,), ns)


def kv_cache_spec(adapter: V1Adapter, cfg: dict) -> tuple[dict, int]:
    """``({layer name: KVCacheSpec}, bytes per block summed over the layers)`` for the scenario's
    ``kv_cache_groups`` (default: one full-attention layer), with the same specs the scheduler
    level builds (``V1Adapter._kv_cache_config``)."""
    torch = __import__("torch")
    groups = cfg.get("kv_cache_groups") or [{"type": "full", "num_layers": 1}]
    specs: dict = {}
    per_block = 0
    layer = 0
    from .adapter import kv_specs

    cache_config = getattr(getattr(adapter, "vllm_config", None), "cache_config", None)
    kv_specs.check_model_config(cfg, cache_config, adapter.version)
    for index, g in enumerate(groups):
        spec = kv_specs.group_spec(adapter, g, index, cfg, torch, cache_config)
        for i in range(g.get("num_layers", 1)):
            specs[f"model.layers.{layer + i}.self_attn.attn"] = spec
        per_block = max(per_block, spec.page_size_bytes)
        layer += g.get("num_layers", 1)
    # bytes one block takes across the layers that share it, as get_kv_cache_config divides
    # the memory: one KV cache type -> every layer holds its own copy of each block
    # (_get_kv_cache_config_uniform_type); several types of one page size -> each block spans
    # one layer of every group, groups padded to the same size
    # (_get_kv_cache_config_uniform_page_size)
    if len({g["type"] for g in groups}) == 1:
        return specs, per_block * layer
    return specs, per_block * max(g.get("num_layers", 1) for g in groups)


def available_memory(cfg: dict, bytes_per_block: int) -> int:
    """What ``determine_available_memory`` reports: ``kv_cache_memory_bytes`` when the scenario
    gives it, else the memory of ``num_gpu_blocks`` blocks (so a scheduler-level pool is kept)."""
    if cfg.get("kv_cache_memory_bytes") is not None:
        return int(cfg["kv_cache_memory_bytes"])
    return int(cfg["num_gpu_blocks"]) * bytes_per_block


__all__ = ["FakeWorker", "FakeModelRunner", "make_executor_class", "kv_cache_spec",
           "available_memory", "executor_base", "unknown_call"]
