"""A release the index has only as wheels (0.15.0, 0.15.1): its Python sources from a wheel,
hash-checked and safely extracted, its requirements from the wheel's METADATA, and said so."""

from __future__ import annotations

import io
import zipfile

import pytest

from vllm_repro.errors import EnvError
from vllm_repro.sources import sdist as sd
from vllm_repro.sources.env import ReleaseEnv, release_requirements
from vllm_repro.sources.index import find_sdist, list_versions, wheel_name_version

from .fake_index import FakeIndex, make_sdist

METADATA = """Metadata-Version: 2.1
Name: vllm
Version: 9.8.1
Requires-Dist: numpy
Requires-Dist: xgrammar==0.1.29; platform_machine == "x86_64"
Requires-Dist: numba==0.61.2
Requires-Dist: ray[cgraph]>=2.48.0
Requires-Dist: torch==2.9.1
Requires-Dist: pandas; extra == "bench"

vLLM
"""


def make_wheel(version: str, extra: dict[str, bytes] | None = None,
               links: tuple[str, ...] = ()) -> bytes:
    """A minimal vLLM wheel: Python files, a compiled extension, data, dist-info."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("vllm/__init__.py", f"__version__ = '{version}'\n")
        zf.writestr("vllm/v1/core/sched/scheduler.py", "class Scheduler: pass\n")
        zf.writestr("vllm/v1/core/kv_cache_manager.py", "class KVCacheManager: pass\n")
        zf.writestr("vllm/_C.abi3.so", b"\x7fELF")
        zf.writestr("vllm/model_executor/configs/a.json", "{}")
        zf.writestr(f"vllm-{version}.dist-info/METADATA", METADATA.replace("9.8.1", version))
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
        for name in links:
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o120777 << 16)
            zf.writestr(info, "/etc/passwd")
    return buf.getvalue()


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def use_index(monkeypatch, url):
    monkeypatch.setenv("PIP_INDEX_URL", url)
    from vllm_repro import settings

    settings.pip_config.cache_clear()


def test_wheel_names():
    assert wheel_name_version("vllm-0.15.1-cp38-abi3-manylinux_2_31_x86_64.whl") == "0.15.1"
    assert wheel_name_version("vllm-0.15.1-1-cp38-abi3-any.whl") == "0.15.1"  # a build tag
    assert wheel_name_version("vllm-0.15.1.tar.gz") is None
    assert wheel_name_version("vllm_other-1.0-py3-none-any.whl") is None


def test_a_release_with_only_wheels_is_taken_from_its_smallest_wheel(monkeypatch, isolated_cache):
    small, big = make_wheel("9.8.1"), make_wheel("9.8.1", {"vllm/pad.bin": b"x" * 4096})
    files = {"vllm-9.8.0.tar.gz": make_sdist("9.8.0"),
             "vllm-9.8.1-cp38-abi3-manylinux_2_31_x86_64.whl": big,
             "vllm-9.8.1-cp38-abi3-manylinux_2_31_aarch64.whl": small}
    with FakeIndex(files) as idx:
        use_index(monkeypatch, idx.url)
        assert list_versions() == {"9.8.0": "sdist", "9.8.1": "wheel"}
        info = find_sdist("9.8.1")
        assert (info.kind, info.filename) == ("wheel", "vllm-9.8.1-cp38-abi3-manylinux_2_31_aarch64.whl")
        rel = sd.fetch_sdist("9.8.1")
        assert rel.from_wheel and rel.sha256 == sd.sha256_file(rel.sdist)
        n = len(idx.requests)
        assert sd.fetch_sdist("9.8.1") == rel and len(idx.requests) == n, "cached: no index traffic"
    tree = sd.extract_tree(rel)
    assert (tree / "vllm/v1/core/sched/scheduler.py").read_text() == "class Scheduler: pass\n"
    assert not (tree / "vllm/_C.abi3.so").exists(), "Python files only"
    assert not (tree / "vllm/model_executor/configs/a.json").exists()
    # the requirements are the wheel's own, less extras and its GPU build's; torch goes as always
    assert release_requirements(tree) == ['numpy', 'xgrammar==0.1.29; platform_machine == "x86_64"']
    env = ReleaseEnv("9.8.1", tree, isolated_cache / "envs" / "9.8.1")
    assert env.substitutions() == [
        "vllm sources from vllm-9.8.1-cp38-abi3-manylinux_2_31_aarch64.whl (the index has no sdist "
        "of 9.8.1; its Python files, requirements from its METADATA)"]
    # a release with its sdist says nothing of the kind
    assert ReleaseEnv("9.8.0", None, isolated_cache / "envs" / "9.8.0").substitutions() == []


def test_a_wheel_whose_hash_differs_is_refused_and_leaves_nothing(monkeypatch, isolated_cache):
    name = "vllm-9.8.2-cp38-abi3-manylinux_2_31_x86_64.whl"
    with FakeIndex({name: make_wheel("9.8.2")}, hashes={name: "0" * 64}) as idx:
        use_index(monkeypatch, idx.url)
        with pytest.raises(EnvError, match="sha256 mismatch"):
            sd.fetch_sdist("9.8.2")
    assert list((isolated_cache / "sdists").iterdir()) == []


@pytest.mark.parametrize("extra,links,words", [
    ({"../evil.py": b"x"}, (), "leaves the extraction folder"),
    ({"/abs/evil.py": b"x"}, (), "leaves the extraction folder"),
    ({}, ("vllm/link.py",), "not a plain file"),
])
def test_unsafe_wheels_are_refused(monkeypatch, isolated_cache, extra, links, words):
    name = "vllm-9.8.3-cp38-abi3-manylinux_2_31_x86_64.whl"
    with FakeIndex({name: make_wheel("9.8.3", extra, links)}) as idx:
        use_index(monkeypatch, idx.url)
        rel = sd.fetch_sdist("9.8.3")
    with pytest.raises(EnvError, match=words):
        sd.extract_tree(rel)
    assert not sd.tree_dir("9.8.3").exists()
