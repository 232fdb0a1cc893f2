"""vLLM's own OffloadingConnector and MultiConnector on real releases, through the CLI (issue
45): their scheduler halves run as shipped under the release's scheduler, only the transfers
are the lab's (the scripted worker half); vLLM's reset_prefix_cache(reset_connector=True)
reaches the connector's cache; the catalog entry vllm-49118 reproduces on 0.26.0 only."""

from __future__ import annotations

import json
import textwrap

import pytest

from ..conftest import ROOT, SCENARIOS

pytestmark = pytest.mark.slow
DATA = ROOT / "tests" / "data"
ENTRY = SCENARIOS / "vllm-49118-offloading-abort-queued-store-assert.yaml"


def result(reports, name, version) -> dict:
    return json.loads((reports / name / version / "result.json").read_text())


def trace(reports, name, version) -> list[dict]:
    return [json.loads(x) for x in
            (reports / name / version / "trace.jsonl").read_text().splitlines()]


def test_49118_an_aborted_queued_request_kills_0_26_and_is_dropped_from_0_27(cli, tmp_path):
    proc = cli("run", str(ENTRY), "--vllm", "0.26.0", "--vllm", "0.27.0",
               "--reports", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr  # both as the entry expects
    crash = result(tmp_path, ENTRY.stem, "0.26.0")["crash"]
    assert (crash["type"], crash["step"], crash["phase"]) == ("AssertionError", 3, "schedule")
    assert crash["vllm_frames"][-1]["function"] == "_build_store_jobs"
    for version in ("0.26.0", "0.27.0"):
        lines = trace(tmp_path, ENTRY.stem, version)
        # A's prompt stored in step 1; B looked up and left waiting without blocks in step 2
        assert lines[0]["kv_connector"]["store"] == ["A"]
        assert lines[1]["waiting"] == ["B"] and "B" not in lines[1]["scheduled"]
        assert lines[2]["aborted"] == ["B"]
    fixed = result(tmp_path, ENTRY.stem, "0.27.0")
    assert fixed["outcome"] == "clean"
    assert fixed["finished"] == {"A": "FINISHED_LENGTH_CAPPED", "B": "FINISHED_ABORTED"}


def test_offloading_loads_a_cpu_hit_and_reset_connector_empties_its_cache(cli, tmp_path):
    """C hits A's prompt in the CPU cache: vLLM's scheduler half loads it asynchronously
    (C waits until the scripted load is reported at step 14, then computes its 16 new
    tokens); after reset_prefix_cache(reset_connector=True) at step 20 D finds nothing and
    computes all 80. Without reset_connector D loads from the CPU cache."""
    keep = tmp_path / "kv-offload-keep.yaml"
    keep.write_text((DATA / "kv-offload.yaml").read_text().replace(
        "name: kv-offload", "name: kv-offload-keep").replace(", reset_connector: true", ""))
    proc = cli("run", str(DATA / "kv-offload.yaml"), str(keep), "--vllm", "0.33.0",
               "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = result(tmp_path / "r", "kv-offload", "0.33.0")
    assert res["outcome"] == "clean", res.get("violations")
    assert sorted(res["finished"]) == ["A", "C", "D", "F"]
    by_step = {ln["step"]: ln for ln in trace(tmp_path / "r", "kv-offload", "0.33.0")}
    assert by_step[12]["kv_connector"] == {"load": ["C"]} and not by_step[12]["scheduled"]
    assert by_step[14]["kv_connector"] == {"recv": ["C"]}
    assert by_step[15]["scheduled"] == {"C": 16}
    assert by_step[20]["reset_prefix_cache"] is True
    assert by_step[21]["scheduled"] == {"D": 80}
    kept = {ln["step"]: ln for ln in trace(tmp_path / "r", "kv-offload-keep", "0.33.0")}
    assert kept[21]["kv_connector"]["load"] == ["D"] and kept[22]["scheduled"] == {"D": 16}


def test_multiconnector_holds_a_send_until_every_child_reports(cli, tmp_path):
    """vLLM's MultiConnector over two scripted children: A loads from the child that has it
    (the second); P's free is delayed by both children, and the first child's report at step
    4 is held by MultiConnector (extra_async_saves) until the second reports at step 7."""
    path = tmp_path / "kv-multi.yaml"
    path.write_text(textwrap.dedent("""
        name: kv-multi
        level: engine-core
        config: {block_size: 16, num_gpu_blocks: 64, max_num_seqs: 4, max_model_len: 256}
        requests:
          - {id: P, at_step: 1, prompt_len: 48, max_tokens: 1}
          - {id: A, at_step: 2, prompt_len: 64, max_tokens: 4}
        kv_transfer_config:
          kv_connector: MultiConnector
          connectors:
            - requests:
                P: {delay_free: true, send_done_at_step: 4}
            - requests:
                P: {delay_free: true, send_done_at_step: 7}
                A: {external_hit_tokens: 32, load_async: true, recv_done_at_step: 3}
        limits: {max_steps: 30}
    """))
    proc = cli("run", str(path), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = result(tmp_path / "r", "kv-multi", "0.33.0")
    assert res["outcome"] == "clean", res.get("violations")
    lines = {ln["step"]: ln for ln in trace(tmp_path / "r", "kv-multi", "0.33.0")}
    assert lines[2]["kv_connector"] == {"load": ["A"]} and lines[4]["scheduled"] == {"A": 32}
    sends = [s for s, ln in lines.items() if "send" in (ln.get("kv_connector") or {})]
    assert sends == [4, 7]
    left = [s for s, ln in lines.items() if "P" in (ln.get("finished") or [])]
    assert left == [7]
    assert lines[7]["free_blocks"] > lines[6]["free_blocks"]


def test_offloading_on_a_release_with_per_request_transfers_is_exit_2(cli, tmp_path):
    path = tmp_path / "kv-off-old.yaml"
    path.write_text((DATA / "kv-offload.yaml").read_text().replace(
        "name: kv-offload", "name: kv-off-old"))
    proc = cli("run", str(path), "--vllm", "0.20.1", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    msg = result(tmp_path / "r", "kv-off-old", "0.20.1")["error"]["message"]
    assert msg.startswith("kv_transfer_config.kv_connector: vLLM 0.20.1's OffloadingConnector "
                          "reports its transfers per request")
