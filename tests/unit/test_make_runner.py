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
  image) [ "{image}" = 1 ] || exit 1; echo 2999-01-01T00:00:00Z; exit 0;;
  run) exit 0;;
  *) exit 0;;
esac
"""


def make_cpu_repro(tmp_path, *, info: int, image: bool, scenario: str, goals=("cpu-repro",)):
    log = tmp_path / "docker.log"
    fake = tmp_path / "docker"
    fake.write_text(FAKE.format(log=log, info=info, image=int(image)))
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
