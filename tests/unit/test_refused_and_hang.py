"""``outcome: refused`` and ``outcome: hang`` (issue 46): how a refusal by vLLM and a step that
never returns are judged, and the watchdog that ends such a step (no release: a looping
function in a file under a folder named ``vllm``)."""

from __future__ import annotations

import importlib.util
import textwrap
import threading
import time

import pytest

from vllm_repro.engine.watchdog import StepTimeout, Watchdog
from vllm_repro.errors import EXIT_INPUT, EXIT_MISMATCH, EXIT_OK
from vllm_repro.records import Crash, Frame, Hang, RunResult
from vllm_repro.scenario.schema import Scenario
from vllm_repro.verdict import exit_code, judge


def scenario(fixed: dict | None = None, expect: dict | None = None) -> Scenario:
    data = {"name": "s", "vllm": {"reproduces_on": ["0.10.1.1"], "clean_on": ["0.10.2"]},
            "config": {"num_gpu_blocks": 8}, "requests": [{"id": "A", "prompt_len": 4}],
            "expect": expect or {"outcome": "crash", "exception": "AssertionError"}}
    if fixed is not None:
        data["fixed"] = fixed
    return Scenario.model_validate(data)


def refused_run(exc_type="ValidationError", message="1 validation error for SchedulerConfig",
                phase="config") -> RunResult:
    r = RunResult.failed("input", f"config: vLLM 0.10.2 refuses this configuration: {exc_type}: "
                                  f"{message}")
    r.refusal = Crash(exc_type, message, Frame("vllm/config/scheduler.py", "__post_init__", 9),
                      step=0, phase=phase)
    return r


def test_a_fix_that_refuses_the_config_is_the_fixed_outcome():
    sc = scenario(fixed={"outcome": "refused", "exception": "ValidationError",
                         "message": "SchedulerConfig"})
    result = refused_run()
    v = judge(sc, "0.10.2", result)
    assert (v.ok, v.outcome, v.expected) == (True, "refused", "refused")
    assert result.outcome == "refused" and result.error is None  # what result.json says
    assert v.observed.startswith("refused ValidationError")
    assert exit_code([v]) == EXIT_OK


def test_a_refusal_with_another_message_is_a_mismatch():
    sc = scenario(fixed={"outcome": "refused", "message": "max_num_seqs"})
    v = judge(sc, "0.10.2", refused_run())
    assert v.ok is False and "does not match 'max_num_seqs'" in v.reason
    assert exit_code([v]) == EXIT_MISMATCH


def test_where_the_scenario_expects_a_run_a_refusal_stays_an_input_error():
    v = judge(scenario(), "0.10.1.1", refused_run())
    assert v.outcome == "error" and v.error_kind == "input"
    assert exit_code([v]) == EXIT_INPUT


def test_a_lab_refusal_is_not_vllms():
    """A field the release lacks is refused by the lab on the release's behalf (no vLLM
    exception): it never counts as ``outcome: refused``."""
    sc = scenario(fixed={"outcome": "refused"})
    v = judge(sc, "0.10.2", RunResult.failed("input", "config.foo: vLLM 0.10.2 has no field"))
    assert v.outcome == "error" and exit_code([v]) == EXIT_INPUT


def test_engine_start_up_and_add_request_refusals_count():
    sc = scenario(fixed={"outcome": "refused", "phase": "engine-build", "exception": "ValueError"})
    crashed = RunResult("crash", crash=Crash("ValueError", "too few blocks", step=0,
                                             phase="engine-build"))
    assert judge(sc, "0.10.2", crashed).ok is True
    sc = scenario(fixed={"outcome": "refused", "phase": "add_request", "message": "too long"})
    ran = RunResult("clean", finished={}, steps=1,
                    refused={"A": "ValueError: prompt too long (EngineCore.preprocess_add_request)"})
    v = judge(sc, "0.10.2", ran)
    assert v.ok is True and ran.refusal.type == "ValueError"


def test_a_refused_expectation_takes_exception_and_phase_but_not_code():
    Scenario.model_validate({**scenario().model_dump(exclude_none=True),
                             "fixed": {"outcome": "refused", "exception": "ValidationError"}})
    with pytest.raises(ValueError, match="only appl"):
        scenario(fixed={"outcome": "refused", "code": "KV_LEAK"})
    with pytest.raises(ValueError, match="`exception` only applies to outcome: crash or refused"):
        scenario(expect={"outcome": "hang", "exception": "X"})


def test_a_hang_is_judged_on_its_frame_and_never_clean():
    hang = Hang(3, 5.0, "schedule", Frame("vllm/v1/core/sched/scheduler.py", "schedule", 200),
                stacks='File "/x/vllm/v1/core/sched/scheduler.py", line 200 in schedule')
    sc = scenario(expect={"outcome": "hang", "where": "vllm/v1/core/sched/scheduler.py:schedule"})
    v = judge(sc, "0.10.1.1", RunResult("hang", hang=hang, steps=3))
    assert v.ok is True and v.observed.startswith("hang vllm/v1/core/sched/scheduler.py:schedule @3")
    v = judge(sc, "0.10.2", RunResult("hang", hang=hang, steps=3))  # clean_on: never clean
    assert v.ok is False and exit_code([v]) == EXIT_MISMATCH
    sc = scenario(expect={"outcome": "hang", "where": "vllm/v1/core/kv_cache_manager.py"})
    assert judge(sc, "0.10.1.1", RunResult("hang", hang=hang, steps=3)).ok is False


def _looping_module(tmp_path):
    (tmp_path / "vllm").mkdir()
    src = tmp_path / "vllm" / "sched.py"
    src.write_text(textwrap.dedent("""
        def schedule():
            n = 0
            while True:
                n += 1
    """))
    spec = importlib.util.spec_from_file_location("vllm_fake_sched", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_watchdog_interrupts_a_livelock_and_names_its_frame(tmp_path):
    mod = _looping_module(tmp_path)
    wd = Watchdog(0.5, tmp_path / "vllm", lambda: "schedule")
    t0 = time.monotonic()
    try:
        wd.arm(3, "step")
        with pytest.raises(StepTimeout):
            mod.schedule()
        wd.disarm()
    finally:
        wd.close()
    took = time.monotonic() - t0
    assert 0.5 <= took < 5, took
    h = wd.hang
    assert (h.step, h.phase, h.stopped) == (3, "schedule", "interrupted")
    assert h.where == Frame("vllm/sched.py", "schedule", h.where.line) and h.where.line in (4, 5)
    assert "sched.py" in h.stacks and "in schedule" in h.stacks
    assert not wd._thread.is_alive()


def test_a_call_that_returns_in_time_is_left_alone(tmp_path):
    wd = Watchdog(0.3, tmp_path)
    try:
        for step in range(5):
            wd.arm(step, "step")
            time.sleep(0.1)
            wd.disarm()
        time.sleep(0.5)  # disarmed: nothing fires later
    finally:
        wd.close()
    assert wd.hang is None
    assert not any(t.name == "vllm-repro-watchdog" for t in threading.enumerate())
