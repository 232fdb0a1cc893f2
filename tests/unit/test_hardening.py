"""Hardening, round two (issue 47): one test (or table row) per class of defect, each built on
the issue's own examples. Nothing here needs a release (the process class is
tests/integration/test_no_leftovers.py)."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.unit.test_hostile_inputs import GOOD, Case, invoke

from vllm_repro.errors import InputError


def scenario(c: Case, text: str) -> Path:
    return c.scenario(text)


def digits_row(command: str):
    """The 5,000-digit num_gpu_blocks through each command that loads a scenario."""
    def build(c: Case):
        s = c.scenario(GOOD.replace("{num_gpu_blocks: 8}", "{num_gpu_blocks: " + "9" * 5000 + "}"))
        if command == "run":
            return c.run(s)
        if command == "matrix":
            return ["matrix", str(s), "--releases", "==0.10.2", "--reports", str(c.tmp / "r")]
        cat = c.tmp / "cat"
        cat.mkdir()
        (cat / "s.yaml").write_text(s.read_text())
        return ["catalog", "run", "--directory", str(cat), "--reports", str(c.tmp / "r")]
    return build


def alias_bomb(depth: int = 30) -> str:
    """A billion-laughs bomb inside ``structured_outputs: {json: ...}`` (engine-core level):
    about 2**depth nodes once expanded, a few hundred bytes as written."""
    lines = ["a0: &a0 [x, x]"] + [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, depth)]
    body = "{" + ", ".join(ln.replace(": ", ": ", 1) for ln in lines) + "}"
    return GOOD.replace("level: ", "") .replace(
        "{id: A, prompt_len: 10}",
        "{id: A, prompt_len: 10, structured_outputs: {json: " + body + "}}") \
        + "level: engine-core\n"


def env_row(name: str, value: str, fragment: str):
    def build(c: Case):
        c.env[name] = value
        return c.run(c.good())
    return build, 2, fragment


ROWS = [
    # 1. bounded work for every count
    ("campaign-a-billion-seeds", lambda c: ["campaign", "--releases", "==0.10.2", "--seeds",
                                            "1000000000", "--examples", "1", "--time", "1s",
                                            "--reports", str(c.tmp / "r")], 2,
     "--seeds 1,000,000,000: at most 10,000"),
    ("campaign-a-billion-examples", lambda c: ["campaign", "--examples", "1000000000000",
                                               "--reports", str(c.tmp / "r")], 2, "--examples"),
    ("fuzz-100000-workers", lambda c: ["fuzz", "--vllm", "0.10.2", "--workers", "100000", "--time",
                                       "1s", "--reports", str(c.tmp / "r")], 2,
     "--workers 100,000: at most"),
    ("fuzz-time-of-a-century", lambda c: ["fuzz", "--vllm", "0.10.2", "--time", "876000h",
                                          "--reports", str(c.tmp / "r")], 2, "--time '876000h': at most"),
    ("run-100000-jobs", lambda c: c.run(c.good(), "--jobs", "100000"), 2, "--jobs 100,000: at most"),
    ("alias-bomb-in-structured-outputs", lambda c: c.run(c.scenario(alias_bomb())), 2,
     "aliases counted as what they expand to"),
    ("alias-bomb-at-the-top", lambda c: c.run(c.scenario(
        GOOD + "description: &d [" + ", ".join(["x"] * 100) + "]\n"
        + "".join(f"x{i}: &x{i} [*{'d' if i == 0 else f'x{i - 1}'}, *{'d' if i == 0 else f'x{i - 1}'}]\n"
                  for i in range(30)))), 2, "YAML nodes"),
    ("alias-that-contains-itself", lambda c: c.run(c.scenario(GOOD + "description: &r [*r]\n")), 2,
     "contains itself"),
    # 6. bad input is exit 2 with one line
    ("num-gpu-blocks-5000-digits-run", digits_row("run"), 2, "an integer of 5,000 digits"),
    ("num-gpu-blocks-5000-digits-matrix", digits_row("matrix"), 2, "an integer of 5,000 digits"),
    ("num-gpu-blocks-5000-digits-catalog", digits_row("catalog"), 2, "an integer of 5,000 digits"),
    ("gpu-verify-remote-dot-dot", lambda c: ["gpu-verify", str(c.good()), "--remote", "../../x",
                                             "--patch", str(c.file("p.diff", "x")),
                                             "--reports", str(c.tmp / "r")], 2,
     "--remote '../../x': not a host name"),
    ("gpu-verify-remote-64-char-label", lambda c: ["gpu-verify", str(c.good()), "--remote",
                                                   "a" * 64 + ".example.com", "--patch",
                                                   str(c.file("p.diff", "x")),
                                                   "--reports", str(c.tmp / "r")], 2,
     "not a host name"),
    ("campaign-out-an-existing-file", lambda c: ["campaign", "--out", str(c.file("f", "x")),
                                                 "--reports", str(c.tmp / "r")], 2,
     "is a regular file, not a folder (the --out folder)"),
    # every environment variable the lab reads is range-checked
    ("setting-5000-digits", *env_row("VLLM_REPRO_MAX_KV_BLOCKS", "9" * 5000,
                                     "VLLM_REPRO_MAX_KV_BLOCKS=")),
    ("setting-steps-over-its-ceiling", *env_row("VLLM_REPRO_MAX_STEPS", "10000000000",
                                                "up to 1,000,000,000")),
    ("setting-memory-nan", *env_row("VLLM_REPRO_WORKER_MEMORY_MB", "nan", "VLLM_REPRO_WORKER_MEMORY_MB")),
    ("setting-processes-zero", lambda c: (c.env.update(VLLM_REPRO_MAX_PROCESSES="0"),
                                          ["fuzz", "--vllm", "0.10.2", "--reports",
                                           str(c.tmp / "r")])[1], 2,
     "VLLM_REPRO_MAX_PROCESSES='0': expected a whole number from 1 to 1,024"),
    ("setting-log-mb-text", lambda c: (c.env.update(VLLM_REPRO_MAX_LOG_MB="lots"),
                                       c.run(c.good()))[1], 2, "VLLM_REPRO_MAX_LOG_MB='lots'"),
]


@pytest.mark.parametrize("build, code, fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_hostile_input(tmp_path, monkeypatch, capsys, build, code, fragment):
    case = Case(tmp_path)
    args = build(case)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    t0 = time.perf_counter()
    got, out, err = invoke(args, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert got == code, err
    assert "Traceback" not in err + out
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert time.perf_counter() - t0 < 20
    assert not (tmp_path / "r").exists(), "an input error must not leave a report folder"


# ---- 1. signals within a second, loading included ------------------------------------------
def big_scenario(n: int) -> str:
    head = ("name: big\nvllm: {reproduces_on: [\"0.10.2\"]}\nconfig: {num_gpu_blocks: 100000}\n"
            "limits: {max_steps: 200000}\nrequests:\n")
    return head + "".join(f"  - {{id: r{i:06d}, prompt_len: 10, max_tokens: 4, at_step: "
                          f"{i // 100 + 1}}}\n" for i in range(n))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_large_scenario_loads_ends_the_lab_within_a_second(tmp_path, sig):
    s = tmp_path / "big.yaml"
    s.write_text(big_scenario(100_000))
    proc = subprocess.Popen([sys.executable, "-m", "vllm_repro.cli", "run", str(s), "--reports",
                             str(tmp_path / "r")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(2.5)  # imported, reading the YAML (seconds of it)
    assert proc.poll() is None, proc.communicate()
    t0 = time.perf_counter()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    took = time.perf_counter() - t0
    assert proc.returncode == 128 + sig, err
    assert took < 1.5, f"{took:.2f} s"
    assert "aborted" in err and "Traceback" not in err


# ---- 7. large legal inputs -------------------------------------------------------------------
def test_a_100000_request_scenario_loads_with_the_c_loader_and_says_so(tmp_path, capsys):
    import yaml

    from vllm_repro.inputs import _strict_loader
    from vllm_repro.scenario.load import load_scenario

    if getattr(yaml, "CSafeLoader", None) is not None:
        assert issubclass(_strict_loader(), yaml.CSafeLoader)
    s = tmp_path / "big.yaml"
    s.write_text(big_scenario(100_000))
    assert s.stat().st_size > 5_000_000
    t0 = time.perf_counter()
    sc = load_scenario(s)
    took = time.perf_counter() - t0
    assert len(sc.requests) == 100_000
    assert took < 90, f"{took:.1f} s"  # minutes on the pure-Python loader (issue 47)
    assert "big.yaml: reading" in capsys.readouterr().err


# ---- 2. nothing written outside where it belongs -----------------------------------------------
def test_a_symlink_at_the_engine_log_is_refused_and_its_target_untouched(tmp_path):
    from types import SimpleNamespace

    from vllm_repro.engine.host import Worker

    target = tmp_path / "victim"
    target.write_text("keep\n")
    log = tmp_path / "reports" / "_engine" / "0.10.2.log"
    log.parent.mkdir(parents=True)
    log.symlink_to(target)
    worker = Worker(SimpleNamespace(version="0.10.2"), log, warm=False)
    with pytest.raises(InputError, match="is a symlink"):
        worker.start()
    assert target.read_text() == "keep\n"


def test_a_symlink_at_the_engine_logs_folder_is_refused(tmp_path):
    from vllm_repro.lab import _claimed_log

    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "_engine").symlink_to(outside)
    with pytest.raises(InputError, match="is a symlink"):
        with _claimed_log(tmp_path / "r" / "_engine" / "0.10.2.log"):
            pass
    assert not list(outside.iterdir())


def _tar_with_everything() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        def add(name, kind, data=b"", **kw):
            info = tarfile.TarInfo(name)
            info.type = kind
            info.size = len(data)
            for k, v in kw.items():
                setattr(info, k, v)
            tf.addfile(info, io.BytesIO(data) if data else None)
        add("out", tarfile.DIRTYPE)
        add("out/summary.json", tarfile.REGTYPE, b"{}")
        add("run.log", tarfile.REGTYPE, b"log\n")
        add("out/fifo", tarfile.FIFOTYPE)
        add("out/null", tarfile.CHRTYPE, devmajor=1, devminor=3)
        add("out/disk", tarfile.BLKTYPE, devmajor=8, devminor=0)
        add("out/link", tarfile.SYMTYPE, linkname="/etc/passwd")
        add("out/hard", tarfile.LNKTYPE, linkname="run.log")
        add("../escape", tarfile.REGTYPE, b"x")
        add("/abs", tarfile.REGTYPE, b"x")
        add("out/setuid", tarfile.REGTYPE, b"x", mode=0o4755)
    return buf.getvalue()


def test_gpu_results_unpack_only_regular_files_and_folders_inside(tmp_path):
    from vllm_repro.remote.ship import extract_results

    tgz = tmp_path / "results.tar.gz"
    tgz.write_bytes(_tar_with_everything())
    local = tmp_path / "gpu" / "run"
    local.mkdir(parents=True)
    said = []
    names = extract_results(tgz, local, said.append)
    # (tarfile's data filter makes "/abs" the relative "abs", inside)
    assert sorted(names) == ["abs", "out", "out/setuid", "out/summary.json", "run.log"]
    for p in local.rglob("*"):
        assert p.is_dir() or (p.is_file() and not p.is_symlink()), p
        assert not p.stat().st_mode & 0o6000, p  # no set-uid bit from the host
    assert not (tmp_path / "gpu" / "escape").exists() and not Path("/abs").exists()
    assert said and "out/fifo" in said[0]


HEADER_ONLY = {
    "empty-new-file": "diff --git a/site.pth b/site.pth\nnew file mode 100644\nindex 0000000..e69de29\n",
    "deletion": "diff --git a/setup.py b/setup.py\ndeleted file mode 100644\nindex e69de29..0000000\n",
    "binary": ("diff --git a/evil.pth b/evil.pth\nnew file mode 100644\nindex 0000000..1111111\n"
               "GIT binary patch\nliteral 5\nMcmZ?wbaZk70000\n\nliteral 0\nHcmV?d00001\n\n"),
    "one-side-outside": "diff --git a/vllm/x.py b/../x.pth\nnew file mode 100644\n",
}


@pytest.mark.parametrize("name", sorted(HEADER_ONLY))
def test_a_header_only_git_entry_outside_vllm_is_refused(tmp_path, name):
    from vllm_repro.verify.patch import patch_files

    p = tmp_path / "fix.diff"
    p.write_text(HEADER_ONLY[name])
    with pytest.raises(InputError, match="a fix may only change files under vllm/"):
        patch_files(p)


def test_a_header_only_git_entry_inside_vllm_is_a_file_of_the_patch(tmp_path):
    from vllm_repro.verify.patch import patch_files

    p = tmp_path / "fix.diff"
    p.write_text("diff --git a/vllm/new.py b/vllm/new.py\nnew file mode 100644\nindex 0000000..e69de29\n")
    assert patch_files(p) == ["vllm/new.py"]


def _bundle(tmp_path: Path, entries: dict[str, bytes]) -> Path:
    b = tmp_path / "bundle"
    b.mkdir()
    (b / "patch.diff").write_text("x")
    sha = {"patch.diff": hashlib.sha256(b"x").hexdigest()}
    sha.update({k: hashlib.sha256(v).hexdigest() for k, v in entries.items()})
    (b / "manifest.json").write_text(json.dumps({"sha256": sha}))
    return b


@pytest.mark.parametrize("how", ["dot-dot", "absolute", "symlink-file", "symlink-folder"])
def test_the_judge_reads_nothing_outside_the_bundle(tmp_path, how):
    from vllm_repro.remote.gpu_judge import check_manifest

    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    if how == "dot-dot":
        b = _bundle(tmp_path, {"../secret": b"s3cret"})
    elif how == "absolute":
        b = _bundle(tmp_path, {str(secret): b"s3cret"})
    elif how == "symlink-file":
        b = _bundle(tmp_path, {"s": b"s3cret"})
        (b / "s").symlink_to(secret)
    else:
        b = _bundle(tmp_path, {"d/secret": b"s3cret"})
        (b / "d").symlink_to(tmp_path)
    with pytest.raises(InputError) as info:
        check_manifest(b)
    assert "symlink" in str(info.value) or "not a path inside the bundle" in str(info.value)


# ---- 4. bounded disk ---------------------------------------------------------------------------
def test_a_runs_worker_output_is_stored_once_and_capped(tmp_path, monkeypatch):
    from vllm_repro.lab import _claimed_log, _run_log
    from vllm_repro.records import ReportDir

    monkeypatch.setenv("VLLM_REPRO_MAX_LOG_MB", "1")
    log = tmp_path / "_engine" / "0.10.2.log"
    log.parent.mkdir()
    log.write_bytes(b"start-up\n")
    start = log.stat().st_size
    with open(log, "ab") as fh:  # 3 MB of output in one run
        fh.write(b"HEAD\n" + b"x" * (3 << 20) + b"\nTAIL\n")
    report = ReportDir(tmp_path, "t", "0.10.2")
    report.begin()
    _run_log(log, start, report)
    kept = (report.current / ReportDir.ENGINE_LOG).read_bytes()
    assert len(kept) < (1 << 20) + 200 and kept.startswith(b"HEAD") and kept.endswith(b"TAIL\n")
    assert b"left out here" in kept
    assert log.read_bytes() == b"start-up\n"  # stored once: the run's part is in its report
    # a log over the cap is rotated when the next run claims it
    log.write_bytes(b"y" * (2 << 20))
    with _claimed_log(log) as claimed:
        assert claimed == log and not log.exists()
    assert (log.parent / "0.10.2.log.1").stat().st_size == 2 << 20


def test_a_concurrent_runs_own_log_is_not_left_behind(tmp_path):
    import fcntl

    from vllm_repro.lab import _claimed_log

    log = tmp_path / "_engine" / "0.10.2.log"
    log.parent.mkdir()
    with open(log.parent / ".0.10.2.lock", "a") as held:  # another run holds the log
        fcntl.flock(held, fcntl.LOCK_EX)
        with _claimed_log(log) as mine:
            assert mine != log
            mine.write_text("this run's worker output\n")
    assert not list(log.parent.glob("0.10.2.*.log"))


def test_a_full_disk_is_exit_3_saying_where(tmp_path, monkeypatch, capsys):
    import vllm_repro.scenario.load as load

    def full(paths):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "r" / "x.json"))

    monkeypatch.setattr(load, "unique_scenarios", full)
    code, out, err = invoke(Case(tmp_path).run(Case(tmp_path).good()), capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 3 and len(lines) == 1 and "Traceback" not in err, err
    assert "no space left on device" in lines[0] and "x.json" in lines[0]
    assert "lab failure" not in lines[0]


# ---- 5. a skipped or refused input is never a success ------------------------------------------
def test_fuzz_where_the_release_refuses_every_example_is_not_no_failure_found(
        tmp_path, monkeypatch, capsys):
    import vllm_repro.fuzz.search as search
    import vllm_repro.sources.prepare as prepare
    from vllm_repro.fuzz.search import Campaign

    monkeypatch.setattr(prepare, "prepare_release", lambda *a, **k: object())
    monkeypatch.setattr(search, "run_campaign", lambda *a, **k: Campaign(
        examples=106, by_outcome={"refused": 106}, elapsed_s=1.0))
    code, out, err = invoke(["fuzz", "--vllm", "0.33.0", "--level", "v0-engine", "--time", "1s",
                             "--db", "none", "--out", str(tmp_path), "--reports",
                             str(tmp_path)], capsys)
    assert code == 2, out + err
    assert "no failure found" not in out
    assert "nothing checked" in err and "refused 106" in err


def test_gpu_verify_counts_skipped_tests_apart():
    from vllm_repro.commands.remote import suite_cell

    cell = suite_cell({"tests": 16, "failures": 0, "errors": 0, "skipped": 14})
    assert "2 passed" in cell and "14 skipped" in cell and "16/16" not in cell


def test_the_judge_does_not_verify_a_suite_that_skipped_everything(tmp_path, monkeypatch):
    import vllm_repro.remote.gpu_judge as judge

    b = _bundle(tmp_path, {})
    (b / "release.txt").write_text("0.10.2\n")
    (b / "verdict.json").write_text(json.dumps({"scenario": "t"}))
    (b / "tests" / "shared").mkdir(parents=True)
    inst = type("I", (), {"version": "0.10.2", "python": "py", "package_dir": "p",
                          "release": "0.10.2"})()
    monkeypatch.setattr(judge, "find_installed", lambda r: inst)
    monkeypatch.setattr(judge, "apply_patch", lambda *a: inst)
    monkeypatch.setattr(judge, "run_suite", lambda suite, sc, out, label, *a: {
        "tests": 16, "failures": 0, "errors": 0, "skipped": 16})
    monkeypatch.setattr(judge, "scenario_result", lambda out, label, *a: {
        "outcome": "crash" if label == "before" else "clean", "observed": label})
    code = judge.judge(b, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert code != 0 and not summary["verified"]
    assert any("skipped" in r for r in summary["reasons"])


# ---- 6. a port that is not an SSH server -------------------------------------------------------
def test_a_port_that_is_not_ssh_is_one_line_without_tracebacks(tmp_path, capfd):
    import socket
    import threading

    from vllm_repro.errors import EnvError
    from vllm_repro.remote.ship import Ship, connect

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host fake\n  HostName 127.0.0.1\n  Port {srv.getsockname()[1]}\n  User u\n")
    try:
        with pytest.raises(EnvError, match="not an SSH server"):
            connect(Ship(host="fake", bundle=tmp_path, local=tmp_path, ssh_config=cfg,
                         connect_timeout=5))
        time.sleep(0.5)  # (paramiko's transport thread logs after the client gave up)
    finally:
        srv.close()
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out, captured.err


def test_a_full_disk_names_the_file_a_write_was_writing(tmp_path):
    """A write's OSError names no file: the line names the file being written all the same."""
    from vllm_repro.cli import _disk_full

    target = tmp_path / "reports" / "result.json"
    target.parent.mkdir()
    try:
        with open(target, "w") as fh:  # noqa: F841 - the frame's open file is the clue
            raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as exc:
        line = _disk_full(exc)
    assert line is not None and line.startswith("no space left on device: ")
    assert str(target) in line


