"""``level: v0-engine``: a scenario driven through the release's own V0 ``LLMEngine``.

The V0 engine (``vllm/engine/llm_engine.py`` with ``vllm/core/scheduler.py`` and the block space
managers of ``vllm/core/``) ran every deployment before 0.8 and shipped until 0.10. Here vLLM
builds and runs everything above the executor; the lab supplies only the executor's worker:

    engine_config = EngineArgs(model=<config-only dir>, **config).create_engine_config()
    LLMEngine(vllm_config=engine_config | **engine_config.to_dict(),   # the release's signature
              executor_class=FakeV0Executor, log_stats=...)
        # start-up (LLMEngine._initialize_kv_caches): determine_num_available_blocks ->
        # num_gpu_blocks_override -> initialize_cache -> Scheduler(... block manager ...)
    per step n: engine.add_request(id, {"prompt_token_ids": ...}, SamplingParams(...))  # at_step n
                engine.abort_request(ids)                                               # events
                engine.step()     # schedule -> execute_model -> output processing (async too)

``FakeV0Executor`` subclasses the release's own executor for one GPU (``UniProcExecutor`` from
0.7, else ``GPUExecutor``), so its ``determine_num_available_blocks`` / ``initialize_cache`` /
``execute_model`` run and delegate to the driver worker as they do in production; only the worker
(:class:`FakeV0Worker`) is fake. It answers what ``vllm/worker/worker.py:Worker`` would:

- ``determine_num_available_blocks``: ``(config.num_gpu_blocks, num_cpu_blocks)`` from the
  scenario (0 allowed); CPU blocks default to what the GPU worker computes from ``swap_space``
  (``swap_space`` bytes // ``CacheEngine.get_cache_block_size``, vLLM's own function);
- ``initialize_cache``: the release's own ``raise_if_cache_size_invalid`` (what ``Worker.
  initialize_cache`` runs first), then records the sizes;
- ``execute_model``: calls the request's ``async_callback`` where the engine gave one (the GPU
  model runner runs it before sampling, which is how V0's async output processing overlaps), then
  returns ``[SamplerOutput(outputs=[CompletionSequenceGroupOutput(...) per scheduled group])]``:
  one ``SequenceOutput`` per sequence of a group that samples (``do_sample``; none for a chunk
  that does not finish its prompt), with the scenario's token, scripted tokens or EOS;
  with multi-step scheduling (``num_scheduler_steps > 1``, where the release's runner is the one
  served: :meth:`V0Adapter.serves_multi_step`), what ``MultiStepWorker.execute_model`` answers
  at each step of a batch (:meth:`V0EngineLoop.execute_multi_step`); with speculative decoding
  by the n-gram drafter (``speculative_model: "[ngram]"``, where served:
  :meth:`V0Adapter.serves_spec_decode`), what ``SpecDecodeWorker.execute_model`` answers: one
  ``SamplerOutput`` per position of a decode step's drafts plus bonus, -1 past the accepted
  ones (:meth:`V0EngineLoop.execute_spec_decode`), and one as above for prefills.

Runs inside the release environment (standard library + vLLM only).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import time
import traceback
import typing
from contextlib import contextmanager
from pathlib import Path

from ..records import EngineInfo, RunResult, Timing, TraceLine
from .adapter.probes import (AdapterError, LevelMissing, RefusedByRelease, _import, _try_import,
                             params_of, refused_by_vllm)
from .adapter.capability_probes import probe_v0
from .adapter.requests import EOS_TOKEN_ID
from .events import Abort, from_mapping, perform, supported
from .engine_args import (NGRAM_FLAT_FIELDS, as_command_line_text, engine_arg_refusal,
                          engine_arg_type_error)
from .loop import StepLoop, describe_exception, vllm_frames

#: the files a tree needs for ``level: v0-engine`` (sources/prepare.py probes the same)
V0_ENGINE_MODULES = ("vllm.engine.llm_engine", "vllm.core.scheduler")
#: the lab's own config fields and the ``EngineArgs`` field each one is, at this level
LAB_TO_ENGINE_ARGS = {"block_size": "block_size", "max_num_seqs": "max_num_seqs",
                      "max_num_batched_tokens": "max_num_batched_tokens",
                      "max_model_len": "max_model_len",
                      "enable_chunked_prefill": "enable_chunked_prefill",
                      "enable_prefix_caching": "enable_prefix_caching"}
#: lab fields with no meaning at this level (the V1 scheduler's, or engine-core's executor)
V1_ONLY = ("kv_cache_memory_bytes", "max_concurrent_batches", "async_scheduling",
           "kv_cache_groups", "execute_model_timeout_seconds", "speculative_max_model_len",
           "multiprocess_mode", "asyncio_mode")
#: the n-gram drafter's names: ``speculative_model`` (0.6 to 0.8.x EngineArgs) or the
#: ``speculative_config`` dict's ``model`` / ``method`` (0.8.5 on)
NGRAM_NAMES = ("[ngram]", "ngram")


def has_v0_engine(vllm_dir: Path) -> bool:
    """Whether the imported release tree has the V0 engine the lab drives (by file)."""
    return all((vllm_dir / (m.split(".", 1)[1].replace(".", "/") + ".py")).is_file()
               for m in V0_ENGINE_MODULES)


class V0Adapter:
    """The V0 engine's classes of the release on ``sys.path``, found by probing.

    ``base``: the worker's V1 adapter where the release has both engines (its import, version
    and platform are shared); without one (a release before the V1 engine) vLLM is imported
    here and the platform is set up for an eagerly resolved ``current_platform``
    (:func:`vllm_repro.engine.adapter.platform.install_eager`)."""

    generation = "v0"
    #: ``EngineArgs``' field annotations, resolved (:meth:`_engine_args_hints`): what a
    #: pass-through value is checked against; empty (nothing checked) until probed
    engine_args_types: dict = {}
    #: (vLLM's eager platform instance, the emulated CUDA class) on releases with both engines
    #: whose ``current_platform`` is bound at import (:func:`platform_scope`), else None
    _swap = None

    @contextmanager
    def platform_scope(self):
        """The emulated CUDA platform for the length of one V0 run, on a release whose eager
        ``current_platform`` the V1 adapter left a ``CpuPlatform`` (0.6.5 to 0.6.6.post1: device
        ``cpu`` and no async output processing, which a GPU deployment has); V1 runs in the
        same worker keep what they had, so their verdicts do not change."""
        if self._swap is None:
            yield
            return
        instance, cls = self._swap
        before = instance.__class__
        instance.__class__ = cls
        try:
            yield
        finally:
            instance.__class__ = before

    def __init__(self, model_dir: Path, base=None):
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("DO_NOT_TRACK", "1")
        self.model_dir = Path(model_dir)
        self.base = base
        if base is not None:
            self.vllm_file, self.version = base.vllm_file, base.version
            self.platform, self.platform_notes = base.platform, base.platform_notes
            from .adapter.platform import eager_cuda_swap

            self._swap = eager_cuda_swap(self.platform_notes)
            if self._swap is not None:
                self.platform = f"cuda (emulated {self._swap[1].__mro__[1].__name__}, V0 runs)"
        else:
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
            from .adapter.platform import before_import_without_platforms

            spec = importlib.util.find_spec("vllm")
            before_import_without_platforms(list(getattr(spec, "submodule_search_locations", None)
                                                 or ()))
            import vllm  # noqa: F401  (the release under test)

            self.vllm_file = Path(sys.modules["vllm"].__file__).parent
            mod = _try_import("vllm.version", "vllm._version")
            self.version = str(getattr(mod, "__version__", None)
                               or getattr(sys.modules["vllm"], "__version__", "unknown"))
            self.platform_notes: list[str] = []
            from .adapter.platform import install_eager

            self.platform = install_eager(self.platform_notes)
        if not has_v0_engine(self.vllm_file):
            raise LevelMissing("v0-engine", f"vLLM {self.version} has no V0 engine "
                               "(vllm/engine/llm_engine.py with vllm/core/scheduler.py)")
        self.LLMEngine = v0_engine_class()
        self.EngineArgs = _import("vllm.engine.arg_utils:EngineArgs")
        self.SamplingParams = _import("vllm.sampling_params:SamplingParams", "vllm:SamplingParams")
        self.Scheduler = _import("vllm.core.scheduler:Scheduler")
        self.SamplerOutput = _import("vllm.model_executor.layers.sampler:SamplerOutput",
                                     "vllm.sequence:SamplerOutput")
        self.CompletionSequenceGroupOutput = _import("vllm.sequence:CompletionSequenceGroupOutput",
                                                     "vllm.sequence:SequenceGroupOutput")
        self.SequenceOutput = _import("vllm.sequence:SequenceOutput")
        self.Logprob = _import("vllm.sequence:Logprob")
        self.executor_base = _try_import("vllm.executor.uniproc_executor:UniProcExecutor",
                                         "vllm.executor.gpu_executor:GPUExecutor")
        if self.executor_base is None:
            raise AdapterError(f"vLLM {self.version}: no V0 executor for one GPU "
                               "(vllm/executor/uniproc_executor.py or gpu_executor.py)")
        self.engine_args_fields = {f.name for f in dataclasses.fields(self.EngineArgs)}
        self.engine_args_types = self._engine_args_hints()
        self.cache_size_check = _try_import("vllm.worker.worker:raise_if_cache_size_invalid")
        #: whether the GPU worker's ``execute_model`` returns a list of ``SamplerOutput`` (0.4.1
        #: on) or one (0.4.0, 0.4.0.post1), by its return annotation
        worker_cls = _try_import("vllm.worker.worker:Worker")
        ret = inspect.signature(worker_cls.execute_model).return_annotation if worker_cls else None
        self.worker_returns_list = ret is None or "list" in str(ret).lower()
        self.sampling_fields, _ = params_of(self.SamplingParams)
        #: the packaged tokenizer's highest token id (the engine loads it: EOS is its ``</s>``)
        self.max_token_id = _max_token_id(self.model_dir)
        self.add_request_params, _ = params_of(self.LLMEngine.add_request)

        self.caps = probe_v0(self)

    def serves_multi_step(self) -> bool:
        """Whether :meth:`V0EngineLoop.execute_multi_step` answers for this release's
        ``MultiStepWorker``: its ``MultiStepModelRunner`` pythonizes and queues each step's
        output itself (methods ``_async_process_outputs`` / ``_final_process_outputs``, 0.6.0 to
        0.10.0) and ``ExecuteModelRequest`` says a batch's first and last step
        (``is_first_multi_step`` / ``is_last_step``). The runner is read from its source
        (``vllm/worker/multi_step_model_runner.py``, by ``ast``), not imported: from 0.10 its
        import needs the GPU build's ``vllm_flash_attn``."""
        request = _try_import("vllm.sequence:ExecuteModelRequest")
        if request is None or not all(hasattr(request, p) for p in ("is_first_multi_step",
                                                                     "is_last_step")):
            return False
        return {"_async_process_outputs", "_final_process_outputs"} <= _class_methods(
            self.vllm_file / "worker" / "multi_step_model_runner.py", "MultiStepModelRunner")

    def serves_spec_decode(self) -> bool:
        """Whether :meth:`V0EngineLoop.execute_spec_decode` answers for this release's
        ``SpecDecodeWorker``: its ``execute_model`` runs ``_run_no_spec`` (one
        ``SamplerOutput``) or ``_run_speculative_decoding_step``, whose
        ``_create_output_sampler_list`` gives one ``SamplerOutput`` per position, and the
        engine's ``MultiStepOutputProcessor`` drops the rejected positions' -1
        (``vllm.sequence.VLLM_INVALID_TOKEN_ID`` where the release has it, else a literal).
        The worker is read from its source (``vllm/spec_decode/spec_decode_worker.py``, by
        ``ast``), not imported (it needs torch's GPU build in places)."""
        return {"_run_no_spec", "_run_speculative_decoding_step",
                "_create_output_sampler_list"} <= _class_methods(
            self.vllm_file / "spec_decode" / "spec_decode_worker.py", "SpecDecodeWorker")

    # ---- configs -----------------------------------------------------------------------------
    def engine_args(self, cfg: dict) -> dict:
        """The ``EngineArgs`` keywords for a scenario's ``config``: the lab's fields under their
        ``EngineArgs`` names, every other key passed through as written. Raises
        :class:`RefusedByRelease` naming a field this release's ``EngineArgs`` lacks, or a lab
        field this level has no meaning for."""
        v = self.version
        spec = speculative_fields(cfg)
        if spec and not asks_for_ngram(cfg):
            raise RefusedByRelease(_spec_refusal(", ".join(f"config.{k}" for k in spec), v))
        for key in V1_ONLY:
            if cfg.get(key) not in (None, False):
                raise RefusedByRelease(f"config.{key}: not supported at level: v0-engine (vLLM "
                                       f"{v}'s V0 LLMEngine); drop it for this level")
        kw: dict = {"model": str(self.model_dir),
                    "disable_log_stats": bool(cfg.get("disable_log_stats", True))}
        if "skip_tokenizer_init" in self.engine_args_fields:  # 0.4.1+; before, always loaded
            kw["skip_tokenizer_init"] = False
        for lab, name in LAB_TO_ENGINE_ARGS.items():
            if lab in cfg and cfg[lab] is not None:
                kw[name] = cfg[lab]
        policy = cfg.get("policy", "fcfs")
        if policy != "fcfs":
            if "scheduling_policy" not in self.engine_args_fields:
                raise RefusedByRelease(f"config.policy: vLLM {v} has no EngineArgs field "
                                       "scheduling_policy (FCFS only); use policy: fcfs")
            kw["scheduling_policy"] = policy
        if cfg.get("long_prefill_token_threshold"):
            kw["long_prefill_token_threshold"] = cfg["long_prefill_token_threshold"]
        if cfg.get("num_speculative_tokens"):  # the lab's field, EngineArgs' name (0.6-0.8.x)
            kw["num_speculative_tokens"] = cfg["num_speculative_tokens"]
        lab_keys = {"num_gpu_blocks", "num_cpu_blocks", "disable_log_stats", "policy", "model",
                    "long_prefill_token_threshold", *LAB_TO_ENGINE_ARGS, *V1_ONLY,
                    "speculative_method", "num_speculative_tokens", "reasoning_parser"}
        for key, value in (cfg.get("passthrough") or {}).items():  # Scenario.child_payload
            kw[key] = value
        for key, value in cfg.items():
            # a lab field left unset (None) is not an EngineArgs value: the release's default
            if key not in lab_keys and key != "passthrough" and value is not None:
                kw[key] = value
        model = cfg.get("model", (cfg.get("passthrough") or {}).get("model"))
        kw["model"] = str(self.model_dir if model is None else self.packaged_model(model))
        self._fold_speculative(kw)
        missing = [key for key in kw if key not in self.engine_args_fields]
        if missing:
            raise RefusedByRelease(engine_arg_refusal(missing, v, self.engine_args_fields))
        hints = self.engine_args_types
        for key, value in kw.items():  # what the command line's argparse types would have made
            if key not in ("model", "skip_tokenizer_init", "disable_log_stats") and key in hints:
                kw[key] = value = as_command_line_text(value, hints[key])
                wrong = engine_arg_type_error(key, value, hints[key], v)
                if wrong:
                    raise RefusedByRelease(wrong)
        return kw

    def _engine_args_hints(self) -> dict:
        """``EngineArgs``' field annotations, resolved (``typing.get_type_hints``; each field's
        own ``type`` where the module's names cannot be resolved)."""
        try:
            return typing.get_type_hints(self.EngineArgs)
        except Exception:  # noqa: BLE001 - an annotation naming what the module lacks
            return {f.name: f.type for f in dataclasses.fields(self.EngineArgs)}

    def _fold_speculative(self, kw: dict) -> None:
        """Where the release's ``EngineArgs`` takes spec decode only as its
        ``speculative_config`` dict (0.8.5 on: no ``speculative_model`` field), the n-gram
        drafter's flat fields go into that dict under ``SpeculativeConfig``'s own names
        (``speculative_model`` -> ``model``, ``ngram_prompt_lookup_max`` ->
        ``prompt_lookup_max``, ``num_speculative_tokens`` as is), each found among the dataclass'
        fields (probed); a field with no such name stays flat, and is refused as one the
        ``EngineArgs`` lacks. In place."""
        fields = self.engine_args_fields
        if (kw.get("speculative_model") not in NGRAM_NAMES or "speculative_model" in fields
                or "speculative_config" not in fields or kw.get("speculative_config")):
            return
        spec_cls = _try_import("vllm.config:SpeculativeConfig")
        try:
            names = {f.name for f in dataclasses.fields(spec_cls)}
        except TypeError:  # not a dataclass: leave the fields to be refused by name
            return
        spec = {}
        for key in NGRAM_FLAT_FIELDS:
            name = {"speculative_model": "model"}.get(key, key)
            name = name if name in names else name.removeprefix("ngram_")
            if key in kw and name in names:
                spec[name] = kw.pop(key)
        kw["speculative_config"] = spec

    def packaged_model(self, name) -> Path:
        """The config-only model directory ``config.model`` names among the lab's packaged ones
        (beside the default, ``src/vllm_repro/models/<name>``: a ``config.json`` and the packaged
        tokenizer), e.g. ``mistral-swa`` (a sliding-window Mistral). Raises
        :class:`RefusedByRelease` naming the packaged models for any other value."""
        root = self.model_dir.parent
        known = sorted(p.name for p in root.iterdir()
                       if (p / "config.json").is_file() and (p / "tokenizer.json").is_file())
        if str(name) not in known:
            raise RefusedByRelease(f"config.model: {name!r} is not one of the lab's packaged model "
                                   f"configs ({', '.join(known)}); use one of them")
        return root / str(name)

    def engine_config(self, args):
        """The release's engine config from its ``EngineArgs``: ``create_engine_config()`` (an
        ``EngineConfig`` / ``VllmConfig``, 0.4.1 on) or, before, ``create_engine_configs()``'s
        tuple, in ``LLMEngine.__init__``'s order, as an :class:`EngineConfigs` (found by
        probing ``EngineArgs``). Raises what vLLM raises for a configuration it refuses."""
        if hasattr(args, "create_engine_config"):
            return args.create_engine_config()
        names = [n for n in inspect.signature(self.LLMEngine.__init__).parameters if n != "self"]
        return EngineConfigs(dict(zip(names, args.create_engine_configs())))

    # ---- requests ----------------------------------------------------------------------------
    def sampling_params(self, max_tokens: int, n: int = 1):
        """The request's ``SamplingParams``: ``max_tokens``, ``n``, EOS honoured, no
        detokenization where the release can skip it (the lab's config-only tokenizer has no
        decoder)."""
        kw = {"max_tokens": max_tokens, "ignore_eos": False}
        if n > 1:
            kw["n"] = n
        if "detokenize" in self.sampling_fields:
            kw["detokenize"] = False
        return self.SamplingParams(**kw)


