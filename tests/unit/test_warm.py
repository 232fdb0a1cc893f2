"""Warm runs without a release (docs/warm-runs.md): the keys that decide when a new warm parent
is needed, the settings, and the protocol end to end with a real parent process in the lab's
own interpreter, forking a stand-in worker module from a tree: descriptors handed over, its own
session, the run's environment and ``sys.path``, an edited tree file seen on the next fork, the
exit status, a killed parent, the idle exit and the fork-safety refusal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from vllm_repro.engine import warm, warm_client
from vllm_repro.errors import InputError

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not Path("/proc").is_dir(),
                                reason="warm parents fork (Linux)")

PYTHON = Path(sys.executable)
ROOT_ENV = PYTHON.parent.parent

STANDIN = textwrap.dedent("""\
    import json, os, sys
    import probe_value
    fd = int(sys.argv[sys.argv.index("--reply-fd") + 1])
    out = os.fdopen(fd, "w", buffering=1)
    print("stand-in says hello on its log", flush=True)
    out.write(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                          "cwd": os.getcwd(), "marker": os.environ.get("WARM_TEST_MARKER"),
                          "path0": sys.path[0], "value": probe_value.VALUE,
                          "argv": sys.argv[1:], "main": __name__}) + "\\n")
    line = sys.stdin.readline()
    out.write(json.dumps({"echo": line.strip()}) + "\\n")
    if line.strip() == "hang":
        import time
        time.sleep(120)
    sys.exit(7)
    """)


@pytest.fixture
def cache(monkeypatch):
    # short: a unix socket's path is at most about 100 bytes (pytest's tmp_path is long)
    d = Path(tempfile.mkdtemp(prefix="vrw-", dir="/tmp"))
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(d))
    monkeypatch.setenv(warm_client.IDLE_SETTING, "30")
    yield d
    for info in d.glob("warm/*/parent.json"):  # no parent outlives its test
        try:
            os.kill(json.loads(info.read_text())["pid"], signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tree(tmp_path):
    t = tmp_path / "tree"
    t.mkdir()
    (t / "standin.py").write_text(STANDIN)
    (t / "probe_value.py").write_text("VALUE = 1\n")
    return t


def _envs(tree: Path, extra_parent_path: str = "") -> tuple[dict, dict]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    lab = str(Path(warm.__file__).resolve().parents[2])
    parent = {**base, "PYTHONPATH": os.pathsep.join(p for p in (lab, extra_parent_path) if p),
              "PYTHONHASHSEED": "0"}
    worker = {**base, "PYTHONPATH": os.pathsep.join([lab, str(tree)]), "PYTHONHASHSEED": "0",
              "WARM_TEST_MARKER": "from-the-run"}
    return parent, worker


def _spawn(tree: Path, log: Path, parent_env: dict, worker_env: dict, python: Path = PYTHON,
           root: Path = ROOT_ENV, mode: str = "full"):
    """Have the warm parent of ``python`` (of the environment ``root``) fork the stand-in in
    ``tree`` (its folder); ``mode``: how the worker finds vLLM (the parent key's)."""
    if not warm_client.modules_file(python, root).exists():  # preload nothing: fast
        warm_client.modules_file(python, root).write_text("[]")
    stdin_r, stdin_w = os.pipe()
    reply_r, reply_w = os.pipe()
    logf = open(log, "a")
    try:
        proc = warm_client.spawn(python, root, ["--model-dir", "x"], worker_env, parent_env,
                                 str(tree), (stdin_r, logf.fileno(), reply_w), stdin=None,
                                 mode=mode, module="standin")
    finally:
        os.close(stdin_r)
        os.close(reply_w)
        logf.close()
    proc.stdin = os.fdopen(stdin_w, "w")
    return proc, reply_r


def _reply(proc, fd) -> dict:
    line = proc.readline(fd)
    return json.loads(line) if line else {}


def _parent_pid() -> int:
    infos = list(Path(os.environ["VLLM_REPRO_CACHE"]).glob("warm/*/parent.json"))
    assert len(infos) == 1, infos
    return json.loads(infos[0].read_text())["pid"]


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _client_thread(tree: Path, log: Path, parent_env: dict, worker_env: dict):
    """A spawn in a thread of its own (started), and the list its exception lands in."""
    import threading

    raised: list[BaseException] = []

    def client():
        try:
            _spawn(tree, log, parent_env, worker_env)
        except BaseException as exc:  # noqa: BLE001 - what the tests look at
            raised.append(exc)

    t = threading.Thread(target=client, daemon=True)
    t.start()
    return t, raised


def _serving_parent(tree: Path, log: Path, parent_env: dict, worker_env: dict) -> int:
    """A parent started by one run that has ended: its pid (it serves the next spawn)."""
    proc, fd = _spawn(tree, log, parent_env, worker_env)
    _reply(proc, fd)
    proc.stdin.close()
    proc.wait(timeout=20)
    return _parent_pid()


def test_a_forked_worker_gets_the_runs_pipes_environment_session_and_exit_code(cache, tree, tmp_path):
    parent_env, worker_env = _envs(tree)
    log = tmp_path / "engine.log"
    proc, fd = _spawn(tree, log, parent_env, worker_env)
    hello = _reply(proc, fd)
    assert hello["pid"] == proc.pid
    assert hello["pgid"] == proc.pid and hello["sid"] == proc.pid  # leads its own session
    assert hello["cwd"] == str(tree) and hello["path0"] == str(tree)
    assert hello["marker"] == "from-the-run"  # the run's variables, not the parent's
    assert hello["argv"][:2] == ["--model-dir", "x"] and "--reply-fd" in hello["argv"]
    assert hello["main"] == "__main__"  # run as `python -m` runs it
    proc.stdin.write("ping\n")
    proc.stdin.flush()
    assert _reply(proc, fd) == {"echo": "ping"}
    assert proc.wait(timeout=20) == 7
    assert _reply(proc, fd) == {}  # the reply pipe ends with the worker
    assert "stand-in says hello on its log" in log.read_text()
    proc.close()


def test_the_next_fork_sees_an_edited_tree_file_and_the_same_parent(cache, tree, tmp_path):
    parent_env, worker_env = _envs(tree)
    proc, fd = _spawn(tree, tmp_path / "log", parent_env, worker_env)
    assert _reply(proc, fd)["value"] == 1
    proc.stdin.close()
    proc.wait(timeout=20)
    first = _parent_pid()
    (tree / "probe_value.py").write_text("VALUE = 2  # edited\n")
    proc, fd = _spawn(tree, tmp_path / "log", parent_env, worker_env)
    assert _reply(proc, fd)["value"] == 2
    assert _parent_pid() == first  # reused, not restarted
    proc.stdin.close()
    proc.wait(timeout=20)


def test_a_killed_parent_ends_its_worker_and_the_next_spawn_starts_a_new_one(cache, tree, tmp_path):
    parent_env, worker_env = _envs(tree)
    proc, fd = _spawn(tree, tmp_path / "log", parent_env, worker_env)
    _reply(proc, fd)
    proc.stdin.write("hang\n")
    proc.stdin.flush()
    assert _reply(proc, fd) == {"echo": "hang"}
    first = _parent_pid()
    os.kill(first, signal.SIGKILL)
    assert proc.readline(fd) == b""  # not the 120 s the worker would sleep
    proc.wait(timeout=10)  # as the host does at the end of the replies: why it ended
    assert proc.lost and str(first) in proc.lost
    deadline = time.monotonic() + 10
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(proc.pid)
    proc, fd = _spawn(tree, tmp_path / "log", parent_env, worker_env)
    assert _reply(proc, fd)["pid"] == proc.pid
    assert _parent_pid() != first
    proc.stdin.close()
    assert proc.wait(timeout=20) == 7


def test_a_parent_exits_after_its_idle_time(cache, tree, tmp_path, monkeypatch):
    monkeypatch.setenv(warm_client.IDLE_SETTING, "1")
    parent_env, worker_env = _envs(tree)
    pid = _serving_parent(tree, tmp_path / "log", parent_env, worker_env)
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    assert not list(cache.glob("warm/*/sock")) and not list(cache.glob("warm/*/parent.json"))


def test_a_parent_whose_imports_start_a_thread_refuses_and_says_why(cache, tree, tmp_path):
    extra = tmp_path / "mods"
    extra.mkdir()
    (extra / "threadstarter.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True, "
        "name='starter').start()\n")
    parent_env, worker_env = _envs(tree, str(extra))
    warm_client.modules_file(PYTHON, ROOT_ENV).write_text(json.dumps(["threadstarter"]))
    with pytest.raises(warm_client.WarmUnavailable, match="threads are running.*starter"):
        _spawn(tree, tmp_path / "log", parent_env, worker_env)
    # remembered for the environment: the next run goes cold at once
    with pytest.raises(warm_client.WarmUnavailable, match="not safe in this environment"):
        _spawn(tree, tmp_path / "log", parent_env, worker_env)


def test_an_abort_ends_the_wait_for_a_starting_parent_at_once_and_kills_it(cache, tree, tmp_path,
                                                                          monkeypatch):
    """Ctrl-C while a parent imports (a matrix's threads wait for it): the wait ends within a
    second with WarmAborted, and the parent, which no run will use, is killed (not left to
    finish its imports and idle)."""
    from vllm_repro import procs

    extra = tmp_path / "mods"
    extra.mkdir()
    (extra / "slowimport.py").write_text("import time\ntime.sleep(60)\n")
    parent_env, worker_env = _envs(tree, str(extra))
    warm_client.modules_file(PYTHON, ROOT_ENV).write_text(json.dumps(["slowimport"]))
    t, raised = _client_thread(tree, tmp_path / "log", parent_env, worker_env)
    deadline = time.monotonic() + 20
    while not warm_client._parents and time.monotonic() < deadline:
        time.sleep(0.02)
    assert warm_client._parents, "no parent was started"
    pid = warm_client._parents[-1].pid
    time.sleep(0.3)  # importing: it says nothing for 60 s
    monkeypatch.setattr(procs, "_aborting", True)
    t0 = time.monotonic()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 2
    assert raised and isinstance(raised[0], warm_client.WarmAborted), raised
    assert not _alive(pid)
    # and no client starts a parent once the abort began
    with pytest.raises(warm_client.WarmAborted):
        _spawn(tree, tmp_path / "log", parent_env, worker_env)


def test_a_stopped_parent_is_named_not_waited_for_and_forks_nothing_for_the_gone_client(
        cache, tree, tmp_path, monkeypatch):
    """A parent stopped by SIGSTOP (a debugger, py-spy) answers no run: the spawn gives up after
    the reply wait (not three times it), naming the parent's pid and how to end it; once the
    parent goes on, it forks no worker for the client that stopped waiting."""
    monkeypatch.setattr(warm_client, "REPLY_TIMEOUT_S", 1.0)
    parent_env, worker_env = _envs(tree)
    pid = _serving_parent(tree, tmp_path / "log", parent_env, worker_env)
    log = tmp_path / "late.log"
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(warm_client.WarmUnavailable, match=rf"pid {pid}.*kill {pid}"):
            _spawn(tree, log, parent_env, worker_env)
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(1.5)  # the parent reads the abandoned request: it must not run it
    assert "stand-in says hello" not in (log.read_text() if log.exists() else "")
    proc, fd = _spawn(tree, tmp_path / "log", parent_env, worker_env)  # and it serves again
    assert _reply(proc, fd)["pid"] == proc.pid and _parent_pid() == pid
    proc.stdin.close()
    assert proc.wait(timeout=20) == 7


def test_an_abort_ends_the_wait_for_a_stopped_parents_answer_at_once(cache, tree, tmp_path,
                                                                    monkeypatch):
    from vllm_repro import procs

    parent_env, worker_env = _envs(tree)
    pid = _serving_parent(tree, tmp_path / "log", parent_env, worker_env)
    os.kill(pid, signal.SIGSTOP)
    try:
        t, raised = _client_thread(tree, tmp_path / "log", parent_env, worker_env)
        time.sleep(0.5)
        monkeypatch.setattr(procs, "_aborting", True)
        t0 = time.monotonic()
        t.join(10)
        assert not t.is_alive() and time.monotonic() - t0 < 1
        assert raised and isinstance(raised[0], warm_client.WarmAborted), raised
    finally:
        os.kill(pid, signal.SIGCONT)


def test_the_parent_key_follows_the_environment_and_its_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path / "c"))
    root = tmp_path / "env"
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text("")
    (root / "pyvenv.cfg").write_text("home = /usr\n")
    py = root / "bin" / "python"
    env = {"HF_HOME": "/a", "PWD": "/x", "PYTEST_CURRENT_TEST": "t1", "PYTHONPATH": "/lab"}
    key = warm_client.parent_key(py, root, env, "full")
    # a different shell folder or test: the same parent
    same = {**env, "PWD": "/y", "PYTEST_CURRENT_TEST": "t2"}
    assert warm_client.parent_key(py, root, same, "full") == key
    # what make exports from its command line (make cpu-repro REPORTS=...): the same parent
    made = {**env, "MAKEOVERRIDES": "${-*-command-variables-*-}", "REPORTS": "/r1",
            "MAKEFLAGS": " -- RUNNER=native REPORTS=/r1", "RUNNER": "native"}
    assert warm_client.parent_key(py, root, made, "full") == key
    assert warm_client.parent_key(py, root, {**made, "REPORTS": "/r2",
                                             "MAKEFLAGS": " -- RUNNER=native REPORTS=/r2"},
                                  "full") == key
    # a variable an import reads: another parent
    assert warm_client.parent_key(py, root, {**env, "HF_HOME": "/b"}, "full") != key
    # the bytecode folder the first parent's imports create in site-packages: the same parent
    # (it changes the folder's mtime; keyed by that, the second run started a second parent)
    (site / "__pycache__").mkdir()
    (site / "__pycache__" / "typing_extensions.cpython-311.pyc").write_bytes(b"x")
    os.utime(site, ns=(1, 1))
    assert warm_client.parent_key(py, root, env, "full") == key
    # a package installed or upgraded (site-packages' entries change) or the environment
    # rebuilt: another parent
    (site / "numpy-2.2.6.dist-info").mkdir()
    rebuilt = warm_client.parent_key(py, root, env, "full")
    assert rebuilt != key
    (root / "pyvenv.cfg").write_text("home = /usr/local\n")
    assert warm_client.parent_key(py, root, env, "full") != rebuilt
    # another python path: another environment
    assert warm_client.env_identity(tmp_path / "other" / "python", root) != \
        warm_client.env_identity(py, root)