def test_a_campaign_whose_tasks_were_all_refused_is_not_a_clean_campaign(tmp_path, monkeypatch,
                                                                          capsys):
    from contextlib import contextmanager

    import vllm_repro.campaign.run as crun
    import vllm_repro.task_executor as executor
    import vllm_repro.sources.index as index
    from vllm_repro.records import CampaignReport, CampaignTaskResult

    monkeypatch.setattr(index, "list_releases", lambda: {"0.10.2": {}, "0.33.0": {}})

    @contextmanager
    def fake_executor(*a, **k):
        yield type("E", (), {"name": "test"})()

    monkeypatch.setattr(executor, "open_executor", fake_executor)
    monkeypatch.setattr(crun, "run_campaign", lambda spec, versions, where, ex, on_event:
                        CampaignReport(spec={}, releases=versions, seeds=[0], tasks=[
                            CampaignTaskResult(release=v, seed=0, status="refused",
                                               message="no V1 scheduler") for v in versions]))
    code, out, err = invoke(["campaign", "--seeds", "1", "--out", str(tmp_path / "c"),
                             "--reports", str(tmp_path)], capsys)
    assert code == 2, out + err
    assert "nothing checked" in err and "2 of 2 task(s) refused" in err


def test_a_bad_worker_state_setting_is_an_input_error_before_a_worker_starts(monkeypatch):
    """VLLM_REPRO_WORKER_STATE (engine/input_batch.py) is checked with the run limits: a value
    that is neither vllm nor lab is one line, exit 2, not a lab error inside the worker."""
    from vllm_repro.errors import InputError
    from vllm_repro.limits import check_worker_state, run_limits

    monkeypatch.setenv("VLLM_REPRO_WORKER_STATE", "bogus")
    with pytest.raises(InputError, match="VLLM_REPRO_WORKER_STATE='bogus': expected one of vllm, lab"):
        run_limits()
    monkeypatch.setenv("VLLM_REPRO_WORKER_STATE", " lab ")
    assert check_worker_state() == "lab"
    monkeypatch.delenv("VLLM_REPRO_WORKER_STATE")
    assert check_worker_state() == "vllm"
