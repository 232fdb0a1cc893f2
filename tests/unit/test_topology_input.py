"""Topologies and rank faults in a scenario (issue 44): the parallel sizes are bounded, a fault
needs rank processes and a rank of the world, and the emulated platform reports the devices
the topology asks for."""

from __future__ import annotations

import textwrap

import pytest

from vllm_repro.engine.topology import MAX_WORLD_SIZE, topology
from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario

BASE = """
    name: t
    level: engine-core
    config: {{num_gpu_blocks: 64, {config}}}
    requests:
      - {{id: A, prompt_len: 10}}
    events:
      - {{at_step: 2, {event}}}
"""


def write(tmp_path, config="tensor_parallel_size: 2, distributed_executor_backend: mp",
          event="fault: {rank: 1, kind: hang, seconds: 5}"):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(BASE.format(config=config, event=event)))
    return p


def test_a_rank_fault_loads_with_its_kind_and_defaults(tmp_path):
    sc = load_scenario(write(tmp_path))
    fault = sc.events[0].fault
    assert (fault.rank, fault.kind, fault.seconds, fault.on_execute_model) == (1, "hang", 5.0, None)
    topo = topology({"passthrough": sc.config.model_extra})
    assert (topo.tp, topo.pp, topo.world_size, topo.multiprocess) == (2, 1, 2, True)


@pytest.mark.parametrize("config, event, words", [
    ("tensor_parallel_size: 2", "fault: {rank: 1, kind: hang}",
     "needs rank processes; add config.distributed_executor_backend: mp"),
    ("tensor_parallel_size: 2, distributed_executor_backend: mp", "fault: {rank: 2, kind: exit}",
     "is not a rank of this world (2 ranks: 0 to 1)"),
    ("tensor_parallel_size: 2, distributed_executor_backend: mp",
     "fault: {rank: 0, kind: raise, seconds: 3}", "`seconds` goes with kind: hang or late"),
    ("tensor_parallel_size: 2, distributed_executor_backend: mp",
     "fault: {rank: 0, kind: hang, seconds: 601}", "seconds"),
    ("tensor_parallel_size: 2, distributed_executor_backend: mp",
     "fault: {rank: 0, kind: hang}, abort: [A]", "exactly one of"),
    ("tensor_parallel_size: 4, pipeline_parallel_size: 4", "abort: [A]",
     f"16 ranks, over the lab's {MAX_WORLD_SIZE}"),
    ("pipeline_parallel_size: 0", "abort: [A]", "pipeline_parallel_size: 0 is not a positive"),
    ("execute_model_timeout_seconds: 0", "abort: [A]", "execute_model_timeout_seconds"),
])
def test_bad_topologies_and_faults_name_the_field(tmp_path, config, event, words):
    with pytest.raises(InputError) as err:
        load_scenario(write(tmp_path, config, event))
    assert words in str(err.value), str(err.value)


def test_the_execute_model_timeout_is_an_engine_core_field(tmp_path):
    p = write(tmp_path, "execute_model_timeout_seconds: 5", "abort: [A]")
    p.write_text(p.read_text().replace("level: engine-core\n", ""))
    with pytest.raises(InputError) as err:
        load_scenario(p)
    assert "add `level: engine-core`" in str(err.value)


def test_the_emulated_platform_answers_the_device_count_set_for_a_run():
    from vllm_repro.engine.adapter import platform

    assert platform.device_count() == 1
    before = platform.set_device_count(3)
    try:
        assert before == 1 and platform.device_count() == 3
        with pytest.raises(platform.PlatformError):
            platform.set_device_count(MAX_WORLD_SIZE + 1)
    finally:
        platform.set_device_count(before)
    assert platform.device_count() == 1


def test_the_asyncio_client_without_the_engine_core_process_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="asyncio_mode: true needs config.multiprocess_mode"):
        load_scenario(write(tmp_path, config="asyncio_mode: true", event="abort: [A]"))


def test_the_engine_core_process_is_an_engine_core_level_field(tmp_path):
    p = write(tmp_path, config="multiprocess_mode: true", event="abort: [A]")
    p.write_text(p.read_text().replace("level: engine-core", "level: scheduler"))
    with pytest.raises(InputError, match="multiprocess_mode applies to level: engine-core"):
        load_scenario(p)


def test_the_world_size_error_names_config_once(tmp_path):
    with pytest.raises(InputError) as err:
        load_scenario(write(tmp_path, "tensor_parallel_size: 9", "abort: [A]"))
    assert "config: config" not in str(err.value)
    assert ": config: tensor_parallel_size x pipeline_parallel_size" in str(err.value)


