"""``vllm-repro gpu-verify``: ship a verification bundle to a GPU host with fabric and bring the
verdict of the shared suite on full vLLM back.

On the host (an ssh-config host name; host keys checked against known_hosts, never accepted
silently): check docker and the GPU, upload the bundle and ``scripts/remote-run.sh`` to a work
folder, build the CUDA image of the release there (or use / pull ``--gpu-image``), run
``vllm-repro gpu-judge`` in a container with the GPUs (``remote-run.sh``), fetch JUnit XML,
logs and the summary into ``reports/gpu/<host>/<run>/``, remove the work folder and the
container, and exit with the remote verdict: 0 verified, 1 not verified, 2 the patch does not
apply there (or a bad bundle), 3 ssh / docker / GPU trouble, the connection dropped.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shlex
import socket
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import EXIT_ENV, EXIT_INPUT, EXIT_MISMATCH, EXIT_OK, EnvError, InputError

REPO = Path(__file__).resolve().parents[3]
REMOTE_SCRIPT = REPO / "scripts" / "remote-run.sh"
REMOTE_BASE = ".cache/vllm-repro-remote"  # below the remote user's home
#: What a remote CUDA image build needs from the checkout (its build context).
LAB_CONTEXT = ("pyproject.toml", "README.md", "src", "tests/shared", "scenarios", "images/cuda")

Say = Callable[[str], None]


@dataclass
class Ship:
    """One run: settings in, results out. ``local`` is ``reports/gpu/<host>/<run>/``."""

    host: str
    bundle: Path
    local: Path
    gpu: str = "all"
    gpu_image: str | None = None
    model: str | None = None
    ssh_config: Path | None = None
    accept_new_host_key: bool = False
    connect_timeout: int = 15
    run_id: str = ""
    image: str = ""
    messages: list[str] = field(default_factory=list)


# ---- connecting ------------------------------------------------------------------------------
def check_reachable(ship: Ship, conn, where: str) -> None:
    """A TCP connection to the host's SSH port, opened and closed before any key is checked, so
    that a host both down and unknown is said to be unreachable (what is wrong), not to have an
    unknown host key. Skipped when the ssh config reaches the host through a ProxyCommand or
    ProxyJump (the port is then not ours to try). Raises :class:`EnvError`, one line."""
    sc = conn.ssh_config
    if sc.get("proxycommand") or sc.get("proxyjump"):
        return
    try:
        socket.create_connection((conn.host, int(conn.port)), timeout=ship.connect_timeout).close()
    except socket.gaierror as exc:
        raise EnvError(f"cannot reach {ship.host}: unknown host name {conn.host!r} "
                       f"({exc.strerror})") from None
    except (socket.timeout, TimeoutError):
        raise EnvError(f"cannot reach {ship.host} ({where}): timed out after "
                       f"{ship.connect_timeout}s") from None
    except OSError as exc:
        why = "connection refused" if isinstance(exc, ConnectionRefusedError) else (
            exc.strerror or str(exc))
        raise EnvError(f"cannot reach {ship.host} ({where}): {why}") from None


#: ``[user@]host[:port]``: an ssh-config host name, a DNS name or an IPv4 address (IPv6 and
#: anything else through the ssh config's ``HostName``)
_REMOTE = re.compile(r"^(?:([A-Za-z0-9_][A-Za-z0-9._-]{0,31})@)?([A-Za-z0-9_](?:[A-Za-z0-9._-]{0,252}))"
                     r"(?::(\d{1,5}))?$")


def check_remote(text: str) -> str:
    """``--remote`` as given, or :class:`InputError` (one line) for a value that is no host
    name: ``../../x``, a name with spaces or control characters, a label over 63 characters
    (the idna codec's ``UnicodeError``), a port outside 1..65535."""
    m = _REMOTE.match(text or "")
    ok = m is not None and ".." not in m.group(2) and not m.group(2).endswith("-") \
        and all(0 < len(label) <= 63 for label in m.group(2).rstrip(".").split(".")) \
        and (m.group(3) is None or 0 < int(m.group(3)) < 65536)
    if not ok:
        raise InputError(f"--remote {text[:80]!r}: not a host name ([user@]host[:port], the "
                         "letters, digits, '.', '-' and '_' of a DNS or ssh-config Host name); "
                         "give the ssh-config Host of the GPU machine")
    return text


def connect(ship: Ship):
    """An open fabric ``Connection`` to ``ship.host``.

    Host keys are checked against ``~/.ssh/known_hosts`` and the ssh config's
    ``UserKnownHostsFile`` / ``GlobalKnownHostsFile``; an unknown key is refused unless
    ``accept_new_host_key`` (or ``StrictHostKeyChecking accept-new|no`` in the ssh config), and a
    changed key is always refused. Raises :class:`EnvError` with one line for an unreachable host,
    a refused key, refused authentication.
    """
    import logging

    import paramiko
    from fabric import Config, Connection

    # paramiko's transport thread logs each failure with its traceback (to stderr, through
    # logging's last resort, where nothing is configured): the one line below says it
    if not logging.getLogger("paramiko").handlers:
        logging.getLogger("paramiko").addHandler(logging.NullHandler())
        logging.getLogger("paramiko").propagate = False
    if ship.ssh_config is not None and not ship.ssh_config.is_file():
        raise InputError(f"--ssh-config {ship.ssh_config}: no such file")
    cfg = Config(runtime_ssh_path=str(ship.ssh_config)) if ship.ssh_config else Config()
    conn = Connection(ship.host, config=cfg, connect_timeout=ship.connect_timeout)
    sc = conn.ssh_config
    if sc.get("identitiesonly", "no").lower() == "yes":
        conn.connect_kwargs.setdefault("allow_agent", False)
        conn.connect_kwargs.setdefault("look_for_keys", False)
    client = conn.client
    known: list[Path] = []
    for key in ("globalknownhostsfile", "userknownhostsfile"):
        for f in str(sc.get(key, "")).split():
            known.append(Path(os.path.expanduser(f)))
    if "userknownhostsfile" not in sc:
        known.append(Path("~/.ssh/known_hosts").expanduser())
    for f in known:
        if f.is_file():
            client.load_host_keys(str(f))  # the last one loaded is where accept-new writes
    strict = str(sc.get("stricthostkeychecking", "ask")).lower()
    accept = ship.accept_new_host_key or strict in ("no", "accept-new", "off")
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy() if accept else paramiko.RejectPolicy())
    where = f"{conn.host}:{conn.port}"
    check_reachable(ship, conn, where)  # before the key: a host down and new is "cannot reach"
    try:
        conn.open()
    except paramiko.BadHostKeyException:
        raise EnvError(f"{ship.host} ({where}): its host key does not match known_hosts; refusing to "
                       "connect (if the host was re-installed, fix known_hosts by hand)") from None
    except paramiko.AuthenticationException as exc:
        raise EnvError(f"{ship.host} ({where}) refused authentication as {conn.user!r}: {exc} "
                       "(check User / IdentityFile in the ssh config)") from None
    except paramiko.SSHException as exc:
        if "not found in known_hosts" in str(exc):
            raise EnvError(f"{ship.host} ({where}): unknown host key (not in known_hosts); verify it "
                           "and add it (ssh-keyscan), or pass --accept-new-host-key") from None
        if "protocol banner" in str(exc):
            raise EnvError(f"{ship.host} ({where}): not an SSH server (no SSH banner came back); "
                           "check the host's Port / HostName in the ssh config") from None
        raise EnvError(f"{ship.host} ({where}): SSH failed: {exc}") from None
    except (socket.timeout, TimeoutError):
        raise EnvError(f"cannot reach {ship.host} ({where}): timed out after "
                       f"{ship.connect_timeout}s") from None
    except UnicodeError:  # the idna codec: a label over 63 characters, an empty label
        raise InputError(f"{ship.host}: host name {conn.host!r} is not a valid DNS name; fix "
                         "HostName in the ssh config (or --remote)") from None
    except socket.gaierror as exc:
        raise EnvError(f"cannot reach {ship.host}: unknown host name {conn.host!r} ({exc.strerror})") from None
    except (paramiko.ssh_exception.NoValidConnectionsError, OSError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
            why = "connection refused" if all(
                getattr(e, "errno", None) == 111 for e in exc.errors.values()) else str(exc)
        raise EnvError(f"cannot reach {ship.host} ({where}): {why}") from None
    if accept:
        try:
            client.save_host_keys(str(known[-1]))
        except (OSError, IndexError):
            pass
    return conn


def _run(conn, cmd: str, what: str, timeout: int | None = 600, out_stream=None):
    """Run ``cmd`` on the host; returns invoke's Result (never raises for a non-zero exit).
    Raises :class:`EnvError` when the connection is lost."""
    try:
        res = conn.run(cmd, hide=True, warn=True, in_stream=False, timeout=timeout,
                       out_stream=out_stream, err_stream=out_stream)
    except Exception as exc:  # noqa: BLE001 - paramiko / invoke failures of the transport
        if _lost(conn) or isinstance(exc, (EOFError, OSError, socket.error)):
            raise ConnectionLost(what) from None
        raise EnvError(f"{what} failed on the host: {exc.__class__.__name__}: {exc}") from None
    if res.exited == -1 or _lost(conn):
        raise ConnectionLost(what)
    return res


def _lost(conn) -> bool:
    t = conn.client.get_transport()
    return t is None or not t.is_active()


class ConnectionLost(EnvError):
    """The SSH connection dropped while ``what`` ran."""

    def __init__(self, what: str):
        super().__init__(f"the connection dropped while {what}")
        self.what = what


# ---- checks ------------------------------------------------------------------------------------
def check_host(conn, ship: Ship, say: Say) -> dict:
    """docker on PATH and answering; a GPU and the NVIDIA runtime unless ``gpu == "none"``.
    Returns what was found; raises :class:`EnvError` naming what is missing."""
    who = _run(conn, "id -un; uname -srm; echo $HOME", "checking the host").stdout.split("\n")
    user, system, home = (who + ["", "", ""])[:3]
    found = {"user": user, "system": system, "home": home}
    res = _run(conn, "command -v docker", "looking for docker")
    if res.exited != 0:
        raise EnvError(f"no docker on {ship.host}: `docker` is not on the PATH of {user} there "
                       "(install Docker Engine and add the user to the docker group)")
    res = _run(conn, "docker version --format '{{.Server.Version}}'", "asking docker for its version")
    if res.exited != 0:
        first = (res.stderr.strip().splitlines() or res.stdout.strip().splitlines() or ["no answer"])[-1]
        raise EnvError(f"docker on {ship.host} does not answer for {user}: {first}")
    found["docker"] = res.stdout.strip()
    say(f"{ship.host}: docker {found['docker']} ({system})")
    if ship.gpu == "none":
        say(f"{ship.host}: GPU=none: not checking for a GPU, running without --gpus")
        return found
    res = _run(conn, "nvidia-smi -L", "looking for a GPU")
    if res.exited != 0 or "GPU" not in res.stdout:
        why = "nvidia-smi not found (no NVIDIA driver)" if res.exited == 127 else \
            ((res.stderr or res.stdout).strip().splitlines() or ["no GPU listed"])[0]
        raise EnvError(f"no GPU on {ship.host}: {why} (GPU=none runs without one, for testing)")
    found["gpus"] = [g for g in res.stdout.strip().splitlines() if g]
    res = _run(conn, "docker info --format '{{json .Runtimes}}'", "asking docker for its runtimes")
    if "nvidia" not in res.stdout and not _run(conn, "command -v nvidia-container-cli",
                                                "looking for the NVIDIA Container Toolkit").stdout.strip():
        raise EnvError(f"{ship.host} has a GPU but docker cannot use it: the NVIDIA Container "
                       "Toolkit is not installed (nvidia-container-cli, docker runtime 'nvidia')")
    say(f"{ship.host}: {len(found['gpus'])} GPU(s): {found['gpus'][0]}")
    return found


# ---- files -------------------------------------------------------------------------------------
def _tar(paths: list[tuple[Path, str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for src, arc in paths:
            tf.add(src, arcname=arc, filter=lambda ti: None if "__pycache__" in ti.name
                   or ti.name.endswith(".pyc") else ti)
    return buf.getvalue()


def lab_context_hash() -> str:
    """12 hex digits of sha256 over the CUDA image's build context (:data:`LAB_CONTEXT`): the
    tag suffix that says whether the image on the host was built from this lab."""
    h = hashlib.sha256()
    for rel in LAB_CONTEXT:
        p = REPO / rel
        files = sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts) \
            if p.is_dir() else [p]
        for f in files:
            h.update(str(f.relative_to(REPO)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def upload(conn, data: bytes, remote_dir: str, what: str, say: Say) -> None:
    """Upload a tar.gz (bytes) and unpack it in ``remote_dir``."""
    say(f"uploading {what} ({len(data) / 1e6:.1f} MB)")
    with tempfile.NamedTemporaryFile(suffix=".tar.gz") as tmp:
        tmp.write(data)
        tmp.flush()
        try:
            conn.put(tmp.name, f"{remote_dir}/upload.tar.gz")
        except Exception as exc:  # noqa: BLE001
            if _lost(conn):
                raise ConnectionLost(f"uploading {what}") from None
            raise EnvError(f"uploading {what} failed: {exc}") from None
    res = _run(conn, f"cd {shlex.quote(remote_dir)} && tar -xzf upload.tar.gz && rm upload.tar.gz",
               f"unpacking {what}")
    if res.exited != 0:
        raise EnvError(f"unpacking {what} on {conn.host} failed: {res.stderr.strip()[:200]}")


def fetch(conn, work: str, local: Path, say: Say) -> list[str]:
    """Bring ``run.log`` and ``out/`` back from the work folder, whatever exists. Returns the
    files fetched (relative to ``local``)."""
    q = shlex.quote(work)
    res = _run(conn, f"cd {q} && ls -d run.log out 2>/dev/null | xargs -r tar -czf results.tar.gz",
               "packing the results", timeout=300)
    local.mkdir(parents=True, exist_ok=True)
    if res.exited != 0 or not _run(conn, f"test -s {q}/results.tar.gz && echo yes",
                                   "looking for results").stdout.strip():
        return []
    with tempfile.TemporaryDirectory() as d:
        tgz = Path(d) / "results.tar.gz"
        conn.get(f"{work}/results.tar.gz", str(tgz))
        names = extract_results(tgz, local, say)
    # out/ holds the judge's files: put them at the top of the run's folder
    out = local / "out"
    if out.is_dir():
        for f in out.iterdir():
            target = local / f.name
            if target.exists():
                continue
            f.rename(target)
        try:
            out.rmdir()
        except OSError:
            pass
    say(f"fetched {len(names)} files into {local}")
    return names


#: what a GPU host's results may hold, at most: members, and bytes unpacked
MAX_RESULT_MEMBERS = 20_000
MAX_RESULT_BYTES = 2 << 30


def extract_results(tgz: Path, local: Path, say: Say) -> list[str]:
    """Unpack a GPU host's results tarball into ``local``: regular files and folders only
    (tarfile's ``data`` filter, and no links, devices or FIFOs at all), each inside ``local``,
    without the host's owners or modes beyond the user's; at most :data:`MAX_RESULT_MEMBERS`
    members and :data:`MAX_RESULT_BYTES` bytes. What is left out is said in one line. Returns
    the names unpacked."""
    names, skipped, total = [], [], 0
    try:
        with tarfile.open(tgz) as tf:
            for i, m in enumerate(tf):
                if i >= MAX_RESULT_MEMBERS:
                    skipped.append(f"{m.name} and the rest (over {MAX_RESULT_MEMBERS} members)")
                    break
                if not (m.isreg() or m.isdir()):
                    skipped.append(f"{m.name} (not a regular file or folder)")
                    continue
                try:
                    member = tarfile.data_filter(m, str(local))
                except tarfile.FilterError as exc:
                    skipped.append(f"{m.name} ({type(exc).__name__})")
                    continue
                total += max(0, member.size)
                if total > MAX_RESULT_BYTES:
                    skipped.append(f"{m.name} and the rest (over {MAX_RESULT_BYTES >> 20} MB)")
                    break
                tf.extract(member, local, set_attrs=False, filter="fully_trusted")
                names.append(member.name)
    except (tarfile.TarError, EOFError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno is not None and exc.errno in (28, 122):
            raise  # a full disk: the command line's exit 3 saying where
        say(f"the results tarball is damaged ({type(exc).__name__}: {exc}); kept what was unpacked")
    if skipped:
        say(f"left out of the results: {', '.join(skipped[:5])}"
            + (f" (+{len(skipped) - 5} more)" if len(skipped) > 5 else ""))
    return names


def cleanup(conn, work: str | None, container: str | None) -> None:
    """Remove the container and the work folder (and the remote script's reaper, if any)."""
    parts = []
    if container:
        parts.append(f"docker rm -f {shlex.quote(container)} >/dev/null 2>&1")
    if work:
        q = shlex.quote(work)
        parts.append(f"if [ -f {q}/reaper.pid ]; then kill $(cat {q}/reaper.pid) 2>/dev/null; fi")
        parts.append(f"rm -rf {q}")
    if parts:
        _run(conn, "; ".join(parts) + "; true", "cleaning up", timeout=120)


# ---- the run -----------------------------------------------------------------------------------
def ensure_image(conn, ship: Ship, release: str, work: str, say: Say, stream) -> str:
    """The image to run: ``--gpu-image`` (present, or pulled), else ``vllm-repro-cuda:<release>-<lab
    hash>`` built there from images/cuda/Dockerfile if not present yet."""
    if ship.gpu_image:
        img = ship.gpu_image
        if _run(conn, f"docker image inspect {shlex.quote(img)} >/dev/null 2>&1", "inspecting the image").exited:
            say(f"pulling {img}")
            res = _run(conn, f"docker pull {shlex.quote(img)}", f"pulling {img}", timeout=3600,
                       out_stream=stream)
            if res.exited != 0:
                raise EnvError(f"{ship.host}: image {img} is not there and cannot be pulled")
        return img
    img = f"vllm-repro-cuda:{release}-{lab_context_hash()}"
    if not _run(conn, f"docker image inspect {shlex.quote(img)} >/dev/null 2>&1", "inspecting the image").exited:
        say(f"{ship.host}: {img} is there")
        return img
    ctx = f"{work}/lab"
    _run(conn, f"mkdir -p {shlex.quote(ctx)}", "making the build folder")
    upload(conn, _tar([(REPO / rel, rel) for rel in LAB_CONTEXT if (REPO / rel).exists()]), ctx,
           "the lab (build context of the CUDA image)", say)
    say(f"building {img} on {ship.host} from vllm/vllm-openai:v{release} (the first time: a large pull)")
    res = _run(conn, f"cd {shlex.quote(ctx)} && docker build -f images/cuda/Dockerfile "
                     f"--build-arg VLLM_VERSION={shlex.quote(release)} -t {shlex.quote(img)} .",
               "building the CUDA image", timeout=3 * 3600, out_stream=stream)
    if res.exited != 0:
        raise EnvError(f"building the CUDA image on {ship.host} failed (see remote.log)")
    return img


class _Stream(io.TextIOBase):
    """Where remote output goes: a local log file, and one callback per line."""

    def __init__(self, log: Path, on_line: Callable[[str], None]):
        self.f = open(log, "a", buffering=1)
        self.on_line = on_line
        self.buf = ""

    def write(self, s: str) -> int:
        self.f.write(s)
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.on_line(line)
        return len(s)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        if self.buf:
            self.on_line(self.buf)
            self.buf = ""
        self.f.close()


def ship_bundle(ship: Ship, say: Say, on_line: Callable[[str], None]) -> int:
    """Do the whole remote run (see the module docstring) and return the exit code. Writes
    ``summary.json`` (the remote judge's, plus what happened here) into ``ship.local`` in every
    case; raises nothing for remote failures, only for bad local input (:class:`InputError`)."""
    bundle = ship.bundle
    if not (bundle / "manifest.json").is_file():
        raise InputError(f"{bundle}: not a verification bundle (no manifest.json); make one with "
                         "`vllm-repro verify`")
    release = (bundle / "release.txt").read_text().strip()
    ship.local.mkdir(parents=True, exist_ok=True)
    log = ship.local / "remote.log"
    stream = _Stream(log, on_line)
    summary: dict = {"host": ship.host, "run": ship.run_id, "bundle": str(bundle), "release": release,
                     "gpu": ship.gpu, "started": time.time()}
    conn = None
    work: str | None = None
    container = f"vllm-repro-{ship.run_id}"[:120]
    code = EXIT_ENV
    try:
        say(f"connecting to {ship.host}")
        conn = connect(ship)
        summary["host_info"] = check_host(conn, ship, say)
        home = summary["host_info"]["home"] or "."
        work = f"{home}/{REMOTE_BASE}/{ship.run_id}"
        res = _run(conn, f"mkdir -p {shlex.quote(work)}", "making the work folder")
        if res.exited != 0:
            raise EnvError(f"cannot make {work} on {ship.host}: {res.stderr.strip()[:200]}")
        upload(conn, _tar([(bundle, "bundle"), (REMOTE_SCRIPT, "remote-run.sh")]), work,
               f"bundle {bundle.name}", say)
        ship.image = ensure_image(conn, ship, release, work, say, stream)
        summary["image"] = ship.image
        say(f"running the shared suite in {ship.image} on {ship.host}")
        res = _run(conn, " ".join(shlex.quote(a) for a in (
            "sh", f"{work}/remote-run.sh", work, ship.image, "none" if ship.gpu == "none" else "all",
            container, ship.model or "")), "running the shared suite", timeout=6 * 3600,
            out_stream=stream)
        code = res.exited if res.exited in (EXIT_OK, EXIT_MISMATCH, EXIT_INPUT, EXIT_ENV) else EXIT_ENV
        summary["remote_exit"] = res.exited
        fetch(conn, work, ship.local, say)
    except ConnectionLost as exc:
        msg = f"connection to {ship.host} dropped mid-run ({exc.what})"
        ship.messages.append(msg)
        summary["error"] = {"kind": "env", "message": msg}
        code = EXIT_ENV
        conn = _reconnect(ship, say)
        if conn is not None and work:
            try:
                _stop_remote_run(conn, work)
                fetch(conn, work, ship.local, say)
            except EnvError:
                pass
    except EnvError as exc:
        ship.messages.append(str(exc))
        summary["error"] = {"kind": "env", "message": str(exc)}
        code = EXIT_ENV
        if conn is not None and work and not _lost(conn):
            try:
                fetch(conn, work, ship.local, say)
            except EnvError:
                pass
    finally:
        stream.close()
        if conn is not None and work:
            try:
                if _lost(conn):
                    conn = _reconnect(ship, say)
                if conn is not None:
                    cleanup(conn, work, container)
                    summary["remote_cleaned"] = True
                    say(f"removed {work} and container {container} on {ship.host}")
            except EnvError as exc:
                ship.messages.append(f"could not clean {work} on {ship.host}: {exc}")
                summary["remote_cleaned"] = False
        if conn is not None:
            conn.close()
    judged = _read_json(ship.local / "summary.json")  # the remote judge's, when it got that far
    if judged:
        summary["judge"] = judged
    if "remote_exit" in summary and code != EXIT_ENV:
        if not judged:
            ship.messages.append("the remote run left no summary.json (see remote.log)")
            code = EXIT_ENV
        elif code != EXIT_OK:
            ship.messages.extend(r for r in judged.get("reasons", []) if r not in ship.messages)
    elif "remote_exit" in summary and judged and judged.get("reasons"):
        ship.messages.extend(r for r in judged["reasons"] if r not in ship.messages)
    elif "remote_exit" in summary:
        ship.messages.append(f"the remote run failed (exit {summary['remote_exit']}); see remote.log")
    summary.update(exit_code=code, messages=ship.messages, finished=time.time())
    (ship.local / "summary.json").write_text(json.dumps(summary, indent=1))
    return code


def _stop_remote_run(conn, work: str, wait_s: int = 60) -> None:
    """After a drop: make the remote script stop its container and save what it had (TERM to it
    unless it already did, having seen its session end), and wait for that (``gone.done``)."""
    q = shlex.quote(work)
    _run(conn, f"cd {q} 2>/dev/null || exit 0; pid=$(cat script.pid 2>/dev/null); "
               f"if [ -n \"$pid\" ] && [ ! -f gone.done ] && kill -0 $pid 2>/dev/null; then kill -TERM $pid; fi; "
               f"i=0; while [ $i -lt {wait_s} ] && [ ! -f gone.done ] && kill -0 $pid 2>/dev/null; "
               "do sleep 1; i=$((i+1)); done; true", "stopping the remote run", timeout=wait_s + 60)


def _reconnect(ship: Ship, say: Say, tries: int = 3):
    for i in range(tries):
        try:
            conn = connect(ship)
            say(f"reconnected to {ship.host} to fetch what was produced and clean up")
            return conn
        except EnvError:
            time.sleep(2 * (i + 1))
    ship.messages.append(f"could not reconnect to {ship.host}: its work folder is removed by the "
                         "remote script after 15 minutes")
    return None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_id(bundle: Path) -> str:
    """``<bundle id>-<YYYYmmdd-HHMMSS>`` (local time): names the remote work folder, the
    container and the local results folder of one run."""
    return f"{bundle.name}-{time.strftime('%Y%m%d-%H%M%S')}"


_SAFE_HOST = re.compile(r"[^A-Za-z0-9._-]+")


def local_dir(reports: Path, host: str, rid: str) -> Path:
    """``reports/gpu/<host>/<run>/`` (the host name made safe for a folder name)."""
    return reports / "gpu" / _SAFE_HOST.sub("_", host) / rid
