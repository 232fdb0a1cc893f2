"""The CUDA image built where no registry answers (opt-in: about 9 GB and 15+ minutes): `make
image-cuda VLLM_VERSION=0.10.1.1 BASE_IMAGE=<a Python base>` installs full vLLM of the release
from the index with the dependency set of its day, and the shared suite's CPU-level tests pass
against it (no GPU in the container: the `gpu` tests are deselected).

    VLLM_REPRO_TEST_CUDA_IMAGE=1 .venv/bin/python -m pytest -q tests/integration/test_image_cuda.py

The base is ``BASE_IMAGE`` (the local Python 3.11 image ../shared/tools/docker-host.sh builds on
this workplace's machines). The image is removed afterwards unless it was there before the test
(then the build reuses its layers and the test takes a minute).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime

import pytest

from ..conftest import ROOT
from .dockerlab import docker_settings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("VLLM_REPRO_TEST_CUDA_IMAGE") != "1",
                       reason="builds the CUDA image (about 9 GB, 15+ min, the index reachable from "
                              "the build): set VLLM_REPRO_TEST_CUDA_IMAGE=1"),
]
VERSION = "0.10.1.1"
#: dependencies whose newest release today is far from August 2025's (transformers 5, protobuf 6+)
#: and the ones vLLM pins tightly: each installed version must predate the cut-off
CHECKED = ("transformers", "tokenizers", "protobuf", "torch", "xformers", "fastapi", "pydantic", "numpy")


def _uploaded(name: str, version: str) -> tuple[datetime | None, list[str]]:
    """(first upload time of ``name==version`` on the index, every version uploaded)."""
    from packaging.utils import parse_wheel_filename, parse_sdist_filename

    from vllm_repro.sources.index import _parse_time, project_files

    first, versions = None, set()
    for f in project_files(name):
        fn = f["filename"]
        try:
            v = str(parse_wheel_filename(fn)[1] if fn.endswith(".whl") else parse_sdist_filename(fn)[1])
        except ValueError:
            continue
        versions.add(v)
        t = _parse_time(f.get("upload-time"))
        if v == version and t and (first is None or t < first):
            first = t
    return first, sorted(versions)


def test_cuda_image_on_a_python_base_has_the_release_and_its_days_dependencies():
    from packaging.version import Version


    settings = docker_settings(gate="VLLM_REPRO_TEST_CUDA_IMAGE")
    base = os.environ.get("BASE_IMAGE") or settings.get("BASE_IMAGE")
    if not base:
        pytest.skip("no BASE_IMAGE (a Python base image present on the engine)")
    tag = f"vllm-repro-cuda:{VERSION}"
    existed = subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0
    env = dict(os.environ, **settings)
    try:
        t = time.perf_counter()
        proc = subprocess.run(["make", "--no-print-directory", "image-cuda", f"VLLM_VERSION={VERSION}",
                               f"BASE_IMAGE={base}", f"CUDA_IMAGE={tag}"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=5400)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        print(f"\n{proc.stdout.strip().splitlines()[-1]} (make image-cuda: {time.perf_counter() - t:.0f}s"
              f"{', layers reused' if existed else ''})", file=sys.stderr)
        cutoff = subprocess.run([sys.executable, "images/cuda/exclude_newer.py", VERSION], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()

        def inside(*cmd: str, timeout: int = 600) -> subprocess.CompletedProcess:
            return subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", cmd[0], tag,
                                   *cmd[1:]], capture_output=True, text=True, timeout=timeout)

        assert inside("cat", "/opt/vllm/EXCLUDE_NEWER").stdout.strip() == cutoff
        listed = inside("python3", "-m", "pip", "list", "--format=freeze")
        assert listed.returncode == 0, listed.stderr
        versions = dict(line.split("==", 1) for line in listed.stdout.split() if "==" in line)
        print("\n" + " ".join(f"{n}=={versions.get(n)}" for n in ("vllm", *CHECKED)), file=sys.stderr)
        assert versions["vllm"] == VERSION
        limit = datetime.fromisoformat(cutoff.replace("Z", "+00:00"))
        for name in CHECKED:
            assert name in versions, (name, sorted(versions))
            first, known = _uploaded(name, versions[name])
            assert first is not None and first <= limit, (name, versions[name], first, cutoff)
        # the index has moved on since: today's resolution would have given newer ones
        for name in ("transformers", "protobuf"):
            newest = max((Version(v) for v in _uploaded(name, versions[name])[1]
                          if not Version(v).is_prerelease))
            assert newest > Version(versions[name]), (name, versions[name], newest)

        suite = inside("python3", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m",
                       "shared and not gpu", "/opt/vllm-repro/lab/tests/shared", timeout=1200)
        print(suite.stdout.strip().splitlines()[-1], file=sys.stderr)
        assert suite.returncode == 0, suite.stdout[-4000:] + suite.stderr[-2000:]
        assert re.search(r"\b\d+ passed", suite.stdout) and "failed" not in suite.stdout, suite.stdout
    finally:
        if not existed:
            subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)
