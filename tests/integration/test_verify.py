"""`vllm-repro verify` on the real 0.10.1.1: our own fix for #23347 is verified; a patch that
changes nothing is not; a stale patch is refused before anything runs."""

from __future__ import annotations

import json

import pytest

from ..conftest import FLAGSHIP, ROOT

pytestmark = pytest.mark.slow
FIX = ROOT / "scenarios/fixes/vllm-23347-0.10.1.1.diff"


def test_fix_is_verified_with_a_bundle(cli, tmp_path):
    proc = cli("verify", str(FLAGSHIP), "--patch", str(FIX), "--vllm", "0.10.1.1",
               "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified" in proc.stdout
    bundle = next((tmp_path / "r" / "verify").iterdir())
    verdict = json.loads((bundle / "verdict.json").read_text())
    assert verdict["verified"] is True
    assert verdict["before"]["observed"].startswith("crash AssertionError vllm/v1/core/sched/scheduler.py:schedule")
    assert verdict["after"]["outcome"] == "clean"
    manifest = json.loads((bundle / "manifest.json").read_text())["sha256"]
    assert {"patch.diff", "release.txt", "verdict.json",
            f"scenarios/{FLAGSHIP.name}"} <= set(manifest)
    assert (bundle / "patch.diff").read_text() == FIX.read_text()


def test_a_patch_that_fixes_nothing_is_not_verified(cli, tmp_path):
    import difflib

    from vllm_repro.sources.sdist import tree_dir

    src = tree_dir("0.10.1.1") / "vllm/v1/core/sched/scheduler.py"  # prepared by the test above
    before = src.read_text().splitlines(keepends=True)
    after = [*before[:10], "# a comment changes nothing\n", *before[10:]]
    noop = tmp_path / "noop.diff"
    noop.write_text("".join(difflib.unified_diff(before, after, "a/vllm/v1/core/sched/scheduler.py",
                                                 "b/vllm/v1/core/sched/scheduler.py")))
    proc = cli("verify", str(FLAGSHIP), "--patch", str(noop), "--vllm", "0.10.1.1",
               "--reports", str(tmp_path / "r"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "not verified" in proc.stdout and "after the patch: crash AssertionError" in proc.stdout


def test_stale_patch_is_refused_exit_2(cli, tmp_path):
    proc = cli("verify", str(FLAGSHIP), "--patch", str(FIX), "--vllm", "0.10.2",
               "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does not apply cleanly to vLLM 0.10.2" in proc.stderr
