"""Probing a release for its :class:`~vllm_repro.engine.capabilities.Capabilities` record
(runs in the release environment, right after the adapter imported vLLM: standard library +
vLLM). The record itself, its cache and its refusals are :mod:`vllm_repro.engine.capabilities`
(host side too); the probes read classes, signatures and sources, never version numbers.
"""

from __future__ import annotations

import re

from ..capabilities import BLOCK_HASH_FIELDS, BLOCK_HASH_TOKENS_FIELDS, Capabilities
from .kv_specs import release_kinds
from .probes import _source_has, _try_import, class_in_source, fields_of, init_params, params_of


def probe(adapter) -> Capabilities:
    """Probe the release the adapter imported (runs in the release environment).

    Reads: ``vllm/v1/request.py:Request.__init__`` (priority); ``Scheduler`` source
    (``spec_token_ids``) and ``ModelRunnerOutput.sampled_token_ids``' annotation (spec decode,
    empty outputs); ``vllm/config`` ``SpeculativeConfig.method`` (draft methods);
    ``vllm/v1/core/sched/async_scheduler.py`` (async); ``Scheduler.__init__``'s
    ``kv_cache_config`` and ``vllm/v1/kv_cache_interface.py`` (KV groups, engine-core sizing);
    ``vllm/v1/executor/abstract.py:Executor.sample_tokens``; ``vllm/v1/engine/core.py:EngineCore``
    (events, batch queue); ``vllm/v1/structured_output`` and the V1 KV connector package.
    """

    spec = not adapter.one_token_per_request and _source_has(adapter.Scheduler, "spec_token_ids")
    methods: list[str] = []
    spec_cls = getattr(adapter.config_mod, "SpeculativeConfig", None)
    if spec and spec_cls is not None:
        ann = str(getattr(spec_cls, "__annotations__", {}).get("method", ""))
        src_mod = _try_import("vllm.config.speculative") or adapter.config_mod
        text = ann + " " + str(getattr(src_mod, "NgramGPUTypes", ""))
        methods.append("ngram")
        if "ngram_gpu" in text or _source_has(spec_cls, '"ngram_gpu"'):
            methods.append("ngram_gpu")
        # the model-based drafters: the names the release's SpeculativeMethod Literal holds
        # (nested Literals flattened: EagleModelTypes, MTPModelTypes), each with a packaged
        # config-only draft (engine/drafter.py:DRAFT_MODELS)
        named = _literal_values(getattr(src_mod, "SpeculativeMethod", None))
        methods.extend(m for m in DRAFTER_METHODS if m in named)

    kinds = release_kinds()
    # EngineCore and the executor are read from their source (ast), not imported: the
    # scheduler level never imports them (a slice may not hold them at all)
    core = _class_source("vllm.v1.engine.core", "EngineCore")
    events: list[str] = []
    batch_from_config = False
    if core is not None:
        core_methods, init_src = core
        events.append("abort")
        if "aborts_queue" in init_src or "batch_queue" in init_src:
            events.append("abort_in_flight")
        if "reset_prefix_cache" in core_methods:
            events.append("reset_prefix_cache")
            if "reset_running_requests" in core_methods["reset_prefix_cache"]:
                events.append("reset_running_requests")
            if "reset_connector" in core_methods["reset_prefix_cache"]:
                events.append("reset_connector")
        if "pause_scheduler" in core_methods:
            events.append("pause")
            if "mode" in core_methods["pause_scheduler"]:
                events.append("pause_mode")
        if "resume_scheduler" in core_methods:
            events.append("resume")
        batch_from_config = "vllm_config.max_concurrent_batches" in init_src
    proc = _class_source("vllm.v1.engine.core", "EngineCoreProc")
    dp = _class_source("vllm.v1.engine.core", "DPEngineCoreProc")
    executor = _class_source("vllm.v1.executor.abstract", "Executor")
    connector, load_failures = _kv_connector_seam(adapter)
    so_field = adapter.structured_params_class()[0] if adapter.StructuredOutputManager else None
    backends = tuple(name for name, module, lib in _SO_BACKENDS
                     if adapter.StructuredOutputManager is not None
                     and _module_exists(f"vllm.v1.structured_output.{module}")
                     and _module_exists(lib))
    reasoning_field, reasoning_names = _reasoning_parsers(adapter)
    return Capabilities(
        version=adapter.version,
        priority="priority" in params_of(adapter.Request)[0],
        spec_decode=spec,
        spec_methods=tuple(methods),
        empty_outputs=not adapter.one_token_per_request,
        async_scheduling=_try_import("vllm.v1.core.sched.async_scheduler:AsyncScheduler") is not None,
        kv_cache_groups="kv_cache_config" in init_params(adapter.Scheduler)[0],
        kv_group_kinds=tuple(kinds),
        mamba_cache_modes=_mamba_cache_modes(adapter),
        # EngineCore._initialize_kv_caches asks the executor for KV cache specs (0.7+, where
        # 0.6.x asks it for a number of blocks), and the engine process steps it through
        # EngineCoreProc._process_engine_step (0.8+; 0.7.x inlines it in run_busy_loop)
        engine_core=core is not None and adapter.FullAttentionSpec is not None
        and "_initialize_kv_caches" in core[0] and proc is not None
        and "_process_engine_step" in proc[0],
        split_sampling=executor is not None and "sample_tokens" in executor[0],
        batch_queue_from_config=batch_from_config,
        events=tuple(events),
        structured_outputs=adapter.StructuredOutputManager is not None,
        structured_outputs_field=so_field,
        structured_backends=backends,
        reasoning_parser_field=reasoning_field,
        reasoning_parsers=reasoning_names,
        preprocess_errors_per_request=proc is not None
        and "_handle_request_preproc_error" in proc[0],
        engine_core_proc=proc is not None and "_handle_client_request" in proc[0]
        and "input_queue" in proc[1] and "multiprocess_mode" in (
            (_class_source("vllm.v1.engine.core_client", "EngineCoreClient") or ({}, ""))[0]
            .get("make_client", ())),
        dp_engine_core_proc=bool(dp) and {"run_busy_loop", "_has_global_unfinished_reqs"}
        <= set(dp[0]) and class_in_source("vllm.v1.engine.core_client", "DPLBAsyncMPClient")
        is not None,
        dp_throttle_prefills=bool(dp) and "_should_throttle_prefills" in dp[0],
        kv_connectors=connector,
        kv_load_failures=load_failures,
        own_kv_connectors=_own_kv_connectors(connector),
        kv_hma=connector and _try_import(
            "vllm.distributed.kv_transfer.kv_connector.v1.base:SupportsHMA") is not None,
        kv_lookup_not_ready=connector and _lookup_may_be_none(),
        v0_engine=_module_exists("vllm.engine.llm_engine") and _module_exists("vllm.core.scheduler"),
        kv_block_hash=_block_field(BLOCK_HASH_FIELDS),
        kv_block_hash_tokens=_block_field(BLOCK_HASH_TOKENS_FIELDS),
        notes=tuple(adapter.platform_notes),
    )


