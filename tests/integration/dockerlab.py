"""Fixtures for the image and gpu-verify tests: a Docker engine with the CPU image, and an
OpenSSH server on 127.0.0.1 with a throwaway user, host key, user key, known_hosts and ssh config.

They are heavy (the CPU image is about 2.9 GB and takes about 15 minutes to build on two cores),
so they run only with ``VLLM_REPRO_TEST_IMAGES=1`` (``.ci/run`` passes it on). The engine comes
from ``../shared/tools/docker-host.sh`` (this workplace's machines cannot pull from a registry;
the script installs docker.io and builds a local base image). Without the setting or the script
the tests are skipped and say why.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER_HOST_SH = ROOT.parent / "shared" / "tools" / "docker-host.sh"
CPU_IMAGE = os.environ.get("CPU_IMAGE", "vllm-repro-cpu:latest")


def _skip(reason: str):
    print(f"\nSKIP: {reason}", file=sys.stderr)
    pytest.skip(reason)


def docker_settings(gate: str = "VLLM_REPRO_TEST_IMAGES") -> dict[str, str]:
    """Run docker-host.sh (idempotent) and return the settings it prints (BASE_IMAGE...).

    Skips the calling test unless the setting ``gate`` is ``1`` (``VLLM_REPRO_TEST_IMAGES``: the
    CPU image's tests; the CUDA image's test has its own) and the script exists."""
    if os.environ.get(gate) != "1":
        _skip(f"image tests are opt-in: {gate}=1 builds the image (the CPU one: ~2.9 GB, ~15 min)")
    if not DOCKER_HOST_SH.is_file():
        _skip(f"no Docker engine set-up script at {DOCKER_HOST_SH} (image tests need it here)")
    proc = subprocess.run(["bash", str(DOCKER_HOST_SH)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"docker-host.sh failed: {proc.stderr[-2000:]}")
    settings = {}
    for line in proc.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            k, v = line[len("export "):].split("=", 1)
            settings[k] = v
    return settings


@pytest.fixture(scope="session")
def cpu_image():
    """The CPU image of this checkout (``make image-cpu``, cached layers make it quick when
    nothing changed). Returns (image name, build settings, build seconds)."""
    settings = docker_settings()
    env = dict(os.environ, **settings)
    t = time.perf_counter()
    proc = subprocess.run(["make", "--no-print-directory", "image-cpu", f"CPU_IMAGE={CPU_IMAGE}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    took = time.perf_counter() - t
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(f"\n{proc.stdout.strip().splitlines()[-1]} (make image-cpu: {took:.0f}s)", file=sys.stderr)
    return CPU_IMAGE, settings, took


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for line in (d / "status").read_text().splitlines():
                if line.startswith("Uid:") and int(line.split()[1]) == uid:
                    pids.append(int(d.name))
        except (OSError, ValueError):
            continue
    return pids


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


@dataclass
class SshHost:
    """A throwaway SSH host on 127.0.0.1 (see :func:`ssh_host`)."""

    dir: Path
    user: str
    home: Path
    port: int
    config: Path
    sshd_config: Path
    proc: subprocess.Popen | None = None
    log: Path = field(default=None)

    def start(self) -> None:
        self.proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(self.sshd_config)],
                                     stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"sshd did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None

    def kill_sessions(self) -> list[int]:
        """SIGKILL the sshd processes serving current connections (not the listener, not the
        commands they run): the connection drops the way a network failure drops it."""
        assert self.proc is not None
        killed = []
        for child in children(self.proc.pid):
            for pid in [*children(child), child]:
                try:
                    if Path(f"/proc/{pid}/comm").read_text().strip().startswith("sshd"):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                except OSError:
                    continue
        return killed

    def user_pids(self) -> list[int]:
        """Processes of the test user still running (its sessions' leftovers)."""
        return _pids_of_uid(pwd.getpwnam(self.user).pw_uid)

    def remote_work(self) -> list[Path]:
        base = self.home / ".cache" / "vllm-repro-remote"
        return sorted(base.iterdir()) if base.is_dir() else []


@pytest.fixture(scope="module")
def ssh_host(tmp_path_factory):
    """Debian's OpenSSH server on 127.0.0.1 (a port of its own), a throwaway user in the docker
    group, host key, user key, known_hosts and an ssh config naming hosts:

    - ``vrtest``: the right key and known_hosts;
    - ``vrbadkey``: a key the server does not know;
    - ``vrnokey``: a known_hosts without the server's key.
    """
    if not Path("/usr/sbin/sshd").is_file():
        _skip("no /usr/sbin/sshd (apt-get install openssh-server; .ci/run does)")
    if os.geteuid() != 0:
        _skip("needs root to add a throwaway user for the SSH server")
    d = tmp_path_factory.mktemp("sshd")
    user = f"vrssh{os.getpid() % 100000}"
    home = Path(f"/tmp/{user}-home")
    shutil.rmtree(home, ignore_errors=True)
    # password "*": no password works, but the account is not locked (sshd refuses locked ones)
    subprocess.run(["useradd", "-m", "-d", str(home), "-s", "/bin/sh", "-G", "docker", "-p", "*", user],
                   check=True)
    try:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for name in ("host", "user", "stranger"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"vllm-repro-test-{name}",
                            "-f", str(d / name)], check=True)
        ssh = home / ".ssh"
        ssh.mkdir(mode=0o700)
        (ssh / "authorized_keys").write_text((d / "user.pub").read_text())
        pw = pwd.getpwnam(user)
        for p in (ssh, ssh / "authorized_keys"):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        (ssh / "authorized_keys").chmod(0o600)
        port = free_port()
        sshd_config = d / "sshd_config"
        sshd_config.write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {d / 'host'}
PidFile {d / 'sshd.pid'}
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin no
AllowUsers {user}
PermitUserEnvironment yes
Subsystem sftp /usr/lib/openssh/sftp-server
LogLevel VERBOSE
""")
        host_pub = " ".join((d / "host.pub").read_text().split()[:2])
        (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub}\n")
        (d / "known_hosts.empty").write_text("")
        config = d / "ssh_config"
        config.write_text(f"""\
Host vrtest vrbadkey vrnokey
  HostName 127.0.0.1
  Port {port}
  User {user}
  IdentitiesOnly yes
  StrictHostKeyChecking yes

Host vrtest
  IdentityFile {d / 'user'}
  UserKnownHostsFile {d / 'known_hosts'}

Host vrbadkey
  IdentityFile {d / 'stranger'}
  UserKnownHostsFile {d / 'known_hosts'}

Host vrnokey
  IdentityFile {d / 'user'}
  UserKnownHostsFile {d / 'known_hosts.empty'}
""")
        host = SshHost(d, user, home, port, config, sshd_config, log=d / "sshd.log")
        host.start()
        yield host
    finally:
        try:
            host.stop()  # noqa: F821 - may not exist when set-up failed early
        except Exception:  # noqa: BLE001
            pass
        uid = pwd.getpwnam(user).pw_uid
        for pid in _pids_of_uid(uid):  # what the test user's sessions left (none, if all went well)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        subprocess.run(["userdel", "-r", user], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
