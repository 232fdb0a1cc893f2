"""Model-based drafters (EAGLE, MTP) on real releases, through the CLI as a user runs them:

- ``speculative_method: eagle`` with ``async_scheduling: true`` on 0.33.0 and 0.34.0 (which
  refuse n-gram drafts under async scheduling: "only EAGLE/MTP"): the release's
  SpeculativeConfig builds the draft from the packaged config-only EAGLE head, the run is clean
  under the audit, the scheduler reserves ``num_lookahead_tokens`` = 3 and schedules the drafts
  the trace's draft record shows proposed;
- the release's rule of whether the drafter runs (0.33.0's
  ``GPUModelRunner._input_fits_in_drafter``): once the batch's longest sequence plus the drafts
  passes the drafter's ``max_model_len``, every request of that step is recorded skipped and its
  zeroed drafts are rejected at the next verification; 0.34.0 (V2 runner only) has no such
  method and its record says so (``rule`` absent);
- ``speculative_method: mtp`` at level scheduler (a DeepSeek-V3 config with one MTP layer);
- n-gram drafts under async scheduling are vLLM's own refusal on 0.33.0;
- EAGLE with a Mamba group on 0.22.0 (whose model runner sizes the Mamba block-table row with
  room for the speculative blocks) runs clean: the worker-side state does not guess that size.
"""

from __future__ import annotations

import json
import textwrap

import pytest

pytestmark = pytest.mark.slow

EAGLE_ASYNC = textwrap.dedent("""
    name: eagle-async
    level: engine-core
    config: {block_size: 16, num_gpu_blocks: 64, max_num_seqs: 4, max_num_batched_tokens: 256,
             max_model_len: 128, async_scheduling: true, num_speculative_tokens: 3,
             speculative_method: eagle}
    requests:
      - {id: A, prompt_len: 20, max_tokens: 16}
      - {id: B, prompt_len: 100, max_tokens: 40}
    model:
      spec_decode: {accept: {A: 1}}
""")

MTP = (EAGLE_ASYNC.replace("name: eagle-async", "name: mtp-sched")
       .replace("level: engine-core", "level: scheduler")
       .replace("async_scheduling: true", "async_scheduling: false")
       .replace("speculative_method: eagle", "speculative_method: mtp"))

EAGLE3_DRAFT_LEN = textwrap.dedent("""
    name: eagle3-draft-len
    level: scheduler
    config: {block_size: 16, num_gpu_blocks: 64, max_num_seqs: 4, max_num_batched_tokens: 256,
             max_model_len: 256, num_speculative_tokens: 3, speculative_method: eagle3,
             speculative_max_model_len: 64}
    requests:
      - {id: A, prompt_len: 40, max_tokens: 40}
""")

NGRAM_ASYNC = (EAGLE_ASYNC.replace("name: eagle-async", "name: ngram-async")
               .replace("speculative_method: eagle", "speculative_method: ngram"))


def _load(reports, name, release):
    folder = reports / name / release
    res = json.loads((folder / "result.json").read_text())
    steps = [json.loads(x) for x in (folder / "trace.jsonl").read_text().splitlines()]
    return res, steps


def _write(tmp_path, *texts) -> list[str]:
    files = []
    for text in texts:
        name = text.split("name: ")[1].split()[0]
        (tmp_path / f"{name}.yaml").write_text(text)
        files.append(str(tmp_path / f"{name}.yaml"))
    return files


def _clean_with_drafts(reports, release):
    res, steps = _load(reports, "eagle-async", release)
    assert res["outcome"] == "clean", (release, res.get("violations"), res.get("error"))
    assert res["audit"]["checks"] > 0 and res["engine"]["scheduler"] == "AsyncScheduler"
    assert set(res["finished"]) == {"A", "B"}
    records = [s["drafter"] for s in steps if s.get("drafter")]
    assert records and all(r["method"] == "eagle" for r in records)
    assert all(r["num_lookahead_tokens"] == 3 for r in records)
    # the scheduler schedules at most what the drafter proposed after the step before
    for before, after in zip(steps, steps[1:]):
        proposed = (before.get("drafter") or {}).get("proposed") or {}
        for rid, n in proposed.items():
            assert (after.get("drafts") or {}).get(rid, 0) <= n, (release, after["step"])
    assert any((s.get("drafts") or {}).get("B") == 3 for s in steps)
    return steps


