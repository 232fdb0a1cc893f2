"""Events on the release side (engine/events.py): the schema's mapping becomes one dataclass per
action, one dispatch calls the level's own method, and a release lacking an EngineCore call is
refused with the line that names it."""

import pytest
import yaml

from vllm_repro.engine import events
from vllm_repro.engine.core_loop import EngineCoreLoop
from vllm_repro.engine.loop import StepLoop
from vllm_repro.engine.v0 import V0EngineLoop
from vllm_repro.records import TraceLine
from vllm_repro.scenario.load import parse_scenario

YAML = """
name: ev
level: engine-core
config: {num_gpu_blocks: 64, block_size: 16}
requests:
  - {id: A, prompt_len: 20, max_tokens: 8, at_step: 1}
  - {id: B, prompt_len: 20, max_tokens: 8, at_step: 1}
events:
  - {at_step: 2, abort: [A, B], when: in_flight}
  - {at_step: 3, reset_prefix_cache: true, reset_running_requests: true}
  - {at_step: 4, pause: true, mode: keep}
  - {at_step: 5, resume: true}
  - {at_step: 5, abort: [B]}
"""


def test_the_schemas_events_become_one_dataclass_each():
    payload = parse_scenario(yaml.safe_load(YAML), "ev.yaml").child_payload()
    got = [events.from_mapping(e) for e in payload["events"]]
    assert got == [events.Abort(2, ("A", "B"), "in_flight"),
                   events.ResetPrefixCache(3, True), events.Pause(4, "keep"), events.Resume(5),
                   events.Abort(5, ("B",))]
    by_step = events.by_step(payload["events"])
    assert [type(e).__name__ for e in by_step[5]] == ["Resume", "Abort"]  # the scenario's order
    fault = events.from_mapping({"at_step": 3, "fault": {"rank": 1, "kind": "exit",
                                                          "exit_code": 7}})
    assert fault == events.InjectFault(3, events.FaultSpec(1, "exit", 60.0, 7, None))
    with pytest.raises(ValueError, match="no action"):
        events.from_mapping({"at_step": 1, "abort": None})


def test_one_dispatch_calls_the_levels_own_method():
    class Level:
        def do_abort(self, e, line):
            line.aborted.extend(e.ids)

    line = TraceLine(step=2, aborted=[])
    events.perform(Level(), events.Abort(2, ("A",)), line)
    assert line.aborted == ["A"]
    assert not events.supported(Level(), events.Pause(2))
    # which kinds each level performs: scheduler and v0-engine abort only, engine-core all
    every = [cls(1) for cls in events.EVENT_TYPES.values()]
    assert [e.action for e in every if hasattr(StepLoop, "do_" + e.action)] == ["abort"]
    assert [e.action for e in every if hasattr(V0EngineLoop, "do_" + e.action)] == ["abort"]
    assert [e.action for e in every if hasattr(EngineCoreLoop, "do_" + e.action)] \
        == list(events.EVENT_TYPES)


def test_a_release_without_the_call_is_refused_naming_it():
    assert events.refusal(events.Pause(4, "keep"), ("pause", "pause_mode"), "0.30.0") is None
    assert events.refusal(events.Pause(4), (), "0.20.0") == (
        "events[at_step 4].pause: vLLM 0.20.0's EngineCore has no pause_scheduler(); drop the "
        "event for this release")
    assert events.refusal(events.Pause(4, "keep"), ("pause",), "0.21.0") == (
        "events[at_step 4].mode: vLLM 0.21.0's pause_scheduler() takes no mode (it pauses "
        "without aborting); drop mode for this release")
    assert "reset_running_requests: vLLM 0.12.0's reset_prefix_cache() does not take it" in \
        events.refusal(events.ResetPrefixCache(3, True), ("reset_prefix_cache",), "0.12.0")
    assert events.refusal(events.Abort(1, ("A",)), (), "0.9.2") is None
