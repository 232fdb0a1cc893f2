"""A release newer than the lab knows degrades, it does not die (issue #42), on a real release:
a copy of 0.34.0's tree (hard links; the edited files written anew, the cache's tree untouched)
where vLLM renamed what the lab reads, run through :func:`vllm_repro.lab.run_pairs` as the CLI
runs it.

- ``KVCacheBlock.block_hash`` renamed ``block_digest`` in ``vllm/v1/core``: the audit turns off
  only its KV hash checks, says so in one line naming the fields and the checks, records them in
  ``result.json`` (``audit.off``), and the verdict reads ``clean (audit partial: KV hash checks
  off; ...)``, never a plain ``clean``.
- Partial-block hashes (``KVCacheBlock.block_hash_num_tokens``, 0.34): a full-attention group
  whose block size is twice the hash block size caches each prompt's last hash boundary inside
  a block; the audit runs clean over dozens of such entries, and finds a token count moved off
  its boundary.
- ``EngineCore._initialize_kv_caches`` calling a worker method no release had: one line, "the
  lab does not know vLLM 0.34.0's worker call `...`", a lab error (exit 3), no traceback in the
  table.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_repro.doctor import PARTIAL
from vllm_repro.engine.host import Worker
from vllm_repro.lab import RunItem, run_pairs
from vllm_repro.scenario.schema import Scenario
from vllm_repro.sources.prepare import prepare_release
from vllm_repro.verdict import exit_code

pytestmark = pytest.mark.slow

RELEASE = "0.34.0"
UNKNOWN_CALL = "report_kv_cache_topology"
PLANTS = Path(__file__).resolve().parent / "plant_partial.py"


def scenario(level: str = "scheduler") -> Scenario:
    """Three requests sharing a 32-token prefix on a 32-block pool, prefix caching on."""
    shared = {"prefix": "p", "prefix_len": 32}
    return Scenario.model_validate({
        "name": f"new-release-{level}",
        "level": level,
        "vllm": {"clean_on": [RELEASE]},
        "config": {"block_size": 16, "num_gpu_blocks": 32, "max_num_seqs": 4,
                   "max_num_batched_tokens": 64, "max_model_len": 512,
                   "enable_prefix_caching": True, "policy": "fcfs"},
        "requests": [
            {"id": "A", "at_step": 1, "prompt_len": 40, "max_tokens": 6, **shared},
            {"id": "B", "at_step": 1, "prompt_len": 20, "max_tokens": 10},
            {"id": "C", "at_step": 3, "prompt_len": 90, "max_tokens": 4, **shared},
        ],
        "limits": {"max_steps": 80},
    })


def edited_tree(dst: Path, edit) -> Path:
    """A copy of the release's tree, hard-linked, with ``edit(path, text) -> text`` applied to
    every ``.py`` file under ``vllm/v1``; a changed file is unlinked and written anew."""
    src = prepare_release(RELEASE).tree
    shutil.copytree(src, dst, copy_function=lambda s, d: Path(d).hardlink_to(s))
    for p in (dst / "vllm" / "v1").rglob("*.py"):
        text = p.read_text()
        new = edit(p, text)
        if new != text:
            p.unlink()
            p.write_text(new)
    return dst


def run_on(tree: Path, sc: Scenario, reports: Path) -> tuple[RunItem, list[str]]:
    env = replace(prepare_release(RELEASE), tree=tree)
    said: list[str] = []
    [item] = run_pairs([RunItem(sc, RELEASE)], reports, prepare=lambda v: env, say=said.append,
                        timelines=False)
    return item, said


def rename_block_hash(path: Path, text: str) -> str:
    if path.parent.name != "core":
        return text
    text = re.sub(r"\.block_hash\b(?!_)", ".block_digest", text)
    return re.sub(r"^(\s+)block_hash: (BlockHashWithGroupId \| None = None)",
                  r"\1block_digest: \2", text, flags=re.M)


def test_a_renamed_block_hash_turns_off_only_the_hash_checks(tmp_path):
    tree = edited_tree(tmp_path / "tree", rename_block_hash)
    assert "block_digest: BlockHashWithGroupId" in \
        (tree / "vllm/v1/core/kv_cache_utils.py").read_text()
    pristine = prepare_release(RELEASE).tree / "vllm/v1/core/kv_cache_utils.py"
    assert "block_digest" not in pristine.read_text(), "the cache's tree was edited"
    item, said = run_on(tree, scenario(), tmp_path / "reports")
    res = item.result
    assert res.outcome == "clean", (res.outcome, res.error, res.violations)
    notes = [s for s in said if "audit partial" in s]
    assert len(notes) == 1, said
    assert "_block_hash, block_hash" in notes[0] and "KV hash checks off" in notes[0]
    # only the hash checks are off: the rest of the audit ran, its pool hooks too
    assert res.audit.checks > 0 and res.audit.hooks and res.audit.off
    assert item.verdict.observed.startswith("clean (audit partial: KV hash checks off; ")
    written = json.loads((tmp_path / "reports" / item.scenario.name / RELEASE /
                          "result.json").read_text())
    assert written["audit"]["off"] == res.audit.off
    assert written["verdict"]["observed"] == item.verdict.observed


def test_the_release_as_shipped_runs_every_check(tmp_path):
    """The contrast: the same scenario on 0.34.0's own tree runs with the hash checks on."""
    item, said = run_on(prepare_release(RELEASE).tree, scenario(), tmp_path / "reports")
    res = item.result
    assert res.outcome == "clean", (res.outcome, res.error, res.violations)
    assert not res.audit.off and not [s for s in said if "audit partial" in s]
    assert re.fullmatch(r"clean \(3 finished, \d+ steps\)", item.verdict.observed)


