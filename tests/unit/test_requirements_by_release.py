"""REQUIREMENTS_BY_RELEASE: extra requirements for a range of releases (settings.py), installed
by the environment builder as uv overrides and shown with every run (sources/env.py)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from vllm_repro.errors import InputError
from vllm_repro.settings import TorchSource, requirements_for_release
from vllm_repro.sources import env as envmod
from vllm_repro.sources.sdist import Release


def values(release: str) -> list[str]:
    return [r.value for r in requirements_for_release(release)]


def test_the_default_gives_the_oldest_v0_releases_what_they_import(monkeypatch):
    monkeypatch.delenv("REQUIREMENTS_BY_RELEASE", raising=False)
    assert values("0.4.0") == ["triton"]  # vllm/model_executor/layers/ops/sample.py
    assert values("0.4.3") == ["triton"]
    assert values("0.5.3.post1") == ["triton", "outlines==0.0.41"]  # a post release is in <0.5.4
    assert values("0.5.5") == ["outlines==0.0.41"]
    assert values("0.6.0") == []
    assert values("0.10.1.1") == []


def test_every_entry_whose_range_holds_the_release_applies_in_order(monkeypatch):
    monkeypatch.setenv("REQUIREMENTS_BY_RELEASE",
                       " >=0.5.0, <0.6 = outlines==0.0.41 ;; <0.5.4=triton>=2.1; ==0.5.5=pycountry")
    assert values("0.5.5") == ["outlines==0.0.41", "pycountry"]
    assert values("0.5.0") == ["outlines==0.0.41", "triton>=2.1"]
    assert values("0.4.3") == ["triton>=2.1"]
    assert values("0.6.3.post1") == []
    monkeypatch.setenv("REQUIREMENTS_BY_RELEASE", "")  # empty: nothing for any release
    assert values("0.4.3") == []


@pytest.mark.parametrize("entry", [
    ">=0.5.0",                      # no requirement
    "0.5=triton",                   # no specifier operator
    "<0.5=",                        # empty requirement
    "<0.5=tri ton!",                # not a PEP 508 requirement
    "<0.5=triton @ https://example.invalid/triton.whl",  # a direct URL
    "<0.5=outlines; python_version<'3.12'",  # a marker's ';' ends the entry
])
def test_a_bad_entry_is_an_input_error_naming_the_variable_and_the_entry(monkeypatch, entry):
    monkeypatch.setenv("REQUIREMENTS_BY_RELEASE", f"<0.5.4=triton; {entry}")
    with pytest.raises(InputError) as info:
        requirements_for_release("0.9.0")  # checked even where no entry's range holds
    msg = str(info.value)
    assert msg.startswith("REQUIREMENTS_BY_RELEASE entry ") and "SPECIFIER=REQUIREMENT" in msg
    assert "fix or unset REQUIREMENTS_BY_RELEASE" in msg
    assert repr(entry.split(";")[-1].strip()) in msg or repr(entry) in msg


def test_torch_by_release_shares_the_parser_and_keeps_its_message(monkeypatch):
    from vllm_repro.settings import torch_for_release

    monkeypatch.setenv("TORCH_BY_RELEASE", "<0.5=outlines==0.0.41")
    with pytest.raises(InputError, match="TORCH_BY_RELEASE entry '<0.5=outlines==0.0.41' is not "
                                         "SPECIFIER=VERSION"):
        torch_for_release("0.4.3")


@pytest.fixture
def fake_uv(tmp_path, monkeypatch):
    """prepare_env with uv stood in for: each call recorded with the requirement and override
    files' text at that moment; ``venv`` makes bin/python."""
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path / "cache"))
    calls: list[dict] = []

    def run_uv(args, env, what, log):
        call = {"args": list(args)}
        for flag, key in (("-r", "reqs"), ("--override", "overrides")):
            if flag in args:
                call[key] = Path(args[args.index(flag) + 1]).read_text()
        if args[0] == "venv":
            py = Path(args[-1]) / "bin" / "python"
            py.parent.mkdir(parents=True)
            py.write_text("")
        calls.append(call)
        return "outlines==0.0.41\n"

    monkeypatch.setattr(envmod, "run_uv", run_uv)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "requirements-common.txt").write_text("outlines >= 0.0.43, < 0.1\nnumpy < 2.0.0\n")
    (tree / "requirements-cpu.txt").write_text("-r requirements-common.txt\ntorch == 2.3.0+cpu\n")
    release = Release("0.5.0", tmp_path / "vllm-0.5.0.tar.gz", "0" * 64,
                      datetime(2024, 6, 11, 23, 6, tzinfo=timezone.utc))
    torch = TorchSource("2.13.0", None, "https://torch.invalid/cpu")
    return calls, release, tree, torch


def test_the_builder_installs_them_as_overrides_and_records_them(fake_uv, monkeypatch):
    calls, release, tree, torch = fake_uv
    monkeypatch.delenv("REQUIREMENTS_BY_RELEASE", raising=False)
    env = envmod.prepare_env(release, tree, torch=torch, python="python3")
    (install,) = [c for c in calls if "reqs" in c]
    # beside the release's own requirement, and winning over it (uv --override)
    assert install["reqs"].splitlines() == ["outlines >= 0.0.43, < 0.1", "numpy < 2.0.0",
                                            "triton", "outlines==0.0.41"]
    overrides = install["overrides"].splitlines()
    assert "outlines==0.0.41" in overrides and "triton" in overrides
    # triton is no longer overridden away where an entry asks for it; the others still are
    assert 'triton ; sys_platform == "never"' not in overrides
    assert 'pytorch-triton ; sys_platform == "never"' in overrides
    ready = json.loads((env.root / ".ready.json").read_text())
    assert ready["extra_requirements"] == ["triton", "outlines==0.0.41"]
    assert env.substitutions() == [
        "triton (REQUIREMENTS_BY_RELEASE '<0.5.4=triton', added to the environment)",
        "outlines==0.0.41 (REQUIREMENTS_BY_RELEASE '>=0.5.0,<0.6.0=outlines==0.0.41', in place "
        "of the release's 'outlines >= 0.0.43, < 0.1')"]
    # built: nothing runs again while the setting is the same ...
    n = len(calls)
    envmod.prepare_env(release, tree, torch=torch, python="python3")
    assert len(calls) == n
    # ... and a changed setting rebuilds the environment without the entries
    monkeypatch.setenv("REQUIREMENTS_BY_RELEASE", "")
    envmod.prepare_env(release, tree, torch=torch, python="python3")
    rebuilt = [c for c in calls[n:] if "reqs" in c][0]
    assert rebuilt["reqs"].splitlines() == ["outlines >= 0.0.43, < 0.1", "numpy < 2.0.0"]
    assert 'triton ; sys_platform == "never"' in rebuilt["overrides"].splitlines()
