"""The scripted KV connector on the real releases, through the CLI as a user runs it: the
release's own scheduler builds the connector from ``kv_transfer_config`` (the lab only
registers it with ``KVConnectorFactory``) and the fake worker reports its transfers through
``ModelRunnerOutput``.

- vLLM #32255 (the catalog entry): aborting a request whose asynchronous load is in flight
  frees its blocks at once on 0.12.0 (KV_TRANSFER_FREED at the abort's step, and with
  ``--keep-going`` the late ``finished_recving`` left behind in the scheduler), and is held
  until the load is reported on 0.16.0 and 0.33.0.
- vLLM #25067 (the catalog entry): an abort of a request that already finished, whose blocks the
  connector keeps for a send, frees them at once on 0.10.2 and 0.11.0 (KV_TRANSFER_FREED at
  the abort's step; without the audit 0.10.2 dies with the PR's KeyError when the send is
  reported and 0.11.0 logs "already freed"), and is ignored from 0.11.1 on.
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
ENTRY_25067 = SCENARIOS / "vllm-25067-abort-after-finish-frees-sent-blocks.yaml"


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
        "KV_TRANSFER_FREED", 3, ["A"], [1, 2, 3])
    lines = trace(tmp_path, name, "0.12.0")
    # the connector's load started in step 1 (A waits for its KV), the abort came at step 3
    assert lines[0]["kv_connector"] == {"load": ["A"]} and lines[0]["waiting"] == ["A"]
    # the run stops in step 3, after schedule(): A is gone from the scheduler, its load not
    assert len(lines) == 3 and lines[2]["aborted"] == ["A"]
    assert "A" not in lines[2]["waiting"] + lines[2]["running"]
    assert [(x["code"], x["phase"]) for x in lines[2]["violations"]] == [
        ("KV_TRANSFER_FREED", "after schedule")]

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
    assert set(codes) == {"KV_TRANSFER_FREED", "REQ_RESIDUE"}
    assert "Scheduler.finished_recving_kv_req_ids" in codes["REQ_RESIDUE"]["message"]
    assert codes["REQ_RESIDUE"]["requests"] == ["A"]
    assert res["finished"] == {"A": "FINISHED_ABORTED", "B": "FINISHED_LENGTH_CAPPED"}


def test_25067_an_abort_after_finish_frees_the_blocks_being_sent_until_0_11_1(cli, tmp_path):
    name = ENTRY_25067.stem
    proc = cli("run", str(ENTRY_25067), "--reports", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for version in ("0.10.2", "0.11.0"):
        bad = result(tmp_path, name, version)
        (v,) = bad["violations"]
        assert (v["code"], v["step"], v["requests"]) == ("KV_TRANSFER_FREED", 4, ["P"]), version
        assert "KV send (a delayed free)" in v["message"]
        lines = trace(tmp_path, name, version)
        # P finished at step 1 but stayed in the scheduler (its free delayed for the send)
        assert lines[0]["finished"] == [] and "P" not in lines[0]["running"]
        assert lines[3]["aborted"] == ["P"] and len(lines) == 4
    for version in ("0.12.0", "0.33.0"):
        fixed = result(tmp_path, name, version)
        assert fixed["outcome"] == "clean", (version, fixed.get("violations"))
        # the abort was ignored: P keeps its own finish, and leaves when its send is reported
        assert fixed["finished"] == {"P": "FINISHED_LENGTH_CAPPED", "Q": "FINISHED_LENGTH_CAPPED"}
        lines = trace(tmp_path, name, version)
        sent = [ln["step"] for ln in lines if "send" in (ln.get("kv_connector") or {})]
        left = [ln["step"] for ln in lines if "P" in (ln.get("finished") or [])]
        assert sent == [6] and left == [6], version


def test_25067_without_the_audit_0_10_2_dies_with_the_prs_key_error(cli, tmp_path):
    proc = cli("run", str(ENTRY_25067), "--no-audit", "--vllm", "0.10.2", "--vllm", "0.11.0",
               "--reports", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # not the expected violation
    crash = result(tmp_path, ENTRY_25067.stem, "0.10.2")["crash"]
    assert (crash["type"], crash["message"], crash["step"], crash["phase"]) == (
        "KeyError", "'P'", 6, "update_from_output")
    assert crash["vllm_frames"][-1]["function"] == "_update_from_kv_xfer_finished"
    # 0.11.0 (PR #25844) only warns, with P's blocks long back in the pool
    assert result(tmp_path, ENTRY_25067.stem, "0.11.0")["outcome"] == "clean"
    log = (tmp_path / ENTRY_25067.stem / "0.11.0" / "engine.log").read_text()  # the run's own
    assert "Got finished sending KV transfer for request P" in log and "already freed" in log


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
