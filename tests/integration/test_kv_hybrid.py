"""Hybrid KV cache groups on real releases, through the CLI: every kind 0.33.0 has runs with
its own single-type manager at both levels under the audit, the groups' tables are what each
manager keeps (Mamba: a few state blocks behind null placeholders; sliding window: null blocks
out of the window), and a kind or field a release lacks is an input error naming it."""

from __future__ import annotations

import json

import pytest

from ..conftest import ROOT

pytestmark = pytest.mark.slow
DATA = ROOT / "tests" / "data"


@pytest.mark.parametrize("level", ["scheduler", "engine-core"])
def test_four_kinds_in_one_pool_run_clean_on_0_33_0(cli, tmp_path, level):
    sc = tmp_path / "kv-hybrid.yaml"
    sc.write_text((DATA / "kv-hybrid.yaml").read_text() + f"level: {level}\n")
    r = tmp_path / "r"
    proc = cli("run", str(sc), "--vllm", "0.33.0", "--reports", str(r), "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((r / "kv-hybrid" / "0.33.0" / "result.json").read_text())
    assert res["outcome"] == "clean", res.get("violations")
    assert sorted(res["finished"]) == ["A", "B", "C"] and not res["unfinished"]
    assert res["audit"]["checks"] >= res["steps"] and not res["audit"]["by_code"]


def test_a_kind_the_release_lacks_is_exit_2_naming_the_field_and_its_kinds(cli, tmp_path):
    sc = tmp_path / "kv-mamba.yaml"
    sc.write_text((DATA / "kv-groups.yaml").read_text().replace(
        "{type: sliding_window, sliding_window: 32}", "{type: mamba}"))
    proc = cli("run", str(sc), "--vllm", "0.9.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "config.kv_cache_groups[1].type: vLLM 0.9.0 has no mamba KV cache groups" in text
    assert "this release's kinds: full, sliding_window" in text
    assert "clean" not in text and "crash" not in text


def test_a_mamba_group_with_prefix_caching_needs_mamba_cache_mode(cli, tmp_path):
    sc = tmp_path / "kv-hybrid.yaml"
    sc.write_text((DATA / "kv-hybrid.yaml").read_text().replace("  mamba_cache_mode: align\n", ""))
    proc = cli("run", str(sc), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config.mamba_cache_mode: a mamba KV cache group with prefix caching needs" in \
        proc.stdout + proc.stderr
