"""Requests in: ``Request`` as ``Request.from_engine_core_request`` makes it, the front door
(``Processor.process_inputs``), aborts; the lab's deterministic prompt tokens."""

from __future__ import annotations

import zlib

from .probes import (AdapterError, RefusedByRelease, _import, _try_import, call_supported,
                     fields_of, params_of, refused_by_vllm)

EOS_TOKEN_ID = 2  # OPT's eos_token_id (the packaged config.json)
VOCAB = 50000


def token_stream(seed_text: str, length: int, offset: int = 0) -> list[int]:
    """Deterministic prompt token ids (never EOS) for a request id or a shared prefix name."""
    seed = zlib.crc32(seed_text.encode())
    return [3 + (seed + (offset + j) * 104729) % VOCAB for j in range(length)]


class RequestsMixin:
    """``V1Adapter``'s request methods."""

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

    def structured_outputs_kwargs(self, req_id: str, spec: dict | None) -> dict:
        """The ``SamplingParams`` keyword for a request's ``structured_outputs`` mapping (the
        scenario's, under vLLM's names): ``{"structured_outputs": StructuredOutputsParams(...)}``,
        or ``{"guided_decoding": GuidedDecodingParams(...)}`` on releases that spell it so
        (found from ``SamplingParams``' fields, never from the version). ``{}`` without one.
        Raises :class:`RefusedByRelease` where the release has no structured outputs or its
        params class lacks a key."""
        if not spec:
            return {}
        field, cls = self.structured_params_class()
        if cls is None:
            raise RefusedByRelease(f"requests[{req_id}].structured_outputs: vLLM {self.version}'s "
                                   "SamplingParams has no structured_outputs / guided_decoding")
        names = fields_of(cls)
        for key in spec:
            if key not in names:
                raise RefusedByRelease(
                    f"requests[{req_id}].structured_outputs.{key}: vLLM {self.version}'s "
                    f"{cls.__name__} has no such field (it has {', '.join(sorted(names))})")
        try:
            return {field: cls(**spec)}
        except Exception as exc:  # noqa: BLE001 - the params class's own checks (__post_init__)
            first = " ".join(str(exc).strip().splitlines()[:1])
            raise RefusedByRelease(f"requests[{req_id}].structured_outputs: vLLM {self.version}'s "
                                   f"{cls.__name__} refuses it: {type(exc).__name__}: {first}") \
                from None

    def structured_params_class(self) -> tuple[str | None, type | None]:
        """``(SamplingParams field, its params class)``: ``structured_outputs`` /
        ``StructuredOutputsParams`` (0.11+), ``guided_decoding`` / ``GuidedDecodingParams``
        (0.6 to 0.10), or ``(None, None)``."""
        sp_fields = fields_of(self.SamplingParams)
        for field, cand in (("structured_outputs", "StructuredOutputsParams"),
                            ("guided_decoding", "GuidedDecodingParams")):
            cls = _try_import(f"vllm.sampling_params:{cand}")
            if field in sp_fields and cls is not None:
                return field, cls
        return None, None

    def validate_structured_outputs(self, sp, tokenizer) -> None:
        """The front end's structured-output validation of one request, the release's own:
        ``SamplingParams._validate_structured_outputs(model_config, structured_outputs_config,
        tokenizer)`` (called from ``SamplingParams.verify`` by the input processor), or the
        processor's ``_validate_structured_output(params)`` on releases that validate there.
        It picks the request's backend (``_backend``: ``auto`` falls back from xgrammar to
        guidance or outlines), which the engine's StructuredOutputManager reads. What it
        raises is the release refusing the request (an HTTP 400), and propagates."""
        cfg = self.vllm_config
        if hasattr(sp, "_validate_structured_outputs"):
            call_supported(sp._validate_structured_outputs, model_config=cfg.model_config,
                           structured_outputs_config=getattr(cfg, "structured_outputs_config", None),
                           decoding_config=getattr(cfg, "decoding_config", None),
                           tokenizer=tokenizer)
            return
        if not hasattr(self, "_so_processor"):
            self._so_processor = None
            for cand in ("vllm.v1.engine.input_processor:InputProcessor",
                         "vllm.v1.engine.processor:Processor"):
                cls = _try_import(cand)
                if cls is None:
                    continue
                try:
                    self._so_processor = call_supported(cls, vllm_config=cfg, tokenizer=tokenizer)
                except Exception:  # noqa: BLE001 - API drift: try the next form
                    continue
                break
        proc = self._so_processor
        if proc is None or not hasattr(proc, "_validate_structured_output"):
            raise AdapterError(f"vLLM {self.version}: no front-door structured-output validation "
                               "found (SamplingParams._validate_structured_outputs or the "
                               "processor's _validate_structured_output)")
        proc._validate_structured_output(sp)

    def validate_sampling_params(self, sp, tokenizer=None) -> None:
        """The front end's validation of one request's ``SamplingParams``, the release's own:
        its input processor's ``_validate_params`` (``Processor`` in
        ``vllm/v1/engine/processor.py``, ``InputProcessor`` in ``input_processor.py`` later;
        ``SamplingParams.verify`` from there on), as ``process_inputs`` calls it for a
        generation request. The processor is built on this adapter's ``vllm_config`` without
        a tokenizer, as the engine runs (``skip_tokenizer_init``), so where the release checks
        something only against a tokenizer (0.28's ``allowed_token_ids``) it checks nothing.
        What it raises is the release refusing the request (an HTTP 400) and propagates;
        :class:`AdapterError` where the release has no such processor or it does not build."""
        del tokenizer  # the processor's own: none, as the engine's
        proc = (self._front_processor("Processor", "vllm.v1.engine.processor:Processor")
                or self._front_processor("InputProcessor",
                                         "vllm.v1.engine.input_processor:InputProcessor"))
        validate = getattr(proc, "_validate_params", None)
        if validate is None:
            raise AdapterError(f"vLLM {self.version}: no front-door parameter validation found "
                               "(Processor / InputProcessor._validate_params)")
        call_supported(validate, params=sp, lora_request=None, supported_tasks=("generate",))

    def front_door(self, req_id: str, prompt: list[int], max_tokens: int, priority: int) -> None:
        """Refuse what the release's own front door refuses before a request reaches the
        scheduler: ``Processor.process_inputs`` (``vllm/v1/engine/processor.py``;
        ``InputProcessor`` in ``input_processor.py`` later) is called with the request's
        priority and prompt, e.g. 0.8/0.9 raise ``V1 does not support priority yet``, and every
        release refuses a prompt longer than ``max_model_len`` (some one as long as it). A
        prompt plus ``max_tokens`` over ``max_model_len`` is vLLM's to take: it caps the output
        (``FINISHED_LENGTH_CAPPED``).

        Only priorities and prompt lengths are checked this way (the rest of a request is plain
        token ids), and only for requests that have one or reach ``max_model_len``. When the
        release's processor cannot be built without a tokenizer the priority check is skipped
        and a prompt over ``max_model_len`` is refused by the lab on vLLM's rule. Raises
        :class:`RefusedByRelease` (with ``vllm_exc``, phase ``add_request``, where vLLM
        refused)."""
        config = getattr(self, "vllm_config", None)
        # the scenario's max_model_len, as the scheduler got it: a release whose ModelConfig
        # caps it at the packaged model's own length (OPT's 2048 on 0.9) keeps the scenario's
        # in SchedulerConfig, where the scheduler reads it
        max_len = getattr(getattr(config, "scheduler_config", None), "max_model_len", None)
        if not isinstance(max_len, int):
            max_len = getattr(getattr(config, "model_config", None), "max_model_len", None)
        long = isinstance(max_len, int) and len(prompt) >= max_len
        if not priority and not long:
            return
        processor = self._front_processor("Processor", "vllm.v1.engine.processor:Processor")
        if processor is None and long:  # later releases: the InputProcessor
            processor = self._front_processor(
                "InputProcessor", "vllm.v1.engine.input_processor:InputProcessor")
        if processor is None:
            self._over_max_model_len(req_id, prompt, max_len, long)
            return
        sp = call_supported(self.SamplingParams, max_tokens=max_tokens)
        try:
            call_supported(processor.process_inputs, request_id=req_id,
                           prompt={"prompt_token_ids": list(prompt)}, params=sp,
                           arrival_time=0.0, priority=priority)
        except (ValueError, NotImplementedError) as exc:
            text = str(exc).lower()
            if priority and "priority" in text:
                raise refused_by_vllm(
                    f"requests[{req_id}].priority: vLLM {self.version}'s front door "
                    f"(Processor.process_inputs) refuses it: {exc}; use priority 0 and "
                    "policy fcfs on this release", exc, "add_request") from None
            if long and ("length" in text or "max_model_len" in text):
                raise refused_by_vllm(
                    f"requests[{req_id}].prompt_len: vLLM {self.version}'s front door "
                    f"refuses a prompt of {len(prompt)} tokens with max_model_len {max_len}: "
                    f"{' '.join(str(exc).split())}; lower prompt_len or raise "
                    "config.max_model_len", exc, "add_request") from None
        except Exception:  # noqa: BLE001 - anything else is not about priority or length
            self._over_max_model_len(req_id, prompt, max_len, long)

    def _front_processor(self, name: str, where: str):
        """The release's front-door processor class at ``where`` built once (on this
        adapter's ``vllm_config``, no tokenizer), or None where it has none or it cannot be
        built so."""
        cache = self.__dict__.setdefault("_front_processors", {})
        if name not in cache:
            cache[name] = None
            cls = _try_import(where)
            if cls is not None:
                try:
                    cache[name] = call_supported(cls, vllm_config=self.vllm_config, tokenizer=None)
                except Exception:  # noqa: BLE001 - API drift: no front-door check possible
                    cache[name] = None
        return cache[name]

    @staticmethod
    def _over_max_model_len(req_id: str, prompt: list[int], max_len, long: bool) -> None:
        """Where the release's front door could not judge the prompt: vLLM's rule, a prompt
        longer than ``max_model_len`` is refused (:class:`RefusedByRelease`, no ``vllm_exc``)."""
        if long and len(prompt) > max_len:
            raise RefusedByRelease(
                f"requests[{req_id}].prompt_len: {len(prompt)} is over config.max_model_len "
                f"{max_len}, which vLLM's front door refuses; lower prompt_len or raise "
                "config.max_model_len")

    def abort(self, scheduler, req_ids: list[str]) -> None:
        """``EngineCore.abort_requests``: finish as aborted."""
        scheduler.finish_requests(req_ids, self.RequestStatus.FINISHED_ABORTED)
