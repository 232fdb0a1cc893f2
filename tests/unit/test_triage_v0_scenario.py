"""``triage --scenario`` on V0 crash logs: the draft is a ``level: v0-engine`` scenario with the
V0 config fields the log shows (read from the logs, no vLLM run)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from vllm_repro.scenario import load_scenario
from vllm_repro.triage import triage_log
from vllm_repro.triage.scenario import draft_scenario, v0_crash

from ..conftest import CRASHLOGS, SCENARIOS, SHARED_HINT

LOG_8881 = SCENARIOS / "vllm-8881-v0-async-stopped-long-prompt.log"
LOG_012 = next(iter(sorted(CRASHLOGS.glob("012-*.log"))), None)
LOG_013 = next(iter(sorted(CRASHLOGS.glob("013-*.log"))), None)


def _draft(tmp_path: Path, log: Path, version: str | None = None):
    report, sc = triage_log(log)
    text, scenario = draft_scenario(report, sc, version=version)
    out = tmp_path / "draft.yaml"
    out.write_text(text)
    return text, load_scenario(out), report


def test_the_8881_traceback_drafts_a_v0_scenario_with_chunked_prefill_from_its_frames(tmp_path):
    text, sc, report = _draft(tmp_path, LOG_8881, "0.6.1.post2")
    assert v0_crash(report) is not None
    assert sc.level == "v0-engine"
    assert sc.config.enable_chunked_prefill is True  # Scheduler._schedule_chunked_prefill
    assert "derived: the crash went through Scheduler._schedule_chunked_prefill" in text
    # the crash is in the V0 scheduler the level runs: the draft expects it on the release
    assert (sc.expect.outcome, sc.expect.exception, sc.expect.where) == (
        "crash", "AssertionError", "vllm/core/scheduler.py:_schedule_running")
    assert sc.vllm.reproduces_on == ["0.6.1.post2"]
    # no stats, no dump: one request, marked as a guess
    assert [r.id for r in sc.requests] == ["guessed-1"] and "guess: the log shows no requests" in text


@pytest.mark.skipif(LOG_013 is None, reason=f"no 013 crash log; {SHARED_HINT}")
def test_the_013_log_carries_the_v0_engine_config_it_shows(tmp_path):
    text, sc, _ = _draft(tmp_path, LOG_013)
    assert sc.level == "v0-engine" and sc.vllm.reproduces_on == ["0.6.1.post2"]  # its banner
    raw = yaml.safe_load(text)["config"]
    # '# GPU blocks: 32028, # CPU blocks: 2978'; the banner's V0 EngineArgs fields
    assert (raw["num_gpu_blocks"], raw["num_cpu_blocks"]) == (32028, 2978)
    assert (raw["use_v2_block_manager"], raw["num_scheduler_steps"],
            raw["enable_prefix_caching"]) == (False, 1, False)
    assert raw["enable_chunked_prefill"] is True
    # max_seq_len=131072 is over the packaged model's 2048 positions: capped, with a note
    assert raw["max_model_len"] == 2048 and "131072" in text
    # the stats line: Running: 2, Pending: 2
    assert [r.id for r in sc.requests] == ["running-1", "running-2", "waiting-1", "waiting-2"]
    assert "V1" not in text.split("expect:")[0].split("level:")[1]  # no V1-only field or note
    for key in ("kv_cache_memory_bytes", "async_scheduling", "num_speculative_tokens"):
        assert key not in raw


@pytest.mark.skipif(LOG_012 is None, reason=f"no 012 crash log; {SHARED_HINT}")
def test_the_012_block_manager_crash_drafts_v0_without_chunked_prefill(tmp_path):
    text, sc, _ = _draft(tmp_path, LOG_012, "0.6.3.post1")
    assert sc.level == "v0-engine"
    assert sc.config.enable_chunked_prefill is False  # Scheduler._schedule_default
    assert (sc.expect.exception, sc.expect.where) == (
        "NoFreeBlocksError", "vllm/core/block/naive_block.py:_allocate_block_id")


def test_a_v1_crash_stays_v1_and_a_v0_start_up_failure_expects_engine_build(tmp_path):
    sp = "/usr/lib/python3.10/site-packages"
    v1 = tmp_path / "v1.log"
    v1.write_text(textwrap.dedent(f"""\
        INFO 01-01 00:00:00 [metrics.py:1] Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 5.0%
        Traceback (most recent call last):
          File "{sp}/vllm/v1/engine/core.py", line 10, in step
            self.scheduler.schedule()
          File "{sp}/vllm/v1/core/sched/scheduler.py", line 20, in schedule
            assert x
        AssertionError
        """))
    report, sc = triage_log(v1)
    assert v0_crash(report) is None
    assert draft_scenario(report, sc, version="0.10.2")[1].level != "v0-engine"
    v0 = tmp_path / "v0.log"
    v0.write_text(textwrap.dedent(f"""\
        INFO 01-01 00:00:00 llm_engine.py:1] Initializing an LLM engine (v0.6.3.post1) with config: model='m', max_seq_len=1024, use_v2_block_manager=True, num_scheduler_steps=1, enable_prefix_caching=True
        Traceback (most recent call last):
          File "{sp}/vllm/engine/llm_engine.py", line 10, in __init__
            self._initialize_kv_caches()
          File "{sp}/vllm/engine/llm_engine.py", line 20, in _initialize_kv_caches
            self.model_executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)
          File "{sp}/vllm/worker/worker.py", line 30, in raise_if_cache_size_invalid
            raise ValueError("No available memory for the cache blocks. Try increasing "
        ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.
        """))
    text, sc_obj, _ = _draft(tmp_path, v0)
    assert sc_obj.level == "v0-engine" and sc_obj.config.num_gpu_blocks == 0
    assert (sc_obj.expect.phase, sc_obj.expect.exception) == ("engine-build", "ValueError")
    assert sc_obj.config.enable_prefix_caching is True
    assert yaml.safe_load(text)["config"]["use_v2_block_manager"] is True


def test_a_multi_step_log_drafts_its_num_scheduler_steps(tmp_path):
    """level: v0-engine runs multi-step scheduling now: the banner's num_scheduler_steps=8 is
    carried into the draft, not left out with a note."""
    sp = "/usr/lib/python3.10/site-packages"
    log = tmp_path / "ms.log"
    log.write_text(textwrap.dedent(f"""\
        INFO 01-01 00:00:00 llm_engine.py:1] Initializing an LLM engine (v0.6.3.post1) with config: model='m', max_seq_len=1024, use_v2_block_manager=True, num_scheduler_steps=8, enable_prefix_caching=False
        Traceback (most recent call last):
          File "{sp}/vllm/engine/llm_engine.py", line 10, in step
            self.scheduler[0].schedule()
          File "{sp}/vllm/core/scheduler.py", line 20, in _schedule_default
            assert x
        AssertionError
        """))
    text, sc, _ = _draft(tmp_path, log)
    assert sc.level == "v0-engine"
    assert yaml.safe_load(text)["config"]["num_scheduler_steps"] == 8
    assert "multi-step" not in text