@pytest.mark.parametrize("value, on", [("", True), ("on", True), ("1", True), ("off", False),
                                       ("0", False), ("cold", False)])
def test_the_warm_setting(monkeypatch, value, on):
    monkeypatch.setenv(warm_client.SETTING, value)
    assert warm_client.enabled() is on


@pytest.mark.parametrize("name, value", [(warm_client.SETTING, "maybe"),
                                         (warm_client.IDLE_SETTING, "-3"),
                                         (warm_client.IDLE_SETTING, "soon"),
                                         (warm_client.MAX_SETTING, "0")])
def test_a_bad_warm_setting_is_an_input_error_naming_it(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(InputError, match=name):
        warm_client.enabled()
        warm_client.idle_seconds()
        warm_client.max_parents()


@pytest.mark.parametrize("name, value", [(warm_client.IDLE_SETTING, "abc"),
                                         (warm_client.IDLE_SETTING, "nan"),
                                         (warm_client.IDLE_SETTING, "1e400"),
                                         (warm_client.MAX_SETTING, "0")])
def test_every_warm_setting_is_checked_before_a_command_runs(monkeypatch, name, value):
    """A running parent is reused without reading the idle time or the limit: a command checks
    them itself first, so a bad one is exit 2 whether or not a parent serves."""
    from vllm_repro.commands import warm_setting

    monkeypatch.setenv(warm_client.SETTING, "on")  # (restored after: --cold below sets it off)
    monkeypatch.setenv(name, value)
    with pytest.raises(InputError, match=name):
        warm_setting(cold=False)
    warm_setting(cold=True)  # --cold: no parent, nothing of them is read


def test_the_recorded_modules_leave_out_vllm_and_the_lab():
    names = warm.third_party_modules()
    assert "json" in names
    assert not [n for n in names if n.split(".")[0] in warm.NEVER or n.startswith("vllm")]


def test_the_childs_sys_path_is_a_cold_python_m_one():
    parent_path = ["/warm/dir", "/lab", "/usr/lib/python3.11", "/env/site-packages"]
    assert warm.child_sys_path("/tree", "/lab:/tree", parent_path, "/lab") == \
        ["/tree", "/lab", "/tree", "/usr/lib/python3.11", "/env/site-packages"]


def test_the_parent_key_follows_the_import_path_the_mode_and_a_slices_tree(tmp_path, monkeypatch):
    """The CPU image: a parent started for a release's runs (``vllm-repro run``: the slice tree
    on the parent's PYTHONPATH) was reused by an installed-mode run of the same interpreter
    (VLLM_REPRO_VLLM=installed:<its python>, gpu-judge), whose worker then could not import
    vLLM. The mode and the parent's own path (a slice's tree) are part of the key; the run's
    tree of a full environment is not (each worker puts its own in front)."""
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path / "c"))
    py, root = tmp_path / "env" / "bin" / "python", tmp_path / "env"
    release = {"HF_HOME": "/a", "PYTHONPATH": "/lab:/slices/1.0-abc"}
    installed = {"HF_HOME": "/a", "PYTHONPATH": "/lab"}
    key = warm_client.parent_key(py, root, release, "slice")
    assert warm_client.parent_key(py, root, installed, "installed") != key
    assert warm_client.parent_key(py, root, {**release, "PYTHONPATH": "/lab"}, "slice") != key
    assert warm_client.parent_key(py, root, {**release, "PYTHONPATH": "/lab:/slices/1.0-def"},
                                  "slice") != key  # another slice: its own stubs
    # the same mode and path with another run's tree: the same parent
    full = warm_client.parent_key(py, root, installed, "full")
    assert full != warm_client.parent_key(py, root, installed, "installed")
    assert warm_client.parent_key(py, root, dict(installed), "full") == full


