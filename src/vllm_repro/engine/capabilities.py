"""What one vLLM release supports, probed once: the :class:`Capabilities` record.

The worker probes it right after importing the release (``probe(adapter)``, inside the release
environment: standard library + vLLM) and sends it in its hello; the host keeps it
(``Worker.capabilities``) and caches it per release (``<cache>/capabilities/<version>.json``),
so that the loop, the fuzzer and triage read one record instead of probing vLLM each in their
own way. Every field is found by probing classes, signatures and sources of the release, never
by comparing version numbers: vLLM's API drift lives here and in the adapter only.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

#: the scenario features a release may refuse, with what a refusal says (``refusal()``)
FEATURES = ("priority", "spec decode", "empty outputs", "async scheduling", "kv cache groups",
            "engine-core", "kv connectors", "engine core process")
#: where a release's ``KVCacheBlock`` may keep its hash / the tokens it covers, in probe order
BLOCK_HASH_FIELDS = ("_block_hash", "block_hash")
BLOCK_HASH_TOKENS_FIELDS = ("_block_hash_num_tokens", "block_hash_num_tokens")
#: what the audit turns off without a block hash field (the verdict's ``audit partial`` text)
HASH_CHECKS = "KV hash checks"
#: the engine generations a release may lack, which ``refusal()`` also answers for
GENERATIONS = ("v0-engine", "v1-engine")


@dataclass(frozen=True)
class Capabilities:
    """One release's support, as probed (see :func:`probe` for the vLLM source each field reads).

    ``events``: the EngineCore calls a scenario's ``events`` may make (``abort``,
    ``abort_in_flight``, ``reset_prefix_cache``, ``reset_running_requests``, ``pause``,
    ``pause_mode`` (``pause_scheduler(mode=...)``), ``resume``); ``spec_methods``: the
    ``SpeculativeConfig.method`` values the lab's fake drafter
    can stand for (``ngram``, ``ngram_gpu``); ``kv_group_kinds``: KV cache spec kinds
    (``full``, ``sliding_window``, ``chunked_local_attention``, ``mamba``,
    ``cross_attention``: ``engine/adapter/kv_specs.py``). ``structured_outputs``: the release has V1's
    ``StructuredOutputManager``; ``structured_outputs_field``: the ``SamplingParams`` field a
    request's constraint goes in (``structured_outputs``, or ``guided_decoding`` on older
    releases); ``structured_backends``: the backends of ``vllm/v1/structured_output`` whose
    library imports in the release's environment (``xgrammar``, ``guidance``, ``outlines``,
    ``lm-format-enforcer``); ``preprocess_errors_per_request``: the engine process's input
    thread answers an exception in ``preprocess_add_request`` with an error for that request
    (``EngineCoreProc._handle_request_preproc_error``) instead of dying. ``kv_connectors``:
    the release's scheduler builds a V1 KV connector from ``kv_transfer_config`` through a
    ``KVConnectorFactory`` that takes registrations, and its ``ModelRunnerOutput`` carries the
    worker's report (``kv_connector_output``, or ``finished_recving`` on the output itself);
    ``kv_load_failures``: the failure reports its ``KVConnectorOutput`` carries
    (``invalid_block_ids``, ``failed_recving``). ``v1_engine``: the release has the V1 scheduler
    the ``scheduler`` and ``engine-core`` levels drive; ``v0_engine``: it has the V0
    ``LLMEngine`` (``vllm/engine/llm_engine.py`` + ``vllm/core/scheduler.py``) that ``level:
    v0-engine`` drives; ``v0_priority``: that engine's ``add_request`` takes a priority.
    """

    version: str
    priority: bool = False
    spec_decode: bool = False
    spec_methods: tuple[str, ...] = ()
    empty_outputs: bool = False
    async_scheduling: bool = False
    kv_cache_groups: bool = False
    kv_group_kinds: tuple[str, ...] = ()
    #: ``CacheConfig.mamba_cache_mode``'s values other than ``none`` (``align``, ``all``):
    #: prefix caching with a Mamba group needs one; empty where the release lacks the field
    #: (and turns prefix caching off for Mamba models)
    mamba_cache_modes: tuple[str, ...] = ()
    engine_core: bool = False
    #: ``config.multiprocess_mode`` (``engine/core_proc.py``): ``EngineCoreClient.make_client``
    #: takes ``multiprocess_mode``, and ``EngineCoreProc`` keeps an ``input_queue`` that
    #: ``_handle_client_request`` serves (``vllm/v1/engine/core_client.py``, ``core.py``)
    engine_core_proc: bool = False
    split_sampling: bool = False
    batch_queue_from_config: bool = False
    events: tuple[str, ...] = ()
    structured_outputs: bool = False
    structured_outputs_field: str | None = None
    structured_backends: tuple[str, ...] = ()
    preprocess_errors_per_request: bool = False
    kv_connectors: bool = False
    kv_load_failures: tuple[str, ...] = ()
    #: vLLM's own connectors whose scheduler half the lab runs (``kv_connector: NixlConnector``):
    #: the names the release's ``KVConnectorFactory`` registry has, of those the lab's worker
    #: half can answer (``engine/kv_worker.py``)
    own_kv_connectors: tuple[str, ...] = ()
    v1_engine: bool = True
    v0_engine: bool = False
    v0_priority: bool = False
    #: the ``KVCacheBlock`` field (``vllm/v1/core/kv_cache_utils.py``) that stores a block's
    #: prefix-cache hash: ``_block_hash`` (behind a ``block_hash`` property, 0.8 to 0.33) or
    #: ``block_hash`` (a plain field, 0.34); None where the class has neither: the audit's KV
    #: hash checks are then off (:data:`HASH_CHECKS`), the rest of the audit runs
    kv_block_hash: str | None = None
    #: the ``KVCacheBlock`` field with the number of prefix tokens its hash covers (partial-block
    #: hashing: ``_block_hash_num_tokens`` 0.26 to 0.33, ``block_hash_num_tokens`` 0.34); None
    #: where blocks are hashed whole only
    kv_block_hash_tokens: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def audit_off(self) -> list[str]:
        """The audit's checks this release's books keep from running, one line each naming
        the attribute it lacks and the checks (empty: the whole audit runs); the V1 audit's
        (``level: scheduler`` / ``engine-core``), none where the release has no V1 engine."""
        if self.v1_engine and self.kv_block_hash is None:
            return [f"vLLM {self.version}'s KVCacheBlock has none of the fields "
                    f"{', '.join(BLOCK_HASH_FIELDS)}: {HASH_CHECKS} off"]
        return []

    def supports(self, feature: str) -> bool:
        """Whether the release supports ``feature`` (one of :data:`FEATURES`)."""
        return self.refusal(feature) is None

    def refusal(self, feature: str) -> str | None:
        """The one-line reason the release refuses ``feature``, or None when it supports it.
        Raises :class:`KeyError` for a feature not in :data:`FEATURES` or
        :data:`GENERATIONS`."""
        v = self.version
        reasons = {
            "priority": None if self.priority else
            f"vLLM {v}'s V1 Request has no priority (the engine refuses priorities); use "
            "priority 0 and policy fcfs on this release",
            "spec decode": None if self.spec_decode else
            f"vLLM {v}'s V1 Scheduler has no speculative decoding (no spec_token_ids)",
            "empty outputs": None if self.empty_outputs else
            f"vLLM {v}'s ModelRunnerOutput holds one sampled token per request; a step without "
            "a token cannot be expressed there",
            "async scheduling": None if self.async_scheduling else
            f"vLLM {v} has no AsyncScheduler (vllm/v1/core/sched/async_scheduler.py)",
            "kv cache groups": None if self.kv_cache_groups else
            f"vLLM {v}'s Scheduler builds one full-attention KV cache from CacheConfig",
            "engine-core": None if self.engine_core else
            f"vLLM {v}'s first-generation V1 engine (no KV cache sizing from executor specs, "
            "or no EngineCoreProc._process_engine_step in vllm/v1/engine/core.py) runs at "
            "level: scheduler only",
            "v0-engine": None if self.v0_engine else
            f"vLLM {v} has no V0 engine (vllm/engine/llm_engine.py with vllm/core/scheduler.py); "
            "use level: scheduler or engine-core on this release",
            "v1-engine": None if self.v1_engine else
            f"vLLM {v} has no V1 engine (only the V0 LLMEngine); use level: v0-engine on this "
            "release",
            "engine core process": None if self.engine_core_proc else
            f"vLLM {v} has no EngineCoreProc serving an input_queue through "
            "_handle_client_request behind EngineCoreClient.make_client(multiprocess_mode=...); "
            "drop config.multiprocess_mode on this release",
            "kv connectors": None if self.kv_connectors else
            f"vLLM {v} has no V1 KV connector seam the lab can script (a KVConnectorFactory "
            "taking registrations, a scheduler that builds the connector from "
            "kv_transfer_config, and the worker's report in ModelRunnerOutput)",
        }
        return reasons[feature]

    def to_dict(self) -> dict:
        """A JSON-ready dict (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Capabilities":
        """The record from :meth:`to_dict`'s output (unknown keys ignored, for records cached
        by an older lab). Raises :class:`KeyError` without ``version``."""
        names = {f.name: f for f in fields(cls)}
        kw = {}
        for k, v in d.items():
            if k in names:
                kw[k] = tuple(v) if isinstance(v, list) else v
        return cls(version=d["version"], **{k: v for k, v in kw.items() if k != "version"})


def cache_path(cache: Path, version: str) -> Path:
    """Where the host keeps a release's probed record."""
    return cache / "capabilities" / f"{version}.json"


def save(cache: Path, caps: Capabilities) -> None:
    """Cache ``caps`` (best effort: a read-only cache, as in the CPU image, keeps nothing)."""
    p = cache_path(cache, caps.version)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(caps.to_dict(), indent=1))
        tmp.replace(p)
    except OSError:
        pass


