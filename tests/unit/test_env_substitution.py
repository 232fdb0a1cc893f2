"""A pinned requirement the index no longer has (0.8.0-0.8.2 pin xgrammar==0.1.16): the nearest
version is used, and the substitution is recorded (sources/env.py)."""

from __future__ import annotations

from vllm_repro.settings import IndexSettings
from vllm_repro.sources import env as envmod

UV_ERROR = ("installing the requirements of vLLM 0.8.1 failed (uv exit 1): error: No solution found "
            "| cause: Because there is no version of xgrammar{platform_machine == 'x86_64'}==0.1.16 "
            "and you require xgrammar{platform_machine == 'x86_64'}==0.1.16, we can conclude ...")
AVAILABLE = {"0.1.13": "2025-02-01T00:00:00Z", "0.1.17": "2025-03-25T11:07:38Z",
             "0.1.18": "2025-04-01T00:00:00Z", "0.2.0": "2025-06-01T00:00:00Z"}


def test_the_nearest_version_is_a_later_patch_of_the_same_series():
    assert envmod.nearest_version("0.1.16", AVAILABLE) == "0.1.17"
    assert envmod.nearest_version("0.1.40", AVAILABLE) == "0.1.18"  # nothing above: highest below
    assert envmod.nearest_version("0.0.1", {"0.2.0": None}) is None


def test_a_missing_pin_from_uvs_error_is_substituted(monkeypatch):
    files = [{"filename": f"xgrammar-{v}-cp311-cp311-manylinux.whl", "upload-time": t}
             for v, t in AVAILABLE.items()]
    monkeypatch.setattr("vllm_repro.sources.index.project_files", lambda name, index=None: files)
    reqs = ["xgrammar == 0.1.16; platform_machine == 'x86_64'", "numpy"]
    (sub,) = envmod.missing_pins(UV_ERROR, reqs, [], IndexSettings.from_pip())
    assert (sub.name, sub.pinned, sub.used) == ("xgrammar", "0.1.16", "0.1.17")
    # uv's cut-off is strict: the substitute is allowed until an hour after its upload
    assert sub.uv_args() == ["--exclude-newer-package", "xgrammar=2025-03-25T12:07:38Z"]
    assert envmod._substituted(reqs[0], [sub]) == "xgrammar ==0.1.17; platform_machine == 'x86_64'"
    assert sub.describe() == "xgrammar==0.1.16 -> xgrammar==0.1.17 (0.1.16 is not on the index)"
    # a name the release does not pin, or one already substituted, is left to uv's error
    assert envmod.missing_pins(UV_ERROR, ["numpy"], [], IndexSettings.from_pip()) == []
    assert envmod.missing_pins(UV_ERROR, reqs, [sub], IndexSettings.from_pip()) == []


def test_torch_by_release_picks_the_first_matching_range(monkeypatch):
    import pytest

    from vllm_repro.errors import InputError
    from vllm_repro.settings import torch_for_release

    monkeypatch.setenv("TORCH_BY_RELEASE", ">=0.17.0,<0.18=2.10.0; <0.7=2.5.1")
    assert torch_for_release("0.17.1") == "2.10.0"
    assert torch_for_release("0.6.6.post1") == "2.5.1"
    assert torch_for_release("0.10.2") is None
    monkeypatch.setenv("TORCH_BY_RELEASE", ">=0.17.0")
    with pytest.raises(InputError, match="TORCH_BY_RELEASE entry '>=0.17.0'"):
        torch_for_release("0.17.1")
    monkeypatch.delenv("TORCH_BY_RELEASE")
    assert torch_for_release("0.17.1") is None  # the default: TORCH_VERSION for every release