def test_the_childs_sys_path_keeps_an_entry_a_pth_adds_that_the_parents_pythonpath_named():
    """A baked environment's .pth names its release tree; a parent whose PYTHONPATH named that
    tree too has it once (site skipped the .pth's as a duplicate). Dropping the parent's
    PYTHONPATH entries must not drop the tree for a worker whose own PYTHONPATH lacks it (an
    installed-mode run: vLLM from the .pth), and a worker whose PYTHONPATH names it gets it once,
    as a cold one does."""
    parent_path = ["/warm/dir", "/lab", "/tree", "/usr/lib/python3.11", "/env/site-packages"]
    interpreter = ["/usr/lib/python3.11", "/env/site-packages", "/tree"]  # the .pth's, last
    assert warm.child_sys_path("/logs", "/lab", parent_path, "/lab:/tree", interpreter) == \
        ["/logs", "/lab", "/usr/lib/python3.11", "/env/site-packages", "/tree"]
    assert warm.child_sys_path("/tree", "/lab:/tree", parent_path, "/lab:/tree", interpreter) == \
        ["/tree", "/lab", "/tree", "/usr/lib/python3.11", "/env/site-packages"]
    # an entry a preloaded module added stays where it is
    grown = [*parent_path, "/added"]
    assert warm.child_sys_path("/logs", "/lab", grown, "/lab:/tree", interpreter) == \
        ["/logs", "/lab", "/usr/lib/python3.11", "/env/site-packages", "/tree", "/added"]