@pytest.mark.parametrize("old, new, fragment", [
    # a token id past int32 was an OverflowError in the runner, shown as a crash (exit 1)
    ("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8}\nmodel: {token: 99999999999999999999999}",
     "model.token"),
    ("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8}\nmodel: {tokens: {A: [1, 4294967296]}}",
     "model.tokens"),
    # a billion drafts a step made the runner build a billion-long list per request (a hang)
    ("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8, num_speculative_tokens: 1000000000}",
     "config.num_speculative_tokens"),
], ids=["token-over-int32", "scripted-token-over-int32", "spec-tokens-billion"])
def test_token_ids_and_draft_counts_are_bounded(tmp_path, capsys, old, new, fragment):
    c = Case(tmp_path)
    s = c.scenario(GOOD.replace(old, new))
    code, _, err = invoke(c.run(s), capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("value, code", [("60", 0), ("0.5", 0), ("-1", 2), ("nan", 2), ("inf", 2),
                                         ("abc", 2), ("999999", 2), ("9" * 5000, 2)])
def test_step_timeout_setting_is_read_not_a_lab_failure(monkeypatch, value, code):
    """Any VLLM_REPRO_STEP_TIMEOUT_S was a KeyError (exit 3, 'lab failure'): its range had no
    ceiling. A value in (0, 3600] is taken, anything else is one InputError naming it."""
    from vllm_repro.limits import run_limits
    monkeypatch.setenv("VLLM_REPRO_STEP_TIMEOUT_S", value)
    if code == 0:
        assert run_limits().step_timeout_s == float(value)
    else:
        with pytest.raises(InputError, match="VLLM_REPRO_STEP_TIMEOUT_S"):
            run_limits()


@pytest.mark.parametrize("files", [{}, {"release.txt": "0.10.2\n"},
                                   {"release.txt": "0.10.2\n", "verdict.json": "[1]"},
                                   {"release.txt": "\n", "verdict.json": '{"scenario": "s"}'}],
                         ids=["no-release-txt", "no-verdict", "verdict-not-object", "empty-release"])
def test_a_bundle_missing_its_release_or_name_is_exit_2(tmp_path, files):
    """A bundle whose manifest checks out (here: lists nothing) but lacks release.txt or a
    scenario name was a FileNotFoundError / KeyError: exit 3, 'lab failure, please report'."""
    from vllm_repro.remote.gpu_judge import judge
    b = tmp_path / "b"
    b.mkdir()
    (b / "manifest.json").write_text(json.dumps({"sha256": {}}))
    for name, text in files.items():
        (b / name).write_text(text)
    code = judge(b, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert code == 2, summary
    assert summary["verified"] is False and summary["error"]["kind"] == "input"


def test_diff_takes_exactly_two_releases(tmp_path, capsys):
    """--vllm A --vllm B --vllm A ran A against B and exited 0, the third release dropped
    without a word; it is one line, exit 2, before anything runs."""
    c = Case(tmp_path)
    code, _, err = invoke(["diff", str(c.good()), "--vllm", "0.10.2", "--vllm", "0.10.1.1",
                           "--vllm", "0.10.2", "--reports", str(tmp_path / "r")], capsys)
    assert code == 2 and "give two different releases" in err and "got 3" in err, err
    assert not (tmp_path / "r").exists()


def test_slice_outside_a_checkout_is_exit_2_before_preparing(tmp_path, capsys, monkeypatch):
    """slice run where --base (default: the working folder) holds no scenarios was exit 3
    (EnvError, 'lab failure' class), and only after preparing the release (minutes)."""
    import vllm_repro.slicing.slicer as slicer
    monkeypatch.setattr(slicer, "prepare_release", lambda *a, **k: pytest.fail("prepared"))
    code, _, err = invoke(["slice", "0.10.2", "--base", str(tmp_path), "--out",
                           str(tmp_path / "out")], capsys)
    assert code == 2 and "no scenario files" in err and "--base" in err, err


def test_a_symlinked_scenario_folder_in_reports_takes_nothing_outside(tmp_path):
    """reports/<scenario> as a symlink to a folder elsewhere: the run's trace, result and page
    were written into the link's target (outside --reports); now the link is replaced by a
    folder and the target stays empty. A symlinked reports/<scenario>/<release> leaves no
    dangling link behind."""
    from vllm_repro.records import ReportDir
    reports, outside, outside2 = tmp_path / "r", tmp_path / "outside", tmp_path / "outside2"
    reports.mkdir(), outside.mkdir(), outside2.mkdir()
    (reports / "s").symlink_to(outside)
    rd = ReportDir(reports, "s", "0.10.2")
    (rd.begin() / "trace.jsonl").write_text("{}\n")
    rd.commit()
    assert list(outside.iterdir()) == []
    assert not (reports / "s").is_symlink() and (reports / "s" / "0.10.2" / "trace.jsonl").is_file()
    # the release level: replaced, and the link itself does not linger as .0.10.2.old.PID
    rd.path.rename(tmp_path / "moved")
    rd.path.symlink_to(outside2)
    (rd.begin() / "trace.jsonl").write_text("{}\n")
    rd.commit()
    assert list(outside2.iterdir()) == [] and not rd.path.is_symlink()
    assert [p.name for p in (reports / "s").iterdir()] == ["0.10.2"]


def test_a_full_disk_leaves_no_half_report_filling_it(tmp_path, monkeypatch):
    """A run that filled a small --reports disk ended exit 3 (no space left) but left its 1 MB
    staging folder (.0.10.2.partial-PID/trace.jsonl) behind, so the disk stayed full; the
    half-written report now goes with the error."""
    import os
    import vllm_repro.lab as lab
    from vllm_repro.records import ReportDir
    rd = ReportDir(tmp_path / "r", "s", "0.10.2")
    (rd.begin() / "trace.jsonl").write_bytes(b"x" * 4096)
    log = tmp_path / "worker.log"
    log.write_text("vLLM said things\n")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(lab.shutil, "copyfileobj", full)
    with pytest.raises(OSError) as info:
        lab._run_log(log, 0, rd)
    assert info.value.errno == errno.ENOSPC
    assert not rd.staging.exists() and not rd.path.exists()


def test_events_are_bounded(tmp_path, capsys):
    """100,000 events (a 2.9 MB scenario, under the 8 MiB cap) loaded for 12 s and then ran
    past a minute; a scenario lists at most 10,000 events, exit 2 naming the field."""
    from vllm_repro.scenario.schema import MAX_EVENTS
    c = Case(tmp_path)
    events = "".join("  - {at_step: 3, abort: [A]}\n" for _ in range(MAX_EVENTS + 1))
    s = c.scenario(GOOD.replace("events:\n  - {at_step: 3, abort: [A]}\n", "events:\n" + events))
    code, _, err = invoke(c.run(s), capsys)
    assert code == 2 and "events: List should have at most 10000" in err, err


def test_a_huge_description_is_refused(tmp_path, capsys):
    """An 8 MB description (legal under the 8 MiB file cap) made a 4 s run take 48 s; a
    description is at most 65,536 characters, exit 2 naming it."""
    c = Case(tmp_path)
    s = c.scenario(GOOD.replace("name: t\n", "name: t\ndescription: " + "a" * 70_000 + "\n"))
    code, _, err = invoke(c.run(s), capsys)
    assert code == 2 and "description" in err and "65536" in err, err
