"""`make cpu-repro`'s runner choice (issue 20 item 4), with a stand-in `docker` command that logs
what it is asked (DOCKER=...): RUNNER=auto picks the image only when it exists, never builds one
because an engine answers, says which and why; a scenario outside the checkout is mounted
read-only under the docker runner."""

from __future__ import annotations

import os
import subprocess

import pytest

from ..conftest import ROOT

FAKE = """#!/bin/sh
echo "$*" >> "{log}"
case "$1" in
  info) exit {info};;
  image) [ "{image}" = 1 ] || exit 1
         case "$*" in *vllm-repro.releases*) echo "{releases}";; *) echo "{label}";; esac; exit 0;;
  run) exit 0;;
  *) exit 0;;
esac
"""


def lab_hash(root=ROOT, *words: str) -> str:
    return subprocess.run(["sh", "images/lab-hash.sh", *words], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip()


def make_cpu_repro(tmp_path, *, info: int, image: bool, scenario: str, goals=("cpu-repro",),
                   label: str | None = None, releases: str = ""):
    """``label``: the lab hash the stand-in image carries (default: this checkout's, over the
    slices of ``releases``, the image's releases label: make images' VLLM_VERSIONS)."""
    log = tmp_path / "docker.log"
    fake = tmp_path / "docker"
    fake.write_text(FAKE.format(log=log, info=info, image=int(image), releases=releases,
                                label=lab_hash(ROOT, *releases.split()) if label is None else label))
    fake.chmod(0o755)
    proc = subprocess.run(["make", "--no-print-directory", *goals, f"DOCKER={fake}", f"SCENARIO={scenario}",
                           f"REPORTS={tmp_path / 'reports'}", "CPU_IMAGE=vr-test:none"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, RUNNER="auto"))
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


@pytest.mark.parametrize("info", [0, 1], ids=["engine", "no-engine"])
def test_auto_runs_natively_without_the_image_and_builds_nothing(tmp_path, info):
    proc, calls = make_cpu_repro(tmp_path, info=info, image=False, scenario=str(tmp_path / "none.yaml"))
    first = proc.stderr.splitlines()[0]
    assert first.startswith("cpu-repro: runner native (RUNNER=auto: "), proc.stderr
    assert ("no image vr-test:none" if info == 0 else "no Docker engine answers") in first
    assert not any(c.startswith("build") for c in calls), calls
    assert "no such scenario file" in proc.stderr  # the native lab ran, and refused the path


def test_auto_runs_in_the_image_when_it_exists_and_mounts_an_outside_scenario(tmp_path):
    outside = tmp_path / "mine.yaml"
    outside.write_text((ROOT / "scenarios/vllm-23347-priority-preempt-scheduled.yaml").read_text())
    proc, calls = make_cpu_repro(tmp_path, info=0, image=True, scenario=str(outside))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0].startswith("cpu-repro: runner docker, image vr-test:none "
                                                  "(RUNNER=auto: the image exists;"), proc.stderr
    [run] = [c for c in calls if c.startswith("run ")]
    assert f"-v {outside}:{outside}:ro" in run and f"-v {ROOT}:{ROOT}:ro" in run
    assert f"run {outside} --reports" in run
    assert not any(c.startswith("build") for c in calls), calls


def test_an_image_of_the_same_lab_is_used_as_it_is_whatever_the_files_mtimes(tmp_path):
    """A fresh clone gives every file a new mtime: the image's lab hash (content) still matches,
    so nothing is rebuilt; an image of another lab (or without the label) is rebuilt."""
    import shutil

    copy = tmp_path / "copy"
    copy.mkdir()
    for part in ("src", "images", "slices"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy)
    shutil.copy(ROOT / "requirements.lock", copy)
    for f in copy.rglob("*"):  # every file newer than any image, as in a fresh clone
        os.utime(f)
    assert lab_hash(copy) == lab_hash(ROOT)
    (copy / "src" / "vllm_repro" / "__init__.py").write_text("# edited\n", encoding="utf-8")
    assert lab_hash(copy) != lab_hash(ROOT)  # content counts
    outside = tmp_path / "mine.yaml"
    outside.write_text((ROOT / "scenarios/vllm-23347-priority-preempt-scheduled.yaml").read_text())
    proc, calls = make_cpu_repro(tmp_path, info=0, image=True, scenario=str(outside))
    assert proc.returncode == 0, proc.stderr
    assert not any(c.startswith("build") for c in calls), calls
    for other in ("0123456789abcdef", "<no value>"):  # another lab's image; one without the label
        (tmp_path / "docker.log").unlink()
        proc, calls = make_cpu_repro(tmp_path, info=0, image=True, scenario=str(outside), label=other)
        assert "the lab differs from the one vr-test:none was built from" in proc.stderr, proc.stderr
        assert any(c.startswith("build") for c in calls), calls


