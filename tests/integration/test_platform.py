"""The platform vLLM sees (issue 18 item 8): the GPU deployment's CUDA platform by default,
emulated at vLLM's platform seam, so CUDA's config rules apply; vLLM's CPU platform on request.
"""

from __future__ import annotations

import json

import pytest
import yaml

from ..conftest import FLAGSHIP

pytestmark = pytest.mark.slow


def flagship_variant(tmp_path, name: str, **changes) -> str:
    """The catalog's flagship (vLLM #23347) with ``changes`` merged into its top level /
    ``config``; the pool keeps its 64 usable tokens when the block size changes."""
    data = yaml.safe_load(FLAGSHIP.read_text())
    data["name"] = name
    data["config"].update(changes.pop("config", {}))
    data.update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def rows(stdout: str) -> list[dict]:
    return json.loads(stdout)


def test_block_size_32_runs_the_flagship_with_its_verdicts_under_cuda(cli, tmp_path):
    """CUDA deployments use block_size 32; 0.10.x's CPU platform refused it. Under the
    (default) emulated CUDA platform the flagship at 32-token blocks (2 usable blocks: the same
    64 tokens as 4 of 16) crashes on 0.10.1.1 with vLLM's assert and is clean on 0.10.2."""
    sc = flagship_variant(tmp_path, "flagship-bs32", config={"block_size": 32, "num_gpu_blocks": 3})
    reports = tmp_path / "r"
    proc = cli("run", sc, "--reports", str(reports), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = {r["vllm"]: r for r in rows(proc.stdout)}
    assert got["0.10.1.1"]["ok"] and got["0.10.1.1"]["observed"].startswith(
        "crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3")
    assert got["0.10.2"]["ok"] and "2 finished" in got["0.10.2"]["observed"]
    result = json.loads((reports / "flagship-bs32" / "0.10.1.1" / "result.json").read_text())
    assert result["platform"].startswith("cuda 9.0 (emulated ")


def test_the_cpu_platform_is_vllms_own_with_its_rules(cli, tmp_path):
    """``platform: {name: cpu}`` is vLLM's CpuPlatform: 0.10.2's refuses 32-token blocks
    ("requires intel_extension_for_pytorch"), reported as the release refusing the scenario
    (exit 2), never as a crash or clean."""
    sc = flagship_variant(tmp_path, "flagship-bs32-cpu", config={"block_size": 32, "num_gpu_blocks": 3},
                          platform={"name": "cpu"})
    proc = cli("run", sc, "--vllm", "0.10.2", "--reports", str(tmp_path / "r"), "--json")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (row,) = rows(proc.stdout)
    assert "intel_extension_for_pytorch" in row["observed"] and "refuses" in row["observed"]


def test_a_bad_platform_is_exit_2_naming_the_field(cli, tmp_path):
    sc = flagship_variant(tmp_path, "flagship-rocm", platform={"name": "rocm"})
    proc = cli("run", sc, "--vllm", "0.10.2", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "platform.name" in proc.stderr and "Traceback" not in proc.stderr
