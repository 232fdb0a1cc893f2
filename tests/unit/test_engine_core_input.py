"""level: engine-core in the scenario format, the verdict for fixed releases, and the adapter's
constructor probe: what a user writes and what the lab makes of it, without any vLLM release."""

from __future__ import annotations

import textwrap

import pytest

from vllm_repro.engine.adapter import call_supported, init_params
from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario
from vllm_repro.verdict import judge

from .builders import make_result

BASE = """
    name: t
    level: engine-core
    vllm: {reproduces_on: ["0.19.1"], clean_on: ["0.20.2"]}
    config: {num_gpu_blocks: 8, max_model_len: 128, num_gpu_blocks_override: 4,
             max_num_partial_prefills: 1}
    requests:
      - {id: A, prompt_len: 10}
    events:
      - {at_step: 2, abort: [A], when: in_flight}
      - {at_step: 3, reset_prefix_cache: true, reset_running_requests: true}
"""


def load(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return load_scenario(p)


def test_engine_core_scenario_keeps_vllm_config_fields_for_the_release(tmp_path):
    sc = load(tmp_path, BASE)
    payload = sc.child_payload()
    assert payload["level"] == "engine-core"
    # vLLM's own fields travel apart from the lab's, to be judged by the release's classes
    assert payload["config"]["passthrough"] == {"max_num_partial_prefills": 1,
                                                "num_gpu_blocks_override": 4}
    assert "num_gpu_blocks_override" not in payload["config"]
    assert payload["events"][0]["when"] == "in_flight"


@pytest.mark.parametrize("old, new, words", [
    ("level: engine-core", "level: scheduler", "add `level: engine-core`"),
    ("num_gpu_blocks: 8,", "kv_cache_memory_bytes: 1000000,", None),
    ("{at_step: 3, reset_prefix_cache: true, reset_running_requests: true}",
     "{at_step: 3, reset_prefix_cache: true, abort: [A]}", "exactly one of"),
    ("{at_step: 3, reset_prefix_cache: true, reset_running_requests: true}",
     "{at_step: 3, pause: true, when: in_flight}", "in_flight` applies to abort only"),
    ("max_num_partial_prefills: 1", "max_num_partial_prefills: [1, 2]", "only plain values"),
])
def test_engine_core_fields_are_checked_where_they_apply(tmp_path, old, new, words):
    text = textwrap.dedent(BASE).replace(old, new)
    if words is None:  # a memory figure instead of a pool: fine at engine-core level
        assert load(tmp_path, text).config.kv_cache_memory_bytes == 1000000
        return
    with pytest.raises(InputError) as e:
        load(tmp_path, text)
    assert words in str(e.value) and "s.yaml" in str(e.value)


def test_scheduler_level_needs_a_pool(tmp_path):
    text = textwrap.dedent(BASE).replace("level: engine-core", "level: scheduler").replace(
        "num_gpu_blocks: 8,", "kv_cache_memory_bytes: 100,").split("    events:")[0]
    with pytest.raises(InputError, match="engine-core"):
        load(tmp_path, text)


def _result(outcome, **crash):
    r = {"steps": 0, "finished": {}, "unfinished": ["A"]}
    if crash:
        r["crash"] = {"type": "ValueError", "message": "To serve at least one request with the "
                      "models's max seq len (2048)", "where": {"file": "vllm/v1/core/kv_cache_utils.py",
                      "function": "_check_enough_kv_cache_memory", "line": 1}, "step": 0,
                      "vllm_frames": [], **crash}
    if outcome == "stall":
        r["stall"] = {"step": 30, "since": 11, "unfinished": ["A"]}
    return make_result(outcome, **r)


def test_a_fix_that_refuses_the_config_at_start_up_is_judged_by_fixed(tmp_path):
    sc = load(tmp_path, textwrap.dedent(BASE) + textwrap.dedent("""
        expect: {outcome: stall}
        fixed: {outcome: crash, phase: engine-build, exception: ValueError, message: max seq len}
    """))
    assert judge(sc, "0.20.2", _result("crash", phase="engine-build")).ok is True
    # the same refusal later than start-up is not what the fix does
    late = judge(sc, "0.20.2", _result("crash", phase="schedule"))
    assert late.ok is False and "phase schedule != engine-build" in late.reason
    # running clean is not what the fix does either
    assert judge(sc, "0.20.2", _result("clean")).ok is False
    # and on the buggy release the expectation is the stall
    assert judge(sc, "0.19.1", _result("stall")).ok is True


class _Scheduler:
    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, log_stats=False):
        self.got = dict(vllm_config=vllm_config, kv_cache_config=kv_cache_config)


class _AsyncScheduler(_Scheduler):
    """vLLM's AsyncScheduler from 0.17 on: a pure forwarder."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def test_a_forwarding_constructor_is_read_through_to_its_base():
    names, var_kw = init_params(_AsyncScheduler)
    assert "kv_cache_config" in names and not var_kw
    # the first V1 generation's keywords are dropped instead of reaching Scheduler.__init__
    s = call_supported(_AsyncScheduler, vllm_config=1, kv_cache_config=2,
                       structured_output_manager=None, scheduler_config=3, lora_config=None)
    assert s.got == {"vllm_config": 1, "kv_cache_config": 2}
