"""Building vLLM's V1 objects as ``EngineCore.__init__`` does: configs, KV cache config, block
hasher, ``Scheduler`` (see the package docstring for the probes)."""

from __future__ import annotations

import importlib
import json
from typing import Any

from ..engine_args import PASSTHROUGH_CLASSES
from . import kv_specs
from .probes import (AdapterError, RefusedByRelease, _import, _source_has, _try_import,
                     call_supported, init_params, params_of)


class BuildMixin:
    """``V1Adapter``'s building methods (the release's classes are the adapter's attributes)."""

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
    PASSTHROUGH_CLASSES = PASSTHROUGH_CLASSES
    #: the ``VllmConfig`` field each pass-through class beyond the first four is handed in as
    VLLM_CONFIG_FIELD = {"StructuredOutputsConfig": "structured_outputs_config",
                         "DecodingConfig": "decoding_config"}

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
        Raises :class:`RefusedByRelease` naming every field none of :data:`PASSTHROUGH_CLASSES`
        has (:func:`~vllm_repro.engine.engine_args.passthrough_refusal`)."""
        from ..engine_args import passthrough_refusal

        routed: dict[str, dict[str, Any]] = {}
        missing = []
        for key, value in (cfg.get("passthrough") or {}).items():
            if key == "model":  # ModelConfig's: the packaged folder, :meth:`_model_dir`
                continue
            for cls_name in self.PASSTHROUGH_CLASSES:
                if key in self.config_fields(cls_name):
                    routed.setdefault(cls_name, {})[key] = value
                    break
            else:
                missing.append(key)
        if missing:
            known = set().union(*(self.config_fields(c) for c in self.PASSTHROUGH_CLASSES))
            raise RefusedByRelease(passthrough_refusal(missing, self.version,
                                                       self.PASSTHROUGH_CLASSES, known))
        return routed

    def build_vllm_config(self, cfg: dict[str, Any], load_tokenizer: bool = False) -> tuple[Any, type]:
        """``(vllm_config, scheduler class)`` as ``EngineArgs.create_engine_config`` would make
        them for the scenario's ``config`` (``num_gpu_blocks`` already set on the cache config
        when the scenario gives it). Pass-through fields go to their config class as written.
        ``load_tokenizer``: the engine loads the packaged tokenizer (structured outputs need
        it: ``StructuredOutputManager`` builds its backend on it); otherwise
        ``skip_tokenizer_init``. Raises :class:`RefusedByRelease` for what the release's
        configs refuse and :class:`AdapterError` when the lab cannot satisfy them."""
        c = self.config_mod
        routed = self.route_passthrough(cfg)
        self._route_reasoning_parser(cfg, routed)
        importlib.import_module("torch")  # as vLLM imports it before its configs
        model_config = self._model_config(cfg, load_tokenizer)
        scheduler_config = self._scheduler_config(cfg, model_config, routed)
        cache_kwargs = dict(block_size=cfg["block_size"], gpu_memory_utilization=0.9, swap_space=0,
                            cache_dtype="auto", enable_prefix_caching=cfg["enable_prefix_caching"])
        cache_kwargs.update(routed.get("CacheConfig", {}))
        cache_config = self._strict_call(c.CacheConfig, cache_kwargs, routed.get("CacheConfig", {}))
        other = self._other_configs(routed)
        spec_config = self._spec_config(cfg, routed, model_config, other)
        if cfg.get("kv_transfer_config"):
            other["kv_transfer_config"] = self.kv_transfer_config(cfg["kv_transfer_config"])
        vllm_config = call_supported(
            c.VllmConfig, scheduler_config=scheduler_config, model_config=model_config,
            cache_config=cache_config, speculative_config=spec_config, **other)
        # what the GPU worker would have reported after profiling (at level engine-core,
        # EngineCore._initialize_kv_caches sets it from the fake executor's figures instead)
        if cfg.get("num_gpu_blocks") is not None:
            cache_config.num_gpu_blocks = cfg["num_gpu_blocks"]
        sched_cls = self._scheduler_class(cfg, vllm_config, spec_config)
        self.vllm_config = vllm_config
        return vllm_config, sched_cls

    def _model_dir(self, cfg: dict[str, Any]):
        """The packaged config-only model folder ``config.model`` names (``model`` is
        ``ModelConfig``'s name; beside the default, ``src/vllm_repro/models/<name>``, e.g.
        ``mixtral-moe``: a mixture-of-experts model, which vLLM's data parallelism needs for a
        ``DPEngineCoreProc``); the default folder where it names none. Raises
        :class:`RefusedByRelease` naming the packaged folders for any other value."""
        name = (cfg.get("passthrough") or {}).get("model", cfg.get("model"))
        if name is None:
            return self.model_dir
        root = self.model_dir.parent
        known = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())
        if str(name) not in known:
            raise RefusedByRelease(f"config.model: {name!r} is not one of the lab's packaged model "
                                   f"configs ({', '.join(known)}); use one of them")
        return root / str(name)

    def _route_reasoning_parser(self, cfg: dict[str, Any], routed: dict) -> None:
        """``config.reasoning_parser`` put into ``routed`` under the config field the release's
        ``StructuredOutputManager`` reads it from (:attr:`Capabilities.reasoning_parser_field`:
        ``StructuredOutputsConfig.reasoning_parser``, or ``DecodingConfig.reasoning_backend``),
        once vLLM's ``ReasoningParserManager`` registers the name and its parser class builds on
        the packaged tokenizer (:meth:`_check_reasoning_parser`). In place. Raises
        :class:`RefusedByRelease` (one line naming the field) where the release reads no
        reasoning parser, registers no such name, or its parser cannot run on the tokenizer."""
        name = cfg.get("reasoning_parser")
        if not name:
            return
        where = self.caps.reasoning_parser_field
        if where is None:
            raise RefusedByRelease(f"config.reasoning_parser: {self.caps.refusal('reasoning parser')}"
                                   "; drop it for this release")
        cls_name, field = where.split(".", 1)
        given = routed.get(cls_name, {}).get(field)
        if given not in (None, "", name):
            raise RefusedByRelease(f"config.reasoning_parser: {name!r} and config.{field}: "
                                   f"{given!r} name two parsers for vLLM {self.version}'s "
                                   f"{where}; keep one")
        known = self.caps.reasoning_parsers
        if name not in known:
            import difflib

            near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            fix = f"did you mean {near[0]}?" if near else "use one of them"
            raise RefusedByRelease(f"config.reasoning_parser: {name!r} is not one of vLLM "
                                   f"{self.version}'s reasoning parsers (ReasoningParserManager: "
                                   f"{', '.join(known)}); {fix}")
        self._check_reasoning_parser(name)
        routed.setdefault(cls_name, {})[field] = name

    def _check_reasoning_parser(self, name: str) -> None:
        """Build vLLM's own parser class for ``name`` (``ReasoningParserManager.
        get_reasoning_parser``) on the packaged tokenizer, loaded as vLLM loads it
        (``get_tokenizer``), as the ``StructuredOutputManager`` does at start-up (0.9 to 0.11)
        or per request (later). Raises :class:`RefusedByRelease` where it cannot: the parser
        looks for tokens the packaged tokenizer lacks (it has ``<think>`` and ``</think>``, what
        ``deepseek_r1`` and ``qwen3`` read)."""
        manager = _import("vllm.reasoning:ReasoningParserManager")
        parser_cls = manager.get_reasoning_parser(name)
        get_tokenizer = _try_import("vllm.tokenizers:get_tokenizer",
                                    "vllm.transformers_utils.tokenizer:get_tokenizer")
        try:
            if get_tokenizer is not None:
                tokenizer = get_tokenizer(str(self.model_dir))
            else:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        except Exception as exc:  # noqa: BLE001 - the lab's tokenizer files
            raise AdapterError(f"the packaged tokenizer in {self.model_dir} does not load: "
                               f"{type(exc).__name__}: {exc}") from exc
        try:
            parser_cls(tokenizer)
        except Exception as exc:  # noqa: BLE001 - the parser's own refusal of the tokenizer
            first = " ".join(str(exc).strip().splitlines()[:1])
            raise RefusedByRelease(
                f"config.reasoning_parser: vLLM {self.version}'s {parser_cls.__name__} cannot run "
                f"on the lab's packaged tokenizer, whose think tokens are <think> and </think> "
                f"({type(exc).__name__}: {first}); use a parser that reads them (deepseek_r1, "
                "qwen3)") from None

    def _model_config(self, cfg: dict[str, Any], load_tokenizer: bool):
        """``ModelConfig`` on the packaged model folder ``config.model`` names (its config.json;
        the default folder's tokenizer)."""
        model_dir = self._model_dir(cfg)
        if model_dir != self.model_dir:
            self._register_model((json.loads((model_dir / "config.json").read_text())
                                  ["architectures"][0],))
        try:
            return call_supported(
                self.config_mod.ModelConfig, model=str(model_dir), task="generate",
                tokenizer=str(self.model_dir), tokenizer_mode="auto", trust_remote_code=False,
                dtype="float16", seed=0, skip_tokenizer_init=not load_tokenizer,
                max_model_len=cfg["max_model_len"], enforce_eager=True)
        except Exception as exc:
            raise AdapterError(f"ModelConfig on {model_dir}: {type(exc).__name__}: {exc}") from exc

    def _scheduler_config(self, cfg: dict[str, Any], model_config, routed: dict):
        """``SchedulerConfig`` from the scenario's scheduler fields and its pass-through ones."""
        sched_kwargs = dict(
            max_num_seqs=cfg["max_num_seqs"],
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            max_model_len=cfg["max_model_len"],
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
        return self._strict_call(self.config_mod.SchedulerConfig, sched_kwargs,
                                 routed.get("SchedulerConfig", {}))

    def _spec_config(self, cfg: dict[str, Any], routed: dict, model_config=None, other=None):
        """``SpeculativeConfig`` (ngram drafts by default) when the scenario turns spec decode
        on, else None; a SpeculativeConfig field without it, or spec decode on a release whose
        V1 scheduler has no draft tokens, is refused. Where the release's ``SpeculativeConfig``
        is V0's, built from positional parts (0.7.x: draft model config, draft parallel config,
        ... 11 of them) by its ``maybe_create_spec_config`` factory, the factory builds it as
        ``EngineArgs.create_engine_config`` calls it (:meth:`_spec_config_by_factory`)."""
        if not cfg.get("num_speculative_tokens"):
            if routed.get("SpeculativeConfig"):
                raise RefusedByRelease(
                    f"config.{next(iter(routed['SpeculativeConfig']))}: a SpeculativeConfig field "
                    "needs num_speculative_tokens (spec decode on)")
            return None
        if not self.caps.spec_decode:
            # 0.6.x/0.7.0: the V1 scheduler has no draft tokens (SpeculativeConfig is V0's)
            raise RefusedByRelease(f"config.num_speculative_tokens: "
                                   f"{self.caps.refusal('spec decode')}; drop it for this release")
        cls = self.config_mod.SpeculativeConfig
        factory = getattr(cls, "maybe_create_spec_config", None)
        if callable(factory) and "num_speculative_tokens" in params_of(factory)[0] \
                and "model" not in init_params(cls)[0]:
            return self._spec_config_by_factory(cfg, routed, factory, model_config)
        from ..draft_models import DRAFT_MODELS

        method = cfg.get("speculative_method", "ngram")
        if cfg.get("speculative_max_model_len") and method not in DRAFT_MODELS:
            raise RefusedByRelease(f"config.speculative_max_model_len: the {method} drafter has "
                                   "no draft model to cap (it takes the target's config); use a "
                                   "model-based speculative_method (eagle, eagle3, mtp, "
                                   "draft_model) or drop it")
        if method in DRAFT_MODELS:
            spec_kwargs = self._draft_model_kwargs(cfg, method, model_config, other)
        else:
            spec_kwargs = dict(model="ngram", method=method,
                               num_speculative_tokens=cfg["num_speculative_tokens"],
                               prompt_lookup_max=4, prompt_lookup_min=1)
        spec_kwargs.update(routed.get("SpeculativeConfig", {}))
        return self._strict_call(self.config_mod.SpeculativeConfig, spec_kwargs,
                                 routed.get("SpeculativeConfig", {}))

    def _draft_model_kwargs(self, cfg: dict[str, Any], method: str, model_config, other) -> dict:
        """``SpeculativeConfig`` arguments for a model-based drafter, as ``EngineArgs.
        create_speculative_config`` hands them over (``vllm/engine/arg_utils.py``): ``method``,
        ``model`` (the packaged config-only draft, :data:`~vllm_repro.engine.drafter.DRAFT_MODELS`:
        the release's own ``SpeculativeConfig.__post_init__`` builds the draft ``ModelConfig``
        from its ``config.json``, and wraps an EAGLE head in its ``EAGLEConfig``), the target's
        model and parallel configs (the same ``ParallelConfig`` object ``VllmConfig`` gets:
        put into ``other``), ``max_model_len`` from ``speculative_max_model_len``. Refused
        where the release's ``SpeculativeMethod`` lacks ``method``
        (:attr:`Capabilities.spec_methods`)."""
        if method not in self.caps.spec_methods:
            have = ", ".join(self.caps.spec_methods) or "none"
            raise RefusedByRelease(f"config.speculative_method: {method!r} is not one of vLLM "
                                   f"{self.version}'s SpeculativeConfig methods the lab drives "
                                   f"({have}); pick one of them")
        if other is not None and "parallel_config" not in other:
            other["parallel_config"] = call_supported(self.config_mod.ParallelConfig)
        parallel = (other or {}).get("parallel_config")
        from ..draft_models import DRAFT_ARCHS, DRAFT_MODELS

        self._register_model(DRAFT_ARCHS[DRAFT_MODELS[method]])
        kwargs = dict(method=method, model=str(self.model_dir.parent / DRAFT_MODELS[method]),
                      num_speculative_tokens=cfg["num_speculative_tokens"],
                      target_model_config=model_config, target_parallel_config=parallel)
        if cfg.get("speculative_max_model_len"):
            kwargs["max_model_len"] = cfg["speculative_max_model_len"]
        return kwargs

    def _spec_config_by_factory(self, cfg: dict[str, Any], routed: dict, factory, model_config):
        """V0's ``SpeculativeConfig.maybe_create_spec_config`` (``vllm/config.py``, 0.7.x) with
        the arguments ``EngineArgs.create_engine_config`` gives it for ``--speculative-model
        [ngram]`` (``vllm/engine/arg_utils.py``): ngram drafts on the target model's config, the
        engine arguments' defaults for the rest. Pass-through fields are its arguments of the
        same name; one it does not take is refused."""
        extra = dict(routed.get("SpeculativeConfig", {}))
        names = params_of(factory)[0]
        unknown = [k for k in extra if k not in names]
        if unknown:
            raise RefusedByRelease(f"config.{unknown[0]}: vLLM {self.version}'s "
                                   "SpeculativeConfig.maybe_create_spec_config does not take it")
        parallel = call_supported(self.config_mod.ParallelConfig)
        kwargs = dict(target_model_config=model_config, target_parallel_config=parallel,
                      target_dtype="float16", speculative_model="[ngram]",
                      speculative_model_quantization=None,
                      speculative_draft_tensor_parallel_size=None,
                      num_speculative_tokens=cfg["num_speculative_tokens"],
                      speculative_disable_mqa_scorer=None, speculative_max_model_len=None,
                      enable_chunked_prefill=cfg["enable_chunked_prefill"],
                      disable_log_stats=True, speculative_disable_by_batch_size=None,
                      ngram_prompt_lookup_max=4, ngram_prompt_lookup_min=1,
                      draft_token_acceptance_method="rejection_sampler",
                      typical_acceptance_sampler_posterior_threshold=None,
                      typical_acceptance_sampler_posterior_alpha=None, disable_logprobs=None)
        kwargs.update(extra)
        return call_supported(factory, **kwargs)

    def _other_configs(self, routed: dict) -> dict[str, Any]:
        """The rest of ``VllmConfig``'s parts: the pass-through ones (``ParallelConfig``,
        :attr:`VLLM_CONFIG_FIELD`'s), and the device and observability configs that
        ``EngineArgs.create_engine_config`` always fills in."""
        c = self.config_mod
        extra = {}
        if routed.get("ParallelConfig"):
            extra["parallel_config"] = self._strict_call(
                c.ParallelConfig, dict(routed["ParallelConfig"]), routed["ParallelConfig"])
        for cls_name, field in self.VLLM_CONFIG_FIELD.items():
            if routed.get(cls_name) and hasattr(c, cls_name):
                extra[field] = self._strict_call(getattr(c, cls_name), dict(routed[cls_name]),
                                                 routed[cls_name])
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
        return extra

    def kv_transfer_config(self, kv: dict):
        """The release's ``KVTransferConfig`` (``vllm/config/kv_transfer.py``, or
        ``vllm.config``) naming the lab's scripted connector (registered first with the
        release's ``KVConnectorFactory.register_connector(name, module, class)``
        (``vllm/distributed/kv_transfer/kv_connector/factory.py``; the scheduler builds it by
        that name), or one of the release's own (``NixlConnector``, ``OffloadingConnector``,
        ``MultiConnector`` with scripted children: its registry must have it).
        ``kv``: the scenario's ``kv_transfer_config`` (``kv_connector``, ``kv_role``,
        ``supports_hma``, ``requests``: the script, handed over in ``kv_connector_extra_config``
        with vLLM's own keys; ``connectors``: MultiConnector's children, each a scripted
        connector with its own script).
        Raises :class:`RefusedByRelease` where the release has no V1 KV connectors."""
        if not self.caps.kv_connectors:
            raise RefusedByRelease(f"kv_transfer_config: {self.caps.refusal('kv connectors')}")
        from .. import connector

        factory = _import("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory")
        registry = getattr(factory, "_registry", {})
        name = kv.get("kv_connector") or connector.NAME
        scripted = connector.NAME
        if kv.get("supports_hma") and name in (connector.NAME, "MultiConnector"):
            if connector.ScriptedHMAConnector is None:  # no SupportsHMA in the release's base
                raise RefusedByRelease(
                    f"kv_transfer_config.supports_hma: vLLM {self.version}'s KV connector base "
                    "has no SupportsHMA (kv_connector/v1/base.py): the hybrid allocator runs "
                    "without connectors there; drop supports_hma for this release")
            scripted = connector.HMA_NAME  # the subclass declaring SupportsHMA
            name = scripted if name == connector.NAME else name
        if name in (connector.NAME, connector.HMA_NAME, "MultiConnector"):
            # the lab's scripted connector (MultiConnector: its children)
            if scripted not in registry:
                factory.register_connector(scripted, connector.__name__, scripted)
        if name not in registry:
            # one of vLLM's own connectors (its scheduler half runs as the release ships it)
            raise RefusedByRelease(f"kv_transfer_config.kv_connector: vLLM {self.version}'s "
                                   f"KVConnectorFactory has no {name} (it has "
                                   f"{', '.join(sorted(registry))})")
        cls = _try_import("vllm.config.kv_transfer:KVTransferConfig", "vllm.config:KVTransferConfig")
        if cls is None:
            raise RefusedByRelease(f"kv_transfer_config: vLLM {self.version} has no "
                                   "KVTransferConfig")
        if name == "OffloadingConnector" and _try_import(
                "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common:"
                "OffloadingWorkerMetadata") is None:
            # the lab's worker half answers the per-job protocol (load_jobs / store_jobs,
            # completions in KVConnectorOutput.kv_connector_worker_meta) only
            raise RefusedByRelease(
                f"kv_transfer_config.kv_connector: vLLM {self.version}'s OffloadingConnector "
                "reports its transfers per request (no OffloadingWorkerMetadata in "
                "kv_connector/v1/offloading/common.py), which the lab's worker half does not "
                "answer; run it on a release with per-job transfers")
        extra = {**(kv.get("kv_connector_extra_config") or {}),
                 connector.SCRIPT_KEY: kv.get("requests") or {}}
        if name == "MultiConnector":  # vLLM's own children list, each a scripted connector
            extra["connectors"] = [
                {"kv_connector": scripted, "kv_role": kv.get("kv_role", "kv_both"),
                 "kv_connector_extra_config": {connector.SCRIPT_KEY: c.get("requests") or {}}}
                for c in kv.get("connectors") or ()]
        return call_supported(cls, kv_connector=name, kv_role=kv.get("kv_role", "kv_both"),
                              kv_connector_extra_config=extra)

    def _scheduler_class(self, cfg: dict[str, Any], vllm_config, spec_config) -> type:
        """The scheduler class the config selects (``AsyncScheduler`` with async scheduling),
        with the config's ``scheduler_cls`` pointing at it as ``EngineArgs`` leaves it; async
        scheduling kept on where the CPU platform turned it off. ``async_scheduling: null`` is
        the release's own default: what ``VllmConfig`` resolved it to (on unless the config
        rules it out, e.g. 0.33.0's V1 model runner with pipeline parallelism)."""
        if cfg["async_scheduling"] is None:
            cfg = {**cfg, "async_scheduling": bool(
                getattr(vllm_config.scheduler_config, "async_scheduling", False))}
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
        return sched_cls

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
            # the first V1 generation (0.6.5 to 0.7.x) takes the configs one by one (0.7.3:
            # speculative_config is a required one)
            scheduler_config=vllm_config.scheduler_config, model_config=vllm_config.model_config,
            cache_config=vllm_config.cache_config, lora_config=None,
            speculative_config=getattr(vllm_config, "speculative_config", None))
        self.block_hasher = self._block_hasher(vllm_config, hash_block_size)
        self.vllm_config = vllm_config
        return scheduler

    def _attention_spec(self, cls, cfg, torch, **extra):
        return call_supported(cls, block_size=cfg["block_size"], num_kv_heads=1, head_size=1,
                              dtype=torch.float32, use_mla=False, sliding_window=None, **extra)

    def _kv_cache_config(self, cfg, torch):
        """``KVCacheConfig`` of ``num_gpu_blocks`` blocks, one ``KVCacheGroupSpec`` per scenario
        group (default: one full-attention layer), each with the spec its kind's layers declare
        (:func:`.kv_specs.group_spec`). Raises :class:`RefusedByRelease` for a kind or field
        the release lacks, or a Mamba group the cache config cannot take."""
        groups = cfg.get("kv_cache_groups") or [{"type": "full", "num_layers": 1}]
        cache_config = self.vllm_config.cache_config
        kv_specs.check_model_config(cfg, cache_config, self.version)
        specs = []
        layer = 0
        for index, g in enumerate(groups):
            spec = kv_specs.group_spec(self, g, index, cfg, torch, cache_config)
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
