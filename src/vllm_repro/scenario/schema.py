"""The scenario file (format v1, docs/scenarios.md): a workload for vLLM's real scheduler.

Field names reuse vLLM's own config names (``block_size``, ``num_gpu_blocks``, ``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``, ``enable_chunked_prefill``,
``enable_prefix_caching``, ``policy``, ``long_prefill_token_threshold``). Every model is strict:
an unknown field is an error that names it.

Units: lengths in tokens, pool sizes in blocks, times in steps (step n is the n-th
``Scheduler.schedule()`` call; anything ``at_step: n`` happens just before it).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from ..engine.engine_args import yaml_word

#: what a scenario may expect: ``refused`` (vLLM refuses its configuration or a request: at
#: ``EngineArgs`` / ``VllmConfig`` build, ``EngineCore`` start-up, ``add_request``) and ``hang``
#: (a step, or start-up, that does not return within the watchdog's time)
Outcome = Literal["clean", "crash", "violation", "stall", "refused", "hang"]
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
#: a token id: vLLM keeps them in int32 arrays (``InputBatch.token_ids_cpu``); a larger one is
#: an OverflowError inside the lab's runner, not anything vLLM could be handed
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
#: drafts per request a step: the fake runner makes a list this long per request every step,
#: so it is bounded (the lab's limit; vLLM's drafters propose a handful)
MAX_SPEC_TOKENS = 1024
#: the most events a scenario lists
MAX_EVENTS = 10_000



#: the most pass-through fields a scenario's ``config:`` may hold (each is read against the
#: release's config classes; all of vLLM's scheduler, cache, parallel and speculative configs
#: together have about 150)
MAX_PASSTHROUGH_FIELDS = 256

class Strict(BaseModel):
    """Unknown fields are errors, and so are values of the wrong type: ``true`` or ``"2"`` for a
    count is refused, not coerced to 1 or 2 (YAML ints are still fine where floats go). A
    number must be finite: ``.nan`` and ``.inf`` are refused."""

    model_config = ConfigDict(extra="forbid", frozen=False, strict=True, allow_inf_nan=False)


def close_field(name: str, candidates, cutoff: float = 0.8) -> str | None:
    """The one of ``candidates`` that ``name`` most likely misspells, or None."""
    import difflib

    near = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=cutoff)
    return near[0] if near else None


def _id_fix(rid, ids) -> str:
    """The fix for an unknown request id: the id it likely misspells, else the ids there are."""
    by_lower = {str(i).lower(): str(i) for i in ids}
    near = close_field(str(rid).lower(), by_lower, cutoff=0.6)
    if near:
        return f"; did you mean {by_lower[near]}?"
    shown = ", ".join(sorted(str(i) for i in ids)[:8]) + (", ..." if len(ids) > 8 else "")
    return f"; use an id from requests[].id ({shown})"


def _check_release(value: str) -> str:
    """A release is a version (``0.10.1.1``) or a specifier set (``>=0.9.2,<0.10.2``)."""
    if len(value) > 64:
        raise ValueError(f"a release of {len(value)} characters is neither a release version "
                         "nor a version range (at most 64)")
    try:
        Version(value)
        return value
    except ValueError:  # InvalidVersion, or an integer past Python's digit limit
        pass
    try:
        SpecifierSet(value)
    except (InvalidSpecifier, ValueError) as exc:
        raise ValueError(f"{value!r} is neither a release version nor a version range") from exc
    return value


class VllmRefs(Strict):
    """Where the bug lives: the vLLM issue, and the releases it reproduces / is clean on.

    ``reproduces_on`` and ``clean_on`` list concrete releases (run by default) and may also hold
    ranges such as ``">=0.9.2,<0.10.2"`` which only decide the expectation for other releases.
    """

    issue: str | None = None
    fixed_by: str | None = None
    reproduces_on: list[str] = Field(default_factory=list)
    clean_on: list[str] = Field(default_factory=list)

    @field_validator("reproduces_on", "clean_on")
    @classmethod
    def _releases(cls, v: list[str]) -> list[str]:
        return [_check_release(x) for x in v]

    @model_validator(mode="after")
    def _not_both(self):
        """A release cannot both reproduce and run clean: a concrete release of one list that
        is (or falls in a range of) the other is a contradiction, refused."""
        for mine, other, here, there in ((self.reproduces_on, self.clean_on, "reproduces_on",
                                          "clean_on"),
                                         (self.clean_on, self.reproduces_on, "clean_on",
                                          "reproduces_on")):
            for v in mine:
                try:
                    ver = Version(v)
                except InvalidVersion:
                    continue
                for e in other:
                    try:
                        hit = Version(e) == ver
                    except InvalidVersion:
                        hit = ver in SpecifierSet(e, prereleases=True)
                    if hit:
                        raise ValueError(
                            f"vllm.{here}: release {v} is also in vllm.{there} ({e!r}); a "
                            "release either reproduces the bug or runs clean: keep it in one list")
        return self

    def concrete(self) -> list[str]:
        """The concrete releases named, reproducing ones first, in file order."""
        out = []
        for v in [*self.reproduces_on, *self.clean_on]:
            try:
                Version(v)
            except InvalidVersion:
                continue
            if v not in out:
                out.append(v)
        return out

    def expectation_for(self, version: str) -> Literal["reproduce", "clean"] | None:
        """``reproduce`` / ``clean`` when the file says so for ``version``, else None."""
        ver = Version(version)
        for kind, entries in (("reproduce", self.reproduces_on), ("clean", self.clean_on)):
            for e in entries:
                try:
                    if Version(e) == ver:
                        return kind  # type: ignore[return-value]
                except InvalidVersion:
                    if ver in SpecifierSet(e, prereleases=True):
                        return kind  # type: ignore[return-value]
        return None


#: each KV cache group kind (vLLM's ``KVCacheSpecKind`` names; ``full`` for full attention)
#: and the group fields only it takes
KV_GROUP_FIELDS = {"full": (), "sliding_window": ("sliding_window",),
                   "chunked_local_attention": ("attention_chunk_size",),
                   "mamba": ("block_size", "mamba_type"), "cross_attention": ()}


class KVCacheGroup(Strict):
    """One KV cache group (vLLM's ``KVCacheGroupSpec``) and the spec its layers declare:
    ``full`` (``FullAttentionSpec``), ``sliding_window`` (``SlidingWindowSpec``, needs
    ``sliding_window``: tokens), ``chunked_local_attention`` (``ChunkedLocalAttentionSpec``,
    needs ``attention_chunk_size``: tokens), ``mamba`` (``MambaSpec``; ``block_size``: the
    group's own block size in tokens, vLLM's ``mamba_block_size``, default ``config.block_size``;
    ``mamba_type``: the release's own name, e.g. ``mamba2``), ``cross_attention``
    (``CrossAttentionSpec``). Whether the release has the kind is the release's to say
    (``engine/adapter/kv_specs.py``): a kind it lacks is an input error naming its kinds."""

    type: Literal["full", "sliding_window", "chunked_local_attention", "mamba",
                  "cross_attention"] = "full"
    sliding_window: PosInt | None = None
    attention_chunk_size: PosInt | None = None
    block_size: PosInt | None = None
    mamba_type: Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9_]{0,39}$")] | None = None
    num_layers: PosInt = 1

    @model_validator(mode="after")
    def _window(self):
        own = KV_GROUP_FIELDS[self.type]
        for name in ("sliding_window", "attention_chunk_size"):
            if name in own and getattr(self, name) is None:
                raise ValueError(f"a {self.type} group needs `{name}: N` (tokens)")
        for name in ("sliding_window", "attention_chunk_size", "block_size", "mamba_type"):
            if getattr(self, name) is not None and name not in own:
                takers = [k for k, v in KV_GROUP_FIELDS.items() if name in v]
                raise ValueError(f"`{name}` only applies to groups of type {' or '.join(takers)}")
        return self


class SchedulerSettings(Strict):
    """vLLM's scheduler and cache config, under vLLM's own names.

    The fields below are the lab's own (typed and checked here). Any other key is a config field
    of the release under test (``SchedulerConfig``, ``CacheConfig``, ``ParallelConfig`` or
    ``SpeculativeConfig``: ``max_num_partial_prefills``, ``num_gpu_blocks_override``, ...): it is
    handed to that class as written and vLLM's own validators judge it; a field the release does
    not have is an input error naming the field and the release (``engine/adapter.py``).
    """

    # unknown keys pass through to the release's config classes (see the docstring)
    model_config = ConfigDict(extra="allow", frozen=False, strict=True)

    block_size: PosInt = 16
    #: block 0 is vLLM's null block (never handed out), so the pool needs at least 2. At
    #: ``level: engine-core`` the fake executor reports the memory these blocks take
    #: (``num_gpu_blocks`` x page size x layers) and vLLM's own start-up sizes the pool from it.
    #: ``level: v0-engine``: what the fake V0 worker's ``determine_num_available_blocks``
    #: reports, 0 and 1 allowed (vLLM's own start-up check judges them).
    num_gpu_blocks: NonNegInt | None = None
    #: ``level: v0-engine`` only: the CPU (swap) blocks the fake V0 worker reports; default:
    #: what the GPU worker computes from ``swap_space`` (vLLM's ``CacheEngine`` block size)
    num_cpu_blocks: NonNegInt | None = None
    #: ``level: engine-core`` only: the bytes the fake executor's ``determine_available_memory``
    #: reports (what profiling would find free for the KV cache); vLLM sizes the pool from it.
    kv_cache_memory_bytes: NonNegInt | None = None
    #: ``level: engine-core`` with ``distributed_executor_backend: mp``: the release's own
    #: ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` for the run (``MultiprocExecutor``'s RPC timeout)
    execute_model_timeout_seconds: Annotated[int, Field(ge=1, le=600)] | None = None
    #: ``level: engine-core``: the production shape, the release's ``EngineCoreProc`` in its own
    #: process started by its own client (``EngineCoreClient.make_client(multiprocess_mode=True,
    #: ...)``, vLLM's name; ``engine/core_proc.py``), the requests and events sent through it
    multiprocess_mode: bool | None = None
    #: with ``multiprocess_mode``: the release's asyncio client (``make_client``'s
    #: ``asyncio_mode=True``: ``AsyncMPClient``, what ``AsyncLLM`` and ``vllm serve`` build)
    asyncio_mode: bool | None = None
    #: ``level: engine-core`` only: the executor's ``max_concurrent_batches`` (pipeline depth;
    #: > 1 makes EngineCore use ``step_with_batch_queue``), where the release reads it there.
    max_concurrent_batches: PosInt | None = None
    max_num_seqs: PosInt = 16
    max_num_batched_tokens: PosInt = 2048
    max_model_len: PosInt = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    policy: Literal["fcfs", "priority"] = "fcfs"
    long_prefill_token_threshold: NonNegInt = 0
    num_speculative_tokens: Annotated[int, Field(ge=1, le=MAX_SPEC_TOKENS)] | None = None
    #: the drafter (vLLM's ``SpeculativeConfig.method``): ``ngram`` (CPU n-gram proposer),
    #: ``ngram_gpu`` (the GPU one, the method async scheduling accepts from 0.20), or a
    #: model-based one on a packaged config-only draft model: ``eagle``, ``eagle3``, ``mtp`` /
    #: ``deepseek_mtp`` (a DeepSeek-V3 config with one MTP layer), ``draft_model`` (the OPT
    #: config as a separate draft); the draft tokens come from the fake model runner (the
    #: scenario's ``model`` section), and for the model-based ones the release's own rule of
    #: whether the drafter runs this step (``engine/drafter.py``)
    speculative_method: Literal["ngram", "ngram_gpu", "eagle", "eagle3", "mtp", "deepseek_mtp",
                                "draft_model"] = "ngram"
    #: the drafter's own ``max_model_len`` (vLLM's ``SpeculativeConfig.max_model_len``, the
    #: ``--speculative-max-model-len`` of older releases), model-based methods only: the
    #: release caps the draft model config's length with it, and its runner stops drafting for a
    #: batch past it (``engine/drafter.py``)
    speculative_max_model_len: PosInt | None = None
    #: vLLM's ``SchedulerConfig.async_scheduling``: false (the lab's default) or true as given;
    #: null leaves it to the release as ``vllm serve`` does without the flag (vLLM's own
    #: ``None``, which ``VllmConfig`` resolves: on unless the config rules it out)
    async_scheduling: bool | None = False
    #: ``level: engine-core``: the reasoning parser the engine's ``StructuredOutputManager``
    #: builds from vLLM's ``ReasoningParserManager`` (``--reasoning-parser``; vLLM's
    #: ``StructuredOutputsConfig.reasoning_parser``, which the adapter hands to the field the
    #: release reads: ``DecodingConfig.reasoning_backend`` on 0.9/0.10): a structured-output
    #: request's grammar is held back while it reasons and applies after the end token
    #: (``deepseek_r1`` / ``qwen3``: ``</think>``, id 356 of the packaged tokenizer)
    reasoning_parser: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")] | None = None
    kv_cache_groups: list[KVCacheGroup] | None = None
    #: vLLM's engine argument: false (as ``vllm serve`` runs) makes the front end record every
    #: step's ``SchedulerStats`` with the release's own stat loggers (``StatLoggerManager``:
    #: logging + Prometheus), as ``AsyncLLM``'s output handler does; true (the ``LLM`` class's
    #: default, and the lab's) records nothing.
    disable_log_stats: bool = True

    @model_validator(mode="after")
    def _limits(self):
        extra = self.model_extra or {}
        if self.num_speculative_tokens is None:
            # (a dumped scenario names the default method: not a drafter asked for)
            for key, named in (("speculative_method", self.speculative_method != "ngram"),
                               ("speculative_max_model_len",
                                self.speculative_max_model_len is not None)):
                if named:
                    raise ValueError(f"config.{key}: spec decode is off without "
                                     "config.num_speculative_tokens (vLLM's SpeculativeConfig "
                                     "needs the drafts a step); add num_speculative_tokens or "
                                     f"drop {key}")
        if self.num_gpu_blocks is None and self.kv_cache_memory_bytes is None:
            for key in extra:
                near = close_field(key, ("num_gpu_blocks", "kv_cache_memory_bytes"))
                if near:
                    raise ValueError(f"config.{key}: unknown field; did you mean {near}? "
                                     f"(config.{near} is required)")
            raise ValueError("config.num_gpu_blocks: missing required field (the KV pool in "
                             "blocks; at level engine-core kv_cache_memory_bytes, the memory "
                             "start-up sizes it from, may stand for it); add it")
        if len(extra) > MAX_PASSTHROUGH_FIELDS:  # each is looked up in the release's classes
            raise ValueError(f"{len(extra):,} fields besides the lab's own, over "
                             f"{MAX_PASSTHROUGH_FIELDS} (the lab's limit; vLLM's config classes "
                             "have fewer); keep the ones the bug needs")
        for key, value in extra.items():
            if not re.fullmatch(r"[a-z][a-z0-9_]*", key):
                raise ValueError(f"{key!r} is not a vLLM config field name")
            if isinstance(value, (dict, list)):
                fix = ("give its fields as plain config keys (speculative_model, "
                       "num_speculative_tokens, ngram_prompt_lookup_max, ...): the lab hands them "
                       "to the release in the shape it takes" if key == "speculative_config"
                       else "give it as a number, a string or a boolean")
                raise ValueError(f"config.{key}: only plain values pass through to vLLM's config "
                                 f"classes; {fix}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"config.{key}: {value} is not a finite number; give a number")
            if isinstance(value, str) and re.fullmatch(
                    r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?|true|false|True|False", value.strip()):
                # quoted in the YAML: vLLM's config takes the number or boolean, not its text
                # (a count compared with '>' fails inside vLLM with a bare TypeError)
                if re.fullmatch(r"[+-]?\d+[eE][+-]?\d+", value.strip()):  # YAML 1.1: text
                    raise ValueError(f"config.{key}: {value!r} is read as text by YAML (a "
                                     "number with an exponent needs a dot there); write it as "
                                     f"{float(value)!r}")
                raise ValueError(f"config.{key}: {value!r} is a quoted string; write it without "
                                 "quotes if it is a number or a boolean")
        from ..engine.topology import topology

        topology({"passthrough": extra})  # parallel sizes: positive, a bounded world
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when enable_chunked_prefill is "
                "false (vLLM's SchedulerConfig rule)")
        return self


#: the constraint kinds of vLLM's ``StructuredOutputsParams`` (``GuidedDecodingParams`` before
#: 0.11): a request gives exactly one of them
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputs(Strict):
    """A request's structured-output constraint, under the release's own names: the fields of
    ``StructuredOutputsParams`` (``SamplingParams.structured_outputs``; ``GuidedDecodingParams``
    and ``SamplingParams.guided_decoding`` on older releases). Exactly one kind of
    :data:`STRUCTURED_KINDS` (``json``: a schema, as a mapping or a JSON string; ``regex``;
    ``choice``: a list of strings; ``grammar``: EBNF or Lark text; ``json_object: true``;
    ``structural_tag``: its JSON text). Any other key (``disable_any_whitespace``,
    ``whitespace_pattern``, ...) is handed to the release's params class as written; one the
    release does not have is an input error naming it and the release. The values are not
    judged here: the release's own front door and backend do (a grammar the release refuses is
    a refused request or a crash, as that release behaves)."""

    model_config = ConfigDict(extra="allow", frozen=False, strict=True, populate_by_name=True)

    #: ``json`` in the file (vLLM's name; pydantic's BaseModel has a ``json`` method)
    json_schema: str | dict | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _one_kind(self):
        given = self.params()
        kinds = [k for k in STRUCTURED_KINDS if k in given]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of {', '.join(STRUCTURED_KINDS)} "
                             f"(this one: {kinds or 'none'})")
        for key, value in (self.model_extra or {}).items():
            if not re.fullmatch(r"[a-z][a-z0-9_]*", key) or key.startswith("_"):
                raise ValueError(f"{key!r} is not a structured-outputs parameter name")
            if isinstance(value, (dict, list)):
                raise ValueError(f"{key}: only plain values pass through to the release's "
                                 "structured-outputs params")
        return self

    def params(self) -> dict:
        """The keyword arguments for the release's params class (absent fields left out)."""
        return {k: v for k, v in self.model_dump(mode="json", by_alias=True).items()
                if v is not None}


class RequestSpec(Strict):
    """One request: added just before step ``at_step``.

    ``prefix`` names a shared token stream: requests with the same prefix share their first
    ``prefix_len`` prompt tokens (default: the whole prompt), which is what prefix caching hits.
    ``arrival_time`` (seconds, vLLM's ``Request.arrival_time``) defaults to the order of addition.
    """

    id: str = Field(min_length=1, max_length=64)
    at_step: PosInt = 1
    prompt_len: PosInt
    max_tokens: PosInt = 16
    #: parallel sampling (``SamplingParams.n``, ``level: v0-engine``): the release's
    #: ``LLMEngine.add_request`` fans the request out into its own child sequence groups
    n: PosInt = 1
    priority: int = 0
    arrival_time: float | None = None
    prefix: str | None = None
    prefix_len: PosInt | None = None
    #: structured outputs (``level: engine-core``): the release's StructuredOutputManager and
    #: its real backend compile the constraint and the fake model samples through its bitmask
    structured_outputs: StructuredOutputs | None = None
    #: the request's ``kv_transfer_params`` (``level: engine-core``, with ``kv_transfer_config``):
    #: what vLLM's front end puts in ``SamplingParams.extra_args["kv_transfer_params"]`` and
    #: ``Request.kv_transfer_params`` carries to the connector, e.g. ``{do_remote_decode: true}``
    #: (a prefill instance's request) or ``{do_remote_prefill: true, remote_block_ids: [...],
    #: ...}`` (the decode side: the prompt was computed elsewhere). Read by vLLM's own connectors
    #: (``kv_connector: NixlConnector``); plain JSON values, handed over as written
    kv_transfer_params: dict[str, str | int | float | bool | list[int] | list[list[int]] | None] \
        | None = None
    #: ``SamplingParams.allowed_token_ids`` (``level: engine-core``): the only token ids the
    #: request may sample; the release's own front door (its input processor's
    #: ``_validate_params``) judges them, and its worker-side ``InputBatch.add_request`` writes
    #: them into the allowed-token mask (one row of the model's vocabulary per slot). The fake
    #: model's tokens are not restricted by them. At most 4096 ids, each within int32
    allowed_token_ids: list[Annotated[int, Field(ge=-(2**31), lt=2**31)]] | None = Field(
        default=None, max_length=4096)

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.:-]+", v):
            raise ValueError("request ids use letters, digits and _ . : - only")
        return v

    @model_validator(mode="after")
    def _prefix(self):
        if self.prefix_len is not None:
            if self.prefix is None:
                raise ValueError("`prefix_len` needs `prefix: NAME`")
            if self.prefix_len > self.prompt_len:
                raise ValueError(f"prefix_len {self.prefix_len} exceeds prompt_len {self.prompt_len}")
        return self


