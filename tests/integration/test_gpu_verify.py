"""`make gpu-verify` end to end over SSH: a real OpenSSH server on 127.0.0.1, the local Docker
engine, and the CPU image standing in for the CUDA one (GPU_IMAGE=..., GPU=none).

Our fix for vLLM #23347 on 0.10.1.1 comes back "reproduced before, clean after", with JUnit in
reports/gpu/; then each failure gives its one-line message and exit code, brings back what was
produced and leaves the remote clean: host unreachable, authentication refused, an unknown host
key, no docker, no GPU, a patch that does not apply there, the connection killed mid-run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ..conftest import FLAGSHIP, ROOT
from .dockerlab import cpu_image, ssh_host  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow
FIX = ROOT / "scenarios/fixes/vllm-23347-0.10.1.1.diff"


def gpu_verify(ssh_host, cpu_image, reports: Path, *args: str, host="vrtest", gpu="none",
               timeout=900) -> subprocess.CompletedProcess:
    image = cpu_image[0]
    cmd = [sys.executable, "-m", "vllm_repro.cli", "gpu-verify", "--remote", host,
           "--ssh-config", str(ssh_host.config), "--gpu-image", image, "--reports", str(reports), *args]
    if gpu:
        cmd += ["--gpu", gpu]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_remote_clean(ssh_host):
    assert ssh_host.remote_work() == [], ssh_host.remote_work()
    names = subprocess.run(["docker", "ps", "-a", "--filter", "name=vllm-repro-", "--format", "{{.Names}}"],
                           capture_output=True, text=True).stdout.split()
    assert names == [], names
    for _ in range(20):  # sshd's session processes take a moment to go after the client closes
        left = {pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                for pid in ssh_host.user_pids() if Path(f"/proc/{pid}").exists()}
        if not left:
            break
        time.sleep(0.5)
    assert left == {}, "the test user's processes are still running"


def run_dir(reports: Path, host: str = "vrtest") -> Path:
    runs = sorted((reports / "gpu" / host).iterdir())
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture(scope="module")
def shipped(ssh_host, cpu_image, tmp_path_factory):
    """The main run, through `make gpu-verify` as a user types it."""
    reports = tmp_path_factory.mktemp("gpu-verify") / "reports"
    env = dict(os.environ, VLLM_REPRO_SSH_CONFIG=str(ssh_host.config))
    t = time.perf_counter()
    proc = subprocess.run(["make", "--no-print-directory", "gpu-verify", "REMOTE=vrtest", f"PATCH={FIX}",
                           f"SCENARIO={FLAGSHIP}", "VLLM=0.10.1.1", f"GPU_IMAGE={cpu_image[0]}", "GPU=none",
                           f"REPORTS={reports}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    print(f"\nmake gpu-verify: {time.perf_counter() - t:.0f}s", file=sys.stderr)
    return proc, reports


def test_fix_is_reproduced_before_and_clean_after_over_ssh(shipped, ssh_host):
    proc, reports = shipped
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert "verified on vrtest" in proc.stdout and "reproduced before, clean after" in proc.stdout
    run = run_dir(reports)
    summary = json.loads((run / "summary.json").read_text())
    judged = summary["judge"]
    assert judged["verified"] is True and summary["exit_code"] == 0
    assert judged["installed"]["version"].startswith("0.10.1.1")
    assert judged["before"]["observed"] == "crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3"
    assert judged["after"]["observed"].startswith("clean (2 finished")
    suite = ET.parse(run / "junit.xml").getroot()
    cases = suite.findall(".//testcase")
    passed = [c for c in cases if not any(x.tag in ("failure", "error", "skipped") for x in c)]
    assert any("vllm-23347-priority-preempt-scheduled@0.10.1.1" in c.get("name") for c in passed)
    assert not suite.findall(".//failure") and not suite.findall(".//error")
    assert ET.parse(run / "junit-before.xml").getroot().findall(".//testcase")
    assert (run / "remote.log").is_file() and (run / "run.log").is_file()
    assert "[gpu-judge] verified" in (run / "run.log").read_text()
    assert summary["remote_cleaned"] is True
    assert_remote_clean(ssh_host)


@pytest.fixture(scope="module")
def bundle(shipped):
    """The verify bundle the main run made (shipped again as it is by the failure tests)."""
    _, reports = shipped
    return next((reports / "verify").iterdir())


def test_host_unreachable_when_sshd_is_stopped(ssh_host, cpu_image, bundle, tmp_path):
    ssh_host.stop()
    try:
        proc = gpu_verify(ssh_host, cpu_image, tmp_path / "r", "--bundle", str(bundle))
    finally:
        ssh_host.start()
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"cannot reach vrtest (127.0.0.1:{ssh_host.port}): connection refused" in proc.stderr
    assert (run_dir(tmp_path / "r") / "summary.json").is_file()


def test_authentication_refused(ssh_host, cpu_image, bundle, tmp_path):
    proc = gpu_verify(ssh_host, cpu_image, tmp_path / "r", "--bundle", str(bundle), host="vrbadkey")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"vrbadkey (127.0.0.1:{ssh_host.port}) refused authentication as '{ssh_host.user}'" in proc.stderr


def test_unknown_host_key_is_refused_unless_asked(ssh_host, cpu_image, bundle, tmp_path):
    proc = gpu_verify(ssh_host, cpu_image, tmp_path / "r", "--bundle", str(bundle), host="vrnokey")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "unknown host key (not in known_hosts)" in proc.stderr
    assert (ssh_host.dir / "known_hosts.empty").read_text() == ""
    # asked: the key is recorded, and the run goes on (to the GPU check, which fails here)
    proc = gpu_verify(ssh_host, cpu_image, tmp_path / "r2", "--bundle", str(bundle), "--accept-new-host-key",
                      host="vrnokey", gpu=None)
    assert "unknown host key" not in proc.stderr
    assert proc.returncode == 3 and "no GPU on vrnokey" in proc.stderr
    known = (ssh_host.dir / "known_hosts.empty").read_text()
    (ssh_host.dir / "known_hosts.empty").write_text("")
    assert f"[127.0.0.1]:{ssh_host.port} ssh-ed25519" in known


def test_no_docker_on_the_remote(ssh_host, cpu_image, bundle, tmp_path):
    # the remote user's PATH (sshd's PermitUserEnvironment) holds everything in /usr/bin but docker
    bin_dir = ssh_host.home / "bin-without-docker"
    bin_dir.mkdir(exist_ok=True)
    for f in Path("/usr/bin").iterdir():
        if not f.name.startswith("docker") and not (bin_dir / f.name).exists():
            (bin_dir / f.name).symlink_to(f)
    env_file = ssh_host.home / ".ssh" / "environment"
    env_file.write_text(f"PATH={bin_dir}\n")
    try:
        proc = gpu_verify(ssh_host, cpu_image, tmp_path / "r", "--bundle", str(bundle))
    finally:
        env_file.unlink()
        shutil.rmtree(bin_dir)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"no docker on vrtest: `docker` is not on the PATH of {ssh_host.user} there" in proc.stderr
    assert_remote_clean(ssh_host)


def test_no_gpu_unless_gpu_none(ssh_host, cpu_image, bundle, tmp_path):
    proc = gpu_verify(ssh_host, cpu_image, tmp_path / "r", "--bundle", str(bundle), gpu=None)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no GPU on vrtest: nvidia-smi not found (no NVIDIA driver) (GPU=none runs without one" in proc.stderr
    assert_remote_clean(ssh_host)


def test_patch_that_does_not_apply_on_the_remote(ssh_host, cpu_image, bundle, tmp_path):
    stale = tmp_path / "stale-bundle"
    shutil.copytree(bundle, stale)
    patch = (stale / "patch.diff").read_text()
    # the same fix against a scheduler whose context line reads differently (another build)
    (stale / "patch.diff").write_text(patch.replace(" key=lambda r: (r.priority, r.arrival_time),",
                                                    " key=lambda r: (r.priority, r.arrival_time, 0),"))
    manifest = json.loads((stale / "manifest.json").read_text())
    manifest["sha256"]["patch.diff"] = hashlib.sha256((stale / "patch.diff").read_bytes()).hexdigest()
    (stale / "manifest.json").write_text(json.dumps(manifest))
    proc = gpu_verify(ssh_host, cpu_image, tmp_path / "r", "--bundle", str(stale))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the patch does not apply cleanly to the installed vLLM 0.10.1.1" in proc.stderr
    run = run_dir(tmp_path / "r")
    assert (run / "junit-before.xml").is_file() and not (run / "junit.xml").exists()
    assert json.loads((run / "summary.json").read_text())["judge"]["error"]["kind"] == "input"
    assert_remote_clean(ssh_host)


def test_connection_killed_mid_run(ssh_host, cpu_image, bundle, tmp_path):
    reports = tmp_path / "r"
    cmd = [sys.executable, "-m", "vllm_repro.cli", "gpu-verify", "--remote", "vrtest", "--ssh-config",
           str(ssh_host.config), "--gpu-image", cpu_image[0], "--gpu", "none", "--reports", str(reports),
           "--bundle", str(bundle)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = []
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "suite before" in line and not killed:
            time.sleep(2)
            killed = ssh_host.kill_sessions()
    out = proc.stdout.read()
    proc.wait(timeout=300)
    err = "".join(lines)
    assert killed, err
    assert proc.returncode == 3, out + err
    assert "connection to vrtest dropped mid-run (running the shared suite)" in err
    run = run_dir(reports)
    assert "[gpu-judge] suite before" in (run / "remote.log").read_text()
    assert "reconnected to vrtest" in err
    # the remote script stopped the container when the session went; the client removed the rest
    assert_remote_clean(ssh_host)