#: where a release's ``StructuredOutputManager`` may read its reasoning parser's name, in probe
#: order: (config class, its ``VllmConfig`` attribute, field)
REASONING_FIELDS = (("StructuredOutputsConfig", "structured_outputs_config", "reasoning_parser"),
                    ("DecodingConfig", "decoding_config", "reasoning_backend"))


def _reasoning_parsers(adapter) -> tuple[str | None, tuple[str, ...]]:
    """``(Class.field, parser names)``: the config field the release's ``StructuredOutputManager``
    reads a reasoning parser's name from (the first of :data:`REASONING_FIELDS` the config class
    has and the manager's source reads: ``self.vllm_config.structured_outputs_config.
    reasoning_parser``, 0.11+; ``...decoding_config.reasoning_backend``, 0.9/0.10), and the
    names vLLM's ``ReasoningParserManager`` registers (``reasoning_parsers``, and
    ``lazy_parsers`` where it has them); ``(None, ())`` where the manager reads none."""
    som = adapter.StructuredOutputManager
    if som is None:
        return None, ()
    for cls_name, attr, name in REASONING_FIELDS:
        if name in adapter.config_fields(cls_name) and _source_has(som, f"{attr}.{name}"):
            manager = _try_import("vllm.reasoning:ReasoningParserManager")
            if manager is None:
                return None, ()
            names = set(getattr(manager, "reasoning_parsers", None) or {})
            names |= set(getattr(manager, "lazy_parsers", None) or {})
            return f"{cls_name}.{name}", tuple(sorted(names))
    return None, ()


