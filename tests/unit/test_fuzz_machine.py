"""The fuzz state machine builds valid scenarios call by call, draws only what the release's
capabilities allow at the campaign's level, and its example database keeps failures."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import Phase, seed, settings
from hypothesis.stateful import run_state_machine_as_test

from vllm_repro.engine.capabilities import Capabilities
from vllm_repro.fuzz.database import FindingsDatabase, campaign_key
from vllm_repro.fuzz.machine import Hybrid, _hybrid_max_model_len, machine_class
from vllm_repro.fuzz.search import STATEFUL_STEPS, _without_local_constants
from vllm_repro.fuzz.strategies import LADDER
from vllm_repro.scenario import parse_scenario

FULL = Capabilities(
    "9.9", priority=True, spec_decode=True, spec_methods=("ngram", "ngram_gpu"),
    empty_outputs=True, async_scheduling=True, kv_cache_groups=True,
    kv_group_kinds=("full", "sliding_window", "chunked_local_attention", "mamba"), engine_core=True,
    events=("abort", "abort_in_flight", "reset_prefix_cache", "reset_running_requests", "pause",
            "pause_mode", "resume"),
    structured_outputs=True, structured_backends=("xgrammar",), kv_connectors=True,
    kv_load_failures=("invalid_block_ids",))
BARE = Capabilities("0.0.1", engine_core=True, events=("abort",))


def _draw(caps, level, n=120, profile=None) -> list[dict]:
    """The scenarios the machine builds over ``n`` examples (each validated as a user's file)."""
    seen: list[dict] = []
    # the draws a function of the seed alone, not of which lab modules this pytest process
    # happened to import before (hypothesis mixes their literals in: see the function)
    _without_local_constants()

    def check(sc):
        parse_scenario(sc, "<machine>")  # raises on an invalid scenario
        seen.append(sc)

    machine = seed(7)(machine_class(profile or LADDER[-1], level, caps, check, caps.version))
    run_state_machine_as_test(machine, settings=settings(
        max_examples=n, database=None, deadline=None, stateful_step_count=STATEFUL_STEPS,
        phases=(Phase.generate,)))
    return seen


def _features(scs) -> Counter:
    c: Counter = Counter()
    for sc in scs:
        cfg = sc["config"]
        c.update(k for k in ("async_scheduling", "kv_cache_groups", "num_speculative_tokens",
                             "max_concurrent_batches", "num_gpu_blocks_override") if k in cfg)
        c.update("grammar" for r in sc["requests"] if "structured_outputs" in r)
        c.update(k for e in sc["events"] for k in ("reset_prefix_cache", "pause", "abort")
                 if e.get(k))
        c.update("in_flight" for e in sc["events"] if e.get("when") == "in_flight")
        c.update(k for k in ("empty_at", "eos_at", "tokens", "spec_decode") if k in sc["model"])
        c.update(f"group:{g['type']}" for g in cfg.get("kv_cache_groups", [])[1:])
        scripts = (sc.get("kv_transfer_config") or {}).get("requests", {}).values()
        c.update(f"connector:{k}" for script in scripts for k in script
                 if k in ("external_hit_tokens", "load_async", "load_fails", "delay_free"))
    return c


@pytest.mark.parametrize("level", ["scheduler", "engine-core"])
def test_every_feature_is_drawn_where_the_release_has_it(level):
    scs = _draw(FULL, level)
    assert scs and all(sc["level"] == level and sc["requests"] for sc in scs)
    f = _features(scs)
    common = {"async_scheduling", "kv_cache_groups", "num_speculative_tokens", "abort",
              "empty_at", "eos_at", "tokens", "spec_decode"}
    common |= {"group:sliding_window", "group:chunked_local_attention", "group:mamba"}
    engine_only = {"grammar", "reset_prefix_cache", "pause", "in_flight",
                   "max_concurrent_batches", "num_gpu_blocks_override", "connector:load_async",
                   "connector:external_hit_tokens", "connector:load_fails", "connector:delay_free"}
    assert not [sc for sc in scs if sc["config"]["enable_prefix_caching"] and any(
        g["type"] == "mamba" for g in sc["config"].get("kv_cache_groups", []))], \
        "a Mamba group with prefix caching needs a mamba_cache_mode not every release knows"
    assert not [r for sc in scs for r in sc["requests"] if "n" in r], \
        "parallel sampling (n) is drawn at level v0-engine only (V1's engine gets one request each)"
    if level == "engine-core":
        assert common | engine_only <= set(f), f
    else:
        assert common <= set(f), f
        assert not engine_only & set(f), "engine-core calls are never drawn at level scheduler"


def test_nothing_the_release_lacks_is_drawn():
    f = _features(_draw(BARE, "engine-core"))
    assert not {"async_scheduling", "kv_cache_groups", "num_speculative_tokens", "grammar",
                "reset_prefix_cache", "pause", "in_flight", "empty_at", "spec_decode",
                "connector:external_hit_tokens"} & set(f), f
    window_only = Capabilities("9.8", engine_core=True, events=("abort",), kv_cache_groups=True,
                               kv_group_kinds=("full", "sliding_window"), kv_connectors=True)
    f = _features(_draw(window_only, "engine-core"))
    assert f["group:sliding_window"] and f["connector:external_hit_tokens"], f
    assert not {"group:chunked_local_attention", "group:mamba", "connector:load_fails"} & set(f), f
    assert f["abort"] and f["eos_at"]


def test_v0_engine_draws_only_what_the_v0_level_runs():
    """``fuzz --level v0-engine``: the profile fitted for the level, on a release whose V1
    record has everything, draws no V1-only field and no EngineCore call; every scenario
    validates at level v0-engine (num_gpu_blocks set, fcfs, no threshold V0 lacks before 0.8)."""
    from vllm_repro.errors import InputError
    from vllm_repro.fuzz.search import fit_profile

    profile = fit_profile(LADDER[-1], {}, level="v0-engine")
    scs = _draw(FULL, "v0-engine", profile=profile)
    assert scs and all(sc["level"] == "v0-engine" for sc in scs)
    f = _features(scs)
    assert not {"async_scheduling", "kv_cache_groups", "num_speculative_tokens", "grammar",
                "reset_prefix_cache", "pause", "in_flight", "empty_at", "spec_decode",
                "max_concurrent_batches", "num_gpu_blocks_override",
                "connector:external_hit_tokens"} & set(f), f
    assert f["abort"] and f["eos_at"], f
    assert all(sc["config"]["policy"] == "fcfs" and not sc["config"]["long_prefill_token_threshold"]
               and "priority" not in r for sc in scs for r in sc["requests"])
    assert any(sc["config"]["enable_prefix_caching"] for sc in scs)
    # parallel sampling, V0's child sequences (#14326, #14353): n of 2 and 3, and aborted too
    ns = Counter(r.get("n", 1) for sc in scs for r in sc["requests"])
    assert ns[2] and ns[3] and set(ns) <= {1, 2, 3}, ns
    parallel = {(id(sc), r["id"]) for sc in scs for r in sc["requests"] if r.get("n", 1) > 1}
    assert any((id(sc), rid) in parallel for sc in scs for e in sc["events"]
               for rid in e.get("abort") or ()), "an n > 1 request is never aborted"
    # prompts over max_model_len (#8881's ground before 0.8.4; the front door refuses them after)
    over = [r for sc in scs for r in sc["requests"]
            if r["prompt_len"] > sc["config"]["max_model_len"]]
    assert over and len(over) < sum(ns.values()) / 4, (len(over), sum(ns.values()))
    with pytest.raises(InputError, match="--spec: fuzz at --level v0-engine"):
        fit_profile(LADDER[-1], {}, spec_forced=True, level="v0-engine")
    with pytest.raises(InputError, match="--policy priority: fuzz at --level v0-engine"):
        fit_profile(LADDER[-1].with_policy("priority"), {}, level="v0-engine")


def test_hybrid_pool_fits_vllms_start_up_estimate():
    # the catalog's #45856 pool: 15 blocks, window 16, 32 batched tokens -> 160 tokens
    assert _hybrid_max_model_len(15, 16, Hybrid("sliding_window", 16, 32)) == 160
    assert _hybrid_max_model_len(3, 16, Hybrid("sliding_window", 16, 2048)) == 0
    # a Mamba group's state (0.24.0's MambaSpec, measured: the pool its start-up refusal names
    # is filled exactly): one block, two aligned, max_model_len's under `all`, one a draft;
    # one block spare for the null block
    assert _hybrid_max_model_len(15, 16, Hybrid("mamba", 16, 32)) == 208  # 13 + 1
    assert _hybrid_max_model_len(10, 16, Hybrid("mamba", 16, 64, None, 3)) == 80  # 5 + 4
    assert _hybrid_max_model_len(10, 16, Hybrid("mamba", 16, 64, "align", 1)) == 96  # 6 + 3
    assert _hybrid_max_model_len(10, 16, Hybrid("mamba", 16, 64, "all", 1)) == 64  # 4 + 4 + 1
    holds = []  # per override drawn: whether it holds one request of max_model_len
    # 400 examples: one seed's examples are not independent (hypothesis mutates earlier ones),
    # and 200 of them put the share anywhere from one half to four fifths
    for sc in _draw(FULL, "engine-core", n=400):
        cfg = sc["config"]
        groups = cfg.get("kv_cache_groups")
        need = -(-cfg["max_model_len"] // 16)
        if groups:
            group = groups[1]
            span = group.get("sliding_window") or group.get("attention_chunk_size")
            spec = cfg.get("num_speculative_tokens", 0)
            extra = ({None: 1, "align": 2}.get(cfg.get("mamba_cache_mode"), need) + spec
                     if group["type"] == "mamba" else -(-min(
                         span - 1 + cfg["max_num_batched_tokens"], cfg["max_model_len"]) // 16) + 1)
            assert need + extra <= cfg["num_gpu_blocks"] - 1
            need += extra + 1
        if "num_gpu_blocks_override" in cfg:
            holds.append(cfg["num_gpu_blocks_override"] >= need)
    # a pool override mostly holds one request of max_model_len (what 0.20+ check at
    # start-up: 0.24.0 refused half its examples when it was drawn from 2 up), one in three is
    # pinned below it (#35541's shape, which 0.19 accepts)
    assert 0.55 < sum(holds) / len(holds) < 0.9, holds


def test_the_database_keys_by_level_and_keeps_failures(tmp_path):
    db = FindingsDatabase(tmp_path, "scheduler")
    digest = b"\x01" * 48  # whatever key hypothesis derives for the test
    db.save(digest, b"choices")
    assert list(FindingsDatabase(tmp_path, "scheduler").fetch(b"another test")) == [b"choices"]
    assert list(FindingsDatabase(tmp_path, "engine-core").fetch(digest)) == []
    db.delete(digest, b"choices")  # a replay that did not fail here
    assert db.stored() == 1
    db.move(digest, digest + b".secondary", b"choices")  # superseded by a smaller failure
    assert db.stored() == 0
    assert list(db.inner.fetch(campaign_key("scheduler") + b".secondary")) == [b"choices"]
    db.delete(digest + b".secondary", b"choices")
    assert list(db.fetch(digest + b".secondary")) == []


def test_a_mamba_group_with_prefix_caching_only_with_a_mamba_cache_mode_the_release_has():
    from dataclasses import replace

    scs = _draw(replace(FULL, mamba_cache_modes=("align", "all")), "engine-core", n=200)
    mamba_pc = [sc["config"] for sc in scs if sc["config"]["enable_prefix_caching"] and any(
        g["type"] == "mamba" for g in sc["config"].get("kv_cache_groups", []))]
    assert mamba_pc, "#53514's family (Mamba + prefix caching) is drawn where the release can"
    assert all(cfg.get("mamba_cache_mode") in ("align", "all") for cfg in mamba_pc)
    assert not [sc for sc in scs if "mamba_cache_mode" in sc["config"] and not any(
        g["type"] == "mamba" for g in sc["config"].get("kv_cache_groups", []))]


def test_connector_hits_nixl_instances_and_continuations():
    """A synchronous scripted hit leaves the last prompt token to compute (a whole-prompt one
    trips vLLM's ``assert num_new_tokens > 0`` in every release: not a bug to find); vLLM's
    own NixlConnector is drawn only where the release's factory has it, as a P/D prefill
    instance (the proxy's requests ``do_remote_decode``); a continuation shares its base's
    prompt."""
    from dataclasses import replace

    nixl = replace(FULL, own_kv_connectors=("NixlConnector",))
    scs = _draw(nixl, "engine-core", n=80)
    prompts = {}
    for sc in scs:
        kv = sc.get("kv_transfer_config") or {}
        lens = {r["id"]: r["prompt_len"] for r in sc["requests"]}
        prompts.update(lens)
        for rid, script in kv.get("requests", {}).items():
            if script.get("external_hit_tokens") and not script.get("load_async"):
                assert script["external_hit_tokens"] < lens[rid], sc
        if kv.get("kv_connector") == "NixlConnector":
            assert "requests" not in kv and all(
                r.get("kv_transfer_params", {"do_remote_decode": True}) == {"do_remote_decode": True}
                for r in sc["requests"]), sc
    kinds = Counter((sc.get("kv_transfer_config") or {}).get("kv_connector") for sc in scs)
    assert kinds["NixlConnector"] and kinds["ScriptedConnector"], kinds
    assert any("kv_transfer_params" in r for sc in scs for r in sc["requests"])
    turns = [(sc, r) for sc in scs for r in sc["requests"]
             if str(r.get("prefix", "")).startswith("turn-")]
    assert turns
    for sc, r in turns:
        base = next(b for b in sc["requests"] if b.get("prefix") == r["prefix"])
        assert base["prefix_len"] == base["prompt_len"] and r["prefix_len"] <= r["prompt_len"]
    assert any(r["prompt_len"] == b["prompt_len"] + 1 and b["prompt_len"] % 16 == 0
               for sc, r in turns for b in sc["requests"] if b.get("prefix") == r["prefix"] and b is not r)
    # without the release's NixlConnector: never drawn
    assert not [sc for sc in _draw(FULL, "engine-core", n=40)
                if (sc.get("kv_transfer_config") or {}).get("kv_connector") == "NixlConnector"]


def test_async_spec_and_resets_while_requests_decode_are_drawn_together():
    """#46066's family: async scheduling with the GPU n-gram drafter (the only n-gram method
    the releases that have it accept with async scheduling), a request whose drafts are
    rejected, two ``reset_prefix_cache(reset_running_requests=True)`` landing a few steps
    after the request came (while it decodes); and short examples (a few calls) beside the
    long ones. Drawn by the machine's generic rules, never as a scenario of its own."""
    from vllm_repro.fuzz.strategies import DEFAULT

    scs = _draw(FULL, "engine-core", n=400, profile=DEFAULT.with_policy("fcfs").with_spec(True))
    assert not [sc for sc in scs if sc["config"].get("async_scheduling")
                and sc["config"]["speculative_method"] != "ngram_gpu"]
    together = 0
    for sc in scs:
        if not sc["config"].get("async_scheduling"):
            continue
        accept = (sc["model"].get("spec_decode") or {}).get("accept", {})
        resets = sorted(e["at_step"] for e in sc["events"] if e.get("reset_running_requests"))
        together += any(accept.get(r["id"]) == 0 and len(
            [t for t in resets if r["at_step"] + 2 <= t <= r["at_step"] + r["max_tokens"]]) >= 2
            for r in sc["requests"])
    # 1 % of examples before machine version 5 (resets at the cursor, acceptance a rule)
    assert together / len(scs) > 0.05, together
    sizes = Counter(len(sc["requests"]) + len(sc["events"]) for sc in scs)
    assert sum(n for k, n in sizes.items() if k <= 3) / len(scs) > 0.15, sizes
