"""What the catalog needed from the adapter, checked on real releases through the CLI: the first
V1 generation (0.6.6.post1, 0.7.0) runs a plain workload like 0.8.5 does; draft tokens reach the
scheduler both ways (in ModelRunnerOutput.spec_token_ids on 0.10.1.1, through
Scheduler.update_draft_token_ids on 0.11.0) and accepted drafts advance a request by
accepted + 1 tokens; what a release cannot express is refused as an input error, not run."""

from __future__ import annotations

import json

import pytest

from ..conftest import ROOT

pytestmark = pytest.mark.slow
DATA = ROOT / "tests" / "data"


def trace(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_first_v1_generation_runs_the_plain_workload_like_0_8_5(cli, tmp_path):
    r = tmp_path / "r"
    proc = cli("run", str(DATA / "fcfs-basic.yaml"), "--vllm", "0.6.6.post1", "--vllm", "0.7.0",
               "--jobs", "1", "--reports", str(r), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for v in ("0.6.6.post1", "0.7.0"):
        res = json.loads((r / "fcfs-basic" / v / "result.json").read_text())
        assert res["vllm"] == v and res["outcome"] == "clean"
        assert res["finished"] == {"A": "FINISHED_LENGTH_CAPPED", "B": "FINISHED_STOPPED",
                                   "C": "FINISHED_ABORTED"}
        steps = trace(r / "fcfs-basic" / v / "trace.jsonl")
        assert steps[0]["scheduled"] == {"A": 64}            # A's prefill chunked at the budget
        assert steps[1]["scheduled"] == {"A": 36, "B": 20}


def test_drafts_reach_the_scheduler_both_ways_and_acceptance_advances_requests(cli, tmp_path):
    r = tmp_path / "r"
    proc = cli("run", str(DATA / "spec-accept.yaml"), "--vllm", "0.10.1.1", "--vllm", "0.11.0",
               "--jobs", "1", "--reports", str(r), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for v in ("0.10.1.1", "0.11.0"):
        steps = trace(r / "spec-accept" / v / "trace.jsonl")
        assert steps[0]["scheduled"] == {"A": 20, "B": 24}
        # decode steps verify 3 drafts: 1 + 3 tokens scheduled per request
        assert steps[1]["scheduled"] == {"A": 4, "B": 4}
        res = json.loads((r / "spec-accept" / v / "result.json").read_text())
        assert res["finished"] == {"A": "FINISHED_LENGTH_CAPPED", "B": "FINISHED_LENGTH_CAPPED"}
        # A: 1 token from prefill, then 2 accepted + 1 bonus a step -> 10 tokens in 1 + 3 steps;
        # B accepts nothing: 1 + 1 a step -> 4 tokens in 1 + 3 steps
        finish_step = {rid: s["step"] for s in steps for rid in s.get("finished", [])}
        assert finish_step == {"A": 4, "B": 4}


def test_a_release_without_kv_cache_groups_refuses_them(cli, tmp_path):
    proc = cli("run", str(DATA / "kv-groups.yaml"), "--vllm", "0.7.0", "--reports", str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "kv_cache_groups" in text and "0.7.0" in text
    assert "clean" not in text and "crash" not in text


def test_one_token_per_request_releases_refuse_empty_outputs(cli, tmp_path):
    proc = cli("run", str(DATA / "empty-output.yaml"), "--vllm", "0.6.6.post1",
               "--reports", str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "empty_at" in text and "0.6.6.post1" in text


def test_a_release_without_spec_decode_in_v1_refuses_draft_tokens(cli, tmp_path):
    """0.7.0's V1 scheduler has no draft tokens (its SpeculativeConfig is V0's): refused as
    input (exit 2), not a lab error from building V0's config."""
    proc = cli("run", str(DATA / "spec-accept.yaml"), "--vllm", "0.7.0", "--reports", str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("config.num_speculative_tokens: vLLM 0.7.0's V1 Scheduler has no speculative decoding"
            in proc.stdout)