class RankFault(Strict):
    """A fault injected into one rank process (``distributed_executor_backend: mp``,
    ``engine/ranks.py``): ``kind`` ``hang`` / ``late`` (the rank sleeps ``seconds`` before its
    forward pass: longer than the RPC timeout, vLLM's ``collective_rpc`` times out; shorter,
    the answer is late), ``raise`` (the rank's ``execute_model`` raises), ``exit`` (the rank
    process exits with ``exit_code``); on the first ``execute_model`` after the event's step,
    or on the run's ``on_execute_model``-th. ``rank``: the global rank (0 to world size - 1)."""

    rank: NonNegInt
    kind: Literal["hang", "late", "raise", "exit"]
    seconds: float = Field(default=60.0, gt=0, le=600)
    exit_code: int = Field(default=1, ge=0, le=255)
    on_execute_model: PosInt | None = None

    @model_validator(mode="after")
    def _fields(self):
        if "seconds" in self.model_fields_set and self.kind not in ("hang", "late"):
            raise ValueError("`seconds` goes with kind: hang or late")
        if "exit_code" in self.model_fields_set and self.kind != "exit":
            raise ValueError("`exit_code` goes with kind: exit")
        return self


class Event(Strict):
    """Something done to the engine at step ``at_step``: one of

    - ``abort: [ids]`` (``EngineCore.abort_requests``); ``when: before_step`` (default) just before
      the step, or ``in_flight`` (``level: engine-core``) while that step's batch is executing,
      as the engine's input thread delivers it (``EngineCore.aborts_queue`` where the release
      has one, else only while a batch-queue step is in flight);
    - ``reset_prefix_cache: true`` (``EngineCore.reset_prefix_cache``; with
      ``reset_running_requests: true`` where the release takes it, and ``reset_connector:
      true``: the scheduler's KV connector's ``reset_cache`` too, where the release takes it);
    - ``pause: true`` / ``resume: true`` (``EngineCore.pause_scheduler`` / ``resume_scheduler``);
      ``mode: abort | keep | wait`` is handed to ``pause_scheduler(mode=...)`` where the release
      takes it (default: the release's own default, which is ``abort`` where modes exist: the
      running requests are aborted, not kept). Steps while paused do not count toward a stall.

    The last three are engine-core calls (``level: engine-core``); a release that lacks the call
    is refused with exit 2 naming it.
    """

    at_step: PosInt
    abort: list[str] | None = Field(default=None, min_length=1)
    when: Literal["before_step", "in_flight"] = "before_step"
    reset_prefix_cache: bool = False
    reset_running_requests: bool = False
    reset_connector: bool = False
    pause: bool = False
    mode: Literal["abort", "keep", "wait"] | None = None
    resume: bool = False
    #: a fault injected into a rank process (:class:`RankFault`; ``level: engine-core`` with
    #: ``distributed_executor_backend: mp``)
    fault: RankFault | None = None

    @model_validator(mode="after")
    def _one_action(self):
        actions = [k for k in ("abort", "reset_prefix_cache", "pause", "resume", "fault")
                   if getattr(self, k)]
        if len(actions) != 1:
            raise ValueError("an event does exactly one of abort: [ids], reset_prefix_cache: true, "
                             f"pause: true, resume: true, fault: {{...}} (this one: "
                             f"{actions or 'none'})")
        if self.when == "in_flight" and not self.abort:
            raise ValueError("`when: in_flight` applies to abort only")
        if self.mode is not None and not self.pause:
            raise ValueError("`mode` goes with pause: true (EngineCore.pause_scheduler's mode)")
        if self.reset_running_requests and not self.reset_prefix_cache:
            raise ValueError("`reset_running_requests` goes with reset_prefix_cache: true")
        if self.reset_connector and not self.reset_prefix_cache:
            raise ValueError("`reset_connector` goes with reset_prefix_cache: true "
                             "(EngineCore.reset_prefix_cache(reset_connector=True))")
        return self


