"""`make image-cuda` without Docker (DOCKER=echo prints the build command): on vLLM's own image by
default; with BASE_IMAGE, the release's cut-off date read from the index (a fake one on loopback)
is passed as EXCLUDE_NEWER, the same cut-off the CPU environments resolve with. The build itself
is tests/integration/test_image_cuda.py (opt-in)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timezone

from vllm_repro.sources.env import exclude_newer

from ..conftest import ROOT
from .fake_index import FakeIndex, make_sdist

UPLOADED = "2025-08-20T23:17:16Z"  # what FakeIndex says of every file


def make_image_cuda(tmp_path, index_url: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_REPRO_CACHE=str(tmp_path / "cache"), PIP_INDEX_URL=index_url,
               EXTRA_CA_CERT="", TORCH_WHEEL_DIR="", BASE_IMAGE="", EXCLUDE_NEWER="")
    return subprocess.run(["make", "--no-print-directory", "image-cuda", "DOCKER=echo",
                           f"BIN={os.path.dirname(sys.executable)}", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_cut_off_is_an_hour_after_the_upload():
    up = datetime.fromisoformat(UPLOADED.replace("Z", "+00:00"))
    assert up.tzinfo == timezone.utc
    assert exclude_newer(up) == "2025-08-21T00:17:16Z"


def test_a_python_base_gets_the_releases_cut_off_and_the_default_base_none(tmp_path):
    with FakeIndex({"vllm-9.9.9.tar.gz": make_sdist("9.9.9")}) as idx:
        plain = make_image_cuda(tmp_path, idx.url, "VLLM_VERSION=9.9.9", "BASE_IMAGE=python:3.11-slim")
        official = make_image_cuda(tmp_path, idx.url, "VLLM_VERSION=9.9.9")
        missing = make_image_cuda(tmp_path, idx.url, "VLLM_VERSION=9.9.10", "BASE_IMAGE=python:3.11-slim")
    cutoff = exclude_newer(datetime.fromisoformat(UPLOADED.replace("Z", "+00:00")))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    build = next(line for line in plain.stdout.splitlines() if line.startswith("build "))
    assert f"--build-arg EXCLUDE_NEWER={cutoff}" in build
    assert "--build-arg BASE_IMAGE=python:3.11-slim" in build and "--build-arg VLLM_VERSION=9.9.9" in build
    assert "-t vllm-repro-cuda:9.9.9" in build

    assert official.returncode == 0, official.stdout + official.stderr
    build = next(line for line in official.stdout.splitlines() if line.startswith("build "))
    assert "EXCLUDE_NEWER" not in build and "BASE_IMAGE" not in build  # the Dockerfile's default base
    assert "on vllm/vllm-openai:v9.9.9" in official.stdout

    # a release the index lacks: the input error (exit 2) with its one line, no build
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "vLLM 9.9.10 is not a release on the index" in missing.stderr
    assert not any(line.startswith("build ") for line in missing.stdout.splitlines())
