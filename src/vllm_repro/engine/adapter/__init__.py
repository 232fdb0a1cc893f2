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
- the platform: :mod:`.platform` sets ``vllm.platforms._current_platform`` to the deployment's
  (vLLM's CUDA platform class with a GPU runtime's answers emulated; or vLLM's CPU platform)
  before any module reads it. The tree's ``vllm-X+cpu.dist-info`` and ``VLLM_TARGET_DEVICE=cpu``
  only keep the detection in ``vllm.platforms`` from probing for a GPU.

Layout: :mod:`.probes` (imports and parameters), :mod:`.build` (configs, scheduler),
:mod:`.requests` (requests in), :mod:`.outputs` (outputs), and :mod:`vllm_repro.engine.state`
(reading live scheduler state); ``V1Adapter`` composes them. Every name importers used from
``vllm_repro.engine.adapter`` is re-exported here.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from .. import state
from ..state import iter_queue  # noqa: F401 - re-exported (older importers)
from .build import BuildMixin
from .capability_probes import probe
from .outputs import OutputsMixin, Scheduled  # noqa: F401 - re-exported
from .probes import (AdapterError, LevelMissing, RefusedByRelease, _import, _source_has,  # noqa: F401
                     _try_import, call_supported, fields_of, init_params, params_of,
                     refused_by_vllm)
from .requests import EOS_TOKEN_ID, VOCAB, RequestsMixin, token_stream  # noqa: F401


class V1Adapter(BuildMixin, RequestsMixin, OutputsMixin):
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
        from .platform import install as install_platform

        #: the platform vLLM sees (adapter/platform.py): the deployment's, CUDA by default
        self.platform = install_platform(self.platform_notes)
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
        #: what this release supports, probed once (sent to the host in the worker's hello)
        self.caps = probe(self)

    # ---- environment -------------------------------------------------------------------------
    def _version(self) -> str:
        mod = _try_import("vllm.version", "vllm._version")
        v = getattr(mod, "__version__", None) if mod else None
        return str(v or getattr(sys.modules["vllm"], "__version__", "unknown"))

    def _register_model(self, archs: tuple[str, ...] = ()) -> None:
        """Register the packaged architecture's real class in-process (or ``archs``: the
        architectures a packaged draft model resolves to), so that ``ModelConfig`` inspects it
        here instead of in a ``python -m vllm.model_executor.models.registry`` subprocess (a
        second 10 s import of torch and vLLM on 0.9/0.10; on 0.17 that subprocess fails for a
        draft model under the emulated platform)."""
        if archs:
            for arch in archs:
                self._register_arch(arch)
            return
        try:
            import json

            self._register_arch(json.loads((self.model_dir / "config.json").read_text())
                                ["architectures"][0])
        except Exception:  # noqa: BLE001 - an optimisation only: the subprocess path still works
            return

    def _register_arch(self, arch: str) -> None:
        registry = _try_import("vllm:ModelRegistry", "vllm.model_executor.models:ModelRegistry")
        if registry is None or not hasattr(registry, "register_model"):
            return
        try:
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

    # ---- state (read by :mod:`.state`) ------------------------------------------------------
    def has_work(self, scheduler) -> bool:
        """Whether ``EngineCore.step`` would call ``schedule()`` now: ``Scheduler.has_requests()``
        (unfinished requests, or finished ids still to tell the runner; 0.10+), else
        ``has_unfinished_requests()`` (0.6 to 0.9). An idle engine does not schedule (0.7.0's
        ``schedule()`` even fails on an empty batch)."""
        probe = getattr(scheduler, "has_requests", None) or scheduler.has_unfinished_requests
        return bool(probe())

    def block_pool(self, scheduler):
        return state.block_pool(scheduler)

    def num_free_blocks(self, scheduler) -> int | None:
        return state.num_free_blocks(scheduler)

    def queues(self, scheduler) -> tuple[list[str], list[str], list[str]]:
        """(waiting ids, running ids, preempted ids) — preempted are waiting with status
        PREEMPTED (``Scheduler._preempt_request``)."""
        return state.queue_ids(scheduler, self.RequestStatus.PREEMPTED)