def _pth_venv(env: Path, tree: Path) -> Path:
    """A virtual environment of this Python whose ``.pth`` names ``tree`` (as the CPU image's
    baked environments name their release trees)."""
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = next(env.glob("lib/python3*/site-packages"))
    (site / "vllm-repro-release.pth").write_text(f"{tree}\n")
    return env / "bin" / "python"


def test_a_worker_imports_what_the_environments_pth_adds_whatever_parent_serves_it(cache,
                                                                                  tmp_path):
    """The CPU image's failure end to end: an environment whose .pth names a tree (here the
    module ``probe_value``), a parent started for a release run with that tree on its
    PYTHONPATH, then a run that finds it through the .pth alone (installed mode). Its worker
    imports from the tree, from a parent of its own (another key) and from the release run's
    parent too (the child's sys.path keeps the .pth's entry)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "probe_value.py").write_text("VALUE = 5\n")
    run_dir = tmp_path / "run"  # the worker's folder: the stand-in, not the tree
    run_dir.mkdir()
    (run_dir / "standin.py").write_text(STANDIN)
    py = _pth_venv(tmp_path / "env", tree)
    root = py.parent.parent
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    lab = str(Path(warm.__file__).resolve().parents[2])
    release_parent = {**base, "PYTHONPATH": os.pathsep.join([lab, str(tree)]), "PYTHONHASHSEED": "0"}
    installed_parent = {**base, "PYTHONPATH": lab, "PYTHONHASHSEED": "0"}
    worker = {**base, "PYTHONPATH": lab, "PYTHONHASHSEED": "0"}  # installed mode: no tree

    def run(parent_env: dict, mode: str) -> dict:
        proc, fd = _spawn(run_dir, tmp_path / "log", parent_env, worker, python=py, root=root,
                          mode=mode)
        hello = _reply(proc, fd)
        proc.stdin.close()
        proc.wait(timeout=20)
        proc.close()
        return hello

    assert run(release_parent, "slice")["value"] == 5, (tmp_path / "log").read_text()
    assert run(installed_parent, "installed")["value"] == 5, (tmp_path / "log").read_text()
    parents = {json.loads(p.read_text())["pid"] for p in cache.glob("warm/*/parent.json")}
    assert len(parents) == 2  # the installed-mode run started a parent of its own


def _foreign(path: Path, how: str) -> None:
    """Make ``path`` unusable for warm parents the way an image's cache is: baked by another
    user (root builds the image, uid 1000 runs it), or not a folder at all."""
    if how == "file":
        path.write_text("not a folder\n")
    else:
        path.mkdir(mode=0o700)
        os.chown(path, 65534, 65534)


@pytest.mark.parametrize("how", ["file", pytest.param("other-user", marks=pytest.mark.skipif(
    os.getuid() != 0, reason="chown to another user needs root"))])
def test_a_cache_whose_warm_folder_is_not_this_users_own_serves_from_tmp(cache, tree, tmp_path,
                                                                         monkeypatch, how):
    _foreign(cache / "warm", how)
    tmp = Path(tempfile.mkdtemp(prefix="vrt-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    try:
        assert warm_client.warm_root() == tmp / f"vllm-repro-{os.getuid()}" / "warm"
        parent_env, worker_env = _envs(tree)
        proc, fd = _spawn(tree, tmp_path / "w.log", parent_env, worker_env)
        assert _reply(proc, fd)["marker"] == "from-the-run"
        proc.stdin.write("bye\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 7
    finally:
        for info in tmp.glob("*/warm/*/parent.json"):
            os.kill(json.loads(info.read_text())["pid"], signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def test_no_usable_warm_folder_is_a_reason_to_start_cold_naming_both(cache, tmp_path, monkeypatch):
    _foreign(cache / "warm", "file")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / f"vllm-repro-{os.getuid()}").write_text("a file where the folder would be\n")
    with pytest.raises(warm_client.WarmUnavailable) as err:
        warm_client.warm_root()
    assert str(cache / "warm") in str(err.value) and "vllm-repro-" in str(err.value)
    with pytest.raises(warm_client.WarmUnavailable):
        warm_client.modules_file(PYTHON, ROOT_ENV)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_tmp_folder_another_user_made_first_is_not_used(cache, monkeypatch):
    _foreign(cache / "warm", "file")
    tmp = Path(tempfile.mkdtemp(prefix="vrt-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    try:
        _foreign(tmp / f"vllm-repro-{os.getuid()}", "other-user")  # made first by uid 65534
        with pytest.raises(warm_client.WarmUnavailable, match="no folder for warm parents"):
            warm_client.warm_root()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_run_line_says_when_this_run_started_the_warm_parent_and_how_long_it_took():
    from types import SimpleNamespace

    from vllm_repro.lab import warm_note

    assert warm_note(SimpleNamespace(warm_started=False, parent_start_s=None)) == ""
    assert warm_note(SimpleNamespace(warm_started=True, parent_start_s=None)) == " (warm)"
    assert warm_note(SimpleNamespace(warm_started=True, parent_start_s=9.84)) == (
        " (warm), after starting its warm parent (9.8 s)")


def test_key_folders_no_parent_serves_and_no_run_used_for_a_week_are_pruned(tmp_path):
    import fcntl

    root = tmp_path / "warm"
    week = warm_client.STALE_S
    now = time.time()

    def folder(name: str, age: float, pid: int | None = None) -> Path:
        d = root / name
        d.mkdir(parents=True)
        (d / "used").touch()
        os.utime(d / "used", (now - age, now - age))
        if pid is not None:
            (d / "parent.json").write_text(json.dumps({"pid": pid}))
        return d

    old = folder("old", week + 60)
    dead = folder("dead-parent", week + 60, pid=2 ** 22 + 12345)  # (no such process)
    served = folder("served", week + 60, pid=os.getpid())  # a live parent keeps its folder
    recent = folder("recent", 3600)
    busy = folder("busy", week + 60)  # a client holds its lock (starting a parent there)
    mine = folder("mine", week + 60)  # the folder the starting parent is for
    (root / "modules").mkdir()
    with open(busy / "lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        assert warm_client._prune(root, mine, now) == 2
    assert not old.exists() and not dead.exists()
    assert served.exists() and recent.exists() and busy.exists() and mine.exists()
    assert (root / "modules").exists()
