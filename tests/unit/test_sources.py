"""Fetching and extracting vLLM sdists: PEP 691, hash checks, atomic cache, safe extraction."""

from __future__ import annotations

import importlib.metadata
import socket
import tarfile

import pytest

from vllm_repro.errors import EnvError, IndexUnreachable, InputError
from vllm_repro.sources import sdist as sd
from vllm_repro.sources.env import release_requirements, requirement_files
from vllm_repro.sources.index import find_sdist

from .fake_index import FakeIndex, make_sdist


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def use_index(monkeypatch, url):
    monkeypatch.setenv("PIP_INDEX_URL", url)
    from vllm_repro import settings

    settings.pip_config.cache_clear()


@pytest.mark.parametrize("html", [False, True])
def test_fetch_checks_hash_caches_and_extracts_only_what_is_needed(monkeypatch, isolated_cache, html):
    with FakeIndex({"vllm-9.9.9.tar.gz": make_sdist("9.9.9")}, html=html) as idx:
        use_index(monkeypatch, idx.url)
        rel = sd.fetch_sdist("9.9.9")
        assert rel.sdist == isolated_cache / "sdists" / "vllm-9.9.9.tar.gz"
        assert rel.sha256 == sd.sha256_file(rel.sdist)
        n = len(idx.requests)
        again = sd.fetch_sdist("9.9.9")  # warm: no index traffic
        assert again.sdist == rel.sdist and len(idx.requests) == n
    tree = sd.extract_tree(rel)
    assert (tree / "vllm/v1/core/sched/scheduler.py").is_file()
    assert (tree / "requirements/common.txt").is_file()
    assert not (tree / "csrc").exists(), "only the package and requirements are extracted"
    # vLLM's CPU-platform probe reads the installed version: it must contain "cpu"
    dists = [d for d in importlib.metadata.distributions(path=[str(tree)]) if d.metadata["Name"] == "vllm"]
    assert [d.version for d in dists] == ["9.9.9+cpu"]


def test_hash_mismatch_is_env_error_and_leaves_nothing(monkeypatch, isolated_cache):
    with FakeIndex({"vllm-9.9.8.tar.gz": make_sdist("9.9.8")}, hashes={"vllm-9.9.8.tar.gz": "0" * 64}) as idx:
        use_index(monkeypatch, idx.url)
        with pytest.raises(EnvError, match="sha256 mismatch"):
            sd.fetch_sdist("9.9.8")
    leftovers = list((isolated_cache / "sdists").iterdir())
    assert leftovers == [], f"partial files left: {leftovers}"


def test_unknown_release_names_nearest(monkeypatch):
    with FakeIndex({"vllm-9.9.9.tar.gz": make_sdist("9.9.9"), "vllm-9.9.7.tar.gz": make_sdist("9.9.7")}) as idx:
        use_index(monkeypatch, idx.url)
        with pytest.raises(InputError, match=r"vLLM 9\.9\.10 is not a release on the index; "
                                             r"nearest releases: .*9\.9\.9"):
            find_sdist("9.9.10")


def test_unreachable_index_is_env_error(monkeypatch):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    use_index(monkeypatch, f"http://127.0.0.1:{port}/simple")
    with pytest.raises(IndexUnreachable, match="unreachable"):  # an EnvError (exit 3)
        sd.fetch_sdist("9.9.9")


