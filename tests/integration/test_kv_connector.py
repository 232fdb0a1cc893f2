"""The scripted KV connector on the real releases, through the CLI as a user runs it: the
release's own scheduler builds the connector from ``kv_transfer_config`` (the lab only
registers it with ``KVConnectorFactory``) and the fake worker reports its transfers through
``ModelRunnerOutput``.

- vLLM #32255 (the catalog entry): aborting a request whose asynchronous load is in flight
  frees its blocks at once on 0.12.0 (KV_LOAD_TARGET_FREED at the abort's step, and with
  ``--keep-going`` the late ``finished_recving`` left behind in the scheduler), and is held
  until the load is reported on 0.16.0 and 0.33.0.
- Bad input: a ``load_fails`` script on a release whose ``KVConnectorOutput`` cannot report a
  failed load is exit 2 naming the field and the release.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from ..conftest import SCENARIOS

pytestmark = pytest.mark.slow

ENTRY = SCENARIOS / "vllm-32255-abort-async-load-frees-blocks.yaml"


def result(reports, name, version) -> dict:
    return json.loads((reports / name / version / "result.json").read_text())


def trace(reports, name, version) -> list[dict]:
    return [json.loads(x) for x in
            (reports / name / version / "trace.jsonl").read_text().splitlines()]


def test_32255_abort_frees_an_in_flight_load_until_0_16_holds_it(cli, tmp_path):
    name = ENTRY.stem
    proc = cli("run", str(ENTRY), "--reports", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = result(tmp_path, name, "0.12.0")
    assert bad["outcome"] == "violation"
    (v,) = bad["violations"]
    assert (v["code"], v["step"], v["requests"], v["blocks"]) == (
        "KV_LOAD_TARGET_FREED", 3, ["A"], [1, 2, 3])
    lines = trace(tmp_path, name, "0.12.0")
    # the connector's load started in step 1 (A waits for its KV), the abort came at step 3
    assert lines[0]["kv_connector"] == {"load": ["A"]} and lines[0]["waiting"] == ["A"]
    # the run stops in step 3, after schedule(): A is gone from the scheduler, its load not
    assert len(lines) == 3 and lines[2]["aborted"] == ["A"]
    assert "A" not in lines[2]["waiting"] + lines[2]["running"]
    assert [(x["code"], x["phase"]) for x in lines[2]["violations"]] == [
        ("KV_LOAD_TARGET_FREED", "after schedule")]

    for version in ("0.16.0", "0.33.0"):
        fixed = result(tmp_path, name, version)
        assert fixed["outcome"] == "clean", (version, fixed.get("violations"))
        assert fixed["finished"] == {"A": "FINISHED_ABORTED", "B": "FINISHED_LENGTH_CAPPED"}
        lines = trace(tmp_path, name, version)
        # A is held (aborted, its blocks kept) until the worker reports its load at step 4
        assert lines[2]["aborted"] == ["A"] and not lines[2]["finished"]
        assert lines[3]["kv_connector"] == {"recv": ["A"]} and lines[3]["finished"] == ["A"]
        assert lines[2]["free_blocks"] == lines[3]["free_blocks"] - 3


def test_32255_keep_going_also_finds_the_late_receive_left_in_the_scheduler(cli, tmp_path):
    """After the early free, the worker's finished_recving for A lands in
    Scheduler.finished_recving_kv_req_ids and nothing ever takes it out (REQ_RESIDUE, found by
    walking the scheduler's per-request sets)."""
    proc = cli("run", str(ENTRY), "--vllm", "0.12.0", "--keep-going", "--reports", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = result(tmp_path, ENTRY.stem, "0.12.0")
    codes = {v["code"]: v for v in res["violations"]}
    assert set(codes) == {"KV_LOAD_TARGET_FREED", "REQ_RESIDUE"}
    assert "Scheduler.finished_recving_kv_req_ids" in codes["REQ_RESIDUE"]["message"]
    assert codes["REQ_RESIDUE"]["requests"] == ["A"]
    assert res["finished"] == {"A": "FINISHED_ABORTED", "B": "FINISHED_LENGTH_CAPPED"}


def test_a_failed_load_on_a_release_that_cannot_report_it_is_exit_2(cli, tmp_path):
    path = tmp_path / "fails.yaml"
    path.write_text(textwrap.dedent("""
        name: kv-fails
        level: engine-core
        config: {num_gpu_blocks: 32, max_model_len: 256}
        requests:
          - {id: A, prompt_len: 64, max_tokens: 4}
        kv_transfer_config:
          requests:
            A: {external_hit_tokens: 32, load_fails: true}
    """))
    proc = cli("run", str(path), "--vllm", "0.10.2", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    res = result(tmp_path / "r", "kv-fails", "0.10.2")
    assert res["outcome"] == "error" and res["error"]["kind"] == "input"
    msg = res["error"]["message"]
    assert msg.startswith("kv_transfer_config.requests.A.load_fails: vLLM 0.10.2's ")
    assert "drop load_fails for this release" in msg
