"""The release side's records (engine/spec.py) carry every field the host sends, with the
schema's defaults: a field added to the schema or to RunLimits but not here would be dropped
silently on the way to the loops."""

from dataclasses import fields

from vllm_repro.engine.spec import LabLimits, ScenarioLimits, ScenarioRequest
from vllm_repro.limits import RunLimits
from vllm_repro.scenario.schema import Limits, RequestSpec, Scenario


def test_each_record_has_the_fields_and_defaults_of_what_the_host_sends():
    for record, host in ((ScenarioRequest, RequestSpec), (ScenarioLimits, Limits)):
        mine = {f.name: f.default for f in fields(record)}
        assert set(mine) == set(host.model_fields), record.__name__
        for name, info in host.model_fields.items():
            if not info.is_required():
                assert mine[name] == info.default, f"{record.__name__}.{name}"
    assert {f.name for f in fields(LabLimits)} == {f.name for f in fields(RunLimits)}


def test_a_scenario_payload_becomes_records_with_its_values():
    sc = Scenario.model_validate({
        "name": "t", "config": {"num_gpu_blocks": 16, "block_size": 4},
        "requests": [{"id": "a", "prompt_len": 8, "priority": 3, "prefix": "p", "prefix_len": 4},
                     {"id": "b", "prompt_len": 5, "at_step": 2}],
        "limits": {"max_steps": 40}})
    payload = sc.child_payload()
    reqs = [ScenarioRequest.from_mapping(r) for r in payload["requests"]]
    assert [(r.id, r.at_step, r.prompt_len, r.priority, r.prefix, r.prefix_len) for r in reqs] == [
        ("a", 1, 8, 3, "p", 4), ("b", 2, 5, 0, None, None)]
    lim = ScenarioLimits.from_mapping(payload["limits"])
    assert (lim.max_steps, lim.stall_steps, lim.step_timeout_s) == (40, 20, None)
    lab = LabLimits.from_mapping(RunLimits(1, 2, 3, 4.5, 6, 7.0, 8.0).as_dict())
    assert (lab.max_kv_blocks, lab.max_trace_mb, lab.worker_memory_mb, lab.step_timeout_s) == (1, 4.5, 6, 8.0)