def test_cli_unreachable_index_exit_3_and_missing_release_exit_2(tmp_path, cli, root):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {"VLLM_REPRO_CACHE": str(tmp_path / "c"), "PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple"}
    proc = cli("prepare", "9.9.9", env=env)
    assert proc.returncode == 3, proc.stderr
    assert "unreachable" in proc.stderr
    with FakeIndex({"vllm-9.9.9.tar.gz": make_sdist("9.9.9")}) as idx:
        env["PIP_INDEX_URL"] = idx.url
        proc = cli("run", str(root / "scenarios/vllm-23347-priority-preempt-scheduled.yaml"),
                   "--vllm", "0.0.42", "--reports", str(tmp_path / "r"), env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "vLLM 0.0.42 is not a release on the index" in proc.stdout + proc.stderr


def _member(name, kind=tarfile.REGTYPE, target=""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    info.size = 1 if kind == tarfile.REGTYPE else 0
    return info


@pytest.mark.parametrize("member, words", [
    (_member("vllm-9.9.6/vllm/evil", tarfile.SYMTYPE, "/etc/passwd"), "is a link"),
    (_member("vllm-9.9.6/vllm/hard", tarfile.LNKTYPE, "vllm-9.9.6/vllm/__init__.py"), "is a link"),
    (_member("vllm-9.9.6/../../escape.py"), "leaves the extraction folder"),
    (_member("/abs/vllm/x.py"), "leaves the extraction folder"),
])
def test_unsafe_sdists_are_refused(monkeypatch, isolated_cache, member, words):
    with FakeIndex({"vllm-9.9.6.tar.gz": make_sdist("9.9.6", [member])}) as idx:
        use_index(monkeypatch, idx.url)
        rel = sd.fetch_sdist("9.9.6")
    with pytest.raises(EnvError, match=words):
        sd.extract_tree(rel)
    assert not (isolated_cache / "trees" / "9.9.6").exists()
    assert not (isolated_cache.parent / "escape.py").exists()


def test_release_requirements_follow_includes_and_drop_gpu_toolchain(tmp_path):
    req = tmp_path / "requirements"
    req.mkdir()
    (req / "common.txt").write_text(
        "regex # fast regex\ntransformers >= 4.55.0\nxgrammar == 0.1.21; platform_machine == \"x86_64\"\n"
        "# comment\n\n")
    (req / "cpu.txt").write_text(
        "-r common.txt\n--extra-index-url https://download.pytorch.org/whl/cpu\ntorch==2.6.0+cpu\n"
        "triton @ https://github.com/x/triton.whl ; python_version == '3.11'\nnumba == 0.61.2\n"
        "intel_extension_for_pytorch==2.6.0\ntorchaudio\n")
    files = requirement_files(tmp_path)
    assert [f.name for f in files] == ["common.txt", "cpu.txt"]
    reqs = release_requirements(tmp_path)
    assert reqs == ["regex", "transformers >= 4.55.0", 'xgrammar == 0.1.21; platform_machine == "x86_64"',
                    "numba == 0.61.2"]


def test_old_requirements_layout(tmp_path):
    (tmp_path / "requirements-common.txt").write_text("numpy\n")
    (tmp_path / "requirements-cpu.txt").write_text("-r requirements-common.txt\ntorch==2.5.1+cpu\n")
    files = requirement_files(tmp_path)
    assert [f.name for f in files] == ["requirements-common.txt", "requirements-cpu.txt"]
    assert release_requirements(tmp_path) == ["numpy"]


def test_a_release_without_the_v1_scheduler_is_refused_before_its_environment(tmp_path):
    """vLLM before 0.6.5 has only the V0 engine: refused (exit 2) by probing the extracted sdist,
    before an environment is built for it."""
    import pytest

    from vllm_repro.errors import InputError
    from vllm_repro.sources.prepare import require_v1_scheduler

    old = tmp_path / "old"
    (old / "vllm/core").mkdir(parents=True)
    (old / "vllm/core/scheduler.py").write_text("")
    with pytest.raises(InputError, match=r"--vllm 0\.5\.0: this release has no V1 engine scheduler"):
        require_v1_scheduler("0.5.0", old)
    for sched in ("vllm/v1/core/scheduler.py", "vllm/v1/core/sched/scheduler.py"):
        new = tmp_path / sched.replace("/", "_")
        (new / sched).parent.mkdir(parents=True)
        (new / sched).write_text("")
        (new / "vllm/v1/core/kv_cache_manager.py").write_text("")
        require_v1_scheduler("0.x", new)


def test_version_strings_are_taken_as_the_index_spells_them():
    import pytest

    from vllm_repro.errors import InputError
    from vllm_repro.sources.sdist import validate_version

    assert validate_version(" 0.10.2 ") == "0.10.2"
    assert validate_version("v0.10.1.1") == "0.10.1.1"
    for bad in ("garbage", "", "vv1"):
        with pytest.raises(InputError, match="is not a vLLM version number"):
            validate_version(bad)


def test_a_tree_with_only_the_v0_engine_is_prepared_for_level_v0_engine(tmp_path):
    """vLLM 0.4 to 0.6.4 have only the V0 engine (``vllm/engine/llm_engine.py`` with
    ``vllm/core/scheduler.py``): such a tree is accepted (level: v0-engine), and the probe says
    which engines a tree has."""
    from vllm_repro.sources.prepare import engines_of, require_v1_scheduler

    old = tmp_path / "old"
    for f in ("vllm/engine/llm_engine.py", "vllm/core/scheduler.py"):
        (old / f).parent.mkdir(parents=True, exist_ok=True)
        (old / f).write_text("")
    require_v1_scheduler("0.6.3.post1", old)
    assert engines_of(old) == ("v0",)
    (old / "vllm/v1/core").mkdir(parents=True)
    (old / "vllm/v1/core/scheduler.py").write_text("")
    (old / "vllm/v1/core/kv_cache_manager.py").write_text("")
    assert engines_of(old) == ("v1", "v0")


def test_a_dependency_whose_only_files_are_newer_than_the_release_is_let_through():
    """uv's hint for pyairports (deleted, uploaded again in 2025; outlines 0.0.4x needs it)
    becomes a recorded substitution that lets uv take that file."""
    from vllm_repro.sources.env import late_uploads

    err = ("hint: `pyairports` was filtered by `exclude-newer` to only include packages "
           "uploaded before 2024-10-17T19:04:42Z. The latest version satisfying the requirement "
           "is v0.0.1, published at 2025-09-25T04:17:09.505Z. Consider using "
           "`exclude-newer-package` to override the cutoff for this package.")
    [sub] = late_uploads(err, [])
    assert (sub.name, sub.used, sub.uploaded) == ("pyairports", "0.0.1", "2025-09-25T05:17:09Z")
    assert sub.uv_args() == ["--exclude-newer-package", "pyairports=2025-09-25T05:17:09Z"]
    assert "uploaded after the release's date" in sub.describe()
    assert late_uploads(err, [sub]) == []
