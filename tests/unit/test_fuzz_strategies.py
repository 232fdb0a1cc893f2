"""The fuzz strategies draw valid scenarios; signatures and file names are stable."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_repro.fuzz.search import signature, slug
from vllm_repro.fuzz.strategies import DEFAULT, LADDER, scenarios
from vllm_repro.scenario import parse_scenario

from .builders import make_result


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([DEFAULT, *LADDER]).flatmap(lambda p: scenarios(p, "0.10.1.1")))
def test_every_drawn_scenario_is_valid_and_fits_its_pool(sc):
    s = parse_scenario(sc, "<drawn>")
    usable_tokens = (s.config.num_gpu_blocks - 1) * s.config.block_size
    for r in s.requests:
        assert r.prompt_len + r.max_tokens <= s.config.max_model_len <= usable_tokens
    assert s.vllm.reproduces_on == ["0.10.1.1"]
    # vLLM's SchedulerConfig refuses a larger threshold: such a draw would be a wasted example
    assert (s.config.long_prefill_token_threshold or 0) <= s.config.max_model_len


@given(scenarios(LADDER[0]))
def test_single_level_has_one_request_and_no_aborts(sc):
    assert len(sc["requests"]) == 1 and sc["events"] == []


def test_policy_and_spec_overrides():
    prof = DEFAULT.with_policy("priority").with_spec(True)
    assert prof.policies == ("priority",) and prof.spec_decode and prof.empty_outputs


def test_signatures():
    crash = make_result("crash", crash={"type": "AssertionError", "where": {
        "file": "vllm/v1/core/sched/scheduler.py", "function": "schedule", "line": 530}})
    assert signature(crash) == "crash:AssertionError@vllm/v1/core/sched/scheduler.py:schedule"
    assert slug(signature(crash)) == "crash-AssertionError-scheduler.schedule"
    assert signature(make_result("violation", violations=[{"code": "KV_DOUBLE_FREE", "step": 3}])) \
        == "violation:KV_DOUBLE_FREE"
    # two ways to one code (V0: #18957's fresh block, the open uncomputed prefix hit) stay apart
    fresh = signature(make_result("violation", violations=[
        {"code": "KV_PREFIX_MAP", "step": 47, "mechanism": "fresh-block"}]))
    assert fresh == "violation:KV_PREFIX_MAP/fresh-block" and "violation:KV_PREFIX_MAP" in fresh
    assert slug(fresh) == "violation-KV_PREFIX_MAP-fresh-block"
    assert signature(make_result("violation", violations=[
        {"code": "KV_PREFIX_MAP", "mechanism": "uncomputed-hit"}])) != fresh
    assert signature(make_result("stall", stall={"step": 9, "since": 1})) == "stall"
    assert signature(make_result("clean")) is None
    assert signature(make_result("error", error={"kind": "lab", "message": "x"})) is None, \
        "a lab error is never a finding"


def test_search_time_must_be_a_positive_duration():
    import pytest

    from vllm_repro.errors import InputError
    from vllm_repro.fuzz.search import parse_duration

    assert parse_duration("2m") == 120 and parse_duration("90") == 90
    for bad in ("0s", "0", "soon", "-5s"):
        with pytest.raises(InputError, match="--time"):
            parse_duration(bad)


def test_profile_fits_what_the_release_refuses():
    import pytest

    from vllm_repro.errors import InputError
    from vllm_repro.fuzz.search import fit_profile

    refused = {"priority": "no priority", "spec decode": "no drafts", "empty outputs": "one token"}
    p = fit_profile(LADDER[-1], refused)
    assert p.policies == ("fcfs",) and not p.spec_decode and not p.empty_outputs
    assert fit_profile(LADDER[-1], {}) == LADDER[-1]
    with pytest.raises(InputError, match="--policy priority: no priority"):
        fit_profile(LADDER[-1].with_policy("priority"), refused)
    with pytest.raises(InputError, match="--spec: no drafts"):
        fit_profile(LADDER[-1], refused, spec_forced=True)