def call_unknown_worker_method(path: Path, text: str) -> str:
    if path.as_posix().endswith("vllm/v1/engine/core.py"):
        marker = "        if vllm_config.cache_config.enable_extensible_kv_cache:\n"
        assert marker in text
        return text.replace(marker, f"        self.model_executor.collective_rpc({UNKNOWN_CALL!r})\n"
                            + marker, 1)
    return text


def test_an_unknown_worker_call_is_one_line_and_exit_3(tmp_path):
    tree = edited_tree(tmp_path / "tree", call_unknown_worker_method)
    item, _ = run_on(tree, scenario("engine-core"), tmp_path / "reports")
    res = item.result
    assert res.outcome == "error" and res.error.kind == "lab", (res.outcome, res.error)
    assert res.error.message.startswith(
        f"the lab does not know vLLM {RELEASE}'s worker call `{UNKNOWN_CALL}`")
    assert "\n" not in res.error.message and "Traceback" not in item.verdict.observed
    assert exit_code([item.verdict]) == 3


def partial_scenario() -> Scenario:
    """doctor's partial-block row (:data:`vllm_repro.doctor.PARTIAL`): a full-attention group
    of 16-token blocks beside a Mamba group of 64 and ``prefix_match_unit: 8``."""
    return Scenario.model_validate({"name": "new-release-partial-hashes", **PARTIAL})


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with Worker(prepare_release(RELEASE), tmp_path_factory.mktemp("engine") / "w.log") as w:
        yield w


def test_partial_block_hashes_are_checked_by_their_token_count(worker, tmp_path):
    sc = partial_scenario()
    res = worker.run(sc.child_payload(), tmp_path / "counted", audit=True, keep_going=False,
                     plant=f"{PLANTS}:count_partial")
    assert res.outcome == "clean", (res.outcome, res.error, res.violations)
    assert not res.audit.off
    assert res.planted["notes"]["partial"]["entries"] >= 10, res.planted
    # keep going: both sides of the audit see it, the pool's (every hashed block's count is a
    # whole number of hash blocks) and the request's (its block after the cached ones)
    res = worker.run(sc.child_payload(), tmp_path / "corrupt", audit=True, keep_going=True,
                     plant=f"{PLANTS}:partial_count_off_boundary")
    notes = res.planted["notes"]
    assert res.outcome == "violation", (res.outcome, res.error, notes)
    # (vLLM's own move_block_hashes may carry the count on to another block later: only the
    # findings at the planted step are about the planted block)
    found = [v for v in res.violations if v.code == "KV_PREFIX_MAP" and v.step == notes["step"]]
    assert found and all(v.blocks == [notes["block"]] for v in found), (res.violations, notes)
    pool_side = [v for v in found if f"hash covers {notes['tokens']} prefix tokens" in v.message]
    req_side = [v for v in found if "after its cached ones" in v.message
                and f"covering {notes['tokens']} prefix tokens" in v.message]
    assert pool_side and req_side, found
    assert min(v.step for v in res.violations) == notes["step"]
