"""Patches: only vllm/ paths, dry run first, applied to a copy (the pristine tree never changes)."""

from __future__ import annotations

import shutil

import pytest

from vllm_repro.errors import InputError
from vllm_repro.verify.patch import dry_run, patch_files, patched_tree

ORIG = "def f():\n    return 1\n"
DIFF = """--- a/vllm/mod.py
+++ b/vllm/mod.py
@@ -1,2 +1,2 @@
 def f():
-    return 1
+    return 2
"""


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path / "cache"))
    t = tmp_path / "trees" / "9.9.9"
    (t / "vllm").mkdir(parents=True)
    (t / "vllm" / "mod.py").write_text(ORIG)
    return t


def test_patch_applies_to_a_copy_only(tree, tmp_path):
    p = tmp_path / "fix.diff"
    p.write_text(DIFF)
    assert patch_files(p) == ["vllm/mod.py"]
    out = patched_tree(tree, p, "9.9.9")
    assert (out / "vllm" / "mod.py").read_text() == "def f():\n    return 2\n"
    assert (tree / "vllm" / "mod.py").read_text() == ORIG
    assert patched_tree(tree, p, "9.9.9") == out  # reused, not re-applied


def test_a_copy_is_reused_only_for_the_tree_it_was_made_from(tree, tmp_path):
    """A slice and the full tree get a copy each; a copy that does not say which tree it came
    from (made before copies were keyed by tree: a slice's copy under the full tree's name) is
    made again from the tree asked for."""
    p = tmp_path / "fix.diff"
    p.write_text(DIFF)
    full = patched_tree(tree, p, "9.9.9")
    sliced_tree = tmp_path / "slices" / "9.9.9-abc123"
    shutil.copytree(tree, sliced_tree)
    (sliced_tree / "_vllm_slice.py").write_text("# the slice's run-time\n")
    sliced = patched_tree(sliced_tree, p, "9.9.9")
    assert sliced != full and sliced.name.endswith("-abc123")
    assert (sliced / "_vllm_slice.py").is_file() and not (full / "_vllm_slice.py").is_file()
    # an old copy under the full tree's name, made from the slice, with no tree recorded
    shutil.rmtree(full)
    shutil.copytree(sliced, full)
    (full / ".patched").write_text(f"{p.resolve()}\nsha256-prefix x\n")
    again = patched_tree(tree, p, "9.9.9")
    assert again == full and not (again / "_vllm_slice.py").is_file()
    assert (again / "vllm" / "mod.py").read_text() == "def f():\n    return 2\n"


def test_patch_that_does_not_apply_is_refused_with_the_release(tree, tmp_path):
    p = tmp_path / "stale.diff"
    p.write_text(DIFF.replace("-    return 1", "-    return 7"))
    with pytest.raises(InputError, match=r"does not apply cleanly to vLLM 9\.9\.9"):
        dry_run(p, tree)


@pytest.mark.parametrize("header", ["setup.py", "a/../etc/passwd", "a/tests/x.py"])
def test_paths_outside_vllm_are_refused(tmp_path, header):
    p = tmp_path / "bad.diff"
    p.write_text(DIFF.replace("a/vllm/mod.py", header).replace("b/vllm/mod.py", header))
    with pytest.raises(InputError, match="may only change files under vllm/"):
        patch_files(p)


def test_not_a_diff(tmp_path):
    p = tmp_path / "x.diff"
    p.write_text("hello\n")
    with pytest.raises(InputError, match="not a unified diff"):
        patch_files(p)


SYMLINK = """diff --git a/vllm/evil b/vllm/evil
new file mode 120000
index 0000000..1234567
--- /dev/null
+++ b/vllm/evil
@@ -0,0 +1 @@
+/etc/passwd
\\ No newline at end of file
"""


def test_a_patch_that_makes_a_symlink_is_refused_before_it_is_applied(tree, tmp_path):
    p = tmp_path / "evil.diff"
    p.write_text(SYMLINK)
    with pytest.raises(InputError, match="line 2: the patch makes a symlink"):
        patched_tree(tree, p, "9.9.9")
    assert not (tmp_path / "cache" / "patched").exists()


def test_the_patched_copy_is_checked_for_links_after_git_apply(tree, tmp_path, monkeypatch):
    """With the mode-line check out of the way, git apply really makes the link: the check of
    the patched copy refuses it, and no patched tree is kept."""
    import re

    import vllm_repro.verify.patch as patch_mod

    monkeypatch.setattr(patch_mod, "_MODE", re.compile(r"(?!)"))
    monkeypatch.setattr(patch_mod, "_INDEX_MODE", re.compile(r"(?!)"))
    p = tmp_path / "evil.diff"
    p.write_text(SYMLINK)
    with pytest.raises(InputError, match=r"applying it makes a symlink \(vllm/evil\)"):
        patched_tree(tree, p, "9.9.9")
    assert not list((tmp_path / "cache" / "patched").iterdir())  # nor a half-made copy