def test_eagle_async_on_0_33_skips_by_the_releases_rule(cli, tmp_path):
    reports = tmp_path / "reports"
    proc = cli("run", *_write(tmp_path, EAGLE_ASYNC), "--vllm", "0.33.0", "--reports", str(reports))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = _clean_with_drafts(reports, "0.33.0")
    # the step whose longest sequence + 3 drafts passes the drafter's 128 is skipped, whole
    skipped = [s for s in steps if (s.get("drafter") or {}).get("skipped")]
    assert skipped, "no step skipped by GPUModelRunner._input_fits_in_drafter"
    first = skipped[0]["drafter"]
    assert first["rule"].endswith("GPUModelRunner._input_fits_in_drafter")
    assert first["max_seq_len"] + 3 > first["drafter_max_model_len"] == 128
    assert set(first["skipped"]) == set(skipped[0]["scheduled"]) == {"A", "B"}
    for s in steps:
        d = s.get("drafter") or {}
        if d.get("proposed"):
            assert d["max_seq_len"] + 3 <= d["drafter_max_model_len"]


def test_eagle_async_on_0_34_drafts_every_step(cli, tmp_path):
    reports = tmp_path / "reports"
    proc = cli("run", *_write(tmp_path, EAGLE_ASYNC), "--vllm", "0.34.0", "--reports", str(reports))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = _clean_with_drafts(reports, "0.34.0")
    # no GPUModelRunner._input_fits_in_drafter in 0.34's V2 runner: the drafter runs each step
    assert all("rule" not in s["drafter"] and "skipped" not in s["drafter"]
               for s in steps if s.get("drafter"))


def test_mtp_eagle3_draft_length_and_ngram_refused_under_async(cli, tmp_path):
    reports = tmp_path / "reports"
    cli("run", *_write(tmp_path, MTP, NGRAM_ASYNC, EAGLE3_DRAFT_LEN), "--vllm", "0.33.0",
        "--reports", str(reports))
    # speculative_max_model_len: the drafter stops where its 64 tokens end, the target goes on
    res, steps = _load(reports, "eagle3-draft-len", "0.33.0")
    assert res["outcome"] == "clean" and res["finished"] == {"A": "FINISHED_LENGTH_CAPPED"}
    records = [s["drafter"] for s in steps if s.get("drafter")]
    assert {r["drafter_max_model_len"] for r in records} == {64}
    assert all(bool(r.get("skipped")) == (r["max_seq_len"] + 3 > 64) for r in records)
    assert any(r.get("skipped") for r in records) and any(r.get("proposed") for r in records)
    # past the drafter's end the zeroed drafts are verified and rejected: the sequence grows
    # by one token a step (after the first skipped step, whose drafts were real)
    lens = [r["max_seq_len"] for r in records if r.get("skipped")]
    assert len(lens) > 3 and all(b - a == 1 for a, b in zip(lens[1:], lens[2:])), lens
    res, steps = _load(reports, "mtp-sched", "0.33.0")
    assert res["outcome"] == "clean", (res.get("violations"), res.get("error"))
    assert {s["drafter"]["method"] for s in steps if s.get("drafter")} == {"mtp"}
    assert any(s.get("drafts") for s in steps)
    res, _ = _load(reports, "ngram-async", "0.33.0")
    assert res["outcome"] == "error", res
    assert "Async scheduling is not supported" in res["refusal"]["message"]
    assert "ngram" in res["refusal"]["message"]


MAMBA_EAGLE = textwrap.dedent("""
    name: mamba-eagle
    level: scheduler
    config: {block_size: 16, num_gpu_blocks: 200, max_num_seqs: 4, max_num_batched_tokens: 512,
             max_model_len: 128, enable_prefix_caching: true, mamba_cache_mode: align,
             num_speculative_tokens: 3, speculative_method: eagle,
             kv_cache_groups: [{type: full}, {type: mamba}]}
    requests:
      - {id: A, prompt_len: 100, max_tokens: 28}
      - {id: B, prompt_len: 30, max_tokens: 98}
""")


def test_eagle_with_a_mamba_group_on_0_22_is_no_block_table_false_positive(cli, tmp_path):
    reports = tmp_path / "reports"
    proc = cli("run", *_write(tmp_path, MAMBA_EAGLE), "--vllm", "0.22.0", "--reports", str(reports))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res, steps = _load(reports, "mamba-eagle", "0.22.0")
    assert res["outcome"] == "clean", (res.get("crash"), res.get("violations"))
    assert set(res["finished"]) == {"A", "B"} and any(s.get("drafts") for s in steps)
    log = (reports / "mamba-eagle" / "0.22.0" / "engine.log").read_text()
    assert "MambaSpec has no max_num_blocks_per_req" in log
