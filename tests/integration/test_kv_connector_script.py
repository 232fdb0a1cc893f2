"""The scripted KV connector's failure-path fields on real releases, through the CLI
(issue 45): a connector declaring HMA support keeps the hybrid KV cache groups, and a load
failing in one group meets each release's own handling; "not yet" lookups park a request for
the scripted number of steps; an aborted request's free is held until its send is reported."""

from __future__ import annotations

import json
import textwrap

import pytest

pytestmark = pytest.mark.slow

HYBRID = """
    name: {name}
    level: engine-core
    config:
      block_size: 16
      num_gpu_blocks: 64
      max_num_seqs: 4
      max_num_batched_tokens: 256
      max_model_len: 256
      kv_cache_groups: [{{type: full}}, {{type: sliding_window, sliding_window: 32}}]
    requests:
      - {{id: A, at_step: 1, prompt_len: 64, max_tokens: 4}}
      - {{id: B, at_step: 1, prompt_len: 32, max_tokens: 4}}
      - {{id: P, at_step: 1, prompt_len: 48, max_tokens: 10}}
    events:
      - {{at_step: 3, abort: [P]}}
    kv_transfer_config:
      supports_hma: {hma}
      requests:
        A: {{external_hit_tokens: 48, load_async: true, not_ready_lookups: 3, load_fails: true{groups}}}
        P: {{delay_free_on_abort: true, send_done_at_step: 6}}
    limits: {{max_steps: 30}}
"""


def scenario(tmp_path, name, hma="true", groups=""):
    p = tmp_path / f"{name}.yaml"
    p.write_text(textwrap.dedent(HYBRID.format(name=name, hma=hma, groups=groups)))
    return p


def result(reports, name, version) -> dict:
    return json.loads((reports / name / version / "result.json").read_text())


def trace(reports, name, version) -> list[dict]:
    return [json.loads(x) for x in
            (reports / name / version / "trace.jsonl").read_text().splitlines()]


def test_a_request_level_failure_under_hma_not_yet_lookups_and_a_held_abort(cli, tmp_path):
    """0.33.0: the connector declares SupportsHMA, so vLLM keeps both groups (64 blocks, not
    the 32 of a pool turned full-attention-only); A is answered "not yet" in steps 1-3, loads
    asynchronously in step 4 and fails as a request (load_fails_groups: [],
    failed_recving only), which the
    default kv_load_failure_policy ends with FINISHED_ERROR; P's abort at step 3 is held
    until the worker reports its send at step 6."""
    path = scenario(tmp_path, "kv-hma", groups=", load_fails_groups: []")
    proc = cli("run", str(path), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = result(tmp_path / "r", "kv-hma", "0.33.0")
    assert res["outcome"] == "clean", res.get("violations")
    assert res["engine"]["num_gpu_blocks"] == 64
    assert res["finished"] == {"A": "FINISHED_ERROR", "B": "FINISHED_LENGTH_CAPPED",
                               "P": "FINISHED_ABORTED"}
    lines = trace(tmp_path / "r", "kv-hma", "0.33.0")
    kv = {ln["step"]: ln.get("kv_connector") for ln in lines}
    assert [s for s, e in kv.items() if e and "not_ready" in e] == [1, 2, 3]
    assert all("A" in lines[i]["waiting"] and "A" not in lines[i]["scheduled"]
               for i in range(3))
    assert kv[4] == {"load": ["A"], "load_failed": ["A"]}
    assert lines[2]["aborted"] == ["P"] and "P" not in lines[2]["finished"]
    assert kv[6] == {"send": ["P"]} and lines[5]["finished"] == ["P"]
    assert lines[5]["free_blocks"] > lines[4]["free_blocks"]  # P's blocks back at the send


def test_a_block_level_failure_in_a_hybrid_layout_meets_each_releases_scheduler(cli, tmp_path):
    """The same failure reported per block (both groups' blocks in invalid_block_ids): 0.29.0's
    Scheduler._update_requests_with_invalid_blocks unpacks one group and dies with ValueError;
    0.33.0 refuses block-level reports for several groups with its own RuntimeError (vLLM
    #56855). Without supports_hma, vLLM turns the hybrid allocator off and the failure is one
    group's: 0.33.0 runs it clean."""
    path = scenario(tmp_path, "kv-hma-blocks")
    proc = cli("run", str(path), "--vllm", "0.29.0", "--vllm", "0.33.0",
               "--reports", str(tmp_path / "r"))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # crashes nobody expected
    old = result(tmp_path / "r", "kv-hma-blocks", "0.29.0")["crash"]
    assert (old["type"], old["message"], old["where"]["function"]) == (
        "ValueError", "too many values to unpack (expected 1)",
        "_update_requests_with_invalid_blocks")
    new = result(tmp_path / "r", "kv-hma-blocks", "0.33.0")["crash"]
    assert (new["type"], new["where"]["function"]) == ("RuntimeError", "_handle_invalid_blocks")
    assert "failed_recving instead" in new["message"]
    assert old["step"] == new["step"] == 4
    plain = scenario(tmp_path, "kv-plain", hma="false")
    proc = cli("run", str(plain), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = result(tmp_path / "r", "kv-plain", "0.33.0")
    assert res["outcome"] == "clean" and res["engine"]["num_gpu_blocks"] == 32


def test_not_yet_lookups_on_a_release_without_them_are_exit_2(cli, tmp_path):
    path = tmp_path / "nr.yaml"
    path.write_text(textwrap.dedent("""
        name: kv-nr
        level: engine-core
        config: {num_gpu_blocks: 32, max_model_len: 256}
        requests:
          - {id: A, prompt_len: 64, max_tokens: 4}
        kv_transfer_config:
          requests:
            A: {external_hit_tokens: 32, not_ready_lookups: 2}
    """))
    proc = cli("run", str(path), "--vllm", "0.10.1", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    msg = result(tmp_path / "r", "kv-nr", "0.10.1")["error"]["message"]
    assert msg.startswith("kv_transfer_config.requests.A.not_ready_lookups: vLLM 0.10.1's ")
    assert "drop not_ready_lookups" in msg


def test_supports_hma_on_a_release_without_it_is_exit_2(cli, tmp_path):
    hma = tmp_path / "hma.yaml"
    hma.write_text(textwrap.dedent("""
        name: kv-hma-old
        level: engine-core
        config: {num_gpu_blocks: 32, max_model_len: 256}
        requests:
          - {id: A, prompt_len: 64, max_tokens: 4}
        kv_transfer_config:
          supports_hma: true
          requests:
            A: {external_hit_tokens: 32}
    """))
    proc = cli("run", str(hma), "--vllm", "0.11.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    msg = result(tmp_path / "r", "kv-hma-old", "0.11.0")["error"]["message"]
    assert msg.startswith("kv_transfer_config.supports_hma: vLLM 0.11.0's KV connector base "
                          "has no SupportsHMA")
