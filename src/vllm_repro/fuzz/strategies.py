"""hypothesis strategies over the scenario schema (format v1), and the escalation ladder.

A strategy draws a whole scenario as a plain dict that validates as
:class:`~vllm_repro.scenario.schema.Scenario`: vLLM config within sane ranges (few blocks for
preemption pressure), requests (arrival step, prompt length from short/long mixes, ``max_tokens``,
priorities with ties in priority and arrival time, shared prefixes), events (aborts at chosen
steps) and model behaviour (EOS steps, empty outputs, spec-decode drafts and acceptance).
Everything shrinks towards fewer requests, shorter prompts, earlier steps and plainer configs.

The ladder (the seeds' escalation) constrains the same strategy: ``single`` (one request),
``concurrent`` (several short requests), ``long`` (long prompts, chunked prefill), ``mixed``
(everything: aborts, prefixes, EOS, empty outputs, spec decode, async scheduling, KV cache
groups, grammar requests, engine-core events).

:func:`scenarios` draws a whole scenario at once (kept for callers that want one);
``vllm-repro fuzz`` builds scenarios call by call with the state machine of
:mod:`vllm_repro.fuzz.machine`, bounded by the same :class:`Profile`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class Profile:
    """What a campaign draws. Lengths in tokens, pools in blocks, times in steps."""

    name: str
    requests: tuple[int, int] = (1, 6)
    short_prompt: tuple[int, int] = (1, 64)
    long_prompt: tuple[int, int] | None = (65, 600)
    blocks: tuple[int, int] = (3, 24)  # num_gpu_blocks, the null block included
    policies: tuple[str, ...] = ("fcfs", "priority")
    prefix_caching: bool = True
    aborts: bool = True
    shared_prefixes: bool = True
    eos: bool = True
    empty_outputs: bool = False
    spec_decode: bool = False
    max_at_step: int = 6
    # drawn by the state machine (fuzz/machine.py) where the release has them
    async_scheduling: bool = True
    kv_cache_groups: bool = True  # full attention + a sliding-window group
    structured_outputs: bool = True  # grammar requests (level engine-core)
    engine_events: bool = True  # reset_prefix_cache, pause/resume (level engine-core)
    pool_override: bool = True  # num_gpu_blocks_override below the memory found (engine-core)
    kv_connectors: bool = True  # a scripted KV connector's events per request (engine-core)
    #: every example drafts (``--spec``: the dimension fixed), where ``spec_decode`` only lets
    #: the machine draw it
    spec_always: bool = False

    def with_policy(self, policy: str | None) -> "Profile":
        return self if policy is None else replace(self, policies=(policy,))

    def with_spec(self, spec: bool | None) -> "Profile":
        return self if spec is None else replace(self, spec_decode=spec, spec_always=spec,
                                                 empty_outputs=spec or self.empty_outputs)


_PLAIN = dict(async_scheduling=False, kv_cache_groups=False, structured_outputs=False,
              engine_events=False, pool_override=False, kv_connectors=False)
LADDER: tuple[Profile, ...] = (
    Profile("single", requests=(1, 1), long_prompt=None, aborts=False, shared_prefixes=False,
            **_PLAIN),
    Profile("concurrent", requests=(2, 8), long_prompt=None, **_PLAIN),
    Profile("long", requests=(1, 6), short_prompt=(1, 32), long_prompt=(100, 900), blocks=(8, 48),
            async_scheduling=False, engine_events=False, kv_connectors=False),
    Profile("mixed", requests=(1, 10), empty_outputs=True, spec_decode=True),
)
DEFAULT = Profile("default")


@st.composite
def base_config(draw, profile: Profile) -> dict:
    """The ``config:`` every fuzzed scenario starts from (vLLM's names), drawn in this order by
    both the state machine (:func:`vllm_repro.fuzz.machine.configs`, which adds the release's
    features) and :func:`scenarios`: a pool of ``profile.blocks`` blocks of 16 tokens (a block
    size every release accepts under either platform; 0.10.x's CPU platform refuses others
    without IPEX), ``max_model_len`` what the pool holds (block 0 is the null block; the engine
    refuses more) up to :data:`MAX_MODEL_LEN`, chunked prefill, prefix caching where the
    profile allows it, the profile's policies and a ``long_prefill_token_threshold`` within
    ``max_model_len`` (vLLM's SchedulerConfig refuses one over it). Shrinks towards the smallest
    pool, one sequence, a 2048-token budget, fcfs."""
    block_size = 16
    num_blocks = draw(st.integers(*profile.blocks))
    max_model_len = min(MAX_MODEL_LEN, (num_blocks - 1) * block_size)
    return {
        "block_size": block_size,
        "num_gpu_blocks": num_blocks,
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_num_batched_tokens": draw(st.sampled_from([2048, 64, 128, 256, 512, 32])),
        "max_model_len": max_model_len,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": profile.prefix_caching and draw(st.booleans()),
        "policy": draw(st.sampled_from(profile.policies)),
        "long_prefill_token_threshold": draw(st.sampled_from(
            [t for t in (0, 0, 16, 64) if t <= max_model_len])),
    }


@st.composite
def scenarios(draw, profile: Profile = DEFAULT, version: str | None = None) -> dict:
    """A scenario dict (validates as ``Scenario``), named ``fuzz``; ``version`` goes into
    ``vllm.reproduces_on`` when given. Its config is :func:`base_config`'s, with spec decode."""
    config = draw(base_config(profile))
    policy, max_model_len = config["policy"], config["max_model_len"]
    spec = profile.spec_decode and draw(st.booleans())
    if spec:
        config["num_speculative_tokens"] = draw(st.integers(1, 4))
        # as `vllm serve` runs (stats on), the front end's stat loggers record every step's
        # SchedulerStats, spec-decode counters included (vLLM #26372 crashes there)
        if draw(st.booleans()):  # shrinks towards the lab's default (stats off)
            config["disable_log_stats"] = False
    n = draw(st.integers(*profile.requests))
    requests = []
    for i in range(n):
        long = profile.long_prompt is not None and draw(st.booleans())
        lo, hi = profile.long_prompt if long else profile.short_prompt
        prompt_len = draw(st.integers(min(lo, max_model_len - 1), min(hi, max_model_len - 1)))
        req = {
            "id": f"R{i}",
            "at_step": draw(st.integers(1, profile.max_at_step)),
            "prompt_len": prompt_len,
            "max_tokens": draw(st.integers(1, min(64, max_model_len - prompt_len))),
        }
        if policy == "priority":
            req["priority"] = draw(st.integers(0, 2))
            arrival = draw(st.sampled_from([None, None, 0.0, 1.0]))
            if arrival is not None:
                req["arrival_time"] = arrival
        if profile.shared_prefixes and draw(st.booleans()):
            req["prefix"] = draw(st.sampled_from(["p0", "p1"]))
            req["prefix_len"] = draw(st.integers(1, prompt_len))
        requests.append(req)
    requests.sort(key=lambda r: r["at_step"])
    ids = [r["id"] for r in requests]
    events = []
    if profile.aborts:
        arrives = {r["id"]: r["at_step"] for r in requests}
        # an abort lands at or after its request's arrival (before it, vLLM ignores the id)
        for delay, rid in draw(st.lists(st.tuples(st.integers(0, 39), st.sampled_from(ids)), max_size=3)):
            events.append({"at_step": arrives[rid] + delay, "abort": [rid]})
    model: dict = {"token": 100}
    if profile.eos:
        eos = draw(st.dictionaries(st.sampled_from(ids), st.integers(1, 16), max_size=3))
        if eos:
            model["eos_at"] = eos
    if profile.empty_outputs:
        empty = draw(st.dictionaries(st.sampled_from(ids), st.lists(st.integers(1, 30), min_size=1, max_size=2),
                                     max_size=2))
        if empty:
            model["empty_at"] = empty
    if spec:
        accept = draw(st.dictionaries(st.sampled_from(ids), st.integers(0, 4), max_size=2))
        if accept:
            model["spec_decode"] = {"accept": accept}
    sc = {
        "name": "fuzz",
        "description": f"found by vllm-repro fuzz (profile {profile.name})",
        "config": config,
        "requests": requests,
        "events": events,
        "model": model,
        "limits": {"max_steps": 400, "stall_steps": 40},
    }
    if version:
        sc["vllm"] = {"reproduces_on": [version]}
    return sc
