"""verify's choice of tree when the patch does not apply to the slice, without a release: in
the CPU image (slices only, sdists dropped) the full tree cannot be made, and the patch's own
error must still be what the user reads (exit 2), not the missing sdist (exit 3)."""

from __future__ import annotations

import pytest

from vllm_repro.errors import EnvError, InputError
from vllm_repro.sources.env import ReleaseEnv
from vllm_repro.verify import core

from ..conftest import FLAGSHIP


def test_a_patch_the_slice_refuses_with_no_full_tree_is_the_patchs_error(tmp_path, monkeypatch):
    patch = tmp_path / "bad.diff"
    patch.write_text("--- a/vllm/core/scheduler.py\n+++ b/vllm/core/scheduler.py\n@@ -1 +1 @@\n-x\n+y\n")
    monkeypatch.setattr(core, "resolve_tree", lambda version, tree, level: "slice")

    def prepare(version, say=None, tree=None):
        if tree == "full":
            raise EnvError(f"vLLM {version}'s sdist is not in this cache (dropped by the bake)")
        return ReleaseEnv(version, tmp_path / "slice-tree", tmp_path / "env")

    def dry_run(patch, tree, version=None):
        raise InputError(f"the patch does not apply cleanly to vLLM {version}: error: patch failed")

    monkeypatch.setattr(core, "prepare_release", prepare)
    monkeypatch.setattr(core, "dry_run", dry_run)
    monkeypatch.setattr(core, "related_entries", lambda *a, **k: [])
    with pytest.raises(InputError, match=r"^the patch does not apply cleanly to vLLM 0.10.1.1: .*; "
                                         r"and vLLM 0.10.1.1 has no full tree here to try it on \("
                                         r"vLLM 0.10.1.1's sdist is not in this cache"):
        core.verify(FLAGSHIP, patch, "0.10.1.1", tmp_path / "r")