def test_slicing_a_release_the_image_does_not_bake_leaves_it_current(tmp_path):
    """The hash covers the slices of the releases the image bakes (its releases label: the
    flagship image's scenario names 0.10.1.1 and 0.10.2), not every slice: a new slice of
    another release rebuilt the flagship image; a changed slice of a baked release still does."""
    import shutil

    flagship = "scenarios/vllm-23347-priority-preempt-scheduled.yaml"
    copy = tmp_path / "copy"
    for part in ("src", "images", "slices", "scenarios"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy)
    shutil.copy(ROOT / "requirements.lock", copy)
    before = lab_hash(copy, flagship), lab_hash(copy, "catalog"), lab_hash(copy)
    (copy / "slices" / "9.9.9.json").write_text("{}\n")  # a release no scenario names
    assert lab_hash(copy, flagship) == before[0] and lab_hash(copy, "catalog") == before[1]
    assert lab_hash(copy) != before[2]  # (no scope: every slice)
    (copy / "slices" / "0.10.2.json").write_text("{}\n")  # one the flagship bakes
    assert lab_hash(copy, flagship) != before[0] and lab_hash(copy, "0.10.2") != lab_hash(ROOT, "0.10.2")
    assert lab_hash(copy, "0.11.0") == lab_hash(ROOT, "0.11.0")
    # make cpu-repro with such an image: the scope is read from the image, nothing is rebuilt
    proc, calls = make_cpu_repro(tmp_path, info=0, image=True, scenario=str(ROOT / flagship),
                                 releases=flagship)
    assert proc.returncode == 0, proc.stderr
    assert not any(c.startswith("build") for c in calls), calls


def _make(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def _logger(tmp_path, name: str, rc: int = 0):
    log = tmp_path / f"{name}.log"
    fake = tmp_path / name
    fake.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexit {rc}\n')
    fake.chmod(0o755)
    return fake, log


def test_gpu_verify_passes_accept_new_host_key_and_a_bundle(tmp_path):
    """The error message of an unknown host key advises --accept-new-host-key: make passes it
    with ACCEPT_NEW_HOST_KEY=1; BUNDLE= ships a verify bundle as it is (no scenario, no patch)."""
    repro, log = _logger(tmp_path, "vllm-repro")
    proc = _make(tmp_path, "gpu-verify", f"REPRO={repro}", "REMOTE=gpu-box", "PATCH=fix.diff",
                 "ACCEPT_NEW_HOST_KEY=1")
    assert proc.returncode == 0, proc.stderr
    proc = _make(tmp_path, "gpu-verify", f"REPRO={repro}", "REMOTE=gpu-box", "BUNDLE=reports/verify/b")
    assert proc.returncode == 0, proc.stderr
    first, second = [line.split() for line in log.read_text().splitlines()]
    assert first[:3] == ["gpu-verify", "scenarios/vllm-23347-priority-preempt-scheduled.yaml",
                         "--patch"] and first[-1] == "--accept-new-host-key"
    assert second[:3] == ["gpu-verify", "--bundle", "reports/verify/b"]
    assert "--patch" not in second and "--accept-new-host-key" not in second
    bad = _make(tmp_path, "gpu-verify", f"REPRO={repro}", "REMOTE=gpu-box", "BUNDLE=b",
                "ACCEPT_NEW_HOST_KEY=yes")
    assert bad.returncode == 2 and "ACCEPT_NEW_HOST_KEY=yes: expected 1" in bad.stderr
    assert len(log.read_text().splitlines()) == 2  # nothing run


def test_image_builds_say_only_what_they_use_and_remove_their_stages(tmp_path):
    """make image-cuda stages no CPU torch wheel (the CUDA image never uses it) and says nothing
    of one; make image-cpu removes the untagged earlier builds and the legacy builder's
    untagged stages (by their labels) after the build."""
    docker, log = _logger(tmp_path, "docker")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    proc = _make(tmp_path, "image-cuda", f"DOCKER={docker}", f"TORCH_WHEEL_DIR={wheels}",
                 "CUDA_IMAGE=vr-test:cuda")
    assert proc.returncode == 0, proc.stderr
    assert "torch" not in proc.stdout + proc.stderr
    assert not list((ROOT / "images/stage/index/torch").glob("*.whl"))
    log.unlink()
    proc = _make(tmp_path, "image-cpu", f"DOCKER={docker}", "CPU_IMAGE=vr-test:cpu")
    assert proc.returncode == 0, proc.stderr
    prunes = [c for c in log.read_text().splitlines() if c.startswith("image prune")]
    assert any("label=org.opencontainers.image.title=vllm-repro (CPU)" in c for c in prunes)
    assert any("label=vllm-repro.stage" in c for c in prunes)
    assert 'LABEL vllm-repro.stage="catalog"' in (ROOT / "images/cpu/Dockerfile").read_text()