class SpecDecode(Strict):
    """What the fake model does with draft tokens (spec decode), per request.

    ``accept``: request id -> how many of the scheduled drafts the model accepts: one count for
    every step (``{H: 1}``), or a list, one count per step in which the request's drafts are
    verified, in order (``{A: [2, 0, 1]}``: 2 at its first verification, none at the second, 1
    at the third; all of them after the list). A count over the drafts scheduled accepts them
    all. ``propose``: request id -> how many drafts the drafter proposes after each step in
    which the request sampled, in order (``{A: [2, 0, 3]}``; 0: no drafts that step, as an
    n-gram drafter that finds no match; after the list, ``model.draft_tokens`` in full), each
    at most ``config.num_speculative_tokens``. ``drafter_skipped_at``: steps after whose
    forward pass the drafter does not run (the model runner's ``input_fits_in_drafter`` is
    false). Where the runner makes that test inline (0.11 to 0.22) the steps stand for it and
    the runner hands the scheduler no draft token ids there; where the release's own
    ``GPUModelRunner._input_fits_in_drafter`` decides (0.24 to 0.33, model-based drafters) its
    answer is used and each listed step is checked against it (a disagreement is exit 2);
    where the runner never skips (0.10.x, 0.34's V2 runner) they do not apply
    (``engine/drafter.py:check_scripted_skips``)."""

    accept: dict[str, int | list[int]] = Field(default_factory=dict)
    propose: dict[str, list[int]] = Field(default_factory=dict)
    drafter_skipped_at: list[PosInt] = Field(default_factory=list, max_length=10_000)

    @field_validator("accept", "propose", mode="before")
    @classmethod
    def _counts(cls, v, info):
        # checked here rather than by a union of types, whose errors name pydantic's branches
        if not isinstance(v, dict):
            return v
        for rid, counts in v.items():
            one = isinstance(counts, int) and not isinstance(counts, bool)
            if info.field_name == "propose" and one:
                raise ValueError(f"{rid}: give a list of counts, one per step ([2, 0, 1])")
            seq = counts if isinstance(counts, list) else [counts]
            if (not seq or any(not isinstance(n, int) or isinstance(n, bool) or n < 0
                               for n in seq)):
                raise ValueError(f"{rid}: give a count >= 0 for every step, or a non-empty "
                                 f"list of counts >= 0 ([2, 0, 1]); got {counts!r}")
        return v