def _block_field(names: tuple[str, ...]) -> str | None:
    """The first of ``names`` that ``vllm/v1/core/kv_cache_utils.py:KVCacheBlock`` stores
    (a dataclass field, a slot or an annotated attribute; a property that reads another field
    is not one); None where the class or every name is absent."""
    import dataclasses


    cls = _try_import("vllm.v1.core.kv_cache_utils:KVCacheBlock")
    if cls is None:
        return None
    stored: set[str] = set()
    if dataclasses.is_dataclass(cls):
        stored |= {f.name for f in dataclasses.fields(cls)}
    for k in cls.__mro__:
        stored |= set(getattr(k, "__annotations__", {})) | set(getattr(k, "__slots__", ()))
    for name in names:
        if name in stored and not isinstance(getattr(cls, name, None), property):
            return name
    return None


def _mamba_cache_modes(adapter) -> tuple[str, ...]:
    """The values of ``CacheConfig.mamba_cache_mode`` but ``none`` (``vllm/config/cache.py``:
    ``mamba_cache_mode: MambaCacheMode``, a ``Literal``), () where the field is absent."""
    import sys
    import typing

    cc = getattr(adapter.config_mod, "CacheConfig", None)
    ann = getattr(cc, "__annotations__", {}).get("mamba_cache_mode") if cc is not None else None
    if ann is None:
        return ()
    if isinstance(ann, str):  # postponed annotations: the alias by name in its module
        ann = getattr(sys.modules.get(cc.__module__), ann, ann)
    values = [a for a in typing.get_args(ann) if isinstance(a, str)]
    if not values and isinstance(ann, str):
        values = re.findall(r"[\"']([a-z_]+)[\"']", ann)
    return tuple(v for v in values if v != "none") or ("align",)


def probe_v0(adapter) -> Capabilities:
    """The record of a release as its V0 adapter sees it (``engine/v0.py``): ``v0_engine``,
    ``v0_priority`` (``LLMEngine.add_request``'s parameters) and ``v1_engine`` (the V1
    scheduler's module exists); the V1 fields come from the V1 adapter where there is one."""
    from dataclasses import replace

    base = getattr(adapter, "base", None)
    caps = base.caps if base is not None else Capabilities(
        version=adapter.version, notes=tuple(adapter.platform_notes),
        v1_engine=_module_exists("vllm.v1.core.sched.scheduler")
        or _module_exists("vllm.v1.core.scheduler"))
    return replace(caps, v0_engine=True, v0_priority="priority" in adapter.add_request_params)


