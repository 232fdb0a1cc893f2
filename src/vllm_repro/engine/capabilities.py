"""What one vLLM release supports, probed once: the :class:`Capabilities` record.

The worker probes it right after importing the release
(:func:`vllm_repro.engine.adapter.capability_probes.probe`, inside the release environment:
standard library + vLLM) and sends it in its hello; the host keeps it
(``Worker.capabilities``) and caches it per release (``<cache>/capabilities/<checkout>/<version>.json``),
so that the loop, the fuzzer and triage read one record instead of probing vLLM each in their
own way. Every field is found by probing classes, signatures and sources of the release, never
by comparing version numbers: vLLM's API drift lives here and in the adapter only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

#: the scenario features a release may refuse, with what a refusal says (``refusal()``)
FEATURES = ("priority", "spec decode", "empty outputs", "async scheduling", "kv cache groups",
            "engine-core", "kv connectors", "engine core process", "data parallel engine cores",
            "reasoning parser")
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
    ``abort_in_flight``, ``reset_prefix_cache``, ``reset_running_requests``,
    ``reset_connector`` (``reset_prefix_cache(reset_connector=...)``), ``pause``,
    ``pause_mode`` (``pause_scheduler(mode=...)``), ``resume``); ``spec_methods``: the
    ``SpeculativeConfig.method`` values the lab's fake drafter
    can stand for (``ngram``, ``ngram_gpu``; the model-based ``eagle``, ``eagle3``, ``mtp``,
    ``deepseek_mtp``, ``draft_model`` where the release's ``SpeculativeMethod`` names them);
    ``kv_group_kinds``: KV cache spec kinds
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
    #: ``config.data_parallel_size`` > 1 with ``multiprocess_mode`` and ``asyncio_mode``
    #: (``engine/core_proc.py``): ``vllm/v1/engine/core.py`` has ``DPEngineCoreProc`` with its
    #: own ``run_busy_loop`` and ``_has_global_unfinished_reqs`` (waves, dummy batches, the
    #: DP all-reduce) and ``vllm/v1/engine/core_client.py`` the ``DPLBAsyncMPClient``
    dp_engine_core_proc: bool = False
    #: ``DPEngineCoreProc._should_throttle_prefills``: its steps call
    #: ``Scheduler.schedule(throttle_prefills=...)`` (DP prefill balancing by
    #: ``prefill_schedule_interval``)
    dp_throttle_prefills: bool = False
    split_sampling: bool = False
    batch_queue_from_config: bool = False
    events: tuple[str, ...] = ()
    structured_outputs: bool = False
    structured_outputs_field: str | None = None
    structured_backends: tuple[str, ...] = ()
    #: the config field the release's ``StructuredOutputManager`` reads its reasoning parser's
    #: name from (``StructuredOutputsConfig.reasoning_parser``; ``DecodingConfig.
    #: reasoning_backend`` on 0.9/0.10-era releases), where it builds one from vLLM's
    #: ``ReasoningParserManager`` to hold the grammar back until reasoning ends; None where it
    #: reads none (no reasoning in ``vllm/v1/structured_output``: the 0.8 line)
    reasoning_parser_field: str | None = None
    #: the names that ``ReasoningParserManager`` registers (eagerly or lazily), what
    #: ``config.reasoning_parser`` may be
    reasoning_parsers: tuple[str, ...] = ()
    preprocess_errors_per_request: bool = False
    kv_connectors: bool = False
    kv_load_failures: tuple[str, ...] = ()
    #: vLLM's own connectors whose scheduler half the lab runs (``kv_connector: NixlConnector``):
    #: the names the release's ``KVConnectorFactory`` registry has, of those the lab's worker
    #: half can answer (``engine/kv_worker.py``)
    own_kv_connectors: tuple[str, ...] = ()
    #: the release's KV connector base has ``SupportsHMA`` (``kv_connector/v1/base.py``): a
    #: connector may declare hybrid memory allocator support (``supports_hma``)
    kv_hma: bool = False
    #: the base's ``get_num_new_matched_tokens`` may answer ``None`` ("not yet": its return
    #: annotation is ``int | None``), which the scheduler skips and asks again
    kv_lookup_not_ready: bool = False
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
            "data parallel engine cores": None if self.dp_engine_core_proc else
            f"vLLM {v} has no DPEngineCoreProc with its own run_busy_loop and "
            "_has_global_unfinished_reqs behind a DPLBAsyncMPClient (vllm/v1/engine/core.py, "
            "core_client.py); drop config.data_parallel_size on this release",
            "reasoning parser": None if self.reasoning_parser_field else
            f"vLLM {v}'s StructuredOutputManager reads no reasoning parser (no "
            "ReasoningParserManager in vllm/v1/structured_output: the grammar applies from the "
            "first token)",
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
    """Where the host keeps a release's probed record: ``<cache>/capabilities/<checkout>/
    <version>.json``, one folder per checkout of the lab (the key of its package folder, as
    :func:`~vllm_repro.engine.host.lab_path` names it), since the record is what *this* lab's
    probes found: two checkouts of different code share the release cache, not their records."""
    package = Path(__file__).resolve().parent.parent
    key = hashlib.sha256(str(package).encode()).hexdigest()[:12]
    return cache / "capabilities" / key / f"{version}.json"


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


__all__ = ["Capabilities", "FEATURES", "HASH_CHECKS", "BLOCK_HASH_FIELDS", "GENERATIONS", "save",
           "load", "cache_path"]
