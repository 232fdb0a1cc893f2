"""Fuzzing as a hypothesis state machine: the engine's own calls, one scenario per example.

Shape (why this one). The release under test runs in a worker process of its own environment
(:class:`~vllm_repro.engine.host.WorkerHandle`); hypothesis runs here, in the lab's process. A rule of
:class:`ScenarioMachine` does not call vLLM: it *appends one engine call* to the scenario being
built, in the scenario format's own terms (a request of ``requests:``, an ``events:`` entry, an
entry of ``model:``), at the step the machine has reached; the ``step`` rule lets the engine
run steps before the next call. At ``teardown`` the finished scenario is run once, in the worker,
by the lab's real engine loops (level ``scheduler``: ``engine/loop.py:StepLoop``, the release's
``Scheduler`` or ``AsyncScheduler`` stepped as ``EngineCore.step`` does; level
``engine-core``: ``engine/core_loop.py:EngineCoreLoop``, the release's own ``EngineCore``), under
the audit; the check (``check``) raises when the run fails with the campaign's signature. So

- vLLM's side is exactly what ``vllm-repro run`` runs (no call is replayed by the lab's own
  code), and a failure *is* a scenario: it is written as the same YAML and pytest regression,
  and replays with ``vllm-repro run``;
- shrinking works over the sequence of calls: hypothesis drops rules (a request, an abort, a
  reset, a step of waiting), shortens ``step`` gaps and simplifies each call's arguments, and
  every candidate is again a whole scenario judged by the same signature;
- one worker run per example (not one per rule) keeps the cost of an example one scenario run:
  vLLM's engine cannot be forked or rewound, so running the prefix again for every rule would
  multiply it by the number of rules.

Preconditions come from the release's :class:`~vllm_repro.engine.capabilities.Capabilities`
(the record the worker probed at start-up): no empty output where a ``ModelRunnerOutput`` holds
one token per request, no ``reset_prefix_cache`` / ``pause`` / in-flight abort where
``EngineCore`` lacks the call, no grammar request without V1 structured outputs and a backend
library, no KV connector script without the release's connector seam (``kv_connectors``) and
no failed load where its ``KVConnectorOutput`` reports none, hybrid KV cache groups only of the
kinds the release defines (``kv_group_kinds``), and only the level's own calls (engine-core
events, grammars and connectors need ``level: engine-core``, as the scenario format says). The
rules are the same class for every release, so an example stored in the database replays on
another release as the same sequence of calls (a call the release lacks is skipped by its
precondition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, multiple,
                                 precondition, rule)

from .strategies import MAX_MODEL_LEN, Profile, base_config

#: bump when a rule's meaning changes: the database's stored examples (keyed by it) would
#: replay as other scenarios
MACHINE_VERSION = 7

#: a V0 request's parallel samples (``SamplingParams.n``): half the requests one, else 2 or 3
PARALLEL = st.sampled_from([1, 1, 2, 3])
#: whether a V0 request's prompt is over max_model_len: one in eight
OVER_LENGTH = st.sampled_from([False] * 7 + [True])
#: the last step a call may land at (the machine's cursor); runs stop at ``limits.max_steps``
MAX_CALL_STEP = 40
#: constraints a grammar request draws from (the ``structured_outputs`` kinds of the scenario
#: format: regex, choice, JSON schema, EBNF grammar, json_object), plain ones and edge cases
#: users send: an empty grammar, a draft-2019 tuple-style ``items`` schema, a schema with
#: nothing in it, a choice list with an empty string
GRAMMARS: tuple[dict, ...] = (
    {"regex": "t4(t5)*"},
    {"choice": ["yes", "no"]},
    {"json": {"type": "object"}},
    {"json_object": True},
    {"grammar": 'root ::= "a" | "b"'},
    {"grammar": ""},
    {"json": {"type": "array", "items": [{"type": "string"}]}},
    {"json": {}},
    {"choice": ["", "x"]},
)


#: how many of a request's drafts the model accepts each step, drawn with the request where
#: spec decode is on (None: all of them, the fake model's default). An n-gram drafter's drafts
#: are mostly rejected, and a rejected frame is what vLLM's async accounting must undo (#46066:
#: num_rejected of a frame pending discard). Drawn with the request (it was a rule of its
#: own, ``accept_drafts``, until machine version 5: a request's drafts were rejected in one
#: example of four on 0.24.0)
ACCEPTS = st.sampled_from([None, 0, 0, 1])


#: where a drawn prompt length lands against the KV block size: anywhere (None), a whole number
#: of blocks (``block``: the boundaries prefix caching, Mamba's aligned state and the connectors'
#: hits fall on), or one token past a whole number (``past``: the length at which a prefix-cache
#: hit, which vLLM caps at the prompt less one token, covers every full block and leaves exactly
#: one token to compute, the boundary of that cap; until machine version 6 only ``block`` was
#: drawn, so the one-past length came only from a continuation with one new token)
BOUNDARY = st.sampled_from([None, "block", "block", "past"])


#: whether a request's prompt is drawn from the profile's long range (prefilled in chunks
#: over several steps) rather than its short one: one request in three. One in two (until
#: machine version 6) left most requests of small-budget examples prefilling for most of the
#: run: of the requests that two running resets met in 0.24.0's spec-decode examples, 55 %
#: needed more than one step to be prefilled again after a preemption, where a call that lands
#: while requests decode (a reset, an abort mid-generation, a preemption) meets a request still
#: prefilling
LONG = st.sampled_from([False, False, True])


#: how many calls (rules) an example makes after ``build_engine``: None for as many as
#: hypothesis draws (``STATEFUL_STEPS`` in the search), or a few. Every example otherwise runs
#: the full count of calls, and each call can end the run's interesting part early (an abort,
#: a pause that aborts, an EOS, a connector's load that a reset then refuses): a bug whose
#: shape is a handful of calls (#46066: one request and two resets) was drawn among
#: two dozen others in 10 of 215 examples on 0.24.0 and never survived them. Swarm testing
#: (hypothesis turns rules off per example) thins the calls' kinds, not their number
CALLS = st.sampled_from([None, None, 6, 2])


#: the second group of a hybrid ``kv_cache_groups`` the machine draws (beside full attention),
#: where the release's capabilities list the kind (``Capabilities.kv_group_kinds``): the
#: scheduler-side kinds with their own managers; ``mamba`` with prefix caching only where the
#: release has ``CacheConfig.mamba_cache_mode`` (``Capabilities.mamba_cache_modes``: one is drawn)
HYBRID_KINDS = ("sliding_window", "chunked_local_attention", "mamba")
#: the group field a kind's span goes to (tokens)
HYBRID_SPAN = {"sliding_window": "sliding_window", "chunked_local_attention": "attention_chunk_size"}


@st.composite
def configs(draw, profile: Profile, level: str, caps) -> dict:
    """The ``config:`` of a scenario (vLLM's names), drawn once per example (``@initialize``).
    Features the release lacks (``caps``) are not drawn; everything shrinks towards a plain
    full-attention fcfs config without spec decode or async scheduling."""
    cfg = draw(base_config(profile))  # the draw every fuzzed scenario starts from
    block_size, num_blocks = cfg["block_size"], cfg["num_gpu_blocks"]
    # two in three where the release has it: the async scheduler's own accounting (output
    # placeholders, frames to discard) is where #42117 and #46066 live
    if profile.async_scheduling and caps.async_scheduling \
            and draw(st.sampled_from([False, True, True])):
        cfg["async_scheduling"] = True
    # spec decode (drawn before the KV cache groups: a Mamba group's state takes a block more per draft,
    # MambaSpec.num_speculative_blocks, which the pool's size must count)
    if profile.spec_decode and caps.spec_decode and (profile.spec_always or draw(st.booleans())):
        cfg["num_speculative_tokens"] = draw(st.integers(1, 4))
        if cfg.get("async_scheduling") and "ngram_gpu" in caps.spec_methods:
            # with async scheduling the GPU n-gram drafter where the release has it: every
            # release whose SpeculativeConfig knows ngram_gpu (0.19.1 to 0.33.0) refuses async +
            # ngram at start-up (VllmConfig.__post_init__: "async scheduling is only supported
            # with EAGLE/MTP/Draft Model/NGram GPU"), an example spent on nothing (15 % of
            # 0.24.0's examples were)
            method = "ngram_gpu"
        else:
            method = draw(st.sampled_from(["ngram", "ngram_gpu"]))
        cfg["speculative_method"] = method if method in caps.spec_methods else "ngram"
        # as `vllm serve` runs (stats on): the front end's stat loggers record every step
        if draw(st.booleans()):
            cfg["disable_log_stats"] = False
    # a Mamba group with prefix caching needs CacheConfig.mamba_cache_mode (align or all, as
    # the hybrid model's config picks), only where the release has the field
    modes = tuple(getattr(caps, "mamba_cache_modes", ()) or ())
    # the instance's KV connector, a deployment's choice (``kv_transfer_config``), drawn once at
    # engine-core level where the release has the connector seam: none, the lab's scripted
    # connector (whose per-request answers the ``kv_connector`` rule scripts), or a P/D
    # prefill instance under vLLM's own NixlConnector where the release's factory has it
    # (Capabilities.own_kv_connectors; its scheduler half is vLLM's code). A connector holds
    # blocks outside the running queue (an asynchronous load waits for them, a finished
    # request's blocks wait for the decode side's read), and an instance without one is the
    # common deployment: until machine version 6 any example with one ``kv_connector`` call
    # ran the scripted connector (19 % of 0.24.0's spec-decode examples, beside 33 % under
    # NixlConnector; 9 % and 28 % now), whatever else the example was about
    connectors = [None]
    if level == "engine-core" and profile.kv_connectors and caps.kv_connectors:
        connectors.append("scripted")
        if "NixlConnector" in (getattr(caps, "own_kv_connectors", ()) or ()):
            connectors.append("nixl")
    connector = draw(st.sampled_from(connectors)) if len(connectors) > 1 else None
    cfg["_connector"] = connector
    nixl = connector == "nixl"
    # half the NixlConnector instances serve a hybrid Mamba model with prefix caching where
    # the release can (Capabilities.mamba_cache_modes): the connector's Mamba paths (the
    # prefill side drops the last prompt token, which the decode side recomputes from the
    # state before it) run only there
    mamba_pd = (nixl and profile.kv_cache_groups and caps.kv_cache_groups and bool(modes)
                and "mamba" in caps.kv_group_kinds and profile.prefix_caching
                and draw(st.booleans()))
    if mamba_pd:
        cfg["enable_prefix_caching"] = True
    hybrid = None  # the second KV cache group, where one is drawn
    kinds = [k for k in HYBRID_KINDS if k in caps.kv_group_kinds
             and (k != "mamba" or not cfg["enable_prefix_caching"] or modes)]
    # two in three examples where the release has groups: the hybrid layouts are where the
    # per-group managers and their shared pool are exercised at all
    if profile.kv_cache_groups and caps.kv_cache_groups and kinds \
            and (mamba_pd or draw(st.sampled_from([False, True, True]))):
        # shrinks towards a sliding window, the kind drawn before the others were
        kind = "mamba" if mamba_pd else draw(st.sampled_from(kinds))
        span = draw(st.sampled_from([16, 32, 64, 128]))
        if kind in HYBRID_SPAN:
            # a window or chunk under a small step budget, mostly: vLLM's per-request cap for
            # these groups (SlidingWindowSpec.max_admission_blocks_per_request, cdiv(window - 1
            # + max_num_batched_tokens) + 1 blocks) falls below a long prompt's block table
            # only when the budget is small against the prompt (#45856: 32 tokens, window 16)
            cfg["max_num_batched_tokens"] = draw(st.sampled_from(
                [32, 64, cfg["max_num_batched_tokens"]]))
        mode = (draw(st.sampled_from(modes)) if kind == "mamba" and cfg["enable_prefix_caching"]
                else None)
        hybrid = Hybrid(kind, span, cfg["max_num_batched_tokens"], mode,
                        cfg.get("num_speculative_tokens") or 0)
        fits = _hybrid_max_model_len(num_blocks, block_size, hybrid)
        if fits < block_size:
            hybrid = None
        else:
            group = {"type": kind}
            if kind in HYBRID_SPAN:
                group[HYBRID_SPAN[kind]] = span
            cfg["kv_cache_groups"] = [{"type": "full"}, group]
            if mode is not None:
                cfg["mamba_cache_mode"] = mode
            cfg["max_model_len"] = fits
            cfg["long_prefill_token_threshold"] = min(cfg["long_prefill_token_threshold"], fits)
    if level == "v0-engine":  # V0's EngineArgs take the threshold from 0.8 only
        cfg["long_prefill_token_threshold"] = 0
    if level == "engine-core":
        if not caps.batch_queue_from_config and draw(st.booleans()):
            cfg["max_concurrent_batches"] = 2  # the executor's pipeline depth (batch queue)
        if profile.pool_override and draw(st.booleans()):
            # vLLM's CacheConfig.num_gpu_blocks_override: the pool used instead of the blocks
            # start-up found memory for (num_gpu_blocks stands for that memory). Mostly a pool
            # that still holds one request of max_model_len (what start-up asks of it from
            # 0.20 on: available memory = override x bytes per block, kv_cache_utils.
            # get_kv_cache_configs; 0.24.0 refused 88 of 169 examples when the override was
            # drawn from 2 up), one in three pinned below it: a pool smaller than the
            # longest prompt the config admits, which releases up to 0.19 accept at start-up
            # (they check the memory found) and then cannot serve (#35541's hang)
            need = _blocks_needed(cfg["max_model_len"], block_size, hybrid)
            if need > 2 and draw(st.sampled_from([False, False, True])):
                cfg["num_gpu_blocks_override"] = draw(st.integers(2, need - 1))
            else:
                cfg["num_gpu_blocks_override"] = draw(st.integers(min(need, num_blocks),
                                                                  num_blocks))
    return cfg


@dataclass(frozen=True)
class Hybrid:
    """The second KV cache group of a hybrid pair (beside full attention), as vLLM's start-up
    check sizes it: ``kind`` (:data:`HYBRID_KINDS`), ``span`` (a window's or chunk's tokens),
    the step budget ``batched`` (``max_num_batched_tokens``), a Mamba group's
    ``mamba_cache_mode`` (None: vLLM's ``none``) and the drafts per step (``num_spec``)."""

    kind: str
    span: int
    batched: int
    mamba_mode: str | None = None
    num_spec: int = 0

    def blocks(self, max_model_len: int, block_size: int) -> int:
        """Blocks the group asks for one request of ``max_model_len`` tokens
        (``max_memory_usage_bytes`` over a page): a window or chunk
        ``cdiv(min(span - 1 + batched, max_model_len)) + 1`` (``SlidingWindowSpec``; vLLM's
        ``ChunkedLocalAttentionSpec`` needs at most that); a Mamba group's state
        (``MambaSpec``, 0.24.0 ``kv_cache_interface.py``) one block, two under ``align``,
        ``cdiv(max_model_len)`` under ``all``, and one more per draft
        (``num_speculative_blocks``) in every mode. Measured on 0.24.0 (the estimated
        maximum model length its start-up refusal names, pools of 10 and 20 blocks, 0, 1 and 3
        drafts): the group's blocks and full attention's ``cdiv(max_model_len)`` fill the
        pool exactly."""
        cdiv = lambda a: -(-a // block_size)  # noqa: E731
        if self.kind == "mamba":
            state = {None: 1, "none": 1, "align": 2}.get(self.mamba_mode)
            return (cdiv(max_model_len) if state is None else state) + self.num_spec
        return cdiv(min(self.span - 1 + self.batched, max_model_len)) + 1


def _blocks_needed(max_model_len: int, block_size: int, hybrid: Hybrid | None = None) -> int:
    """The pool (blocks) that vLLM's start-up check asks for one request of ``max_model_len``
    tokens: ``cdiv(max_model_len)`` blocks for full attention alone
    (``FullAttentionSpec.max_memory_usage_bytes``; the check does not count the null block,
    so a pool of exactly that many keeps one request of max_model_len waiting: a stall the
    machine may find), plus the second group's (:meth:`Hybrid.blocks`) and a null block for a
    hybrid pair (:func:`_hybrid_max_model_len` keeps that one spare)."""
    full = -(-max_model_len // block_size)
    return full if hybrid is None else full + hybrid.blocks(max_model_len, block_size) + 1


def _hybrid_max_model_len(num_blocks: int, block_size: int, hybrid: Hybrid) -> int:
    """The largest ``max_model_len`` (a multiple of ``block_size``, at most MAX_MODEL_LEN) whose
    one request fits a pool of ``num_blocks`` (a null block spare) shared by a full-attention
    group and ``hybrid``: what vLLM's start-up check
    (``kv_cache_utils.check_enough_kv_cache_memory`` over each spec's
    ``max_memory_usage_bytes``: ``cdiv(max_model_len)`` blocks for full attention and
    :meth:`Hybrid.blocks` for the other group) accepts, so the scheduler level is not handed
    a pool the engine would refuse at start-up. 0 when not even one block's worth fits."""
    mml = min(MAX_MODEL_LEN, (num_blocks - 1) * block_size) // block_size * block_size
    while mml >= block_size:
        if _blocks_needed(mml, block_size, hybrid) <= num_blocks:
            return mml
        mml -= block_size
    return 0


class ScenarioMachine(RuleBasedStateMachine):
    """The fuzz machine (the module docstring says why this shape): each rule appends one
    engine call to the scenario being built, ``teardown`` runs it once through ``check``.

    The rules are the methods below; their arguments' strategies and preconditions depend on
    the campaign (``profile`` bounds the draws, ``level`` is the scenario's level, ``caps`` the
    release's record), so :func:`machine_class` binds them per campaign (:func:`_rules`) in a
    subclass that also sets these class attributes and ``check(scenario)`` (raises to fail the
    example) and ``version`` (``vllm.reproduces_on``)."""

    requests = Bundle("requests")
    profile: Profile
    level: str
    caps: Any
    version: str | None = None
    check: Callable[[dict], None]

    def __init__(self) -> None:
        super().__init__()
        self.cursor = 1  # the step the next call lands just before
        self.config: dict = {}
        self.reqs: list[dict] = []
        self.events: list[dict] = []
        self.model: dict = {"token": 100}
        self.connector: dict[str, dict] = {}  # request id -> KVConnectorScript fields
        #: the instance's KV connector (None, ``scripted``, ``nixl``), drawn with the config
        self.connector_kind: str | None = None
        #: vLLM's own NixlConnector as the prefill instance of P/D (instead of the script)
        self.nixl = False
        #: its requests sent for remote decode (``kv_transfer_params: {do_remote_decode: true}``)
        self.remote: set[str] = set()
        #: the calls this example may still make (None: every one hypothesis draws)
        self.calls_left: int | None = None

    # -- the scenario being built -----------------------------------------------------
    def scenario(self) -> dict:
        """The scenario dict so far (validates as ``Scenario``)."""
        sc = {"name": "fuzz", "level": self.level,
              "description": f"found by vllm-repro fuzz (profile {self.profile.name}, "
                             f"level {self.level})",
              "config": dict(self.config), "requests": [dict(r) for r in self.reqs],
              "events": [dict(e) for e in self.events],
              "model": {k: v for k, v in self.model.items() if v not in ({}, None)},
              "limits": {"max_steps": 400, "stall_steps": 40}}
        if self.version:
            sc["vllm"] = {"reproduces_on": [self.version]}
        if self.nixl:
            # the prefill instance of P/D: the proxy's requests come with do_remote_decode
            # (vLLM's NixlConnector decides hits, truncation and delayed frees from it; its
            # worker half is the lab's), others are served here. An emulated A100: NIXL's package imports
            # Mamba's Triton ops on 9.0 (0.33.0), whose config filter the CPU environment's
            # Triton stand-in cannot serve (as the catalog's #53514 runs)
            sc["kv_transfer_config"] = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
            for r in sc["requests"]:
                if r["id"] in self.remote:
                    r["kv_transfer_params"] = {"do_remote_decode": True}
            sc["platform"] = {"name": "cuda", "capability": "8.0",
                              "device_name": "NVIDIA A100-SXM4-80GB"}
        elif self.connector:
            sc["kv_transfer_config"] = {"kv_connector": "ScriptedConnector", "kv_role": "kv_both",
                                        "requests": {k: dict(v) for k, v in self.connector.items()}}
        return sc

    def _engine_core(self) -> bool:
        return self.level == "engine-core"

    def _has_requests(self) -> bool:
        return bool(self.reqs)

    def _space(self) -> bool:
        return len(self.reqs) < self.profile.requests[1]

    def _spent(self) -> bool:
        """Whether this example's calls are used up (then a rule changes nothing: a
        precondition would leave hypothesis no rule to run); else counts one call."""
        if self.calls_left is None:
            return False
        if self.calls_left <= 0:
            return True
        self.calls_left -= 1
        return False

    # -- preconditions (read the campaign's profile and the release's capabilities) ---------
    def _can_continue(self) -> bool:
        return self._space() and self.profile.shared_prefixes

    def _can_add_grammar(self) -> bool:
        return (self._space() and self._engine_core() and self.profile.structured_outputs
                and self.caps.structured_outputs and bool(self.caps.structured_backends))

    def _has_connector(self) -> bool:
        return self.connector_kind is not None

    def _before_last_step(self) -> bool:
        return self.cursor < MAX_CALL_STEP

    def _can_abort(self) -> bool:
        return self.profile.aborts

    def _can_reset(self) -> bool:
        return (self.profile.engine_events and self._engine_core()
                and "reset_prefix_cache" in self.caps.events)

    def _can_pause(self) -> bool:
        return (self.profile.engine_events and self._engine_core() and "pause" in self.caps.events
                and "resume" in self.caps.events and self.cursor < MAX_CALL_STEP)

    # -- calls --------------------------------------------------------------------------
    def build_engine(self, config, long, prompt, max_tokens, priority, aligned, accept,
                     remote, calls, data=None):
        """The engine's configuration (EngineCore is built from it before step 1) and its
        first request (a scenario holds at least one: no example runs nothing). At
        engine-core level the instance's KV connector is drawn with the config
        (:func:`configs`: none, the scripted one, or a P/D prefill instance under vLLM's
        own NixlConnector where the release's KVConnectorFactory has it); on such an
        instance ``remote``: the request is the proxy's (:meth:`add_request`)."""
        config = dict(config)
        #: the instance's KV connector (:func:`configs`): None, scripted or nixl
        self.connector_kind = config.pop("_connector", None)
        self.nixl = self.connector_kind == "nixl"
        self.config = config
        self.calls_left = calls
        return self._add(long, prompt, max_tokens, priority, None, None, 1, aligned=aligned,
                         accept=accept, remote=remote, data=data)

    def add_request(self, long, prompt, max_tokens, priority, arrival, prefix, prefix_len,
                    aligned, accept, remote, data=None):
        """``EngineCore.add_request`` (``Scheduler.add_request``) before the next step;
        ``aligned``: where the prompt's length lands against the block size
        (:data:`BOUNDARY`); ``accept``: how many of its drafts the model accepts each step,
        where spec decode is on (None: all); ``remote``: on a P/D prefill instance
        (NixlConnector), the request is the proxy's, sent for remote decode
        (``kv_transfer_params: {do_remote_decode: true}``), else served here. The proxy
        sends every request it routes through P/D to the prefill instance that way, so
        half of them are (until machine version 6 only the ``kv_connector`` rule's and
        continuations were)."""
        if self._spent():
            return multiple()
        return self._add(long, prompt, max_tokens, priority, arrival, prefix, prefix_len,
                         aligned=aligned, accept=accept, remote=remote, data=data)

    # extra 0: the same prompt sent again (a client's retry, the proxy resending a
    # request, users sharing a template), a full-prompt hit that vLLM caps at the prompt
    # less one token
    def add_continuation(self, rid, extra, max_tokens, remote_decode, accept):
        """A request whose prompt is ``rid``'s shared part (its whole prompt where it shares
        none: from now on a prefix of its own) and ``extra`` new tokens: a conversation's next
        turn, a prompt sent again with a token more (a prefix-cache hit on every full block but
        the tail; vLLM caps a hit at the prompt less one token), or the same prompt again."""
        if self._spent():
            return multiple()
        base = next(r for r in self.reqs if r["id"] == rid)
        if "prefix" not in base:
            base["prefix"], base["prefix_len"] = f"turn-{rid}", base["prompt_len"]
        shared = base["prefix_len"]
        mml = self.config["max_model_len"]
        prompt_len = max(1, min(shared + extra, mml - 1))
        req = {"id": f"R{len(self.reqs)}", "at_step": self.cursor, "prompt_len": prompt_len,
               "max_tokens": max(1, min(max_tokens, mml - prompt_len)),
               "prefix": base["prefix"], "prefix_len": min(shared, prompt_len)}
        if self.config["policy"] == "priority":
            req["priority"] = base.get("priority", 0)
        if self.nixl and remote_decode:  # the next turn sent through P/D
            self.remote.add(req["id"])
        self._accept(req["id"], accept)
        self.reqs.append(req)
        return req["id"]

    def _add(self, long, prompt, max_tokens, priority, arrival, prefix, prefix_len,
             structured=None, aligned=None, accept=None, remote=False, data=None) -> str:
        mml = self.config["max_model_len"]
        profile = self.profile
        lo, hi = (profile.long_prompt if long and profile.long_prompt else profile.short_prompt)
        # within what the config admits (max_model_len - 1, a token left to generate), as
        # the whole-scenario strategy draws: clamping a drawn length to it (until machine
        # version 6) made every long prompt of a small pool a one-token request at the
        # admission limit, which ends at its prefill and never decodes (in 0.24.0's
        # spec-decode examples 17 % of the requests sat at max_model_len - 1 and 23 % had
        # max_tokens 1; 8 % and 14 % drawn within the range)
        hi = max(1, min(hi, mml - 1))
        lo = min(lo, hi)
        prompt_len = lo + (prompt - 1) % (hi - lo + 1)
        bs = self.config["block_size"]
        if aligned and prompt_len >= bs:
            prompt_len = prompt_len // bs * bs
            if aligned == "past" and prompt_len < mml - 1:
                prompt_len += 1
        req = {"id": f"R{len(self.reqs)}", "at_step": self.cursor, "prompt_len": prompt_len,
               "max_tokens": max(1, min(max_tokens, mml - prompt_len))}
        if self.config["policy"] == "priority":
            req["priority"] = priority
            if arrival is not None:
                req["arrival_time"] = arrival
        if profile.shared_prefixes and prefix is not None:
            req["prefix"] = prefix
            req["prefix_len"] = min(prefix_len, prompt_len)
        if structured is not None:
            req["structured_outputs"] = structured
        if self.nixl and remote:
            self.remote.add(req["id"])
        if data is not None:  # (level v0-engine only: V0_DATA)
            # parallel sampling (SamplingParams.n), which V0 runs as child sequences of
            # one group (#14326's abort, #14353's finished children); drawn from the rule's
            # data, an argument only the v0-engine level's rules have (V0_DATA), so the
            # other levels draw exactly what they drew before
            n = data.draw(PARALLEL, label="n")
            if n > 1:
                req["n"] = n
            # a prompt over max_model_len, one request in eight: V0's front door
            # (LLMEngine._validate_model_inputs) let it through before 0.8.4 (#8881, with
            # chunked prefill), refuses it from 0.8.4 (a refusal, not a finding); the
            # other levels refuse such a scenario as input (exit 2)
            if data.draw(OVER_LENGTH, label="over max_model_len"):
                req["prompt_len"] = mml + data.draw(st.integers(1, 2 * bs), label="over by")
        self._accept(req["id"], accept)
        self.reqs.append(req)
        return req["id"]

    def _accept(self, rid: str, accept: int | None) -> None:
        """``rid``'s drafts: ``accept`` of them accepted each step (None: all), where spec
        decode is on (``model.spec_decode.accept``)."""
        if accept is not None and self.config.get("num_speculative_tokens"):
            self.model.setdefault("spec_decode", {}).setdefault("accept", {})[rid] = accept

    def add_grammar_request(self, grammar, prompt, max_tokens):
        """A structured-output request: the release's front door validates it, its
        ``StructuredOutputManager`` compiles the grammar, the fake model samples through
        the step's bitmask."""
        if self._spent():
            return multiple()
        return self._add(False, prompt, max_tokens, 0, None, None, 1, structured=grammar)

    def kv_connector(self, rid, hit, load_async, recv_after, load_fails, delay_free,
                     send_after):
        """The scripted KV connector's answers for ``rid`` (``kv_transfer_config``): an
        external prefix hit on part of its prompt, loaded synchronously or asynchronously
        (``finished_recving`` ``recv_after`` steps after now), a failed load where the
        release's ``KVConnectorOutput`` reports one, and a delayed free
        (``request_finished`` keeps the blocks until ``finished_sending``)."""
        if self._spent():
            return
        if self.nixl:  # vLLM's NixlConnector: rid is one of the proxy's, sent for remote decode
            self.remote.add(rid)
            return
        prompt = next(r["prompt_len"] for r in self.reqs if r["id"] == rid)
        ext = max(1, int(prompt * hit))
        if not load_async:
            # a synchronous hit leaves the last prompt token to compute, as vLLM's own
            # connectors do (ExampleConnector rounds len(prompt) - 1 down to a block; LMCache
            # recomputes the last token of a full-prompt hit): the scheduler must schedule at
            # least one token (``assert num_new_tokens > 0`` in Scheduler.schedule fails on a
            # whole-prompt hit, in every release). An asynchronous whole-prompt hit is vLLM's
            # own case (the scheduler takes one token back once the load is done,
            # Scheduler._update_waiting_for_remote_kv)
            ext = min(ext, prompt - 1)
        script: dict = {}
        if ext > 0:
            script["external_hit_tokens"] = ext
            if load_async:
                script["load_async"] = True
                if recv_after:
                    script["recv_done_at_step"] = self.cursor + recv_after
            if load_fails and self.caps.kv_load_failures:
                script["load_fails"] = True
        if delay_free:
            script["delay_free"] = True
            if send_after:
                script["send_done_at_step"] = self.cursor + send_after
        self.connector[rid] = script

    def step(self, steps):
        """Let the engine run ``steps`` steps before the next call."""
        if self._spent():
            return
        self.cursor = min(MAX_CALL_STEP, self.cursor + steps)

    # one rule for both kinds of abort (each rule is drawn as often as any other: two
    # would make aborts, which end a request's story, twice as common as a reset).
    # ``after``: an abort lands 0-8 steps after the cursor, as the engine's other calls do
    # (a client disconnects while its request prefills, decodes, or after it finished and
    # its blocks wait for a connector); at the cursor alone (until machine version 6) it
    # mostly landed at the request's own arrival step, before it was ever scheduled
    def abort(self, rid, in_flight, after):
        """``EngineCore.abort_requests([rid])`` before the step ``after`` steps from now, or
        (``in_flight``, at engine-core level where the release has it: ``abort_in_flight``)
        delivered by the engine's input thread while that step's batch executes."""
        if self._spent():
            return
        ev = {"at_step": self.cursor + after, "abort": [rid]}
        if in_flight and self._engine_core() and "abort_in_flight" in self.caps.events:
            ev["when"] = "in_flight"
        self.events.append(ev)

    # reset_running_requests two times in three: a reset without it only fails while any
    # request holds blocks (Scheduler.reset_prefix_cache returns False), so it changes
    # nothing while requests run, where the scheduler's own accounting is tested
    # ``after``: most calls land a few steps after the machine's cursor, once the requests
    # added so far are decoding: the machine's calls mostly come before its cursor moves
    # (``step`` is one rule of many), so a reset at the cursor landed before the first
    # decode step (on 0.24.0, two resets while a request decoded came in 1 % of examples)
    def reset_prefix_cache(self, running, again, after):
        """``EngineCore.reset_prefix_cache`` ``after`` steps from now
        (``reset_running_requests`` where the release takes it), and the same call again on
        each of the ``again`` following steps (an RLHF loop's weight syncs, or
        ``pause_generation(clear_cache=True)`` retried, come in runs: a second reset while
        the first one's preempted requests resume meets frames still in flight)."""
        if self._spent():
            return
        if running == "unconnected":
            # under a KV connector a running reset is drawn one time in three, not two:
            # Scheduler.reset_prefix_cache raises when the preempted requests' blocks are
            # still held by the connector (an asynchronous load, a finished request's blocks
            # waiting for the decode side's read), which vLLM documents as "not supported
            # yet"; on 0.24.0, 23 % of the spec-decode examples with two running resets
            # ended there, at their first reset, before anything the resets lead to
            running = self.connector_kind is None
        for k in range(again + 1):
            ev = {"at_step": self.cursor + after + k, "reset_prefix_cache": True}
            if running and "reset_running_requests" in self.caps.events:
                ev["reset_running_requests"] = True
            self.events.append(ev)

    # no mode "wait": vLLM 0.33.0's pause_scheduler refuses it in-process ("'wait' mode
    # can't be used in inproc-engine mode"), where the lab's EngineCore runs: a refusal of
    # the call, not a crash under load (59 false findings in a 40 s campaign)
    # ``after``: a pause lands 0-8 steps after the cursor, as a reset does: at the cursor
    # alone (until machine version 6) most pauses came before the engine's first step, where
    # vLLM's default mode (abort, with clear_cache) aborts every request before any was
    # scheduled and empties the prefix cache: an example's whole story gone at step 1 (a
    # pause came in 30 % of 0.24.0's examples, two in three of them aborting)
    def pause(self, mode, steps, after):
        """``EngineCore.pause_scheduler`` ``after`` steps from now, ``resume_scheduler``
        ``steps`` later (an engine left paused never finishes its requests: not a
        finding)."""
        if self._spent():
            return
        at = self.cursor + after
        ev = {"at_step": at, "pause": True}
        if mode is not None and "pause_mode" in self.caps.events:
            ev["mode"] = mode
        self.events.append(ev)
        self.events.append({"at_step": at + steps, "resume": True})

    # what the model returns is one rule, its kind drawn: the fake runner's output is one
    # concern, and as four rules (empty_output, eos, scripted_output, propose_drafts,
    # until machine version 6) it was four calls in twelve, each drawn as often as a
    # request or an engine call, so the engine's own calls (requests, resets, aborts,
    # pauses, connector answers) were a minority of every example's calls. The kinds are
    # the release's and the profile's (empty outputs where a ModelRunnerOutput holds
    # several tokens, drafts where the example decodes speculatively); scripted tokens,
    # the harmless kind, first: what the kind shrinks towards
    def model_output(self, rid, kind, at, tokens):
        """The model's behaviour for ``rid``: ``tokens``, the tokens it prefers, one per
        output position (``model.tokens``); ``eos``, EOS at output length ``at``
        (``model.eos_at``); ``empty``, no sampled token at the next step although it was
        scheduled, what a preempted or aborted request looks like to the runner
        (``model.empty_at``); ``drafts``, what the drafter proposes after each step, at
        most ``num_speculative_tokens`` (``model.draft_tokens``, every request's)."""
        if self._spent():
            return
        if kind == "tokens":
            self.model.setdefault("tokens", {})[rid] = tokens
        elif kind == "eos":
            self.model.setdefault("eos_at", {})[rid] = at
        elif kind == "empty":
            steps = self.model.setdefault("empty_at", {}).setdefault(rid, [])
            if self.cursor not in steps:
                steps.append(self.cursor)
        elif self.config.get("num_speculative_tokens"):  # drafts, where the example drafts
            self.model["draft_tokens"] = tokens[: self.config["num_speculative_tokens"]]

    def teardown(self) -> None:
        if self.reqs:  # none only when build_engine itself failed
            type(self).check(self.scenario())


def _rules(profile: Profile, level: str, caps) -> dict[str, Callable]:
    """:class:`ScenarioMachine`'s rules bound to one campaign: each method with its
    arguments' strategies and its precondition (hypothesis's ``initialize`` / ``rule`` /
    ``precondition``). The strategies are the campaign's (the profile's ranges, the release's
    config features, the model-output kinds it supports), so they are bound here rather than
    at the class: the same names and strategies in the same order as every machine version
    drew them, so stored examples replay."""
    m = ScenarioMachine
    requests = m.requests
    #: the kinds of the ``model_output`` rule this campaign draws (the profile's, the release's)
    model_kinds = (("tokens",) + (("eos",) if profile.eos else ())
                   + (("empty",) if profile.empty_outputs and caps.empty_outputs else ())
                   + (("drafts",) if profile.spec_decode and caps.spec_decode else ()))
    #: the request rules' extra argument at level v0-engine (a request's ``n`` and an over-long
    #: prompt are drawn from it); none at the other levels, whose rules keep the arguments, and
    #: so the draws, they had
    v0_data = {"data": st.data()} if level == "v0-engine" else {}
    return {
        "build_engine": initialize(
            target=requests, config=configs(profile, level, caps), long=LONG,
            prompt=st.integers(1, 900), max_tokens=st.integers(1, 64),
            priority=st.integers(0, 2), aligned=BOUNDARY, accept=ACCEPTS,
            remote=st.booleans(), calls=CALLS, **v0_data)(m.build_engine),
        "add_request": precondition(m._space)(rule(
            target=requests, long=LONG, prompt=st.integers(1, 900),
            max_tokens=st.integers(1, 64), priority=st.integers(0, 2),
            arrival=st.sampled_from([None, None, 0.0, 1.0]),
            prefix=st.sampled_from([None, None, "p0", "p1"]), prefix_len=st.integers(1, 900),
            aligned=BOUNDARY, accept=ACCEPTS, remote=st.booleans(), **v0_data)(m.add_request)),
        "add_continuation": precondition(m._can_continue)(rule(
            target=requests, rid=requests, extra=st.sampled_from([1, 1, 0, 16, 33]),
            max_tokens=st.integers(1, 64), remote_decode=st.booleans(),
            accept=ACCEPTS)(m.add_continuation)),
        "add_grammar_request": precondition(m._can_add_grammar)(rule(
            target=requests, grammar=st.sampled_from(GRAMMARS), prompt=st.integers(1, 64),
            max_tokens=st.integers(1, 32))(m.add_grammar_request)),
        "kv_connector": precondition(m._has_connector)(rule(
            rid=requests, hit=st.sampled_from([1.0, 0.5, 0.25]), load_async=st.booleans(),
            recv_after=st.integers(0, 4), load_fails=st.booleans(), delay_free=st.booleans(),
            send_after=st.integers(0, 4))(m.kv_connector)),
        "step": precondition(m._before_last_step)(rule(steps=st.integers(1, 4))(m.step)),
        "abort": precondition(m._can_abort)(rule(
            rid=requests, in_flight=st.booleans(), after=st.integers(0, 8))(m.abort)),
        "reset_prefix_cache": precondition(m._can_reset)(rule(
            running=st.sampled_from([False, True, "unconnected"]), again=st.integers(0, 2),
            after=st.integers(0, 8))(m.reset_prefix_cache)),
        "pause": precondition(m._can_pause)(rule(
            mode=st.sampled_from([None, "abort", "keep"]), steps=st.integers(1, 4),
            after=st.integers(0, 8))(m.pause)),
        "model_output": rule(
            rid=requests, kind=st.sampled_from(model_kinds), at=st.integers(1, 16),
            tokens=st.lists(st.integers(0, 200), min_size=1, max_size=4))(m.model_output),
    }


def machine_class(profile: Profile, level: str, caps, check: Callable[[dict], None],
                  version: str | None = None) -> type[RuleBasedStateMachine]:
    """The state machine of one campaign: a subclass of :class:`ScenarioMachine` with its rules
    bound (:func:`_rules`). ``profile`` bounds the draws, ``level`` is the scenario's level,
    ``caps`` the release's record (preconditions), ``check(scenario)`` runs the built scenario
    dict at teardown and raises to fail the example."""
    name = f"ScenarioMachine_{level.replace('-', '_')}"
    namespace = {"profile": profile, "level": level, "caps": caps, "version": version,
                 "check": staticmethod(check), **_rules(profile, level, caps)}
    machine = type(name, (ScenarioMachine,), namespace)
    machine.__qualname__ = name
    return machine