def _kv_connector_seam(adapter) -> tuple[bool, tuple[str, ...]]:
    """``(kv_connectors, kv_load_failures)`` (see :class:`Capabilities`): reads
    ``vllm/distributed/kv_transfer/kv_connector/factory.py:KVConnectorFactory.register_connector``,
    ``kv_connector/v1/base.py:KVConnectorBase_V1``, the scheduler's source (``self.connector``
    built with ``create_connector``) and ``vllm/v1/outputs.py`` (``ModelRunnerOutput``,
    ``KVConnectorOutput``)."""

    if not _module_exists("vllm.distributed.kv_transfer.kv_connector.v1"):
        return False, ()
    factory = _try_import("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory")
    base = _try_import("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1")
    mro = params_of(adapter.ModelRunnerOutput)[0]
    report = "kv_connector_output" in mro or "finished_recving" in mro
    builds = _source_has(getattr(adapter.Scheduler, "__init__", None), "create_connector")
    ok = bool(factory is not None and hasattr(factory, "register_connector") and base is not None
              and report and builds)
    kvo = _try_import("vllm.v1.outputs:KVConnectorOutput")
    failures = tuple(f for f in ("invalid_block_ids", "failed_recving")
                     if ok and kvo is not None and f in fields_of(kvo))
    return ok, failures


def _lookup_may_be_none() -> bool:
    """Whether ``KVConnectorBase_V1.get_num_new_matched_tokens`` (``kv_connector/v1/base.py``)
    declares ``None`` in its count (``tuple[int | None, bool]``, ``Optional[int]``: the
    "not yet" answer, vLLM #23620)."""
    import inspect

    base = _try_import("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1")
    try:
        ann = inspect.signature(base.get_num_new_matched_tokens).return_annotation
    except (AttributeError, TypeError, ValueError):
        return False
    text = ann if isinstance(ann, str) else repr(ann)
    return "None" in text or "Optional" in text


#: vLLM's own connectors the lab's worker half answers (engine/kv_worker.py reads their metadata)
LAB_RUNS_OWN_CONNECTORS = ("NixlConnector", "OffloadingConnector")


def _own_kv_connectors(seam: bool) -> tuple[str, ...]:
    """The :data:`LAB_RUNS_OWN_CONNECTORS` the release's ``KVConnectorFactory._registry``
    (``vllm/distributed/kv_transfer/kv_connector/factory.py``, names registered at import)
    holds, where the lab can script its connector seam at all; () otherwise."""

    if not seam:
        return ()
    factory = _try_import("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory")
    registry = getattr(factory, "_registry", None) or {}
    return tuple(n for n in LAB_RUNS_OWN_CONNECTORS if n in registry)


#: (backend name, its module in vllm/v1/structured_output, the library it needs)
_SO_BACKENDS = (("xgrammar", "backend_xgrammar", "xgrammar"),
                ("guidance", "backend_guidance", "llguidance"),
                ("outlines", "backend_outlines", "outlines_core"),
                ("lm-format-enforcer", "backend_lm_format_enforcer", "lmformatenforcer"))


#: the model-based ``SpeculativeConfig.method`` values the lab's drafter stands for, where the
#: release names them (``engine/drafter.py``)
DRAFTER_METHODS = ("eagle", "eagle3", "mtp", "deepseek_mtp", "draft_model")


def _literal_values(tp) -> set[str]:
    """The strings of a ``typing.Literal`` (nested Literals and Optional flattened); empty for
    None or anything else."""
    import typing

    out: set[str] = set()
    if tp is None:
        return out
    for arg in typing.get_args(tp):
        if isinstance(arg, str):
            out.add(arg)
        else:
            out |= _literal_values(arg)
    return out


def _module_exists(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _class_source(module: str, cls: str) -> tuple[dict[str, set[str]], str] | None:
    """``({method: its argument names}, the source of __init__)`` of class ``cls`` in
    ``module``'s file, read with :mod:`ast` (nothing imported); None when the file or the class
    is absent."""
    import ast

    found = class_in_source(module, cls)
    if found is None:
        return None
    _, text, node = found
    methods: dict[str, set[str]] = {}
    init_src = ""
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = item.args
            methods[item.name] = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
            if item.name == "__init__":
                init_src = ast.get_source_segment(text, item) or ""
    return methods, init_src


__all__ = ["probe", "probe_v0"]
