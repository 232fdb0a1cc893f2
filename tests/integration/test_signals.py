"""SIGINT and SIGTERM to a real ``vllm-repro run`` (vLLM 0.10.2, nothing mocked): while the worker
imports vLLM and in the middle of a 700-step workload, with a cold worker and with one a warm
parent forked (docs/warm-runs.md). Every process of the run is gone one second after (the warm
parent, shared by every run of its environment, stays); "aborted"; exit 130 / 143. (The four
moments with a stand-in worker, including environment build and report writing, are
tests/unit/test_signals.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import ROOT, warm_parent_pid

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

STRESS = ROOT / "scenarios" / "stress" / "stress-fcfs-nocache.yaml"


def _table() -> dict[int, tuple[int, str]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                rest = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[int(name)] = (int(rest[1]), rest[0])
    return out


def _tree(root: int) -> set[int]:
    table = _table()
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for child, (ppid, _) in table.items():
            if ppid == pid and child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _assert_stopped(proc, err: str, code: int, seen: set[int], what: str) -> None:
    """The run exited with ``code``, said "aborted" without a traceback, and no process it had
    is alive one second later."""
    time.sleep(1.0)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == "aborted" and "Traceback" not in err, err
    left = [p for p in seen if _alive(p)]
    assert not left, f"alive one second after {what}: {left}"


def _is_warm(pid: int) -> bool:
    try:
        return "vllm_repro.engine.warm" in open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return False


def _workers(seen: set[int], warm: bool) -> set[int]:
    """The engine workers: cold, a ``vllm_repro.engine.worker`` process of the run; warm, a child
    of this checkout's warm parent of 0.10.2."""
    if not warm:
        return {p for p in seen if _alive(p) and "vllm_repro.engine.worker" in
                open(f"/proc/{p}/cmdline").read()}
    parent = warm_parent_pid("0.10.2")
    return {p for p in _tree(parent) if _alive(p)} if parent else set()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("moment", ["import", "mid-run"])
@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_signal_stops_a_real_run(tmp_path, mode, moment, sig, code):
    reports = tmp_path / "r"
    warm = mode == "warm"
    proc = subprocess.Popen([sys.executable, "-m", "vllm_repro.cli", "run", str(STRESS), "--vllm",
                             "0.10.2", "--reports", str(reports), "--jobs", "1",
                             *([] if warm else ["--cold"])],
                            env={**os.environ, "VLLM_REPRO_WARM_IDLE_S": "120"},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trace = reports / "stress-fcfs-nocache" / "0.10.2" / "trace.jsonl"
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 900  # a first run builds the environment
        while True:
            assert proc.poll() is None, f"the run ended before the {moment} moment: {proc.communicate()}"
            assert time.monotonic() < deadline, f"never reached the {moment} moment"
            seen |= _tree(proc.pid) | _workers(seen, warm)
            if moment == "import" and _workers(seen, warm):
                if not trace.parent.exists():  # still importing: no report folder yet
                    break
            # a run in progress is reported in its staging folder (records.ReportDir.begin)
            staged = next(iter(trace.parent.parent.glob(".0.10.2.partial-*/trace.jsonl")), None)
            if moment == "mid-run" and staged is not None and staged.read_text().count("\n") > 50:
                break
            time.sleep(0.05)
        seen |= _tree(proc.pid) | _workers(seen, warm)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    parent = warm_parent_pid("0.10.2") if warm else None
    seen = {p for p in seen if p != parent}
    assert seen, "no process of the run was seen"
    _assert_stopped(proc, err, code, seen, f"{sig.name} at {moment}")
    assert not trace.exists(), "an interrupted run left a half report in place"
    if warm:  # the parent serves the next run of 0.10.2
        assert parent is not None and _alive(parent)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_signal_stops_a_fuzz_campaign(tmp_path, mode, sig, code):
    """fuzz: search processes (multiprocessing, spawned), each with its own worker; all stop."""
    warm = mode == "warm"
    proc = subprocess.Popen([sys.executable, "-m", "vllm_repro.cli", "fuzz", "--vllm", "0.10.2",
                             "--time", "120s", "--workers", "2", "--out", str(tmp_path / "found"),
                             "--reports", str(tmp_path / "r"), *([] if warm else ["--cold"])],
                            env={**os.environ, "VLLM_REPRO_WARM_IDLE_S": "120"},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the search never started its workers"
            seen |= _tree(proc.pid)
            workers = _workers(seen, warm)
            if len(workers) == 2:
                break
            time.sleep(0.1)
        time.sleep(3)  # the workers import vLLM and start searching
        seen |= _tree(proc.pid) | _workers(seen, warm)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    parent = warm_parent_pid("0.10.2") if warm else None
    _assert_stopped(proc, err, code, {p for p in seen if p != parent}, sig.name)
