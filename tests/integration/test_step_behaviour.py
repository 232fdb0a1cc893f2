"""Per-step model behaviour and the decode side of P/D on a real release (0.33.0), through the
CLI as a user runs it, in one worker:

- ``spec_decode.accept: {A: [2, 0, 1]}`` and ``propose: {A: [3, 3, 0, 2]}``: the scheduler
  schedules each step what the drafter proposed after the last one (1 + drafts), and the
  request finishes when the accepted drafts say, at both levels;
- the decode side of P/D with vLLM's own NixlConnector (its scheduler half as the release
  ships it): a request whose prompt was computed by a prefill instance
  (``kv_transfer_params: {do_remote_prefill: true, remote_block_ids: ...}``) waits for the
  pull, which the worker half reports at ``recv_done_at_step``, then computes only its last
  prompt token (vLLM recomputes it to sample the first output) and decodes.

Both run under an emulated A100 (capability 8.0): on 0.33.0 NixlConnector's package imports
the Mamba Triton ops, whose sm90 filter reads attributes of ``triton.Config`` that the CPU
environment's Triton stand-in lacks (docs/scenarios.md).
"""

from __future__ import annotations

import json
import textwrap

import pytest

pytestmark = pytest.mark.slow

RELEASE = "0.33.0"
PLATFORM = 'platform: {name: cuda, capability: "8.0", device_name: NVIDIA A100-SXM4-80GB}'

SPEC = textwrap.dedent(f"""
    name: spec-per-step
    level: engine-core
    vllm: {{clean_on: ["{RELEASE}"]}}
    config: {{block_size: 16, num_gpu_blocks: 32, max_num_seqs: 4,
              max_num_batched_tokens: 256, max_model_len: 256, num_speculative_tokens: 3}}
    requests:
      - {{id: A, prompt_len: 20, max_tokens: 12}}
    model:
      draft_tokens: [100, 100, 100]
      spec_decode:
        accept: {{A: [2, 0, 1]}}
        propose: {{A: [3, 3, 0, 2]}}
    {PLATFORM}
""")

DECODE = textwrap.dedent(f"""
    name: pd-decode-side
    level: engine-core
    vllm: {{clean_on: ["{RELEASE}"]}}
    config: {{block_size: 16, num_gpu_blocks: 32, max_num_seqs: 4,
              max_num_batched_tokens: 256, max_model_len: 256, enable_prefix_caching: true}}
    requests:
      - {{id: D, prompt_len: 40, max_tokens: 4,
          kv_transfer_params: {{do_remote_prefill: true, remote_block_ids: [1, 2, 3],
                               remote_engine_id: prefill-0, remote_request_id: D-prefill,
                               remote_host: 127.0.0.1, remote_port: 5600, tp_size: 1}}}}
      - {{id: L, prompt_len: 20, max_tokens: 4}}
    kv_transfer_config:
      kv_connector: NixlConnector
      kv_role: kv_consumer
      requests:
        D: {{recv_done_at_step: 3}}
    {PLATFORM}
""")


def trace(reports, name) -> list[dict]:
    return [json.loads(x) for x in
            (reports / name / RELEASE / "trace.jsonl").read_text().splitlines()]


def result(reports, name) -> dict:
    return json.loads((reports / name / RELEASE / "result.json").read_text())


def test_per_step_drafts_and_acceptance_and_the_decode_side(cli, tmp_path):
    files = []
    for text in (SPEC, SPEC.replace("name: spec-per-step", "name: spec-per-step-sched")
                 .replace("level: engine-core", "level: scheduler"), DECODE):
        name = text.split("name: ")[1].split()[0]
        (tmp_path / f"{name}.yaml").write_text(text)
        files.append(str(tmp_path / f"{name}.yaml"))
    reports = tmp_path / "reports"
    proc = cli("run", *files, "--reports", str(reports))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # A: prefill (then 3 drafts proposed); 1+3 (2 accepted, 3 proposed); 1+3 (none accepted,
    # none proposed); 1 (no drafts: no verification; 2 proposed); 1+2 (1 accepted; the
    # proposal list is over: 3); 1+3 (the accept list is over: all) -> 12 tokens at step 6
    for name in ("spec-per-step", "spec-per-step-sched"):
        res = result(reports, name)
        assert res["outcome"] == "clean", (name, res.get("violations"))
        steps = trace(reports, name)
        assert [s["scheduled"].get("A", 0) for s in steps[:6]] == [20, 4, 4, 1, 3, 4], name
        assert steps[5]["finished"] == ["A"], name
        assert res["finished"] == {"A": "FINISHED_LENGTH_CAPPED"}

    # D: NixlConnector's scheduler half pulls the whole prompt (reqs_to_recv, step 1); D holds
    # its blocks and waits while L runs; the pull is reported at step 3; then D computes only
    # its last prompt token (40 -> 39 computed, as _update_waiting_for_remote_kv leaves it)
    res = result(reports, "pd-decode-side")
    assert res["outcome"] == "clean", res.get("violations")
    steps = trace(reports, "pd-decode-side")
    assert steps[0]["kv_connector"] == {"load": ["D"]} and "D" not in steps[0]["scheduled"]
    assert steps[2]["kv_connector"] == {"recv": ["D"]}
    assert all("D" not in s["scheduled"] for s in steps[:3])
    assert steps[3]["scheduled"]["D"] == 1
    assert sum(s["scheduled"].get("D", 0) for s in steps) == 1 + 3  # then 3 decode steps
    assert res["finished"] == {"D": "FINISHED_LENGTH_CAPPED", "L": "FINISHED_LENGTH_CAPPED"}
