"""The one seam where vLLM's API drift is absorbed: build vLLM's own V1 objects by probing.

Runs inside a release environment (no lab dependencies beyond the standard library). Nothing
here compares version numbers: every difference between releases is found by looking for a
module, an attribute or a parameter, and the first working form is used. What it builds mirrors
``vllm/v1/engine/core.py:EngineCore.__init__`` (configs, KV-cache config, block hasher,
``Scheduler``) and ``EngineCore.preprocess_add_request`` / ``Processor.process_inputs`` (the
``Request``), for the V1 engine from 0.6.5 (opt-in then, ``VLLM_USE_V1=1``) to 0.33.0.

Probes (each names the vLLM source it follows):

- scheduler module: ``vllm/v1/core/sched/scheduler.py`` (0.8+), else ``vllm/v1/core/scheduler.py``;
  the class from ``SchedulerConfig.get_scheduler_cls()`` where the release has it.
- the scheduler's constructor: ``Scheduler(vllm_config, kv_cache_config, ...)`` (0.8+), or the
  first V1 generation's ``Scheduler(scheduler_config, [model_config,] cache_config, lora_config)``
  (0.6.5 to 0.7.x), which builds its own single-group ``KVCacheManager`` from ``CacheConfig``:
  there the lab builds no ``KVCacheConfig`` (the module ``vllm/v1/kv_cache_interface.py`` may
  not even exist) and refuses ``kv_cache_groups``.
- the request's prompt: ``Request(prompt_token_ids=...)``, or ``Request(inputs=token_inputs(...))``
  as ``Request.from_engine_core_request`` does in 0.6.x.
- scheduled requests: ``SchedulerOutput.scheduled_cached_reqs`` (one ``CachedRequestData``, or a
  list of them up to 0.9.1), or the first generation's ``scheduled_resumed_reqs`` +
  ``scheduled_running_reqs``.
- sampled tokens: ``ModelRunnerOutput.sampled_token_ids`` as one list per request (0.8+, numpy
  arrays where annotated so), or one token per request (``List[int]``, 0.6.x/0.7.x; the scheduler
  ignores the entry of a request still in prefill, so a step cannot say "no token" there).
- constructors are called with the keyword arguments they accept (``inspect.signature``):
  ``Scheduler(block_size=...)``, ``Request(block_hasher=..., eos_token_id=..., multi_modal_*)``,
  ``FullAttentionSpec(use_mla=...)``, ``KVCacheConfig(tensors= | kv_cache_tensors=)``,
  ``ModelRunnerOutput(spec_token_ids=...)``, ``SchedulerConfig(is_encoder_decoder=...)``.
- block hashing: ``get_request_block_hasher`` + ``init_none_hash`` (0.10.1+, request-side), else
  the KV cache manager hashes by itself.
- ``register_all_kvcache_specs(vllm_config)`` (0.33) before the scheduler is built.
- where ``num_computed_tokens`` advances: in ``schedule()`` (0.8+), or in
  ``update_from_output`` (0.6.x/0.7.x, whose source adds the scheduled count there); the audit
  reads it from ``computed_advanced_in_schedule``.
- draft tokens: ``ModelRunnerOutput.spec_token_ids`` (<= 0.10.1) or
  ``Scheduler.update_draft_token_ids(DraftTokenIds)`` (0.10.2+).
- the CPU platform: the tree's ``vllm-X+cpu.dist-info`` makes ``vllm.platforms`` pick the CPU
  platform (0.8 to 0.10 look for "cpu" in the installed version); ``VLLM_TARGET_DEVICE=cpu``
  does it for newer ones; as a last resort ``vllm.platforms._current_platform`` is set.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import state
from .state import iter_queue  # noqa: F401 - re-exported (older importers)

EOS_TOKEN_ID = 2  # OPT's eos_token_id (the packaged config.json)
VOCAB = 50000


class AdapterError(Exception):
    """The release's API could not be matched: a lab error (outcome ``error``), never a
    reproduction."""


class RefusedByRelease(Exception):
    """The release's own front door refuses the workload (e.g. priorities on 0.9.0): an input
    error naming the field and the release."""


def _import(*candidates: str):
    """The first importable ``module:attr`` of ``candidates`` (``module`` alone for a module)."""
    errors = []
    for cand in candidates:
        mod_name, _, attr = cand.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as exc:
            errors.append(f"{mod_name}: {exc}")
            continue
        if not attr:
            return mod
        if hasattr(mod, attr):
            return getattr(mod, attr)
        errors.append(f"{mod_name} has no {attr}")
    raise AdapterError("none of " + ", ".join(candidates) + " is importable: " + "; ".join(errors))


def _try_import(*candidates: str):
    try:
        return _import(*candidates)
    except AdapterError:
        return None


def params_of(fn: Callable) -> tuple[set[str], bool]:
    """(names of the parameters ``fn`` accepts, whether it takes ``**kwargs``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def init_params(cls: type) -> tuple[set[str], bool]:
    """``params_of`` for a class's constructor, looking through ``__init__(self, *args,
    **kwargs)`` wrappers to the first class in the MRO that names its parameters.

    vLLM's ``AsyncScheduler.__init__(self, *args, **kwargs)`` (0.17 onward) only forwards to
    ``Scheduler.__init__``: read as "takes any keyword", it made the lab pass the first V1
    generation's keywords, which ``Scheduler`` rejects (the async-scheduling defect)."""
    for klass in getattr(cls, "__mro__", (cls,)):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            sig = inspect.signature(init)
        except (TypeError, ValueError):
            continue
        kinds = {p.kind for p in list(sig.parameters.values())[1:]}
        if kinds and kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
            continue  # a pure forwarder: look at the base class
        return params_of(init)
    return params_of(cls)


def call_supported(fn: Callable, /, **kwargs):
    """Call ``fn`` with the subset of ``kwargs`` it accepts (drift in optional parameters).
    For a class, its effective constructor (:func:`init_params`) decides."""
    names, var_kw = init_params(fn) if isinstance(fn, type) else params_of(fn)
    if not var_kw:
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    return fn(**kwargs)


def token_stream(seed_text: str, length: int, offset: int = 0) -> list[int]:
    """Deterministic prompt token ids (never EOS) for a request id or a shared prefix name."""
    seed = zlib.crc32(seed_text.encode())
    return [3 + (seed + (offset + j) * 104729) % VOCAB for j in range(length)]


@dataclass
class Scheduled:
    """One request in a ``SchedulerOutput``: tokens scheduled this step, computed tokens before
    this step, and the draft (spec) tokens scheduled for verification."""

    req_id: str
    num_scheduled: int
    num_computed_before: int | None  # None: in num_scheduled_tokens without new/cached data
    spec_tokens: list[int]
    new: bool


class V1Adapter:
    """vLLM V1 objects of the release on ``sys.path``, built by probing.

    ``model_dir``: a config-only model directory (``config.json``), tokenizer skipped.
    """

    def __init__(self, model_dir: Path):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_USE_V1", "1")
        self.model_dir = Path(model_dir)
        #: where the lab undid a CPU-platform rule that a GPU platform does not have
        self.platform_notes: list[str] = []
        import vllm  # noqa: F401  (the release under test)

        self.vllm_file = Path(sys.modules["vllm"].__file__).parent
        self.version = self._version()
        self._ensure_cpu_platform()
        self.config_mod = _import("vllm.config")
        self.Scheduler = _import("vllm.v1.core.sched.scheduler:Scheduler", "vllm.v1.core.scheduler:Scheduler")
        self.Request = _import("vllm.v1.request:Request")
        self.RequestStatus = _import("vllm.v1.request:RequestStatus")
        self.SamplingParams = _import("vllm.sampling_params:SamplingParams", "vllm:SamplingParams")
        self.ModelRunnerOutput = _import("vllm.v1.outputs:ModelRunnerOutput")
        self.KVCacheConfig = _try_import("vllm.v1.kv_cache_interface:KVCacheConfig")
        self.KVCacheGroupSpec = _try_import("vllm.v1.kv_cache_interface:KVCacheGroupSpec")
        self.FullAttentionSpec = _try_import("vllm.v1.kv_cache_interface:FullAttentionSpec")
        self.SlidingWindowSpec = _try_import("vllm.v1.kv_cache_interface:SlidingWindowSpec")
        self.StructuredOutputManager = _try_import("vllm.v1.structured_output:StructuredOutputManager")
        self.DraftTokenIds = _try_import("vllm.v1.outputs:DraftTokenIds")
        self._mro_fields, _ = params_of(self.ModelRunnerOutput)
        ann = str(getattr(self.ModelRunnerOutput, "__annotations__", {}).get("sampled_token_ids", ""))
        #: True where ModelRunnerOutput carries one sampled token per request (List[int]):
        #: no spec decode, and no way to say "no token" for a request that has finished prefill
        self.one_token_per_request = ann.replace(" ", "").lower() in ("list[int]", "typing.list[int]")
        self._sampled_ndarray = "ndarray" in ann
        #: whether Scheduler.schedule() advances num_computed_tokens by the scheduled count
        #: (0.8+: in schedule() or _update_after_schedule) or update_from_output does (0.6.x/0.7.x)
        self.computed_advanced_in_schedule = not _source_has(
            getattr(self.Scheduler, "update_from_output", None), "num_computed_tokens +=")
        self._register_model()
        from .capabilities import probe

        #: what this release supports, probed once (sent to the host in the worker's hello)
        self.caps = probe(self)

    # ---- environment -------------------------------------------------------------------------
    def _version(self) -> str:
        mod = _try_import("vllm.version", "vllm._version")
        v = getattr(mod, "__version__", None) if mod else None
        return str(v or getattr(sys.modules["vllm"], "__version__", "unknown"))

    def _ensure_cpu_platform(self) -> None:
        platforms = _import("vllm.platforms")
        try:
            current = platforms.current_platform
            is_cpu = current.is_cpu() if hasattr(current, "is_cpu") else False
        except Exception:  # noqa: BLE001 - detection itself failed; fall back below
            is_cpu = False
        if not is_cpu and hasattr(platforms, "_current_platform"):
            cpu_cls = _import("vllm.platforms.cpu:CpuPlatform")
            platforms._current_platform = cpu_cls()

    def _register_model(self) -> None:
        """Register the packaged architecture's real class in-process, so that ``ModelConfig``
        inspects it here instead of in a ``python -m vllm.model_executor.models.registry``
        subprocess (a second 10 s import of torch and vLLM on 0.9/0.10)."""
        registry = _try_import("vllm:ModelRegistry", "vllm.model_executor.models:ModelRegistry")
        if registry is None or not hasattr(registry, "register_model"):
            return
        try:
            import json

            arch = json.loads((self.model_dir / "config.json").read_text())["architectures"][0]
            models = getattr(registry, "models", {})
            lazy = models.get(arch)
            if lazy is None or not hasattr(lazy, "module_name"):
                return
            import logging

            cls = getattr(importlib.import_module(lazy.module_name), lazy.class_name)
            logging.getLogger("vllm").disabled = True
            try:
                registry.register_model(arch, cls)
            finally:
                logging.getLogger("vllm").disabled = False
        except Exception:  # noqa: BLE001 - an optimisation only: the subprocess path still works
            return

    # ---- building ---------------------------------------------------------------------------
    def build(self, cfg: dict[str, Any]) -> tuple[Any, Any]:
        """Build ``(vllm_config, scheduler)`` from a scenario's ``config`` mapping.

        Mirrors ``EngineCore.__init__``: ``ModelConfig`` on the packaged config dir,
        ``SchedulerConfig``, ``CacheConfig`` (``num_gpu_blocks`` set as after profiling),
        ``VllmConfig``, ``KVCacheConfig`` with one group per scenario KV cache group, and the
        scheduler class the config selects. Raises :class:`AdapterError` when the release's
        constructors cannot be satisfied.
        """
        vllm_config, sched_cls = self.build_vllm_config(cfg)
        return vllm_config, self._build_scheduler(cfg, vllm_config, sched_cls)

    #: the vLLM config classes a scenario's pass-through fields may belong to, in lookup order
    PASSTHROUGH_CLASSES = ("SchedulerConfig", "CacheConfig", "ParallelConfig", "SpeculativeConfig")

    def config_fields(self, class_name: str) -> set[str]:
        """The field names of the release's ``vllm.config.<class_name>`` (dataclass fields or
        constructor parameters); empty where the release has no such class."""
        cls = getattr(self.config_mod, class_name, None)
        if cls is None:
            return set()
        fields = set(getattr(cls, "__dataclass_fields__", {}) or {})
        fields |= set(getattr(cls, "model_fields", {}) or {})
        return fields | init_params(cls)[0]

    def route_passthrough(self, cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Which vLLM config class takes each pass-through field: ``{class name: {field: value}}``.
        Raises :class:`RefusedByRelease` for a field none of :data:`PASSTHROUGH_CLASSES` has."""
        routed: dict[str, dict[str, Any]] = {}
        for key, value in (cfg.get("passthrough") or {}).items():
            for cls_name in self.PASSTHROUGH_CLASSES:
                if key in self.config_fields(cls_name):
                    routed.setdefault(cls_name, {})[key] = value
                    break
            else:
                raise RefusedByRelease(
                    f"config.{key}: vLLM {self.version} has no such field in "
                    f"{', '.join(self.PASSTHROUGH_CLASSES)}; check the name against that "
                    "release's vllm/config, or drop it for this release")
        return routed

    def build_vllm_config(self, cfg: dict[str, Any]) -> tuple[Any, type]:
        """``(vllm_config, scheduler class)`` as ``EngineArgs.create_engine_config`` would make
        them for the scenario's ``config`` (``num_gpu_blocks`` already set on the cache config
        when the scenario gives it). Pass-through fields go to their config class as written."""
        c = self.config_mod
        routed = self.route_passthrough(cfg)
        torch = importlib.import_module("torch")
        max_model_len = cfg["max_model_len"]
        try:
            model_config = call_supported(
                c.ModelConfig, model=str(self.model_dir), task="generate",
                tokenizer=str(self.model_dir), tokenizer_mode="auto", trust_remote_code=False,
                dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=max_model_len,
                enforce_eager=True)
        except Exception as exc:
            raise AdapterError(f"ModelConfig on {self.model_dir}: {type(exc).__name__}: {exc}") from exc
        sched_kwargs = dict(
            max_num_seqs=cfg["max_num_seqs"],
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            max_model_len=max_model_len,
            enable_chunked_prefill=cfg["enable_chunked_prefill"],
            policy=cfg["policy"],
            long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
            async_scheduling=cfg["async_scheduling"],
            is_encoder_decoder=getattr(model_config, "is_encoder_decoder", False),
            watermark=0.0,
        )
        if cfg["long_prefill_token_threshold"] == 0:
            sched_kwargs.pop("long_prefill_token_threshold")
        sched_kwargs.update(routed.get("SchedulerConfig", {}))
        scheduler_config = self._strict_call(c.SchedulerConfig, sched_kwargs,
                                             routed.get("SchedulerConfig", {}))
        cache_kwargs = dict(block_size=cfg["block_size"], gpu_memory_utilization=0.9, swap_space=0,
                            cache_dtype="auto", enable_prefix_caching=cfg["enable_prefix_caching"])
        cache_kwargs.update(routed.get("CacheConfig", {}))
        cache_config = self._strict_call(c.CacheConfig, cache_kwargs, routed.get("CacheConfig", {}))
        spec_config = None
        if cfg.get("num_speculative_tokens"):
            if not self.caps.spec_decode:
                # 0.6.x/0.7.0: the V1 scheduler has no draft tokens (SpeculativeConfig is V0's)
                raise RefusedByRelease(f"config.num_speculative_tokens: "
                                       f"{self.caps.refusal('spec decode')}; drop it for this release")
            spec_kwargs = dict(model="ngram", method=cfg.get("speculative_method", "ngram"),
                               num_speculative_tokens=cfg["num_speculative_tokens"],
                               prompt_lookup_max=4, prompt_lookup_min=1)
            spec_kwargs.update(routed.get("SpeculativeConfig", {}))
            spec_config = self._strict_call(c.SpeculativeConfig, spec_kwargs,
                                            routed.get("SpeculativeConfig", {}))
        elif routed.get("SpeculativeConfig"):
            raise RefusedByRelease(
                f"config.{next(iter(routed['SpeculativeConfig']))}: a SpeculativeConfig field "
                "needs num_speculative_tokens (spec decode on)")
        extra = {}
        if routed.get("ParallelConfig"):
            extra["parallel_config"] = self._strict_call(
                c.ParallelConfig, dict(routed["ParallelConfig"]), routed["ParallelConfig"])
        if hasattr(c, "DeviceConfig"):  # 0.8.x leaves it None unless EngineArgs fills it in
            try:
                extra["device_config"] = call_supported(c.DeviceConfig, device="cpu")
            except Exception:  # noqa: BLE001 - keep the release's default
                pass
        if hasattr(c, "ObservabilityConfig"):
            # EngineArgs.create_engine_config always fills it in; some releases' VllmConfig
            # leave it None otherwise, and the stat loggers read it
            try:
                extra["observability_config"] = call_supported(c.ObservabilityConfig)
            except Exception:  # noqa: BLE001 - keep the release's default
                pass
        vllm_config = call_supported(
            c.VllmConfig, scheduler_config=scheduler_config, model_config=model_config,
            cache_config=cache_config, speculative_config=spec_config, **extra)
        # what the GPU worker would have reported after profiling (at level engine-core,
        # EngineCore._initialize_kv_caches sets it from the fake executor's figures instead)
        if cfg.get("num_gpu_blocks") is not None:
            cache_config.num_gpu_blocks = cfg["num_gpu_blocks"]
        sched_cls = self.Scheduler
        get_cls = getattr(vllm_config.scheduler_config, "get_scheduler_cls", None)
        if callable(get_cls) and not cfg["async_scheduling"]:
            chosen = get_cls()
            if isinstance(chosen, type):
                sched_cls = chosen
        elif cfg["async_scheduling"]:
            if not self.caps.async_scheduling:
                raise RefusedByRelease(f"config.async_scheduling: "
                                       f"{self.caps.refusal('async scheduling')}; drop it for this release")
            sched_cls = _import("vllm.v1.core.sched.async_scheduler:AsyncScheduler")
        if cfg["async_scheduling"] and getattr(vllm_config.scheduler_config, "async_scheduling",
                                                True) is False:
            # the CPU platform's check_and_update_config turns async scheduling off ("not
            # required on CPU", vllm/platforms/cpu.py); the GPU platform being debugged keeps
            # what the user asked for, and VllmConfig's own async checks above already ran
            vllm_config.scheduler_config.async_scheduling = True
            self.platform_notes.append("async_scheduling kept on (the CPU platform turns it off)")
        if cfg["async_scheduling"] and spec_config is not None:
            args_cls = _try_import("vllm.engine.arg_utils:EngineArgs")
            if _source_has(getattr(args_cls, "create_engine_config", None),
                           "speculative decoding is not supported with"):
                # EngineArgs.create_engine_config refuses it there (not the config classes)
                raise RefusedByRelease(
                    f"config.async_scheduling: vLLM {self.version}'s EngineArgs refuses "
                    "speculative decoding with async scheduling (\"Currently, speculative "
                    "decoding is not supported with async scheduling.\"); drop one of them")
        current = getattr(vllm_config.scheduler_config, "scheduler_cls", None)
        if isinstance(current, str) and not current.startswith("vllm.v1."):
            # EngineArgs.create_engine_config swaps V0's default scheduler class for the V1 one
            # (or AsyncScheduler) the engine then resolves; EngineCore reads it from the config
            vllm_config.scheduler_config.scheduler_cls = (
                f"{sched_cls.__module__}.{sched_cls.__qualname__}")
        self.vllm_config = vllm_config
        return vllm_config, sched_cls

    def _strict_call(self, cls, kwargs: dict, passthrough: dict):
        """``call_supported`` that never drops a pass-through field silently."""
        names, var_kw = init_params(cls)
        missing = [k for k in passthrough if k not in names and not var_kw]
        if missing:
            raise RefusedByRelease(f"config.{missing[0]}: vLLM {self.version}'s {cls.__name__} "
                                   "does not take it as a constructor argument")
        return call_supported(cls, **kwargs)

    def _build_scheduler(self, cfg: dict[str, Any], vllm_config, sched_cls):
        """The scheduler as ``EngineCore.__init__`` builds it, on a ``KVCacheConfig`` with
        ``num_gpu_blocks`` blocks (level scheduler: no profiling)."""
        torch = importlib.import_module("torch")
        takes_kv_config = "kv_cache_config" in init_params(sched_cls)[0]
        if takes_kv_config:
            kv_cache_config = self._kv_cache_config(cfg, torch)
        else:
            # 0.6.x/0.7.x: Scheduler builds KVCacheManager(num_gpu_blocks, block_size, ...) itself
            kv_cache_config = None
            groups = cfg.get("kv_cache_groups") or []
            if len(groups) > 1 or any(g["type"] != "full" for g in groups):
                raise RefusedByRelease(
                    f"config.kv_cache_groups: vLLM {self.version}'s Scheduler builds one "
                    "full-attention KV cache from CacheConfig; it has no KV cache groups")
        register = _try_import("vllm.v1.core.single_type_kv_cache_manager:register_all_kvcache_specs")
        if register is not None:
            register(vllm_config)
        block_size = cfg["block_size"]
        hash_block_size = block_size
        resolve = _try_import("vllm.v1.core.kv_cache_utils:resolve_kv_cache_block_sizes")
        if resolve is not None and kv_cache_config is not None:
            try:
                block_size, hash_block_size = resolve(kv_cache_config, vllm_config)
            except Exception:  # noqa: BLE001 - keep the scenario's block size
                pass
        self.hash_block_size = hash_block_size
        som = self.StructuredOutputManager(vllm_config) if self.StructuredOutputManager else None
        scheduler = call_supported(
            sched_cls, vllm_config=vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=som, log_stats=True, block_size=block_size,
            hash_block_size=hash_block_size, include_finished_set=False,
            # the first V1 generation (0.6.5 to 0.7.x) takes the configs one by one
            scheduler_config=vllm_config.scheduler_config, model_config=vllm_config.model_config,
            cache_config=vllm_config.cache_config, lora_config=None)
        self.block_hasher = self._block_hasher(vllm_config, hash_block_size)
        self.vllm_config = vllm_config
        return scheduler

    def _attention_spec(self, cls, cfg, torch, **extra):
        return call_supported(cls, block_size=cfg["block_size"], num_kv_heads=1, head_size=1,
                              dtype=torch.float32, use_mla=False, sliding_window=None, **extra)

    def _kv_cache_config(self, cfg, torch):
        groups = cfg.get("kv_cache_groups") or [{"type": "full", "num_layers": 1}]
        specs = []
        layer = 0
        for g in groups:
            if g["type"] == "sliding_window":
                if self.SlidingWindowSpec is None:
                    raise AdapterError("this release has no SlidingWindowSpec (kv_cache_groups)")
                spec = call_supported(
                    self.SlidingWindowSpec, block_size=cfg["block_size"], num_kv_heads=1,
                    head_size=1, dtype=torch.float32, use_mla=False,
                    sliding_window=g["sliding_window"])
            else:
                spec = self._attention_spec(self.FullAttentionSpec, cfg, torch)
            names = [f"model.layers.{layer + i}.self_attn.attn" for i in range(g.get("num_layers", 1))]
            layer += len(names)
            specs.append((names, spec))
        if self.KVCacheGroupSpec is None or self.KVCacheConfig is None:
            raise AdapterError("this release's Scheduler takes a KVCacheConfig, but "
                               "vllm.v1.kv_cache_interface has no KVCacheConfig/KVCacheGroupSpec")
        group_specs = [self.KVCacheGroupSpec(names, spec) for names, spec in specs]
        return call_supported(self.KVCacheConfig, num_blocks=cfg["num_gpu_blocks"], tensors={},
                              kv_cache_tensors=[], kv_cache_groups=group_specs)

    def _block_hasher(self, vllm_config, hash_block_size):
        """``EngineCore``'s request block hasher where the release hashes on the request side."""
        get_hasher = _try_import("vllm.v1.core.kv_cache_utils:get_request_block_hasher")
        if get_hasher is None:
            return None
        cache = vllm_config.cache_config
        needs = getattr(cache, "enable_prefix_caching", False)
        if not needs:
            return None
        get_fn = _try_import("vllm.utils.hashing:get_hash_fn_by_name", "vllm.utils:get_hash_fn_by_name")
        algo = getattr(cache, "prefix_caching_hash_algo", "builtin")
        hash_fn = get_fn(algo) if get_fn else hash
        init_none = _try_import("vllm.v1.core.kv_cache_utils:init_none_hash")
        if init_none is not None:
            init_none(hash_fn)
        return call_supported(get_hasher, block_size=hash_block_size, caching_hash_fn=hash_fn,
                              num_lookahead_tokens=getattr(vllm_config, "num_hash_lookahead_tokens", 0)) \
            if "block_size" in params_of(get_hasher)[0] else get_hasher(hash_block_size, hash_fn)

    # ---- requests ---------------------------------------------------------------------------
    def make_request(self, req_id: str, prompt: list[int], max_tokens: int, priority: int,
                     arrival_time: float):
        """A ``vllm.v1.request.Request`` as ``Request.from_engine_core_request`` would make it:
        sampling params with ``max_tokens`` and EOS, the engine's block hasher, priority and
        arrival time (seconds)."""
        sp = call_supported(self.SamplingParams, max_tokens=max_tokens, ignore_eos=False,
                            temperature=0.0)
        if hasattr(sp, "update_from_generation_config"):
            try:
                sp.update_from_generation_config({}, EOS_TOKEN_ID)
            except TypeError:
                pass
        names, _ = params_of(self.Request)
        if priority and not self.caps.priority:
            raise RefusedByRelease(f"requests[{req_id}].priority: {self.caps.refusal('priority')}")
        kwargs = dict(
            request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
            pooling_params=None, eos_token_id=EOS_TOKEN_ID, arrival_time=arrival_time,
            lora_request=None, priority=priority, block_hasher=self.block_hasher,
            multi_modal_inputs=None, multi_modal_kwargs=None, multi_modal_hashes=None,
            multi_modal_placeholders=None, mm_features=None, structured_output_request=None,
            cache_salt=None, client_index=0, prompt_embeds=None, trace_headers=None)
        if "mm_features" in names:
            kwargs["mm_features"] = []
            if "multi_modal_hashes" not in names:
                kwargs["mm_features"] = None
        if "inputs" in names and "prompt_token_ids" not in names:
            # 0.6.x: Request.from_engine_core_request wraps the prompt in token_inputs(...)
            token_inputs = _import("vllm.inputs:token_inputs", "vllm.inputs.data:token_inputs")
            kwargs["inputs"] = call_supported(
                token_inputs, prompt_token_ids=list(prompt), prompt=None, multi_modal_data=None,
                multi_modal_inputs=None, multi_modal_hashes=None, multi_modal_placeholders=None,
                mm_processor_kwargs=None)
        kwargs.setdefault("prompt", None)
        request = call_supported(self.Request, **kwargs)
        return request

    def front_door(self, req_id: str, prompt: list[int], max_tokens: int, priority: int) -> None:
        """Refuse what the release's own front door refuses before a request reaches the
        scheduler: ``Processor.process_inputs`` (``vllm/v1/engine/processor.py``) is called with
        the request's priority, e.g. 0.8/0.9 raise ``V1 does not support priority yet``.

        Only priorities are checked this way (the rest of a request is plain token ids). When the
        release's processor cannot be built without a tokenizer the check is skipped.
        """
        if not priority:
            return
        if not hasattr(self, "_processor"):
            self._processor = None
            proc_cls = _try_import("vllm.v1.engine.processor:Processor")
            if proc_cls is not None:
                try:
                    self._processor = call_supported(proc_cls, vllm_config=self.vllm_config,
                                                     tokenizer=None)
                except Exception:  # noqa: BLE001 - API drift: no front-door check possible
                    self._processor = None
        if self._processor is None:
            return
        sp = call_supported(self.SamplingParams, max_tokens=max_tokens)
        try:
            call_supported(self._processor.process_inputs, request_id=req_id,
                           prompt={"prompt_token_ids": list(prompt)}, params=sp,
                           arrival_time=0.0, priority=priority)
        except (ValueError, NotImplementedError) as exc:
            if "priority" in str(exc).lower():
                raise RefusedByRelease(
                    f"requests[{req_id}].priority: vLLM {self.version}'s front door "
                    f"(Processor.process_inputs) refuses it: {exc}; use priority 0 and "
                    "policy fcfs on this release") from None
        except Exception:  # noqa: BLE001 - anything else is not about priority
            return

    # ---- scheduler output / model output ----------------------------------------------------
    def scheduled(self, so) -> list[Scheduled]:
        """What ``SchedulerOutput`` asks the model runner to compute, per request, in
        ``num_scheduled_tokens`` order (``vllm/v1/core/sched/output.py``; read by
        :mod:`.state`)."""
        before, new_ids = state.computed_before(so)
        spec = state.spec_tokens(so)
        out = []
        for rid, n in so.num_scheduled_tokens.items():
            out.append(Scheduled(rid, n, before.get(rid), list(spec.get(rid, [])), rid in new_ids))
        return out

    def model_output(self, req_ids: list[str], sampled: list[list[int]],
                     drafts: list[list[int]] | None):
        """``ModelRunnerOutput`` for ``req_ids`` (ordered as scheduled).

        ``sampled``: the tokens of each request this step (``[]``: none, e.g. a partial prefill).
        Where the release takes one token per request (0.6.x/0.7.x) a request without a token
        gets the placeholder id 0, which that scheduler ignores for a request still in prefill
        (as the GPU runner's sampled token is ignored there); more than one token is an
        :class:`AdapterError` (no spec decode in that API)."""
        sampled_field: list = sampled
        if self.one_token_per_request:
            if any(len(s) > 1 for s in sampled):
                raise AdapterError(f"vLLM {self.version}'s ModelRunnerOutput takes one sampled "
                                   "token per request (no spec decode)")
            sampled_field = [s[0] if s else 0 for s in sampled]
        elif self._sampled_ndarray:
            import numpy as np

            sampled_field = [np.array(s, dtype=np.int32) for s in sampled]
        kwargs = dict(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                      sampled_token_ids=sampled_field, logprobs=None, prompt_logprobs_dict={},
                      pooler_output=[], num_nans_in_logits=None,
                      logprob_token_ids_cpu=None, logprobs_cpu=None)
        if "spec_token_ids" in self._mro_fields:
            kwargs["spec_token_ids"] = drafts
        return call_supported(self.ModelRunnerOutput, **kwargs)

    def deliver_drafts(self, scheduler, req_ids: list[str], drafts: list[list[int]] | None) -> None:
        """0.10.2+: drafts reach the scheduler through ``update_draft_token_ids`` after
        ``update_from_output`` (``EngineCore.step``); older releases took them in the output."""
        if drafts is None or "spec_token_ids" in self._mro_fields:
            return
        if self.DraftTokenIds is not None and hasattr(scheduler, "update_draft_token_ids"):
            scheduler.update_draft_token_ids(self.DraftTokenIds(req_ids, drafts))

    def stat_logger(self, vllm_config):
        """The front end's stat loggers, as ``AsyncLLM`` builds them when stats are logged
        (``disable_log_stats: false``): ``StatLoggerManager(vllm_config, engine_idxs=[0])`` (0.10+,
        logging + Prometheus), else ``LoggingStatLogger`` and ``PrometheusStatLogger`` one by one
        (0.8/0.9). Returns a callable ``record(scheduler_stats)`` (``vllm/v1/metrics/loggers.py``;
        iteration stats come from the detokenizing output processor, which the lab does not run,
        so they are None). Raises :class:`AdapterError` where the release has no V1 stat
        loggers."""
        try:
            loggers_mod = importlib.import_module("vllm.v1.metrics.loggers")
        except Exception as exc:  # noqa: BLE001 - e.g. a slice without the metrics modules
            raise AdapterError(f"vLLM {self.version}'s stat loggers (vllm.v1.metrics.loggers, for "
                               f"config.disable_log_stats: false) do not import: "
                               f"{type(exc).__name__}: {exc}") from exc
        manager_cls = getattr(loggers_mod, "StatLoggerManager", None)
        if manager_cls is not None:
            manager = call_supported(manager_cls, vllm_config=vllm_config, engine_idxs=[0],
                                     custom_stat_loggers=None, enable_default_loggers=True)
            loggers = [manager]
        else:
            classes = [_try_import("vllm.v1.metrics.loggers:LoggingStatLogger"),
                       _try_import("vllm.v1.metrics.loggers:PrometheusStatLogger")]
            if None in classes:
                raise AdapterError(f"vLLM {self.version} has no V1 stat loggers "
                                   "(config.disable_log_stats: false)")
            loggers = [call_supported(cls, vllm_config=vllm_config, engine_index=0,
                                      engine_indexes=[0]) for cls in classes]

        def record(scheduler_stats) -> None:
            for lg in loggers:
                call_supported(lg.record, scheduler_stats=scheduler_stats, iteration_stats=None,
                               mm_cache_stats=None, engine_idx=0)
        return record

    @staticmethod
    def scheduler_stats(engine_core_outputs) -> list:
        """The ``SchedulerStats`` that ``update_from_output`` attached to its outputs
        (``dict[int, EngineCoreOutputs]`` 0.9+, one ``EngineCoreOutputs`` 0.8, a list of
        ``EngineCoreOutput`` before)."""
        if isinstance(engine_core_outputs, dict):
            outs = list(engine_core_outputs.values())
        elif isinstance(engine_core_outputs, (list, tuple)):
            outs = []
        else:
            outs = [engine_core_outputs]
        return [st for o in outs if (st := getattr(o, "scheduler_stats", None)) is not None]

    def has_work(self, scheduler) -> bool:
        """Whether ``EngineCore.step`` would call ``schedule()`` now: ``Scheduler.has_requests()``
        (unfinished requests, or finished ids still to tell the runner; 0.10+), else
        ``has_unfinished_requests()`` (0.6 to 0.9). An idle engine does not schedule (0.7.0's
        ``schedule()`` even fails on an empty batch)."""
        probe = getattr(scheduler, "has_requests", None) or scheduler.has_unfinished_requests
        return bool(probe())

    def abort(self, scheduler, req_ids: list[str]) -> None:
        """``EngineCore.abort_requests``: finish as aborted."""
        scheduler.finish_requests(req_ids, self.RequestStatus.FINISHED_ABORTED)

    # ---- state (read by :mod:`.state`) ------------------------------------------------------
    def block_pool(self, scheduler):
        return state.block_pool(scheduler)

    def num_free_blocks(self, scheduler) -> int | None:
        return state.num_free_blocks(scheduler)

    def queues(self, scheduler) -> tuple[list[str], list[str], list[str]]:
        """(waiting ids, running ids, preempted ids) — preempted are waiting with status
        PREEMPTED (``Scheduler._preempt_request``)."""
        return state.queue_ids(scheduler, self.RequestStatus.PREEMPTED)


def _source_has(fn, text: str) -> bool:
    """Whether the source of ``fn`` contains ``text`` (False when it has no readable source)."""
    try:
        return text in inspect.getsource(fn)
    except (OSError, TypeError):
        return False
