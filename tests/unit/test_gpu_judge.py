"""gpu-judge in the CPU image picks the baked environment that stands in for the CUDA image's
installed vLLM (``remote/gpu_judge.py:find_installed``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PYTHON = sys.executable  # the real one: the fixture points sys.executable elsewhere


def _fake_env(root: Path, version: str) -> Path:
    """An interpreter (a wrapper around this one) whose ``vllm`` is a stub package of ``version``."""
    site = root / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    py = root / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {PYTHON} "$@"\n')
    py.chmod(0o755)
    return py


@pytest.fixture
def baked_cache(tmp_path, monkeypatch):
    from vllm_repro.sources.installed import probe

    probe.cache_clear()
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(cache))
    monkeypatch.delenv("VLLM_REPRO_VLLM", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    yield cache
    probe.cache_clear()


def test_the_full_tree_stands_in_for_the_cuda_image_where_one_is_baked(tmp_path, baked_cache):
    """0.10.1.1 is baked twice (its slice for scheduler-level runs, its full tree for the
    engine-core and V0 entries): a bundle carrying #18957 (V0) must be judged on the full tree,
    as the CUDA image has all of vLLM; the slice lacks vllm/engine."""
    from vllm_repro.remote.gpu_judge import find_installed

    sliced = _fake_env(tmp_path / "slice", "0.10.1.1+cpu")
    full = _fake_env(tmp_path / "full", "0.10.1.1+cpu")
    only_slice = _fake_env(tmp_path / "slice2", "0.11.0+cpu")
    (baked_cache / "baked.json").write_text(json.dumps({
        "0.10.1.1": {"kind": "slice", "python": str(sliced)},
        "0.10.1.1:full": {"kind": "full", "python": str(full)},
        "0.11.0": {"kind": "slice", "python": str(only_slice)},
    }))
    inst = find_installed("0.10.1.1")
    assert inst.python == full and inst.package_dir == tmp_path / "full" / "site" / "vllm"
    assert find_installed("0.11.0").python == only_slice  # no full tree baked: the slice


def test_another_release_is_refused_naming_both(tmp_path, baked_cache):
    from vllm_repro.errors import EnvError
    from vllm_repro.remote.gpu_judge import find_installed

    py = _fake_env(tmp_path / "x", "0.10.2+cpu")
    (baked_cache / "baked.json").write_text(json.dumps({"0.10.1.1": {"python": str(py)}}))
    with pytest.raises(EnvError, match=r"vLLM 0\.10\.2\+cpu .* the bundle is for 0\.10\.1\.1"):
        find_installed("0.10.1.1")


PATCH = """--- a/vllm/core.py
+++ b/vllm/core.py
@@ -1 +1 @@
-FIXED = False
+FIXED = True
"""


def _release_tree(tree: Path, version: str) -> Path:
    """A release tree: ``vllm`` (``vllm/core.py``: ``FIXED = False``) and its metadata."""
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "core.py").write_text("FIXED = False\n")
    (tree / f"vllm-{version}.dist-info").mkdir()
    (tree / f"vllm-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return tree


def _baked_venv(env: Path, tree: Path) -> Path:
    """A virtual environment whose interpreter imports ``tree`` through a ``.pth``, as
    images/cpu/bake.py makes each baked release's."""
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(env)], check=True)
    site = next(env.glob("lib/python3*/site-packages"))
    (site / "vllm-repro-release.pth").write_text(f"{tree}\n")
    return env / "bin" / "python"