def load(cache: Path, version: str) -> Capabilities | None:
    """The cached record of ``version``, or None when the release never ran here."""
    try:
        return Capabilities.from_dict(json.loads(cache_path(cache, version).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
    from .adapter import _source_has, _try_import, init_params, params_of

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
    from .adapter.kv_specs import release_kinds

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
        if "pause_scheduler" in core_methods:
            events.append("pause")
            if "mode" in core_methods["pause_scheduler"]:
                events.append("pause_mode")
        if "resume_scheduler" in core_methods:
            events.append("resume")
        batch_from_config = "vllm_config.max_concurrent_batches" in init_src
    proc = _class_source("vllm.v1.engine.core", "EngineCoreProc")
    executor = _class_source("vllm.v1.executor.abstract", "Executor")
    connector, load_failures = _kv_connector_seam(adapter)
    so_field = adapter.structured_params_class()[0] if adapter.StructuredOutputManager else None
    backends = tuple(name for name, module, lib in _SO_BACKENDS
                     if adapter.StructuredOutputManager is not None
                     and _module_exists(f"vllm.v1.structured_output.{module}")
                     and _module_exists(lib))
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
        engine_core_proc=proc is not None and "_handle_client_request" in proc[0]
        and "input_queue" in proc[1] and "multiprocess_mode" in (
            (_class_source("vllm.v1.engine.core_client", "EngineCoreClient") or ({}, ""))[0]
            .get("make_client", ())),
        split_sampling=executor is not None and "sample_tokens" in executor[0],
        batch_queue_from_config=batch_from_config,
        events=tuple(events),
        structured_outputs=adapter.StructuredOutputManager is not None,
        structured_outputs_field=so_field,
        structured_backends=backends,
        preprocess_errors_per_request=proc is not None
        and "_handle_request_preproc_error" in proc[0],
        kv_connectors=connector,
        kv_load_failures=load_failures,
        own_kv_connectors=_own_kv_connectors(connector),
        v0_engine=_module_exists("vllm.engine.llm_engine") and _module_exists("vllm.core.scheduler"),
        kv_block_hash=_block_field(BLOCK_HASH_FIELDS),
        kv_block_hash_tokens=_block_field(BLOCK_HASH_TOKENS_FIELDS),
        notes=tuple(adapter.platform_notes),
    )


def _block_field(names: tuple[str, ...]) -> str | None:
    """The first of ``names`` that ``vllm/v1/core/kv_cache_utils.py:KVCacheBlock`` stores
    (a dataclass field, a slot or an annotated attribute; a property that reads another field
    is not one); None where the class or every name is absent."""
    import dataclasses

    from .adapter import _try_import

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
    from .adapter import _source_has, _try_import, fields_of, params_of

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


#: vLLM's own connectors the lab's worker half answers (engine/kv_worker.py reads their metadata)
LAB_RUNS_OWN_CONNECTORS = ("NixlConnector",)


def _own_kv_connectors(seam: bool) -> tuple[str, ...]:
    """The :data:`LAB_RUNS_OWN_CONNECTORS` the release's ``KVConnectorFactory._registry``
    (``vllm/distributed/kv_transfer/kv_connector/factory.py``, names registered at import)
    holds, where the lab can script its connector seam at all; () otherwise."""
    from .adapter import _try_import

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
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        text = Path(spec.origin).read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            methods: dict[str, set[str]] = {}
            init_src = ""
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = item.args
                    methods[item.name] = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
                    if item.name == "__init__":
                        init_src = ast.get_source_segment(text, item) or ""
            return methods, init_src
    return None


__all__ = ["Capabilities", "FEATURES", "HASH_CHECKS", "BLOCK_HASH_FIELDS", "GENERATIONS", "probe",
           "probe_v0", "save", "load", "cache_path"]