def _class_methods(path: Path, name: str) -> set[str]:
    """The names of the functions class ``name`` defines at the top level of the module at
    ``path``, read from its source (``ast``, nothing imported); empty when the file or the
    class is not there."""
    import ast

    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
    return set()


def refuse_unserved_workers(engine_config, cfg: dict, version: str,
                            serves_multi_step: bool = False,
                            serves_spec_decode: bool = False) -> None:
    """Refuse an engine config whose release would run a worker the lab's
    :class:`FakeV0Worker` does not stand in for, read from the config vLLM built (probed, not
    by version):

    - multi-step scheduling (``scheduler_config.num_scheduler_steps > 1``, 0.5.5 to 0.10.0)
      where ``serves_multi_step`` is False (:meth:`V0Adapter.serves_multi_step`: the release's
      ``MultiStepModelRunner`` is not the one :meth:`V0EngineLoop.execute_multi_step` answers
      for, e.g. 0.5.5's, whose sync ``LLMEngine`` has no multi-step path at all: only its
      ``AsyncLLMEngine`` caches a batch's schedule); run, one ``SamplerOutput`` per
      call would lose every step's tokens but the last (requests that never finish, then
      ``KV_LEAK``, not a reproduction);
    - V0 speculative decoding (``speculative_config`` set, from ``speculative_model`` /
      ``num_speculative_tokens`` up to 0.8.x or the ``speculative_config`` dict from 0.8.5)
      unless ``serves_spec_decode`` (:meth:`V0Adapter.serves_spec_decode`) and the drafter is
      the n-gram one (:func:`ngram_drafter`): vLLM runs ``SpecDecodeWorker``
      (``vllm/spec_decode/``), which :meth:`V0EngineLoop.execute_spec_decode` stands in for
      only with a drafter that has no model (a draft model's KV cache split and weights are
      not faked).

    ``cfg``: the scenario's ``config`` (the field named is the one the scenario wrote). Raises
    :class:`RefusedByRelease` (exit 2) naming the field, the release and what to do instead."""
    steps = multi_steps(engine_config)
    if steps > 1 and not serves_multi_step:
        raise RefusedByRelease(
            f"config.num_scheduler_steps: {steps}: vLLM {version}'s multi-step scheduling runs "
            "its MultiStepWorker / MultiStepModelRunner (vllm/worker/multi_step_*.py), which the "
            "lab's V0 worker does not serve on this release; use 1 (the default) at level: "
            "v0-engine")
    spec = getattr(engine_config, "speculative_config", None)
    if spec is not None and not (serves_spec_decode and ngram_drafter(spec)):
        raise RefusedByRelease(_spec_refusal(
            ", ".join(f"config.{k}" for k in speculative_fields(cfg)) or "config", version))