def _fixed(python: Path) -> str:
    """What ``vllm.core.FIXED`` is for ``python`` (run as the lab runs a worker: no PYTHON*)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run([str(python), "-c", "import vllm.core; print(vllm.core.FIXED)"], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def _digest(tree: Path) -> dict:
    return {str(p.relative_to(tree)): p.read_bytes() for p in sorted(tree.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_the_cpu_image_judges_a_patched_copy_and_never_writes_the_baked_tree(tmp_path, baked_cache,
                                                                             monkeypatch):
    """In the CPU image the installed vLLM is a baked tree of the cache: read-only as uid 1000
    (git apply in place: "unable to unlink 'vllm/v1/core/sched/scheduler.py': Permission
    denied"), and the pristine release of every other run as root. The patch goes to a copy
    under <cache>/patched/ (as verify makes them) and the second suite runs with an interpreter
    of the same environment that imports the copy."""
    from vllm_repro.remote import gpu_judge as judge

    tree = _release_tree(baked_cache / "slices" / "1.0.0-abc", "1.0.0+cpu")
    py = _baked_venv(baked_cache / "envs" / "1.0.0-slice", tree)
    (baked_cache / "baked.json").write_text(json.dumps({"1.0.0": {"kind": "slice", "python": str(py)}}))
    bundle = tmp_path / "bundle"
    (bundle / "tests" / "shared").mkdir(parents=True)
    (bundle / "scenarios").mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"scenario": "bug", "sha256": {}}))
    (bundle / "release.txt").write_text("1.0.0\n")
    (bundle / "patch.diff").write_text(PATCH)
    seen = {}

    def run_suite(suite, scenarios, out, label, fixed, inst):
        seen[label] = (inst, _fixed(inst.python))
        return {"pytest_exit": 0, "junit": "junit.xml", "tests": 1, "failures": 0, "errors": 0,
                "skipped": 0}

    monkeypatch.setattr(judge, "run_suite", run_suite)
    monkeypatch.setattr(judge, "scenario_result", lambda out, label, name, release: {
        "outcome": "crash" if label == "before" else "clean", "observed": label})
    pristine = _digest(tree)
    assert judge.judge(bundle, tmp_path / "out") == 0, (tmp_path / "out" / "summary.json").read_text()
    assert _digest(tree) == pristine  # the baked tree as baked
    assert seen["before"] == (judge.find_installed("1.0.0"), "False")
    after, fixed = seen["after"]
    assert fixed == "True" and after.release == "1.0.0"
    assert after.package_dir.parent.parent == baked_cache / "patched"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["verified"] and summary["patched_copy"] == str(after.package_dir.parent)


def _pip_venv(env: Path, version: str) -> Path:
    """A virtual environment with ``vllm`` (``vllm/core.py``: ``FIXED = False``) and its
    metadata in its own site-packages, as pip installs it in the CUDA image."""
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(env)], check=True)
    _release_tree(next(env.glob("lib/python3*/site-packages")), version)
    return env / "bin" / "python"


def test_a_vllm_outside_the_cache_is_patched_in_place(tmp_path, baked_cache):
    """The CUDA image's vLLM (installed by pip in its interpreter's environment, writable,
    outside the lab's cache) is patched in place, as before."""
    from vllm_repro.remote.gpu_judge import apply_patch
    from vllm_repro.sources.installed import probe

    py = _pip_venv(tmp_path / "cuda", "1.0.0+cu128")
    core = next((tmp_path / "cuda").glob("lib/python3*/site-packages")) / "vllm" / "core.py"
    (tmp_path / "fix.diff").write_text(PATCH)
    inst = probe(py)
    assert inst.in_environment
    assert apply_patch(tmp_path / "fix.diff", inst, tmp_path / "scratch") == inst
    assert core.read_text() == "FIXED = True\n"
    assert not (baked_cache / "patched").exists()


def test_a_baked_tree_outside_the_cache_is_patched_as_a_copy(tmp_path, baked_cache):
    """gpu-judge with VLLM_REPRO_CACHE pointed away from the image's cache and
    VLLM_REPRO_VLLM=installed:<a baked environment's python> patched the baked tree in place
    (as root: the pristine release of every other run), since the tree was not under the cache
    then in use. What decides is what the vLLM is: a tree the interpreter imports by path (the
    environment's .pth; or PYTHONPATH) is never written, wherever it lies; the copy goes to the
    cache in use."""
    from vllm_repro.errors import EnvError
    from vllm_repro.remote.gpu_judge import apply_patch
    from vllm_repro.sources.installed import probe

    image = tmp_path / "image-cache"  # the image's own cache, not VLLM_REPRO_CACHE's
    tree = _release_tree(image / "slices" / "1.0.0-abc", "1.0.0+cpu")
    py = _baked_venv(image / "envs" / "1.0.0-slice", tree)
    (tmp_path / "fix.diff").write_text(PATCH)
    pristine = _digest(tree)
    inst = probe(py)
    assert not inst.in_environment
    patched = apply_patch(tmp_path / "fix.diff", inst, tmp_path / "scratch")
    assert _digest(tree) == pristine
    assert patched != inst and patched.package_dir.parent.parent == baked_cache / "patched"
    assert _fixed(patched.python) == "True" and _fixed(py) == "False"
    # a tree on a PYTHONPATH (no virtual environment to import a copy): refused, never written
    other = _fake_env(tmp_path / "pp", "1.0.0+cpu")
    (tmp_path / "pp" / "site" / "vllm" / "core.py").write_text("FIXED = False\n")
    with pytest.raises(EnvError, match="not a virtual environment"):
        apply_patch(tmp_path / "fix.diff", probe(other), tmp_path / "scratch2")
    assert (tmp_path / "pp" / "site" / "vllm" / "core.py").read_text() == "FIXED = False\n"


def test_no_vllm_names_the_mode_variable_only_where_it_is_set(tmp_path, baked_cache, monkeypatch):
    """gpu-judge in the CPU image asks the lab's own interpreter first, VLLM_REPRO_VLLM unset:
    "unset VLLM_REPRO_VLLM" is no advice there."""
    from vllm_repro.errors import EnvError
    from vllm_repro.sources.installed import probe

    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = tmp_path / "bare" / "bin" / "python"
    with pytest.raises(EnvError) as unset:
        probe(bare)
    assert "has no vLLM installed" in str(unset.value) and "VLLM_REPRO_VLLM" not in str(unset.value)
    monkeypatch.setenv("VLLM_REPRO_VLLM", f"installed:{bare}")
    with pytest.raises(EnvError, match=r"has no vLLM installed .*; unset VLLM_REPRO_VLLM to run "
                                       "releases from their sdists"):
        probe(bare)


def test_no_baked_environment_is_said_first(baked_cache):
    """With no baked.json where the cache points (VLLM_REPRO_CACHE moved to a writable folder,
    away from the image's read-only one), the only interpreter left is the lab's own, which has
    no vLLM: the error says first that the baked environment was not found, and where."""
    from vllm_repro.errors import EnvError
    from vllm_repro.remote.gpu_judge import find_installed

    with pytest.raises(EnvError, match=r"^no installed vLLM in this image: no baked environment of "
                                       rf"1\.0\.0 in {baked_cache}/baked\.json \(FileNotFoundError\)"):
        find_installed("1.0.0")
