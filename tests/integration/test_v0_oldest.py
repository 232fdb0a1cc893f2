"""level: v0-engine on the oldest releases that run: vLLM 0.4.1 (no vllm/platforms, triton
imported at module level, execute_model by keywords) and 0.5.5 (outlines imported with vllm),
each in an environment the default REQUIREMENTS_BY_RELEASE completes, through the CLI."""

from __future__ import annotations

import json

import pytest
import yaml

pytestmark = pytest.mark.slow

RELEASES = ("0.4.1", "0.5.5")


def scenario(tmp_path, name: str, **config) -> str:
    d = {"name": name, "level": "v0-engine",
         "config": {"block_size": 16, "max_model_len": 160, "max_num_batched_tokens": 256,
                    "enable_chunked_prefill": False, "max_num_seqs": 4, "num_gpu_blocks": 12,
                    "num_cpu_blocks": 40, **config},
         "requests": [{"id": "A", "prompt_len": 40, "max_tokens": 60},
                      {"id": "B", "prompt_len": 40, "max_tokens": 60},
                      {"id": "C", "prompt_len": 40, "max_tokens": 60},
                      {"id": "D", "at_step": 3, "prompt_len": 30, "max_tokens": 40}],
         "events": [{"at_step": 20, "abort": ["B"]}],
         "vllm": {"clean_on": list(RELEASES)}}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(p)


def test_the_oldest_releases_run_a_preempting_pool_clean_under_the_audit(cli, tmp_path):
    """A 12-block pool that preempts (recompute) under both block managers: clean, every request
    finished or aborted, every GPU block back, and the audit reads the KV books of each: the
    v2 allocators' (its ref-count hooks called) and the default BlockSpaceManagerV1's, with and
    without prefix caching (its allocators' free hooked and called; nothing named unread). The
    environment's additions are listed with the result."""
    reports = tmp_path / "r"
    v1 = scenario(tmp_path, "v0-old-bm1")
    v2 = scenario(tmp_path, "v0-old-bm2", use_v2_block_manager=True)
    pc = scenario(tmp_path, "v0-old-bm1-pc", enable_prefix_caching=True)
    res = cli("run", v1, v2, pc, *(a for r in RELEASES for a in ("--vllm", r)),
              "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    for release in RELEASES:
        for name in ("v0-old-bm1", "v0-old-bm2", "v0-old-bm1-pc"):
            d = json.loads((reports / name / release / "result.json").read_text())
            assert d["outcome"] == "clean" and d["level"] == "v0-engine", (name, release, d)
            assert d["finished"] == {"A": "length", "B": "aborted", "C": "length", "D": "length"}
            assert d["engine"]["num_gpu_blocks"] == 12
            assert d["audit"]["checks"] > 100 and not d["audit"]["by_code"]
            lines = [json.loads(x) for x in
                     (reports / name / release / "trace.jsonl").read_text().splitlines()]
            assert lines[-1]["free_blocks"] == 12
            assert "unread" not in d["audit"]  # the KV books were read, not only the queues
            assert "unread" not in d["verdict"]["observed"]
            if name == "v0-old-bm2":
                assert d["audit"]["hook_calls"].get("GPU.decr", 0) > 0
            else:  # BlockSpaceManagerV1: its allocators' free is hooked and called
                kind = "Cached" if name.endswith("-pc") else "Uncached"  # prefix caching
                assert d["audit"]["hooks"] == [f"GPU.{kind}BlockAllocator.free",
                                               f"CPU.{kind}BlockAllocator.free"]
                assert d["audit"]["hook_calls"].get("GPU.free", 0) > 0
    old = json.loads((reports / "v0-old-bm2" / "0.4.1" / "result.json").read_text())
    assert old["platform"] == "cuda (no vllm/platforms; vllm.utils.is_cpu answers False)"
    assert any(s.startswith("triton (REQUIREMENTS_BY_RELEASE '<0.5.4=triton'")
               for s in old["substitutions"])
    mid = json.loads((reports / "v0-old-bm2" / "0.5.5" / "result.json").read_text())
    assert any(s.startswith("outlines==0.0.41 (REQUIREMENTS_BY_RELEASE") for s in mid["substitutions"])
    assert not any("pyairports" in s for s in mid["substitutions"])


def test_a_planted_fault_in_block_space_manager_v1s_books_is_flagged(tmp_path):
    """vLLM 0.5.5's default BlockSpaceManagerV1, one fault planted at a time into the release
    (tests/integration/plant_faults.py): a reference no block table holds is KV_REFCOUNT at the
    planted step naming the request and block; a block freed twice is KV_DOUBLE_FREE inside the
    allocator's free, before the release's own ValueError("Double free!")."""
    from pathlib import Path

    from vllm_repro.engine.host import Worker
    from vllm_repro.scenario.load import load_scenario
    from vllm_repro.sources.prepare import prepare_release

    plants = Path(__file__).resolve().parent / "plant_faults.py"
    sc = load_scenario(Path(scenario(tmp_path, "v0-bm1-plant")))
    with Worker(prepare_release("0.5.5"), tmp_path / "engine.log") as w:
        ref = w.run(sc.child_payload(), tmp_path / "ref", plant=f"{plants}:v0_bm1_extra_ref")
        dfree = w.run(sc.child_payload(), tmp_path / "df", plant=f"{plants}:v0_bm1_double_free")
    for res, code in ((ref, "KV_REFCOUNT"), (dfree, "KV_DOUBLE_FREE")):
        planted = res.planted["notes"]
        assert res.outcome == "violation", (res.outcome, res.crash)
        v = res.violations[0]
        assert (v.code, v.step, v.requests, v.blocks) == (
            code, planted["step"], ["A"] if code == "KV_REFCOUNT" else [], planted["blocks"])
    assert "ref count 2 but held by A (expected 1)" in ref.violations[0].message
    assert dfree.violations[0].phase == "in UncachedBlockAllocator.free"
    assert "given back with ref count 0" in dfree.violations[0].message
