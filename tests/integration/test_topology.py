"""N GPUs on a CPU (issue 44): the emulated platform reports the devices a topology asks for, the
batch queue deepens with pipeline_parallel_size through vLLM's own config, and the release's own
MultiprocExecutor runs its rank processes with the lab's fake worker, faults injected into them.
Through the CLI, as a user runs it."""

from __future__ import annotations

import json

import pytest
import yaml

from ..conftest import ROOT
from .test_engine_core import at_engine_core

pytestmark = pytest.mark.slow

STRESS = ROOT / "scenarios" / "stress"


def trace(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("versions", [("0.26.0", "0.33.0")])
def test_pipeline_parallel_3_keeps_three_batches_in_flight_clean_on_the_stress_workload(
        cli, tmp_path, versions):
    f = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, pipeline_parallel_size=3,
                       max_concurrent_batches=3)
    args = [str(f)]
    for v in versions:
        args += ["--vllm", v]
    proc = cli("run", *args, "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = yaml.safe_load(f.read_text())["name"]
    for v in versions:
        run = tmp_path / "r" / name / v
        res = json.loads((run / "result.json").read_text())
        assert res["outcome"] == "clean", (v, res["outcome"], res.get("violations"))
        assert res["audit"]["checks"] > 0
        assert res["engine"]["batch_queue_size"] == 3
        assert res["engine"]["step_fn"] == "step_with_batch_queue"
        lines = trace(run / "trace.jsonl")
        assert max(line.get("in_flight") or 0 for line in lines) == 3
        # a batch is applied two steps after the step that scheduled it, once the pipe is full
        lags = {line["step"] - s for line in lines for s in line.get("applied_from") or ()}
        assert 2 in lags, sorted(lags)


def test_a_batch_queue_depth_vllms_config_does_not_give_is_refused_naming_the_fix(cli, tmp_path):
    f = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, max_concurrent_batches=4)
    proc = cli("run", str(f), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config.max_concurrent_batches" in proc.stdout + proc.stderr
    assert "pipeline_parallel_size: 4" in proc.stdout + proc.stderr


def test_a_world_over_the_lab_bound_is_an_input_error(cli, tmp_path):
    f = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, tensor_parallel_size=4,
                       pipeline_parallel_size=4)
    proc = cli("run", str(f), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "16 ranks" in proc.stdout + proc.stderr