class ModelBehaviour(Strict):
    """What the fake model runner emits (what the GPU would compute).

    ``token``: the token id sampled each step (``tokens``: a scripted list per request).
    Structured-output requests sample through the step's grammar bitmask: ``token`` (or the
    scripted token) where the bitmask allows it, else EOS where allowed, else the highest
    allowed token id (a bitmask that allows nothing gives token 0, what ``argmax`` over all
    ``-inf`` logits gives). ``eos_at``: request id -> the output length at
    which the model emits EOS (the request then finishes as stopped). ``empty_at``: request id ->
    steps at which the model returns no sampled token for that request although it was scheduled
    (what a preempted or aborted request looks like to the runner).
    """

    token: TokenId = 100
    #: request id -> the token ids the model prefers, one per output position (then ``token``);
    #: for a structured-output request the grammar's bitmask is applied as the GPU sampler
    #: applies it: a scripted token the bitmask forbids gives way to the allowed choice
    tokens: dict[str, list[TokenId]] = Field(default_factory=dict)
    eos_at: dict[str, PosInt] = Field(default_factory=dict)
    empty_at: dict[str, list[PosInt]] = Field(default_factory=dict)
    draft_tokens: list[TokenId] | None = None
    spec_decode: SpecDecode | None = None


class Platform(Strict):
    """The platform vLLM sees (``vllm.platforms.current_platform``), emulated at vLLM's platform
    seam (``engine/adapter/platform.py``, which lists the hooks): ``cuda`` by default, the GPU
    deployment being debugged, so that config rules (block sizes, async scheduling, spec-decode
    methods, defaults in ``check_and_update_config``) are the GPU's; ``cpu`` runs vLLM's own
    ``CpuPlatform`` with its rules. ``capability``: the CUDA compute capability the emulated
    device reports (``"9.0"``: Hopper, ``"8.0"``: Ampere, ``"10.0"``: Blackwell);
    ``device_name``; ``total_memory_gib``: what ``get_device_total_memory`` reports (GiB)."""

    name: Literal["cuda", "cpu"] = "cuda"
    capability: str = Field(default="9.0", pattern=r"^[0-9]{1,2}\.[0-9]$")
    device_name: str = Field(default="NVIDIA H100 80GB HBM3", min_length=1, max_length=80)
    total_memory_gib: float = Field(default=80.0, gt=0, le=4096)

    @field_validator("capability", mode="before")
    @classmethod
    def _capability_text(cls, v):
        # YAML reads `capability: 9.0` as a float; the compute capability is MAJOR.MINOR text
        return f"{v:.1f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    def key(self) -> str:
        """The JSON the worker reads (``VLLM_REPRO_PLATFORM``); also what groups runs into
        workers (a worker presents one platform: vLLM's modules bind it at import)."""
        import json

        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


class KVConnectorScript(Strict):
    """What the scripted KV connector does for one request (``level: engine-core``; vLLM's own
    names for the connector's calls, ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

    ``external_hit_tokens``: the prompt tokens the external KV cache holds; the connector's
    ``get_num_new_matched_tokens`` answers those beyond the local prefix hit. ``load_async``:
    the load runs asynchronously (the request waits in ``WAITING_FOR_REMOTE_KVS``) and the
    worker reports it in ``finished_recving`` at step ``recv_done_at_step`` (default: the step
    the load starts; never earlier). ``load_fails``: the first load of the request fails (its
    blocks in ``invalid_block_ids``, the request in ``failed_recving``, where the release's
    ``KVConnectorOutput`` has them). ``delay_free``: ``request_finished`` returns True (the
    connector keeps the blocks, as a prefill instance does for the decode side to read) and
    the worker reports ``finished_sending`` at step ``send_done_at_step`` (default: the step the
    worker learns of the send; never earlier). ``delay_free_on_abort``: the same for the
    request aborted (a connector whose save of it is already under way when the abort comes);
    without it an aborted request is freed at once, as NixlConnector does.
    ``load_fails_groups``: the KV cache groups (indices into ``config.kv_cache_groups``) whose
    blocks the failed load reports in ``invalid_block_ids`` (default: every group it wrote;
    ``[]``: none, the request only in ``failed_recving``). ``not_ready_lookups``: the first N
    lookups of the request answer ``None`` ("not yet": vLLM skips the request that step and
    asks again), at most ``limits.max_steps``."""

    external_hit_tokens: NonNegInt = 0
    load_async: bool = False
    recv_done_at_step: PosInt | None = None
    load_fails: bool = False
    load_fails_groups: list[NonNegInt] | None = None
    delay_free: bool = False
    delay_free_on_abort: bool = False
    send_done_at_step: PosInt | None = None
    not_ready_lookups: NonNegInt = 0
    #: vLLM's OffloadingConnector: each store job of the request is done this many steps after
    #: the worker learns of it (instead of at ``send_done_at_step``), at most limits.max_steps
    store_steps: NonNegInt | None = None


class KVChildConnector(Strict):
    """One child of vLLM's ``MultiConnector`` (``kv_transfer_config.connectors[i]``): the lab's
    scripted connector with its own script (``requests``, as :class:`KVTransferConfig`'s)."""

    kv_connector: Literal["ScriptedConnector"] = "ScriptedConnector"
    requests: dict[str, KVConnectorScript] = Field(default_factory=dict)