def multi_steps(engine_config) -> int:
    """``scheduler_config.num_scheduler_steps`` of the engine config vLLM built (1 where the
    release has no multi-step scheduling)."""
    sched = getattr(engine_config, "scheduler_config", None)
    return int(getattr(sched, "num_scheduler_steps", 1) or 1)


def ngram_drafter(spec_config) -> bool:
    """Whether the release's ``SpeculativeConfig`` drafts by n-gram prompt lookup
    (``ngram_prompt_lookup_max > 0``, 0.6 to 0.8.x; ``method == "ngram"``, 0.8.5 on), by
    attribute."""
    if (getattr(spec_config, "ngram_prompt_lookup_max", 0) or 0) > 0:
        return True
    return getattr(spec_config, "method", None) == "ngram"


def speculative_tokens(engine_config) -> int:
    """``speculative_config.num_speculative_tokens`` of the engine config vLLM built (0 with
    spec decode off)."""
    spec = getattr(engine_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0


def asks_for_ngram(cfg: dict) -> bool:
    """Whether the scenario's config asks for the n-gram drafter: ``speculative_model:
    "[ngram]"`` or a ``speculative_config`` dict whose ``model`` / ``method`` is ``ngram``
    (``config`` or its ``passthrough``). Any other drafter loads a model the lab has not."""
    keys = {**(cfg.get("passthrough") or {}), **cfg}
    if keys.get("speculative_model") in NGRAM_NAMES:
        return True
    spec = keys.get("speculative_config")
    return isinstance(spec, dict) and (spec.get("model") in NGRAM_NAMES
                                       or spec.get("method") in NGRAM_NAMES)


def speculative_fields(cfg: dict) -> list[str]:
    """The scenario's config fields (``config`` and its ``passthrough``) that ask for
    speculative decoding, set to a value (``speculative_model``, ``speculative_config``,
    ``num_speculative_tokens``, ``ngram_prompt_lookup_*`` ...); the lab's
    ``speculative_method`` (which drafter, meaningful only with ``num_speculative_tokens``) is
    not one."""
    keys = {**(cfg.get("passthrough") or {}), **cfg}
    found = [k for k, value in keys.items()
             if k not in ("passthrough", "speculative_method") and value not in (None, False)
             and ("specul" in k or k.startswith("ngram_prompt_lookup"))]
    return sorted(found, key=lambda k: ("specul" not in k, k))


def _spec_refusal(field: str, version: str) -> str:
    return (f"{field}: vLLM {version}'s V0 speculative decoding runs its SpecDecodeWorker "
            "(vllm/spec_decode/), which the lab's V0 worker serves only with the n-gram drafter "
            "(speculative_model: \"[ngram]\" with ngram_prompt_lookup_max) on a release whose "
            "SpecDecodeWorker it answers for; use that drafter or drop it at level: v0-engine "
            "(levels scheduler and engine-core drive spec decode on the V1 engine)")


class EngineConfigs:
    """``EngineArgs.create_engine_configs()``'s tuple (0.4.0, 0.4.0.post1: ``(model_config,
    cache_config, parallel_config, scheduler_config, device_config, lora_config,
    vision_language_config)``) by ``LLMEngine.__init__``'s parameter names: each an attribute
    (``cache_config``...), and :meth:`to_dict` as 0.4.1's ``EngineConfig.to_dict``."""

    def __init__(self, configs: dict):
        self._configs = dict(configs)
        for name, value in self._configs.items():
            setattr(self, name, value)

    def to_dict(self) -> dict:
        return dict(self._configs)


def _max_token_id(model_dir: Path) -> int:
    """The highest id of the packaged tokenizer's base vocabulary (``tokenizer.json``, its
    model's ``vocab``: the special tokens and ``t4``.. the printable characters). The added
    tokens above it (``<think>``, ``</think>``, for the reasoning parsers) are left out: a
    prompt folded into this range never holds them. Raises :class:`AdapterError` when it
    cannot be read."""
    import json

    try:
        tok = json.loads((model_dir / "tokenizer.json").read_text())
        ids = list((tok.get("model") or {}).get("vocab", {}).values())
        return max(ids)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdapterError(f"the packaged tokenizer {model_dir / 'tokenizer.json'} cannot be "
                           f"read: {exc}") from exc


def v0_engine_class():
    """The release's V0 ``LLMEngine`` class. From 0.7, ``vllm/engine/llm_engine.py`` rebinds the
    name to V1's engine when ``VLLM_USE_V1`` is set at import; the module is then imported
    (again) with ``VLLM_USE_V1=0`` to get the V0 class. Raises :class:`AdapterError` when the
    class found is not V0's."""
    name = "vllm.engine.llm_engine"
    old = os.environ.get("VLLM_USE_V1")
    os.environ["VLLM_USE_V1"] = "0"
    try:
        mod = sys.modules.get(name)
        if mod is None:
            mod = importlib.import_module(name)
        elif getattr(mod.LLMEngine, "__module__", name) != name:
            mod = importlib.reload(mod)
    finally:
        if old is None:
            os.environ.pop("VLLM_USE_V1", None)
        else:
            os.environ["VLLM_USE_V1"] = old
    cls = mod.LLMEngine
    if cls.__module__ != name:
        raise AdapterError(f"vllm.engine.llm_engine.LLMEngine is {cls.__module__}.{cls.__name__}, "
                           "not the V0 engine")
    return cls


class FakeV0Worker:
    """What the release's GPU ``Worker`` answers its executor (see the module docstring; the
    contract: :class:`vllm_repro.engine.interfaces.FakeWorker`)."""

    def __init__(self, loop: "V0EngineLoop"):
        self.loop = loop
        self.cache: tuple[int, int] | None = None
        self.executor = None

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.loop.lab_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """``Worker.initialize_cache``: vLLM's own ``raise_if_cache_size_invalid`` first."""
        ex = self.executor
        check = self.loop.adapter.cache_size_check
        if check is not None:
            values = {"num_gpu_blocks": num_gpu_blocks, "block_size": ex.cache_config.block_size,
                      "is_attention_free": getattr(ex.cache_config, "is_attention_free", False),
                      "max_model_len": ex.model_config.max_model_len,
                      "pipeline_parallel_size": ex.parallel_config.pipeline_parallel_size}
            params = list(inspect.signature(check).parameters)
            check(*[values[p] for p in params])
        ex.cache_config.num_gpu_blocks = num_gpu_blocks
        ex.cache_config.num_cpu_blocks = num_cpu_blocks
        self.cache = (num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, execute_model_req=None, **kwargs):
        """``Worker.execute_model``: an ``ExecuteModelRequest`` (0.4.2 on) or, before, its
        fields as keywords (:class:`_KeywordRequest`)."""
        if execute_model_req is None and kwargs:
            execute_model_req = _KeywordRequest(**kwargs)
        return self.loop.execute(execute_model_req)

    # 0.4.0 / 0.4.0.post1: GPUExecutor._init_cache's calls (its own forced_num_gpu_blocks and
    # check_block_size_valid run between them)
    def profile_num_available_blocks(self, *args, **kwargs) -> tuple[int, int]:
        return self.loop.lab_blocks()

    def init_cache_engine(self, cache_config) -> None:
        self.cache = (cache_config.num_gpu_blocks, cache_config.num_cpu_blocks)

    def warm_up_model(self) -> None:
        return None

    # what the executor's other calls would find on a GPU worker
    def init_device(self):
        return None

    def load_model(self):
        return None

    def add_lora(self, *a, **k):
        return False

    def remove_lora(self, *a, **k):
        return False

    def pin_lora(self, *a, **k):
        return False

    def list_loras(self):
        return set()

    def check_health(self):
        return None

    def shutdown(self):
        return None

    def stop_remote_worker_execution_loop(self):
        return None


def make_v0_executor_class(base, worker: FakeV0Worker):
    """A subclass of the release's executor for one GPU whose ``_init_executor`` installs
    ``worker`` as the driver worker (instead of loading a model on a device)."""

    def _init_executor(self):
        worker.executor = self
        self.driver_worker = worker

    def check_health(self):
        return None

    # 0.4.0 / 0.4.0.post1: GPUExecutor.__init__ itself calls _init_worker, then _init_cache
    return type(f"FakeV0{base.__name__}", (base,), {
        "__module__": __name__, "_init_executor": _init_executor, "_init_worker": _init_executor,
        "check_health": check_health, "uses_ray": False})


class V0EngineLoop(StepLoop):
    """One scenario run at ``level: v0-engine`` (see the module docstring). The observer
    protocol is :class:`~vllm_repro.engine.loop.StepLoop`'s; ``self.scheduler`` is the
    engine's own V0 ``Scheduler`` (virtual engine 0) once built, and ``after_schedule`` gets
    ``(step, SchedulerOutputs, scheduled)`` with ``scheduled`` as request id -> tokens."""

    level = "v0-engine"

    def __init__(self, adapter: V0Adapter, scenario: dict, trace=None, observer=None):
        super().__init__(adapter, scenario, trace, observer)
        self.sampled_at: dict[str, int] = {}
        m = scenario.get("model") or {}
        self.token = m.get("token", 100)
        self.scripted = {rid: list(t) for rid, t in (m.get("tokens") or {}).items()}
        self.eos_at = m.get("eos_at") or {}
        #: the scenario's requests the caller aborted so far (``LLMEngine.abort_request``)
        self.aborted_ids: set[str] = set()
        #: multi-step scheduling on (``num_scheduler_steps > 1``), and the batch in flight
        self.multi_step = False
        self._multi: _MultiStepBatch | None = None
        #: spec decode on (``speculative_config.num_speculative_tokens``, 0: off), the
        #: running-queue size at which the worker stops speculating (None: never), and the
        #: scenario's accepted drafts (``model.spec_decode.accept``) with each request's
        #: verifications so far
        self.spec_k = 0
        self.spec_disable_at = None
        self.accept = dict(((m.get("spec_decode") or {}).get("accept")) or {})
        self._verified: dict[str, int] = {}

    def prompt_of(self, spec: dict) -> list[int]:
        """The lab's prompt (:meth:`StepLoop.prompt_of`) folded into the packaged tokenizer's
        vocabulary (ids 3 to its highest), since V0's front door checks prompt ids against the
        tokenizer (``LLMEngine._validate_token_prompt``, 0.7+): never EOS, and the same ids
        for the same prefix."""
        top = self.adapter.max_token_id
        return [3 + (t - 3) % (top - 2) for t in super().prompt_of(spec)]

    # ---- the fake worker's answers ----------------------------------------------------------
    def lab_blocks(self) -> tuple[int, int]:
        """``(num_gpu_blocks, num_cpu_blocks)``: the scenario's, CPU blocks defaulting to what
        the GPU worker computes from ``swap_space`` (``Worker.determine_num_available_blocks``:
        ``int(swap_space_bytes // cache_block_size)``)."""
        cfg = self.cfg
        gpu = int(cfg["num_gpu_blocks"])
        if cfg.get("num_cpu_blocks") is not None:
            return gpu, int(cfg["num_cpu_blocks"])
        ex = self.worker.executor
        engine_mod = _import("vllm.worker.cache_engine:CacheEngine")
        values = {"cache_config": ex.cache_config, "model_config": ex.model_config,
                  "parallel_config": ex.parallel_config,
                  "block_size": ex.cache_config.block_size,  # 0.4.0: fields, not the config
                  "cache_dtype": ex.cache_config.cache_dtype}
        params = list(inspect.signature(engine_mod.get_cache_block_size).parameters)
        size = engine_mod.get_cache_block_size(*[values[p] for p in params])
        swap = getattr(ex.cache_config, "swap_space_bytes", 0) or 0
        return gpu, int(swap // size) if size else 0

    def execute(self, req):
        """``Worker.execute_model`` for ``req`` (an ``ExecuteModelRequest``); with multi-step
        scheduling, ``MultiStepWorker.execute_model`` (:meth:`execute_multi_step`)."""
        if req is None:
            return [] if self.adapter.worker_returns_list else None
        if self.multi_step and req.seq_group_metadata_list:
            return self.execute_multi_step(req)
        if self.spec_k and req.seq_group_metadata_list and self._speculates(req):
            return self.execute_spec_decode(req)
        a = self.adapter
        callback = getattr(req, "async_callback", None)
        if callback is not None:
            callback()  # GPUModelRunner.execute_model: the previous step's output processing
        before = getattr(self.observer, "before_execute", None)
        if before is not None:
            before(self.step, req)  # the audit's look at what the worker is asked to do
        if getattr(req, "num_steps", 1) > 1:
            raise AdapterError("ExecuteModelRequest.num_steps > 1 (a multi-step request for one "
                               "call) is not driven by the lab's V0 worker")
        outputs = self._sample(req.seq_group_metadata_list)
        out = a.SamplerOutput(outputs=outputs)
        return [out] if a.worker_returns_list else out

    def _sample(self, metas, base: dict | None = None, step: int = 0) -> list:
        """One ``CompletionSequenceGroupOutput`` per group of ``metas``, in order: one
        ``SequenceOutput`` per sequence of a group that samples (``do_sample``; in a multi-step
        batch every step after the first samples, as the GPU runner's ``advance_step`` turns the
        batch's prefills into decodes), with the token for the sequence's output count
        (``base[seq_id] + step`` in a multi-step batch, else its ``output_token_ids`` now)."""
        a = self.adapter
        outputs = []
        for meta in metas:
            samples = []
            if step > 0 or getattr(meta, "do_sample", True):
                for seq_id, data in meta.seq_data.items():
                    n = (base[seq_id] + step) if base is not None else len(data.output_token_ids)
                    tok = self._next_token(self.request_of(meta.request_id), n)
                    samples.append(a.SequenceOutput(seq_id, tok, {tok: a.Logprob(0.0)}))
            outputs.append(a.CompletionSequenceGroupOutput(samples, None))
        return outputs

    def _speculates(self, req) -> bool:
        """``SpecDecodeWorker.execute_model``'s choice: speculate unless the step has no
        lookahead slots (prefills, chunks), the running queue reached
        ``speculative_disable_by_batch_size`` (``_should_disable_all_speculation``; the
        worker then sets every group's ``num_speculative_tokens`` to 0, for good), or every
        group's ``num_speculative_tokens`` is 0. Otherwise ``_run_no_spec``: one
        ``SamplerOutput`` as without spec decode."""
        metas = req.seq_group_metadata_list
        disable = (self.spec_disable_at is not None
                   and (getattr(req, "running_queue_size", 0) or 0) >= self.spec_disable_at)
        if disable:  # SpecDecodeWorker._maybe_disable_speculative_tokens
            for meta in metas:
                meta.num_speculative_tokens = 0
        return not ((getattr(req, "num_lookahead_slots", 0) or 0) == 0 or disable
                    or all(getattr(m, "num_speculative_tokens", None) == 0 for m in metas))

    def _accepted(self, rid: str, k: int) -> int:
        """Drafts of ``rid`` accepted in this verification: ``model.spec_decode.accept`` (a
        count for every verification, or the next of a list; past it, and by default: all
        ``k``), at most ``k`` (as the V1 levels' fake runner)."""
        rule = self.accept.get(rid)
        i = self._verified.get(rid, 0)
        self._verified[rid] = i + 1
        if isinstance(rule, list):
            return min(rule[i], k) if i < len(rule) else k
        return k if rule is None else min(int(rule), k)

    def execute_spec_decode(self, req) -> list:
        """``SpecDecodeWorker._run_speculative_decoding_step`` (``vllm/spec_decode/
        spec_decode_worker.py``, 0.5 to 0.10) for a decode step with ``k =
        req.num_lookahead_slots`` lookahead slots: the n-gram drafter proposes ``k`` tokens
        per sequence, the target model accepts :meth:`_accepted` of them and adds its bonus
        token; ``_create_output_sampler_list`` answers a list of ``SamplerOutput``, one per
        position ``0..k``, each with one ``CompletionSequenceGroupOutput`` per sequence
        (``get_all_seq_ids_and_request_ids``' order) whose one ``SequenceOutput`` carries the
        position's token or, past the sequence's accepted tokens, ``VLLM_INVALID_TOKEN_ID``
        (-1); positions where every sequence has -1 are left off (the list stops there).
        Accepted drafts are the model's own tokens (:meth:`_next_token` for each output
        position; greedy acceptance), so tokens past EOS or ``max_tokens`` are the engine's
        to cut (``MultiStepOutputProcessor._process_seq_outputs``). No
        ``spec_decode_worker_metrics`` (vLLM's rejection sampler collects them only every
        few seconds; None is what most steps carry)."""
        a = self.adapter
        before = getattr(self.observer, "before_execute", None)
        if before is not None:
            before(self.step, req)
        invalid = _try_import("vllm.sequence:VLLM_INVALID_TOKEN_ID")
        invalid = -1 if invalid is None else invalid  # older releases: the literal -1
        k = int(req.num_lookahead_slots)
        rows = []  # per sequence: (seq_id, its k+1 tokens, -1 past the accepted ones)
        for meta in req.seq_group_metadata_list:
            rid = self.request_of(meta.request_id)
            for seq_id, data in meta.seq_data.items():
                n = len(data.output_token_ids)
                take = 1 + self._accepted(rid, k)
                rows.append((seq_id, [self._next_token(rid, n + i) if i < take else invalid
                                      for i in range(k + 1)]))
        out = []
        for pos in range(k + 1):
            if all(toks[pos] == invalid for _, toks in rows):
                break
            groups = [a.CompletionSequenceGroupOutput(
                [a.SequenceOutput(seq_id, toks[pos], {toks[pos]: a.Logprob(0.0)})], None)
                for seq_id, toks in rows]
            out.append(a.SamplerOutput(outputs=groups))
        return out

    def execute_multi_step(self, req):
        """``MultiStepWorker.execute_model`` (``vllm/worker/multi_step_worker.py`` with
        ``MultiStepModelRunner.execute_model`` of ``multi_step_model_runner.py``, 0.6.0 to
        0.10.0) for one step of a multi-step batch: the engine calls it once per
        ``LLMEngine.step()`` with the batch's cached ``seq_group_metadata_list`` until the
        batch's last step (``req.is_first_multi_step`` / ``req.is_last_step``, the release's
        own properties). What the worker answers, and does to the engine's output queue:

        - first step: the request is read (the audit's ``before_execute`` look; later steps
          reuse the prepared input as the worker does) and the engine's async callback, if any,
          kept (``base_output_proc_callback``);
        - every step, async output processing on: ``_async_process_outputs`` (the base runner
          calls it before sampling): the engine's callback, then each earlier step's output not
          yet pythonized is pythonized (the lab's GPU is always done), queued on the callback's
          ``ctx`` (``ctx.append_output(..., is_async=False, is_last_step=False,
          is_first_step_output=step == 0)``, or the 5-tuple on ``ctx.output_queue`` where the
          release's ``SchedulerContext`` has no ``append_output``) and processed by the callback;
        - the step samples (:meth:`_sample`): a ``SamplerOutput`` whose ``outputs`` stay empty
          until pythonized (``skip_sampler_cpu_output``); without async output processing every
          output is pythonized at once (``maybe_pythonize``);
        - not the last step: ``[this step's SamplerOutput]`` (the engine keeps it only for
          pipeline parallelism);
        - last step (``_final_process_outputs``): with async output processing, for each step's
          output the callback, then pythonize and queue the ones not yet queued, returning
          ``[last step's SamplerOutput]``; without, every step's ``SamplerOutput`` in order.
        """
        a = self.adapter
        first, last = req.is_first_multi_step, req.is_last_step
        if first or self._multi is None:
            before = getattr(self.observer, "before_execute", None)
            if before is not None:
                before(self.step, req)  # MultiStepWorker prepares its input at the first step
            self._multi = _MultiStepBatch(getattr(req, "async_callback", None))
        batch = self._multi
        callback = batch.callback
        if callback is not None:  # MultiStepModelRunner._async_process_outputs
            callback()
            for i in range(len(batch.outputs)):
                if not batch.pythonized[i]:
                    self._pythonize(batch, i)
                    self._queue(callback, batch.outputs[i], i)
                    callback()
        metas = req.seq_group_metadata_list
        if not first and not self._line.scheduled:
            # a later step of the batch: the engine runs it from the schedule it cached, without
            # schedule(); the trace counts one token per group decoded (progress, not a stall)
            scheduled: dict[str, int] = {}
            for meta in metas:
                scheduled[meta.request_id] = scheduled.get(meta.request_id, 0) + 1
            self._line.scheduled = scheduled
        if not batch.outputs:
            batch.base = {seq_id: len(data.output_token_ids) for meta in metas
                          for seq_id, data in meta.seq_data.items()}
        step = len(batch.outputs)
        batch.outputs.append(a.SamplerOutput(outputs=[]))
        batch.sampled.append(self._sample(metas, batch.base, step))
        batch.pythonized.append(False)
        if callback is None:
            for i in range(len(batch.outputs)):
                self._pythonize(batch, i)
        if not last:
            return [batch.outputs[-1]]
        self._multi = None
        if callback is None:
            return list(batch.outputs)
        final = []
        for i, out in enumerate(batch.outputs):  # MultiStepModelRunner._final_process_outputs
            callback()
            if not batch.pythonized[i]:
                self._pythonize(batch, i)
                if i < len(batch.outputs) - 1:
                    self._queue(callback, out, i)
                else:
                    final.append(out)
        return final

    @staticmethod
    def _pythonize(batch: "_MultiStepBatch", i: int) -> None:
        """``ModelOutput.pythonize``: step ``i``'s sampled groups into its ``SamplerOutput``."""
        if not batch.pythonized[i]:
            batch.outputs[i].outputs.extend(batch.sampled[i])
            batch.pythonized[i] = True

    @staticmethod
    def _queue(callback, out, i: int) -> None:
        """Queue step ``i``'s output on the engine's ``SchedulerContext`` (the callback's
        ``ctx`` keyword), as ``MultiStepModelRunner`` does."""
        ctx = callback.keywords["ctx"]
        append = getattr(ctx, "append_output", None)
        if append is None:  # 0.6.0, 0.6.1.x: the tuple straight onto the queue
            ctx.output_queue.append(([out], ctx.seq_group_metadata_list, ctx.scheduler_outputs,
                                     False, False))
            return
        kw = {"outputs": [out], "seq_group_metadata_list": ctx.seq_group_metadata_list,
              "scheduler_outputs": ctx.scheduler_outputs, "is_async": False,
              "is_last_step": False, "is_first_step_output": i == 0}
        names, _ = params_of(append)
        append(**{k: v for k, v in kw.items() if k in names})

    def _next_token(self, rid: str, outputs: int) -> int:
        """The token a request samples after ``outputs`` output tokens: its script's, else the
        model's token; EOS as its ``outputs + 1``-th where ``model.eos_at`` says so."""
        if self.eos_at.get(rid) == outputs + 1:
            return EOS_TOKEN_ID
        script = self.scripted.get(rid, ())
        return script[outputs] if outputs < len(script) else self.token

    # ---- start-up ----------------------------------------------------------------------------
    def _build(self):
        a = self.adapter
        cfg = self.cfg
        if (self.scenario.get("model") or {}).get("empty_at"):
            raise RefusedByRelease("model.empty_at: not supported at level: v0-engine (a V0 "
                                   "worker returns a token for every sampling group)")
        for e in map(from_mapping, self.scenario.get("events", [])):
            if not supported(self, e) or (isinstance(e, Abort) and e.when == "in_flight"):
                raise RefusedByRelease("events: only aborts between steps at level: v0-engine "
                                       "(LLMEngine.abort_request)")
        for r in self.requests:
            if r.structured_outputs:
                raise RefusedByRelease("requests[].structured_outputs: not supported at level: "
                                       "v0-engine")
            if r.priority and "priority" not in a.add_request_params:
                raise RefusedByRelease(f"requests[].priority: vLLM {a.version}'s "
                                       "LLMEngine.add_request takes no priority; use 0")
        if "detokenize" not in a.sampling_fields:
            raise AdapterError(f"level: v0-engine on vLLM {a.version}: its SamplingParams has no "
                               "detokenize (0.4.1 on) and its engine detokenizes every output, "
                               "which the lab's config-only tokenizer (no decoder) cannot; use "
                               "0.4.1 or later")
        kw = a.engine_args(cfg)
        old = os.environ.get("VLLM_USE_V1")
        os.environ["VLLM_USE_V1"] = "0"  # 0.8+: EngineArgs picks V0 (envs read when asked)
        self._use_v1_was = old
        try:
            args = a.EngineArgs(**kw)
            engine_config = a.engine_config(args)
        except (AdapterError, RefusedByRelease, MemoryError):
            raise
        except Exception as exc:
            raise self.refusal(exc) from exc
        steps = multi_steps(engine_config)
        spec_k = speculative_tokens(engine_config)
        refuse_unserved_workers(engine_config, cfg, a.version,
                                serves_multi_step=steps > 1 and a.serves_multi_step(),
                                serves_spec_decode=bool(spec_k) and a.serves_spec_decode())
        self.multi_step = steps > 1
        self.spec_k = spec_k
        spec_cfg = getattr(engine_config, "speculative_config", None)
        self.spec_disable_at = getattr(spec_cfg, "speculative_disable_by_batch_size", None)
        sd = (self.scenario.get("model") or {}).get("spec_decode") or {}
        if spec_k and (sd.get("propose") or (self.scenario.get("model") or {}).get("draft_tokens")):
            raise RefusedByRelease("model.spec_decode.propose / model.draft_tokens: not driven at "
                                   "level: v0-engine (the fake SpecDecodeWorker accepts "
                                   "model.spec_decode.accept drafts, each the model's own "
                                   "token); use accept")
        pp = engine_config.parallel_config.pipeline_parallel_size
        if pp != 1:
            raise RefusedByRelease("config.pipeline_parallel_size: the lab's V0 worker runs one "
                                   "rank; use 1")
        self.worker = FakeV0Worker(self)
        executor_cls = make_v0_executor_class(a.executor_base, self.worker)
        init, _ = params_of(a.LLMEngine)
        common = {"executor_class": executor_cls, "log_stats": not kw["disable_log_stats"]}
        try:
            if "vllm_config" in init:
                engine = a.LLMEngine(vllm_config=engine_config, **common)
            else:
                engine = a.LLMEngine(**engine_config.to_dict(), **common)
        except (AdapterError, RefusedByRelease, MemoryError):
            raise
        except Exception as exc:
            if not vllm_frames(exc.__traceback__, a.vllm_file) or _raised_in_lab(exc):
                raise AdapterError(f"building vLLM {a.version}'s V0 LLMEngine failed in the lab: "
                                   f"{type(exc).__name__}: {exc}") from exc
            raise _BuildCrash(exc) from exc
        self.engine = engine
        self.engine_config = engine_config
        self.scheduler = engine.scheduler[0] if isinstance(engine.scheduler, list) else engine.scheduler
        self._observe()

    def _observe(self) -> None:
        """Wrap the scheduler's ``schedule`` on the instance (vLLM's method unchanged) so that
        the trace and the audit see what each step scheduled."""
        sched = self.scheduler
        schedule = sched.schedule
        loop = self

        def observed_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            sched_out = out[1] if isinstance(out, tuple) else out
            scheduled = {}
            for s in getattr(sched_out, "scheduled_seq_groups", ()):
                rid = s.seq_group.request_id
                scheduled[rid] = scheduled.get(rid, 0) + int(s.token_chunk_size)
            loop._line.scheduled = scheduled
            loop._so = sched_out
            loop._ignored.update(_ignored_in(sched_out))
            if loop.observer is not None and loop._lab(loop.observer.after_schedule, loop.step,
                                                       sched_out, scheduled):
                raise _ObserverStop()
            return out

        sched.schedule = observed_schedule

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> RunResult:
        t0 = time.perf_counter()
        self.step = 0
        self._line = TraceLine(0)
        self._so = None
        self._use_v1_was = os.environ.get("VLLM_USE_V1")
        try:
            try:
                self._build()
            except _BuildCrash as crash:
                exc = crash.__cause__
                c = describe_exception(exc, self.adapter.vllm_file, 0, "engine-build")
                self.trace(TraceLine(0, phase="engine-build", crash=c.brief()))
                return RunResult("crash", crash=c, steps=0, finished={},
                                 unfinished=[r.id for r in self.requests],
                                 limit_reached=False, level=self.level,
                                 timing=Timing(round(time.perf_counter() - t0, 4)))
            build_s = time.perf_counter() - t0
            result = self._run_steps(build_s, self._engine_step, scheduled={})
            cc = self.engine_config.cache_config
            result.engine = EngineInfo(getattr(cc, "num_gpu_blocks", None), 1, "step",
                                       type(self.scheduler).__name__)
            return result
        finally:
            if self._use_v1_was is None:
                os.environ.pop("VLLM_USE_V1", None)
            else:
                os.environ["VLLM_USE_V1"] = self._use_v1_was

    def do_abort(self, e: Abort, line: TraceLine) -> None:
        """``LLMEngine.abort_request``: the only event of this level (engine/events.py)."""
        self.engine.abort_request(list(e.ids))
        line.aborted.extend(e.ids)
        self.aborted_ids.update(e.ids)

    def _engine_step(self, step: int, line: TraceLine):
        """One turn of ``LLMEngine``'s caller: this step's requests added, aborts applied, then
        ``engine.step()`` where the engine has unfinished requests."""
        a = self.adapter
        engine = self.engine
        self._line = line
        self._so = None
        phase = "add_request"
        try:
            for r in self.requests_by_step.get(step, []):
                kw = {"arrival_time": r.arrival_time if r.arrival_time is not None
                      else float(self.order)}
                if r.priority and "priority" in a.add_request_params:
                    kw["priority"] = r.priority
                self.order += 1
                prompt = self.prompt_of(r)
                params = a.sampling_params(r.max_tokens, r.n or 1)
                if "prompt_token_ids" in a.add_request_params:  # before 0.4.2's inputs
                    engine.add_request(r.id, None, params, prompt_token_ids=prompt, **kw)
                else:
                    engine.add_request(r.id, {"prompt_token_ids": prompt}, params, **kw)
                self.created[r.id] = True
                line.added.append(r.id)
            phase = "abort"
            for e in self.events_by_step.get(step, []):
                perform(self, e, line)
            if not engine.has_unfinished_requests():
                line.idle = True
                return None, None
            phase = "step"
            outputs = engine.step()
            for out in outputs or ():
                if getattr(out, "finished", False) and out.request_id not in self.finished:
                    reasons = [o.finish_reason for o in getattr(out, "outputs", ()) if o.finish_reason]
                    self.finished[out.request_id] = (
                        "FINISHED_IGNORED" if out.request_id in self._ignored
                        else str(reasons[0] if reasons else "finished"))
                    self._newly.append(out.request_id)
        except (RefusedByRelease, AdapterError):
            raise
        except (self._stop_exception(), _ObserverStop):
            return self._stopped(line), self._so
        except MemoryError:
            raise
        except Exception as exc:
            if _raised_in_lab(exc):
                raise AdapterError(f"the lab failed inside vLLM {a.version}'s V0 step {step}: "
                                   f"{type(exc).__name__}: {exc}") from exc
            return self._crashed(exc, step, phase, line), self._so
        return None, self._so or _NoSchedule()

    _newly: list[str] = []
    #: request ids the V0 scheduler ignored (``SchedulerOutputs.ignored_seq_groups``: a prompt
    #: too long for the pool or ``max_model_len``); vLLM finishes them with reason ``length``
    _ignored: set[str] = set()

    def _run_steps(self, build_s, step_fn, scheduled=None):
        self._newly = []
        self._ignored = set()
        return super()._run_steps(build_s, step_fn, scheduled)

    def _collect_finished(self) -> list[str]:
        """Requests whose final ``RequestOutput`` came out of this step, and aborted ones
        (which V0 drops without an output)."""
        newly, self._newly = self._newly, []
        live = self._live_ids()
        # an aborted request whose last output is still in the async output queue is over for
        # its caller (the abort ended its stream); only a scheduler queue keeps it alive
        live -= self.aborted_ids - self._live_ids(output_queue=False)
        for rid in self.created:
            if rid not in self.finished and rid not in live and rid not in newly:
                self.finished[rid] = "aborted"
                newly.append(rid)
        return newly

    def request_of(self, group_request_id: str) -> str:
        """The scenario request a V0 sequence group belongs to: itself, or for a child of a
        request with ``n > 1`` its parent (``LLMEngine.seq_id_to_seq_group[child].group_id``,
        the release's own map; ``ParallelSampleSequenceGroup`` in ``vllm/sequence.py``)."""
        group = (getattr(self.engine, "seq_id_to_seq_group", None) or {}).get(group_request_id)
        return getattr(group, "group_id", None) or group_request_id

    def _live_ids(self, output_queue: bool = True) -> set[str]:
        """The scenario requests in V0's scheduler queues and, with ``output_queue``, those
        with an output still queued for async output processing."""
        ids = set()
        for sched in (self.engine.scheduler if isinstance(self.engine.scheduler, list)
                      else [self.engine.scheduler]):
            for q in (sched.waiting, sched.running, sched.swapped,
                      getattr(sched, "_async_stopped", ())):  # past max_model_len (async)
                ids.update(self.request_of(sg.request_id) for sg in q)
        # multi-step: a prompt the batch's schedule ignored gets its output at the batch's last
        # step (LLMEngine.cached_scheduler_outputs holds the schedule until then)
        for cached in getattr(self.engine, "cached_scheduler_outputs", ()) or ():
            ids.update(self.request_of(rid) for rid in _ignored_in(
                getattr(cached, "scheduler_outputs", None)))
        # V0 with async output processing: a request's last output may still be queued
        for ctx in (getattr(self.engine, "scheduler_contexts", ()) or ()) if output_queue else ():
            for item in getattr(ctx, "output_queue", ()) or ():
                for sg in _groups_in(item):
                    ids.add(self.request_of(sg))
        return ids

    def _busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def _state(self, line: TraceLine) -> None:
        """V0's queues (``swapped`` stands in the trace's ``preempted`` column) and free GPU
        blocks, read now."""
        try:
            s = self.scheduler
            line.waiting = [sg.request_id for sg in s.waiting]
            line.running = [sg.request_id for sg in s.running]
            line.preempted = [sg.request_id for sg in s.swapped]
            line.free_blocks = s.block_manager.get_num_free_gpu_blocks()
        except Exception as exc:  # noqa: BLE001 - after a crash the books may be unreadable
            line.state_error = f"{type(exc).__name__}: {exc}"

    def _track_worker_batch(self) -> None:
        return None

    def refusal(self, exc: Exception) -> Exception:
        """A failure while vLLM builds its engine config: the release refuses the config."""
        first = " ".join(" ".join(str(exc).strip().splitlines()[:3]).split())
        if vllm_frames(exc.__traceback__, self.adapter.vllm_file) or type(exc).__name__ in (
                "ValidationError", "TypeError", "ValueError"):
            return refused_by_vllm(f"config: vLLM {self.adapter.version} refuses this "
                                   f"configuration: {type(exc).__name__}: {first}", exc)
        return AdapterError(f"building vLLM {self.adapter.version}'s engine config failed: "
                            f"{type(exc).__name__}: {first}")


def _groups_in(item) -> list[str]:
    """Request ids of the sequence groups in one entry of ``SchedulerContext.output_queue``
    (``OutputData`` or a tuple, by release): the scheduled ones and the prompts the schedule
    ignored (their output is made when the entry is processed)."""
    metas = getattr(item, "seq_group_metadata_list", None)
    sched_out = getattr(item, "scheduler_outputs", None)
    if metas is None and isinstance(item, tuple) and len(item) > 2:
        metas, sched_out = item[1], item[2]
    return [getattr(m, "request_id", None) for m in (metas or ())
            if getattr(m, "request_id", None)] + _ignored_in(sched_out)


def _ignored_in(sched_out) -> list[str]:
    """Request ids of ``SchedulerOutputs.ignored_seq_groups`` (none for ``so`` None)."""
    return [sg.request_id for sg in getattr(sched_out, "ignored_seq_groups", None) or ()]


class _KeywordRequest:
    """What ``Worker.execute_model`` got as keywords before ``ExecuteModelRequest`` (0.4.0,
    0.4.1), in its shape: the swap maps (``{src: dst}``) and the copy map (``{src: [dst...]}``)
    as lists of ``(src, dst)`` pairs, as ``ExecuteModelRequest`` carries them."""

    num_steps = 1
    async_callback = None

    def __init__(self, seq_group_metadata_list=None, blocks_to_swap_in=None,
                 blocks_to_swap_out=None, blocks_to_copy=None, **_):
        self.seq_group_metadata_list = list(seq_group_metadata_list or ())
        self.blocks_to_swap_in = _pairs(blocks_to_swap_in)
        self.blocks_to_swap_out = _pairs(blocks_to_swap_out)
        self.blocks_to_copy = _pairs(blocks_to_copy)


def _pairs(blocks) -> list[tuple[int, int]]:
    if not isinstance(blocks, dict):
        return list(blocks or ())
    return [(src, d) for src, dst in blocks.items()
            for d in (dst if isinstance(dst, (list, tuple)) else [dst])]


@dataclasses.dataclass
class _MultiStepBatch:
    """What ``MultiStepModelRunner`` keeps for the batch in flight (its ``StatefulModelInput``):
    the engine's async output callback (``base_output_proc_callback``; None without async
    output processing), each step's ``SamplerOutput`` (``cached_outputs``), the groups each
    step sampled (filled in when pythonized) and whether it is, and each sequence's output
    count at the batch's first step."""

    callback: object = None
    outputs: list = dataclasses.field(default_factory=list)
    sampled: list = dataclasses.field(default_factory=list)
    pythonized: list = dataclasses.field(default_factory=list)
    base: dict = dataclasses.field(default_factory=dict)


class _NoSchedule:
    """A step that did not schedule (the engine stepped on output processing only)."""

    scheduled_seq_groups = ()
    num_batched_tokens = 0


class _BuildCrash(Exception):
    """vLLM raised inside ``LLMEngine.__init__``: the run's ``crash`` at ``engine-build``."""


class _ObserverStop(Exception):
    """The observer stopped the run after ``schedule()`` returned."""


_LAB_DIR = str(Path(__file__).resolve().parent.parent)


def _raised_in_lab(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc`` is the lab's own code (a lab failure)."""
    tb = traceback.extract_tb(exc.__traceback__)
    return bool(tb) and str(Path(tb[-1].filename).resolve()).startswith(_LAB_DIR + "/")
