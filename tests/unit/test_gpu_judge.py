"""gpu-judge in the CPU image picks the baked environment that stands in for the CUDA image's
installed vLLM (``remote/judge.py:find_installed``)."""

from __future__ import annotations

import json
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
    from vllm_repro.remote.judge import find_installed

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
    from vllm_repro.remote.judge import find_installed

    py = _fake_env(tmp_path / "x", "0.10.2+cpu")
    (baked_cache / "baked.json").write_text(json.dumps({"0.10.1.1": {"python": str(py)}}))
    with pytest.raises(EnvError, match=r"vLLM 0\.10\.2\+cpu .* the bundle is for 0\.10\.1\.1"):
        find_installed("0.10.1.1")