class KVTransferConfig(Strict):
    """vLLM's ``kv_transfer_config`` (``KVTransferConfig``), with the lab's scripted connector:
    ``kv_connector`` (``ScriptedConnector``, registered with the release's
    ``KVConnectorFactory``), ``kv_role`` (vLLM's: ``kv_both``, ``kv_producer``,
    ``kv_consumer``), ``supports_hma`` (the scripted connector declares vLLM's ``SupportsHMA``,
    so the release keeps hybrid KV cache groups and calls ``request_finished_all_groups``) and
    ``requests``: request id -> :class:`KVConnectorScript` (a request without an entry gets no
    external hit and is freed at once)."""

    kv_connector: Literal["ScriptedConnector", "NixlConnector", "OffloadingConnector",
                          "MultiConnector"] = "ScriptedConnector"
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"
    supports_hma: bool = False
    #: vLLM's own ``kv_connector_extra_config`` for vLLM's own connector, handed over as written
    #: (OffloadingConnector: ``cpu_bytes_to_use``, ``block_size`` / ``blocks_per_chunk``,
    #: ``eviction_policy``, ...): at most 16 keys of plain values, numbers at most 2**40
    kv_connector_extra_config: dict[str, int | float | str | bool] | None = None
    requests: dict[str, KVConnectorScript] = Field(default_factory=dict)
    #: ``kv_connector: MultiConnector``: its children, in order (vLLM's
    #: ``kv_connector_extra_config.connectors``), 1 to 4 scripted connectors, each with its
    #: own script; vLLM's MultiConnector loads from the first child with a hit and saves to all
    connectors: list[KVChildConnector] | None = Field(default=None, min_length=1, max_length=4)

    def scripts(self) -> list[tuple[str, dict[str, KVConnectorScript]]]:
        """``(field path, script)`` of every scripted connector: the children of a
        MultiConnector, else this connector's own ``requests``."""
        if self.connectors:
            return [(f"kv_transfer_config.connectors[{i}].requests", c.requests)
                    for i, c in enumerate(self.connectors)]
        return [("kv_transfer_config.requests", self.requests)]

    @model_validator(mode="after")
    def _consistent(self):
        if self.kv_connector == "MultiConnector":
            if not self.connectors:
                raise ValueError("kv_transfer_config.connectors: MultiConnector needs its "
                                 "children; add e.g. `connectors: [{requests: {...}}, "
                                 "{requests: {...}}]`")
            if self.requests:
                raise ValueError("kv_transfer_config.requests: with MultiConnector each child "
                                 "has its own script; move it into connectors[i].requests")
        elif self.connectors is not None:
            raise ValueError("kv_transfer_config.connectors: only MultiConnector has children;"
                             " set kv_connector: MultiConnector or drop connectors")
        for prefix, script in self.scripts():
            self._check_script(prefix, script, scripted=self.kv_connector in (
                "ScriptedConnector", "MultiConnector"))
        return self._check_rest()

    def _check_script(self, prefix: str, script: dict, scripted: bool) -> None:
        for rid, e in script.items():
            where = f"{prefix}.{rid}"
            if e.store_steps is not None and self.kv_connector != "OffloadingConnector":
                raise ValueError(f"{where}.store_steps: times OffloadingConnector's store jobs;"
                                 " set kv_connector: OffloadingConnector or drop it")
            if e.store_steps is not None and e.send_done_at_step is not None:
                raise ValueError(f"{where}.store_steps: give it or send_done_at_step, not both")
            if not scripted:
                # vLLM's own connector decides hits, async loads and delayed frees from the
                # request's kv_transfer_params; only its worker half is scripted
                for key in ("external_hit_tokens", "load_async", "load_fails", "delay_free",
                            "delay_free_on_abort", "load_fails_groups", "not_ready_lookups"):
                    if getattr(e, key):
                        raise ValueError(
                            f"{where}.{key}: {self.kv_connector}'s scheduler half (vLLM's own) "
                            "decides this from the request's kv_transfer_params; give "
                            "requests[].kv_transfer_params instead, and here only "
                            "recv_done_at_step / send_done_at_step (its worker half's reports)")
                continue
            if e.load_fails_groups is not None and not e.load_fails:
                raise ValueError(f"{where}.load_fails_groups: goes with load_fails: true (no "
                                 "load of this request fails otherwise)")
            if not e.external_hit_tokens:
                for key in ("load_async", "recv_done_at_step", "load_fails"):
                    if getattr(e, key):
                        raise ValueError(f"{where}.{key}: needs `external_hit_tokens: N` (N > 0):"
                                         " without an external hit nothing is loaded")
            if e.recv_done_at_step is not None and not e.load_async:
                raise ValueError(f"{where}.recv_done_at_step: goes with load_async: true (a "
                                 "synchronous load finishes inside its step)")
            if e.send_done_at_step is not None and not (e.delay_free or e.delay_free_on_abort):
                raise ValueError(f"{where}.send_done_at_step: goes with delay_free: true or "
                                 "delay_free_on_abort: true (nothing is sent otherwise)")

    def _check_rest(self):
        extra = self.kv_connector_extra_config
        if extra is not None:
            if self.kv_connector in ("ScriptedConnector", "MultiConnector"):
                raise ValueError("kv_transfer_config.kv_connector_extra_config: the scripted "
                                 "connector reads only `requests`; drop it, or name one of "
                                 "vLLM's own connectors in kv_connector")
            if len(extra) > 16:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config: {len(extra)} "
                                 "keys, over the lab's 16; give only what the connector reads")
            for key, value in extra.items():
                if key in NUMERIC_EXTRA_KEYS and (isinstance(value, bool) or
                                                  not isinstance(value, (int, float))):
                    raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key}: "
                                     f"{value!r} is not a number (vLLM's connector does "
                                     "arithmetic with it); give a plain number, e.g. "
                                     f"`{key}: 100000000`")
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and not 0 <= value <= 2 ** 40:
                    raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key}: "
                                     f"{value} is outside 0..2**40; give a number in that "
                                     "range")
                if isinstance(value, str) and len(value) > 200:
                    raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key}: "
                                     "over 200 characters; give a shorter value")
        if self.kv_connector == "OffloadingConnector" and not (extra or {}).get(
                "cpu_bytes_to_use"):
            raise ValueError("kv_transfer_config.kv_connector_extra_config.cpu_bytes_to_use: "
                             "OffloadingConnector's CPU spec needs the CPU cache's size in bytes"
                             " (vLLM's own key); add e.g. `kv_connector_extra_config: "
                             "{cpu_bytes_to_use: 1000000}`")
        if self.supports_hma and self.kv_connector not in ("ScriptedConnector",
                                                           "MultiConnector"):
            raise ValueError(f"kv_transfer_config.supports_hma: {self.kv_connector} declares "
                             "its own HMA support (vLLM's class decides); drop supports_hma")
        return self


#: ``kv_connector_extra_config`` keys vLLM's offloading connectors read as numbers
#: (``vllm/v1/kv_offload/``: sizes, chunk sizes, thresholds): a string there would reach vLLM and
#: fail as if it were the release's crash
NUMERIC_EXTRA_KEYS = frozenset({"cpu_bytes_to_use", "num_cpu_blocks", "block_size",
                                "blocks_per_chunk", "store_threshold", "max_tracker_size",
                                "sync_load_budget_bytes", "tier_poll_interval_s"})


class Limits(Strict):
    """``max_steps``: stop after this many steps; ``stall_steps``: this many steps with no
    progress while requests are unfinished is a stall; ``step_timeout_s``: a step (or the
    engine's start-up) that has not returned after this many seconds ends the run as ``hang``
    (the watchdog; default ``VLLM_REPRO_STEP_TIMEOUT_S``, 300 s; at most an hour)."""

    max_steps: PosInt = 500
    stall_steps: PosInt = 20
    step_timeout_s: Annotated[float, Field(gt=0, le=3600)] | None = None


class StepExpect(Strict):
    """What the scheduler decided at step ``at_step`` (``expect.steps``; docs/scenarios.md):
    ``scheduled`` (request id -> the exact tokens scheduled), ``not_scheduled``, ``preempted``
    (in that step; by ``preempted_by`` where given), ``not_preempted``, ``finished`` (request id
    -> ``length``, ``stop``, ``abort``, ``ignored`` or vLLM's ``FINISHED_*`` name), ``drafts``
    (request id -> draft tokens scheduled), ``sampled`` (structured-output requests: request id
    -> the exact token ids sampled through the grammar bitmask, the trace's ``sampled``),
    ``reasoning_ended`` (with ``config.reasoning_parser``: request id -> the release's
    ``reasoning_ended`` after the step). Judged by :mod:`vllm_repro.decisions`."""

    at_step: PosInt
    scheduled: dict[str, NonNegInt] | None = None
    not_scheduled: list[str] | None = None
    preempted: list[str] | None = None
    preempted_by: Literal["schedule", "reset_prefix_cache", "pause"] | None = None
    not_preempted: list[str] | None = None
    finished: dict[str, str] | None = None
    drafts: dict[str, NonNegInt] | None = None
    sampled: dict[str, list[TokenId]] | None = None
    reasoning_ended: dict[str, bool] | None = None

    @model_validator(mode="after")
    def _something(self):
        given = [k for k in ("scheduled", "not_scheduled", "preempted", "not_preempted",
                             "finished", "drafts", "sampled", "reasoning_ended")
                 if getattr(self, k) is not None]
        if not given:
            raise ValueError(f"step {self.at_step}: say what to check (scheduled, not_scheduled, "
                             "preempted, not_preempted, finished, drafts, sampled, "
                             "reasoning_ended)")
        if self.preempted_by and not self.preempted:
            raise ValueError("`preempted_by` goes with `preempted: [ids]`")
        from ..decisions import FINISH_NAMES

        for rid, how in (self.finished or {}).items():
            if how.lower() not in FINISH_NAMES and not re.fullmatch(r"FINISHED_[A-Z_]+", how):
                raise ValueError(f"finished.{rid}: {how!r} is no finish; use one of "
                                 f"{', '.join(FINISH_NAMES)} or vLLM's FINISHED_* name")
        return self

    def request_ids(self) -> set[str]:
        """Every request id it names."""
        return {*(self.scheduled or {}), *(self.not_scheduled or ()), *(self.preempted or ()),
                *(self.not_preempted or ()), *(self.finished or {}), *(self.drafts or {}),
                *(self.sampled or {}), *(self.reasoning_ended or {})}


class StatsExpect(Strict):
    """The release's own ``SchedulerStats`` (``expect.stats``): ``at_step`` (none: over the
    run, counters summed), and any other key a stat's dotted name (``prefix_cache_stats.hits``,
    ``num_running_reqs``, ``spec_decoding_stats.num_accepted_tokens``) with a number (equal)
    or a comparison (``">= 1"``, ``"< 0.5"``, ``"!= 0"``). Judged by
    :mod:`vllm_repro.decisions`."""

    model_config = ConfigDict(extra="allow", frozen=False, strict=True, allow_inf_nan=False)

    at_step: PosInt | None = None

    @model_validator(mode="after")
    def _stats(self):
        from ..decisions import COMPARISON

        if not self.model_extra:
            raise ValueError("name at least one stat (e.g. prefix_cache_stats.hits: 0)")
        for key, value in self.model_extra.items():
            if not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z0-9_]+){0,3}", key):
                raise ValueError(f"{key!r} is not a SchedulerStats field name (dotted: "
                                 "prefix_cache_stats.hits)")
            if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (
                    isinstance(value, str) and not COMPARISON.match(value)):
                raise ValueError(f"{key}: give a number or a comparison such as '>= 1' "
                                 f"(got {value!r})")
        return self

    def values(self) -> dict:
        """Stat name -> expected number or comparison."""
        return dict(self.model_extra or {})