def test_the_engine_core_process_at_v0_says_to_drop_it_not_to_size_a_pool(tmp_path):
    p = write(tmp_path, config="multiprocess_mode: true", event="abort: [A]")
    p.write_text(p.read_text().replace("level: engine-core", "level: v0-engine"))
    with pytest.raises(InputError) as err:
        load_scenario(p)
    assert "config.multiprocess_mode applies to level: engine-core; drop it" in str(err.value)
    assert "num_gpu_blocks" not in str(err.value)


def test_the_engine_core_process_is_picked_by_its_field():
    from vllm_repro.engine.core_loop import EngineCoreLoop
    from vllm_repro.engine.core_proc import CoreProcLoop, loop_class

    assert loop_class({"config": {"multiprocess_mode": True}}) is CoreProcLoop
    assert loop_class({"config": {"multiprocess_mode": False}}) is EngineCoreLoop
    assert loop_class({"config": {}}) is EngineCoreLoop


def test_expect_steps_of_a_data_parallel_run_is_an_input_error_naming_the_field(tmp_path):
    """Each DP rank's engine core numbers its own steps: expect.steps / stats cannot name one."""
    p = tmp_path / "dp.yaml"
    p.write_text(textwrap.dedent("""
        name: dp
        level: engine-core
        config: {num_gpu_blocks: 64, multiprocess_mode: true, asyncio_mode: true,
                 model: mixtral-moe, data_parallel_size: 2}
        requests:
          - {id: A, prompt_len: 10}
        expect:
          outcome: clean
          steps: [{at_step: 2, scheduled: {A: 1}}]
    """))
    with pytest.raises(InputError, match=r"expect\.steps / expect\.stats with "
                                         r"config\.data_parallel_size 2"):
        load_scenario(p)
    p.write_text(p.read_text().replace("data_parallel_size: 2", "data_parallel_size: 1"))
    assert load_scenario(p).expect.steps


DP = ("multiprocess_mode: true, asyncio_mode: true, model: mixtral-moe, "
      "data_parallel_size: 2")


@pytest.mark.parametrize("config, request_fields, words", [
    (DP + ", tensor_parallel_size: 2, distributed_executor_backend: mp", "",
     "config.data_parallel_size: 2 with config.tensor_parallel_size: 2: rank processes under "
     "each DP rank are not built yet"),
    (DP + ", pipeline_parallel_size: 3, distributed_executor_backend: mp", "",
     "with config.pipeline_parallel_size: 3"),
    (DP, ", allowed_token_ids: [100]",
     "requests[0].allowed_token_ids with config.data_parallel_size: 2: the front door of a DP "
     "run does not judge it yet"),
    (DP, ", structured_outputs: {regex: '[0-9]+'}", "requests[0].structured_outputs with"),
    (DP + ", data_parallel_size_local: 1", "", "config.data_parallel_size_local: 1: every DP "
     "rank runs on this host"),
    (DP + ", data_parallel_master_ip: 10.1.2.3", "", "stay on 127.0.0.1"),
    (DP + ", data_parallel_external_lb: true", "",
     "config.data_parallel_external_lb: true with config.data_parallel_size: 2"),
    (DP + ", data_parallel_rank: 1", "", "config.data_parallel_rank: 1 with"),
    (DP + ", data_parallel_backend: ray", "", "Ray is not in the lab's release environments"),
    (DP.replace("asyncio_mode: true, ", ""), "",
     "add config.multiprocess_mode: true and config.asyncio_mode: true"),
])
def test_what_data_parallelism_does_not_run_yet_is_refused_before_any_run(
        tmp_path, config, request_fields, words):
    p = tmp_path / "dp.yaml"
    p.write_text(textwrap.dedent(f"""
        name: dp
        level: engine-core
        config: {{num_gpu_blocks: 64, max_model_len: 256, {config}}}
        requests:
          - {{id: a, prompt_len: 10, max_tokens: 4{request_fields}}}
    """))
    with pytest.raises(InputError) as err:
        load_scenario(p)
    assert words in str(err.value), str(err.value)


def test_dp_with_events_is_refused_before_any_run(tmp_path):
    p = write(tmp_path, config=DP, event="abort: [A]")
    with pytest.raises(InputError, match="events are not sent through the DP client yet"):
        load_scenario(p)


def test_the_engine_core_process_on_vllms_cpu_platform_is_refused_before_any_run(tmp_path):
    p = write(tmp_path, config="multiprocess_mode: true", event="abort: [A]")
    p.write_text(p.read_text() + "platform: {name: cpu}\n")
    with pytest.raises(InputError, match="config.multiprocess_mode with platform.name: cpu"):
        load_scenario(p)