class Expect(Strict):
    """What the buggy releases (``reproduces_on``) show (``fixed``: the fixed ones). ``outcome:
    refused``: vLLM refuses the configuration or a request (``exception``, ``message``,
    ``where``, ``phase``: ``config``, ``engine-build`` or ``add_request``, matched as a crash's);
    ``outcome: hang``: a step that did not return within the watchdog's time (``where``: the
    frame vLLM's thread sat in; ``message``: searched in the threads' stacks). ``where`` is a
    vLLM file, optionally with ``:function`` (``vllm/v1/core/sched/scheduler.py:schedule``),
    matched against the innermost vLLM frame; ``code`` a violation code; ``mechanism`` which of the code's ways
    (:data:`vllm_repro.records.MECHANISMS`, e.g. ``KV_PREFIX_MAP``'s ``fresh-block``), matched
    against :attr:`~vllm_repro.records.Violation.mechanism`; ``message`` a regular expression;
    ``step`` exact. Raises ``ValueError`` (a schema error naming the field) for a field that does
    not apply to ``outcome``, a ``mechanism`` without ``code`` or not one of the code's, and a
    ``message`` that is no regular expression."""

    outcome: Outcome
    exception: str | None = None
    where: str | None = None
    message: str | None = None
    code: str | None = None
    #: which of ``code``'s ways the violation came about (``outcome: violation`` with ``code``)
    mechanism: str | None = None
    step: PosInt | None = None
    #: where the crash happened: ``engine-build`` (vLLM's start-up: config checks, KV cache
    #: sizing), ``add_request``, ``schedule``, ``update_from_output``, ``step`` ...
    phase: str | None = None
    #: the kind of rank fault (``events[].fault``) that must have fired in the run
    fault: Literal["hang", "late", "raise", "exit"] | None = None
    #: what the scheduler decided at given steps (a wrong decision, no crash): on a release
    #: with ``clean_on`` and no ``fixed.steps``, they must not all hold
    steps: list[StepExpect] | None = Field(default=None, min_length=1, max_length=200)
    #: the release's own SchedulerStats, at a step or over the run (likewise)
    stats: list[StatsExpect] | None = Field(default=None, min_length=1, max_length=50)

    @model_validator(mode="before")
    @classmethod
    def _violation_fields(cls, data):
        """``code`` and ``mechanism`` apply to ``outcome: violation`` only: said once, naming
        every one of them given, so that the fix it gives is the whole fix."""
        if isinstance(data, dict) and data.get("outcome") not in (None, "violation"):
            given = [k for k in ("code", "mechanism") if data.get(k) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} only appl{'y' if len(given) > 1 else 'ies'}"
                                 f" to outcome: violation (this one expects {data['outcome']}); "
                                 f"drop {' and '.join(given)}, or set outcome: violation")
        return data

    @model_validator(mode="after")
    def _consistent(self):
        if self.outcome not in ("crash", "refused") and self.exception:
            raise ValueError("`exception` only applies to outcome: crash or refused")
        if self.outcome not in ("crash", "refused", "hang") and (self.where or self.phase):
            raise ValueError("`where` and `phase` only apply to outcome: crash, refused or hang")
        if self.message:
            try:
                re.compile(self.message)
            except re.error as exc:
                raise ValueError(f"`message` is not a valid regular expression: {exc}") from exc
        return self

    @field_validator("code", mode="before")
    @classmethod
    def _a_violation_code(cls, code):
        """``code`` is one of the audit's codes (:data:`vllm_repro.audit.codes.CODES`): a
        misspelt code would otherwise only show as a failed reproduction. Anything YAML read as
        no string is answered with the codes. (That it applies to ``outcome: violation`` only
        is :meth:`_violation_fields`'.)"""
        from ..audit.codes import CODES

        if code is None:
            return code
        if not isinstance(code, str):
            raise ValueError(f"{yaml_word(code)} is no violation code; use one of "
                             f"{', '.join(CODES)} (docs/audit.md)")
        if code in CODES:
            return code
        near = code.upper() if code.upper() in CODES else close_field(code, CODES, cutoff=0.6)
        raise ValueError(f"{code!r} is no violation code of the audit"
                         + (f"; did you mean {near}?" if near else
                            f"; use one of {', '.join(CODES)} (docs/audit.md)"))

    @field_validator("mechanism", mode="before")
    @classmethod
    def _a_tag(cls, mechanism, info):
        """A ``mechanism`` that YAML read as no string (``3``, ``true``) is refused with the
        tags themselves, not a hint to quote it."""
        if mechanism is None or isinstance(mechanism, str):
            return mechanism
        from ..records import MECHANISMS

        known = MECHANISMS.get(info.data.get("code") or "") or \
            tuple(t for tags in MECHANISMS.values() for t in tags)
        raise ValueError(f"{yaml_word(mechanism)} is no mechanism tag; use one of "
                         f"{', '.join(known)}")

    @field_validator("mechanism")
    @classmethod
    def _one_of_the_codes_ways(cls, mechanism: str | None, info):
        """``mechanism`` names one of ``code``'s ways (:data:`~vllm_repro.records.MECHANISMS`);
        ``outcome`` and ``code`` are validated before it (declared first)."""
        from ..records import MECHANISMS

        if mechanism is None:
            return mechanism
        if "code" not in info.data:  # (the code itself was refused: that error says why)
            return mechanism
        code = info.data.get("code")
        if not code:
            owners = [c for c, tags in MECHANISMS.items() if mechanism in tags] or list(MECHANISMS)
            raise ValueError("needs the violation's code: add code "
                             f"({' or '.join(owners)}) or drop mechanism")
        known = MECHANISMS.get(code)
        if not known:
            raise ValueError(f"the audit tells no mechanisms of {code} apart (only of "
                             f"{', '.join(MECHANISMS)}); drop mechanism")
        if mechanism not in known:
            near = mechanism.strip().lower() if mechanism.strip().lower() in known \
                else close_field(mechanism, known, cutoff=0.6)
            raise ValueError(f"{mechanism!r} is not one of {code}'s: {', '.join(known)}"
                             + (f"; did you mean {near}?" if near else "; use one of them"))
        return mechanism


#: what a scenario may not be named: the lab's own entries in a reports folder (the index page,
#: the engine logs, the docs site, triage's drafts, verify's bundles, the test report)
RESERVED_NAMES = frozenset({"index.html", "_engine", "site", "triage", "verify", "junit.xml"})
#: a scenario's name is a folder name; with the staging suffix it must stay under NAME_MAX (255)
MAX_NAME_CHARS = 120


class Scenario(Strict):
    """A whole scenario file (format v1). See docs/scenarios.md for the format."""

    name: str = Field(min_length=1)
    #: at most 65,536 characters (the lab's limit; the catalog's longest is about 2,100): an
    #: 8 MB description took a run from 4 s to 48 s, carried to the worker and into the report
    description: str = Field(default="", max_length=65_536)
    vllm: VllmRefs = Field(default_factory=VllmRefs)
    #: ``scheduler``: the release's Scheduler driven step by step as ``EngineCore.step`` does;
    #: ``engine-core``: the release's own ``EngineCore`` built and driven with a fake executor
    #: ``v0-engine``: the release's V0 ``LLMEngine`` (0.4 to 0.10) with a fake V0 executor
    level: Literal["scheduler", "engine-core", "v0-engine"] = "scheduler"
    config: SchedulerSettings
    requests: list[RequestSpec] = Field(min_length=1)
    #: at most MAX_EVENTS (the lab's limit): 100,000 events loaded for 12 s and ran past a
    #: minute (the catalog's stress workloads have about 20)
    events: list[Event] = Field(default_factory=list, max_length=MAX_EVENTS)
    model: ModelBehaviour = Field(default_factory=ModelBehaviour)
    limits: Limits = Field(default_factory=Limits)
    #: the platform vLLM sees: the GPU deployment's (CUDA, emulated) unless the scenario says
    platform: Platform = Field(default_factory=Platform)
    #: vLLM's KV transfer config with the lab's scripted connector (``level: engine-core``)
    kv_transfer_config: KVTransferConfig | None = None
    expect: Expect | None = None
    #: what the fixed releases (``clean_on``) must do; default: run clean. E.g. the fix refuses the
    #: config at start-up: ``{outcome: crash, phase: engine-build, exception: ValueError}``
    fixed: Expect | None = None
    #: the file's text as the lab read it (set by ``load_scenario``; the report's scenario.yaml)
    _source_text: str | None = PrivateAttr(default=None)

    @property
    def source_text(self) -> str | None:
        """The scenario file's text as read, or ``None`` for a scenario not read from a file."""
        return self._source_text

    #: the file it was read from, as given (set by ``load_scenario``)
    _source_path: str | None = PrivateAttr(default=None)

    @property
    def source_path(self) -> str | None:
        """The scenario file's path as given (``scenarios/x.yaml``), or ``None`` for a scenario
        not read from a file (a matrix mode's overlay, a fuzzer's draw): where an input error
        found at run time (a config field the release lacks) is said to be."""
        return self._source_path

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v in RESERVED_NAMES:
            raise ValueError(f"{v!r} is a name the lab uses inside the reports folder "
                             f"({', '.join(sorted(RESERVED_NAMES))}); rename the scenario")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError("names start with a letter or digit and use letters, digits and "
                             "_ . - (they become report folders)")
        if len(v) > MAX_NAME_CHARS:
            raise ValueError(f"{len(v)} characters, over {MAX_NAME_CHARS} (it becomes a report "
                             "folder name); shorten it")
        return v

    def _check_data_parallel(self, dp: int) -> None:
        """What the lab's data parallelism does not run yet, refused before any run (exit 2,
        naming the field): ranks under each DP rank (its fake workers would answer the other
        rank's requests), events (not sent through the DP client), requests whose front door
        answers through the engine core process (structured outputs, allowed_token_ids), a DP
        rank off this host (``data_parallel_size_local``) and a DP address off loopback."""
        extra = self.config.model_extra or {}
        where = f"config.data_parallel_size: {dp}"
        if not self.config.asyncio_mode:
            raise ValueError(f"{where}: data parallelism runs an engine core process per DP "
                             "rank (the release's DPEngineCoreProc) behind vLLM's asyncio client "
                             "(make_async_mp_client: DPLBAsyncMPClient); add "
                             "config.multiprocess_mode: true and config.asyncio_mode: true")
        for key, fix in (("data_parallel_external_lb", "every DP rank runs behind the lab's one "
                          "client (rank 0's)"),
                         ("data_parallel_rank", "the lab starts every DP rank from rank 0's "
                          "client"),
                         ("data_parallel_backend", "only vLLM's own multiprocessing backend "
                          "('mp') runs here (Ray is not in the lab's release environments)")):
            value = extra.get(key)
            if value not in (None, False, 0, "mp"):
                shown = str(value).lower() if isinstance(value, bool) else repr(value)
                raise ValueError(f"config.{key}: {shown} with {where}: {fix}; drop it")
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if isinstance(extra.get(key), int) and extra[key] > 1:
                raise ValueError(f"{where} with config.{key}: {extra[key]}: rank processes under "
                                 "each DP rank are not built yet; drop one of them")
        if self.events:
            raise ValueError(f"{where}: events are not sent through the DP client yet; drop "
                             "events")
        for i, r in enumerate(self.requests):
            for field in ("structured_outputs", "allowed_token_ids"):
                if getattr(r, field, None) is not None:
                    raise ValueError(f"requests[{i}].{field} with {where}: the front door of a "
                                     "DP run does not judge it yet; drop it or "
                                     "data_parallel_size")
        local = extra.get("data_parallel_size_local")
        if local is not None and local != dp:
            raise ValueError(f"config.data_parallel_size_local: {local}: every DP rank runs on "
                             "this host; drop it")
        ip = extra.get("data_parallel_master_ip")
        if ip is not None and ip != "127.0.0.1":
            raise ValueError(f"config.data_parallel_master_ip: {ip!r}: the lab's DP group and "
                             "coordinator stay on 127.0.0.1; drop it")

    @model_validator(mode="after")
    def _cross_checks(self):
        ids: set[str] = set()
        for i, r in enumerate(self.requests):
            if r.id in ids:
                raise ValueError(f"requests[{i}].id: request id {r.id!r} is used twice; give "
                                 "each request an id of its own")
            ids.add(r.id)
            if r.n > 1 and self.level != "v0-engine":
                raise ValueError(
                    f"requests[{i}].n: parallel sampling is driven at level: v0-engine only (its "
                    "LLMEngine fans the request out); at this level write each child as a "
                    "request of its own")
            # prompt_len + max_tokens over max_model_len is vLLM's to take (it caps the output:
            # FINISHED_LENGTH_CAPPED); a prompt over it is refused by the release's own front
            # door (engine/adapter/requests.py:front_door; V0's LLMEngine._validate_model_inputs
            # from 0.8.4, before which it reached the scheduler: vLLM #8881)
        engine_only = {"kv_cache_memory_bytes": self.config.kv_cache_memory_bytes,
                       "max_concurrent_batches": self.config.max_concurrent_batches,
                       "execute_model_timeout_seconds":
                           self.config.execute_model_timeout_seconds,
                       "multiprocess_mode": self.config.multiprocess_mode,
                       "asyncio_mode": self.config.asyncio_mode}
        if self.config.asyncio_mode and not self.config.multiprocess_mode:
            raise ValueError("config.asyncio_mode: true needs config.multiprocess_mode: true (vLLM's "
                             "EngineCoreClient.make_client has no asyncio client in process); add it")
        if self.config.multiprocess_mode and self.platform.name == "cpu":
            raise ValueError("config.multiprocess_mode with platform.name: cpu: vLLM's CPU "
                             "platform spawns the engine core process, which cannot take the "
                             "lab's fake executor with it; drop one of them")
        dp = (self.config.model_extra or {}).get("data_parallel_size")
        if self.level == "engine-core" and isinstance(dp, int) and dp > 1:
            self._check_data_parallel(dp)
            for name, exp in (("expect", self.expect), ("fixed", self.fixed)):
                if exp is not None and (exp.steps or exp.stats):
                    raise ValueError(f"{name}.steps / {name}.stats with config.data_parallel_size "
                                     f"{dp}: each engine core numbers its own steps (trace lines "
                                     "per dp_rank), which they do not name yet; drop them")
        blocks = self.config.num_gpu_blocks
        if self.level != "v0-engine":
            if blocks is not None and blocks < 2:
                raise ValueError(f"config.num_gpu_blocks: {blocks} leaves no block to allocate "
                                 "(block 0 is vLLM's null block); use a value of at least 2 "
                                 "(0 and 1 are for level: v0-engine's start-up checks)")
            if self.config.num_cpu_blocks is not None:
                raise ValueError("config.num_cpu_blocks applies to level: v0-engine (the V0 "
                                 "engine's swap space); drop it or add `level: v0-engine`")
        else:
            if blocks is None:
                raise ValueError("config.num_gpu_blocks is required at level: v0-engine (what "
                                 "the fake worker's determine_num_available_blocks reports)")
            for key, value in engine_only.items():
                if value is not None:
                    fix = ("at level: v0-engine the pool is config.num_gpu_blocks"
                           if key == "kv_cache_memory_bytes" else
                           "drop it, or use `level: engine-core` (the V0 engine has no such "
                           "setting)")
                    raise ValueError(f"config.{key} applies to level: engine-core; {fix}")
        if self.level == "scheduler":
            for key, value in engine_only.items():
                if value is not None:
                    raise ValueError(f"config.{key} applies to level: engine-core (the fake "
                                     "executor reports it); add `level: engine-core`")
            if self.config.num_gpu_blocks is None:
                raise ValueError("config.num_gpu_blocks is required at level: scheduler")
        max_steps = self.limits.max_steps
        for i, r in enumerate(self.requests):
            if r.at_step > max_steps:
                raise ValueError(f"requests[{i}].at_step {r.at_step} is past limits.max_steps "
                                 f"{max_steps}: it would never be added; raise max_steps or "
                                 "move the request earlier")
        for i, e in enumerate(self.events):
            if e.at_step > max_steps:
                raise ValueError(f"events[{i}].at_step {e.at_step} is past limits.max_steps "
                                 f"{max_steps}: it would never happen; raise max_steps or move "
                                 "the event earlier")
            if self.level == "scheduler" and (e.when == "in_flight" or not e.abort):
                raise ValueError(f"events[{i}]: in-flight aborts, reset_prefix_cache and "
                                 "pause/resume are EngineCore calls; add `level: engine-core`")
            if e.fault is not None:
                from ..engine.topology import topology

                topo = topology({"passthrough": self.config.model_extra or {}})
                if not topo.multiprocess:
                    raise ValueError(f"events[{i}].fault: a rank fault needs rank processes; add "
                                     "config.distributed_executor_backend: mp")
                if e.fault.rank >= topo.world_size:
                    raise ValueError(f"events[{i}].fault.rank: {e.fault.rank} is not a rank of "
                                     f"this world ({topo.world_size} ranks: 0 to "
                                     f"{topo.world_size - 1}); use one of them")
            arrives = {r.id: r.at_step for r in self.requests}
            for rid in e.abort or ():
                if rid not in ids:
                    raise ValueError(f"events[{i}].abort: unknown request id {rid!r}"
                                     f"{_id_fix(rid, ids)}")
                if arrives[rid] > e.at_step:
                    # vLLM's abort_requests ignores ids it does not hold: a silent no-op
                    raise ValueError(f"events[{i}].abort: {rid} arrives at step {arrives[rid]}, "
                                     f"after this abort at step {e.at_step}; vLLM ignores an "
                                     "abort of a request it does not hold (a no-op): move the "
                                     f"abort to step {arrives[rid]} or later")
        if self.config.reasoning_parser is not None and self.level != "engine-core":
            raise ValueError("config.reasoning_parser applies to level: engine-core (the "
                             "engine's StructuredOutputManager builds the parser); add `level: "
                             "engine-core`")
        if self.level == "scheduler":
            for i, r in enumerate(self.requests):
                if r.structured_outputs is not None:
                    raise ValueError(
                        f"requests[{i}].structured_outputs: grammars are compiled by the "
                        "engine's StructuredOutputManager and applied by EngineCore.step "
                        "(get_grammar_bitmask); add `level: engine-core`")
        if self.level != "engine-core":
            for i, r in enumerate(self.requests):
                if r.allowed_token_ids is not None:
                    raise ValueError(
                        f"requests[{i}].allowed_token_ids: the release's front door judges them "
                        "per request (its V1 input processor's _validate_params), which the lab "
                        "runs at level engine-core; add `level: engine-core`")
        for key in ("eos_at", "empty_at", "tokens"):
            for rid in getattr(self.model, key):
                if rid not in ids:
                    raise ValueError(f"model.{key}: unknown request id {rid!r}{_id_fix(rid, ids)}")
        for rid, steps in self.model.empty_at.items():
            late = [n for n in steps if n > max_steps]
            if late:
                raise ValueError(f"model.empty_at.{rid}: step {late[0]} is past limits.max_steps "
                                 f"{max_steps}: it would never happen; raise max_steps or drop it")
        if self.model.spec_decode:
            k = self.config.num_speculative_tokens
            for key in ("accept", "propose"):
                for rid in getattr(self.model.spec_decode, key):
                    if rid not in ids:
                        raise ValueError(f"model.spec_decode.{key}: unknown request id {rid!r}; "
                                         "use an id from requests[].id")
            for rid, counts in self.model.spec_decode.propose.items():
                if not k:
                    raise ValueError(f"model.spec_decode.propose.{rid}: spec decode is off (no "
                                     "config.num_speculative_tokens); set it or drop propose")
                over = [n for n in counts if n > k]
                if over:
                    raise ValueError(f"model.spec_decode.propose.{rid}: {over[0]} drafts, over "
                                     f"config.num_speculative_tokens {k} (vLLM's drafter "
                                     "proposes at most that many a step); give at most that many")
            late = [n for n in self.model.spec_decode.drafter_skipped_at if n > max_steps]
            if late:
                raise ValueError(f"model.spec_decode.drafter_skipped_at: step {late[0]} is past "
                                 f"limits.max_steps {max_steps}: it would never happen; raise "
                                 "max_steps or drop it")
        for key in ("expect", "fixed"):
            exp = getattr(self, key)
            for j, st in enumerate((exp.steps or ()) if exp is not None else ()):
                for rid in sorted(st.request_ids()):
                    if rid not in ids:
                        raise ValueError(f"{key}.steps[{j}]: unknown request id {rid!r}"
                                         f"{_id_fix(rid, ids)}")
                if st.at_step > max_steps:
                    raise ValueError(f"{key}.steps[{j}].at_step {st.at_step} is past "
                                     f"limits.max_steps {max_steps}")
        self._check_drafts()
        self._check_kv_transfer()
        self._check_lab_limits()
        return self

    def _check_kv_transfer(self) -> None:
        """The connector script names requests of this scenario, loads at most their prompt,
        and its steps fall inside ``limits.max_steps``; the connector runs at engine-core level
        (the fake worker reports its transfers)."""
        kv = self.kv_transfer_config
        if kv is None:
            for i, r in enumerate(self.requests):
                if r.kv_transfer_params is not None:
                    raise ValueError(f"requests[{i}].kv_transfer_params: no KV connector reads "
                                     "them; add kv_transfer_config (e.g. kv_connector: "
                                     "NixlConnector) or drop kv_transfer_params")
            return
        if self.level != "engine-core":
            raise ValueError("kv_transfer_config: the scripted connector's worker half reports "
                             "through the fake worker's ModelRunnerOutput; add `level: "
                             "engine-core`")
        prompts = {r.id: r.prompt_len for r in self.requests}
        max_steps = self.limits.max_steps
        for prefix, rid, entry in [(p, rid, e) for p, script in kv.scripts()
                                   for rid, e in script.items()]:
            if rid not in prompts:
                near = close_field(rid, prompts, cutoff=0.6)
                raise ValueError(f"{prefix}: unknown request id {rid!r} (no "
                                 "request has it); "
                                 + (f"did you mean {near!r}?" if near else
                                    "use an id from requests[].id or drop the entry"))
            if entry.external_hit_tokens > prompts[rid]:
                raise ValueError(f"{prefix}.{rid}.external_hit_tokens: "
                                 f"{entry.external_hit_tokens} is over its prompt_len "
                                 f"{prompts[rid]} (an external cache holds prompt tokens only);"
                                 " give at most the prompt length")
            groups = len(self.config.kv_cache_groups or ()) or 1
            for g in entry.load_fails_groups or ():
                where = f"{prefix}.{rid}.load_fails_groups"
                if g >= groups:
                    raise ValueError(f"{where}: group {g} is past config.kv_cache_groups "
                                     f"({groups} group(s)); give indices below {groups}")
                if g and not kv.supports_hma:
                    raise ValueError(f"{where}: group {g} needs kv_transfer_config.supports_hma:"
                                     " true (a connector without HMA support makes vLLM turn "
                                     "the hybrid allocator off: one KV cache group)")
            if len(set(entry.load_fails_groups or ())) != len(entry.load_fails_groups or ()):
                raise ValueError(f"{prefix}.{rid}.load_fails_groups: a group"
                                 " is named twice; name each once")
            if (entry.store_steps or 0) > max_steps:
                raise ValueError(f"{prefix}.{rid}.store_steps: {entry.store_steps} is over "
                                 f"limits.max_steps {max_steps}; give fewer")
            if entry.not_ready_lookups > max_steps:
                raise ValueError(f"{prefix}.{rid}.not_ready_lookups: "
                                 f"{entry.not_ready_lookups} is over limits.max_steps "
                                 f"{max_steps} (one lookup a step at most); give fewer")
            for key in ("recv_done_at_step", "send_done_at_step"):
                at = getattr(entry, key)
                if at is not None and at > max_steps:
                    raise ValueError(f"{prefix}.{rid}.{key}: step {at} is "
                                     f"past limits.max_steps {max_steps}: it would never "
                                     "happen; raise max_steps or give an earlier step")

    def _check_drafts(self) -> None:
        """``model.draft_tokens`` are what the drafter proposes after each step: at most
        ``config.num_speculative_tokens`` of them (vLLM's proposer never makes more), and only
        with spec decode on."""
        drafts = self.model.draft_tokens
        if drafts is None:
            return
        k = self.config.num_speculative_tokens
        if not k:
            raise ValueError("model.draft_tokens: spec decode is off (no config.num_speculative_"
                             "tokens), so no drafts are proposed; set num_speculative_tokens or "
                             "drop draft_tokens")
        if len(drafts) > k:
            raise ValueError(f"model.draft_tokens: {len(drafts)} drafts, over config."
                             f"num_speculative_tokens {k} (vLLM's drafter proposes at most that "
                             "many a step); give at most that many")

    def _check_lab_limits(self) -> None:
        """The machine's limits (:mod:`vllm_repro.limits`): the KV pool, the tokens of all
        requests, the steps; refused before any release is prepared."""
        from ..limits import over_limit, run_limits

        lim = run_limits()
        blocks = self.config.num_gpu_blocks
        if blocks is not None and blocks > lim.max_kv_blocks:
            raise ValueError(over_limit("config.num_gpu_blocks", blocks, "max_kv_blocks", lim,
                                        "vLLM's BlockPool makes a Python object per block"))
        tokens = sum(r.prompt_len + r.max_tokens for r in self.requests)
        if tokens > lim.max_tokens:
            raise ValueError(over_limit("requests: prompt_len + max_tokens", tokens, "max_tokens",
                                        lim, "every token is held in Python lists"))
        if self.limits.max_steps > lim.max_steps:
            raise ValueError(over_limit("limits.max_steps", self.limits.max_steps, "max_steps",
                                        lim, "each step writes a trace line"))

    def child_payload(self) -> dict:
        """The plain-JSON form the engine worker receives (no pydantic on that side). The config
        keys that pass through to vLLM's config classes are under ``config["passthrough"]``."""
        data = self.model_dump(mode="json")
        extra = set(self.config.model_extra or {})
        data["config"]["passthrough"] = {k: data["config"].pop(k) for k in sorted(extra)}
        for spec, r in zip(self.requests, data["requests"]):
            # vLLM's own names (``json``), extra parameters included, absent ones left out
            r["structured_outputs"] = (spec.structured_outputs.params()
                                       if spec.structured_outputs is not None else None)
        return data
