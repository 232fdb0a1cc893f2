"""`vllm-repro triage` as a user runs it: the report, --json, stdin, and bad input (one line,
exit code 2, never a traceback)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from vllm_repro.triage import reader

from ..conftest import ROOT

SP = "/usr/local/lib/python3.12/dist-packages"
CRASH = (
    "INFO 06-01 00:00:00 [core.py:61] Initializing a V1 LLM engine (v0.9.2) with config: model='m'\n"
    "ERROR 06-01 00:00:09 [core.py:500] Traceback (most recent call last):\n"
    f"ERROR 06-01 00:00:09 [core.py:500]   File \"{SP}/vllm/v1/engine/core.py\", line 520, in run_busy_loop\n"
    "ERROR 06-01 00:00:09 [core.py:500]     self._process_engine_step()\n"
    f"ERROR 06-01 00:00:09 [core.py:500]   File \"{SP}/vllm/v1/core/sched/scheduler.py\", line 700, in update_from_output\n"
    "ERROR 06-01 00:00:09 [core.py:500]     req = self.requests[req_id]\n"
    "ERROR 06-01 00:00:09 [core.py:500] KeyError: 'cmpl-7'\n"
)


def run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_repro.cli", "triage", *args],
                          input=stdin, capture_output=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def test_report_names_cause_frame_stage_exit_and_release(tmp_path):
    log = tmp_path / "crash.log"
    log.write_text(CRASH)
    p = run(str(log))
    assert p.returncode == 0, p.stderr
    out = p.stdout.decode()
    assert "KeyError: 'cmpl-7'" in out
    assert "vllm/v1/core/sched/scheduler.py:update_from_output" in out
    assert "runtime" in out and "python_exception" in out and "0.9.2" in out


def test_json_from_stdin_has_the_readme_fields():
    p = run("-", "--json", stdin=CRASH.encode())
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    for key in ("exception_type", "exception_message", "last_vllm_frame", "stage", "exit_kind",
                "vllm_version", "scheduler_state"):
        assert key in d
    assert d["source"] == "<stdin>"
    assert d["last_vllm_frame"]["module"] == "vllm/v1/core/sched/scheduler.py"
    assert d["vllm_version"] == "0.9.2"


BAD_INPUTS = {
    "empty": (b"", "empty"),
    "binary": (b"\x00\x01\x02ELF junk\n", "binary"),
    "gzip": (gzip.compress(CRASH.encode()), "gzip"),
    "header-only-traceback": (b"INFO 06-01 00:00:00 [core.py:61] starting\n"
                              b"ERROR 06-01 00:00:09 [core.py:500] Traceback (most recent call "
                              b"last):\n", "cut off before its exception"),
    "no-crash": (b"INFO 06-01 00:00:00 [api_server.py:1] all good\n", "no crash found"),
    "utf16": (CRASH.encode("utf-16"), "UTF-16"),
}

# documentation that talks about signals (a README, an issue write-up): it names SIGSEGV, fatal
# signals and worker processes, quotes what crash logs print, and shows no crash
SIGNAL_PROSE = """\
## When a worker dies

vLLM runs the model in worker processes. When one of them hits SIGSEGV (a segmentation fault
in a CUDA kernel or in NCCL), the engine core notices a fatal signal from worker processes and
shuts down; a SIGKILL from the OOM killer ends the run the same way. The exit is read from
faulthandler, `*** SIGSEGV received`, `terminate called`, exit codes -9/-11/-6, 137/139/134,
the OOM killer. A bare `Killed` right after "Got fatal signal from worker processes"
is vLLM killing its own processes, not the OOM killer.
Killed workers are not restarted: a process that received signal 11 and exited with code 139
leaves no Python traceback, only Python's Fatal Python error: Segmentation fault banner.
Segmentation faults show as signal:SIGSEGV.
"""

# the same crash as a real log: faulthandler's banner and the dying thread's stack, then the shell
SEGFAULT = (
    "INFO 06-01 00:00:00 [core.py:61] Initializing a V1 LLM engine (v0.9.2) with config: model='m'\n"
    "(VllmWorker rank=0 pid=226) Fatal Python error: Segmentation fault\n"
    "(VllmWorker rank=0 pid=226)\n"
    "(VllmWorker rank=0 pid=226) Current thread 0x00007f0000000002 (most recent call first):\n"
    f"(VllmWorker rank=0 pid=226)   File \"{SP}/vllm/distributed/device_communicators/"
    "pynccl_wrapper.py\", line 290 in ncclAllReduce\n"
    f"(VllmWorker rank=0 pid=226)   File \"{SP}/vllm/v1/worker/gpu_model_runner.py\", line 1441 "
    "in execute_model\n"
    "(VllmWorker rank=0 pid=226)\n"
    "Segmentation fault (core dumped)\n"
)


def test_prose_about_signals_is_no_crash_but_a_segfault_log_is(tmp_path):
    doc = tmp_path / "notes.md"
    doc.write_text(SIGNAL_PROSE)
    p = run(str(doc))
    err = p.stderr.decode()
    assert p.returncode == 2, p.stdout.decode()
    assert "no crash found" in err and len(err.strip().splitlines()) == 1, err

    log = tmp_path / "segv.log"
    log.write_text(SEGFAULT)
    p = run(str(log), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["exit_kind"] == "signal:SIGSEGV"
    assert d["signal"]["source"] == "faulthandler" and d["signal"]["log_line"] == 2
    assert d["last_vllm_frame"]["module"] == "vllm/distributed/device_communicators/pynccl_wrapper.py"
    assert d["last_vllm_frame"]["function"] == "ncclAllReduce"


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(tmp_path, kind):
    data, words = BAD_INPUTS[kind]
    log = tmp_path / f"{kind}.log"
    log.write_bytes(data)
    p = run(str(log))
    err = p.stderr.decode()
    assert p.returncode == 2, (p.stdout, err)
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert str(log) in err and words in err


def test_bytes_that_are_not_utf8_are_replaced_not_refused(tmp_path):
    for name, data in (("latin1", CRASH.replace("cmpl-7", "caf\u00e9").encode("latin-1")),
                       ("cut-utf8", CRASH.encode() + "\u00e9".encode()[:1])):
        log = tmp_path / f"{name}.log"
        log.write_bytes(data)
        p = run(str(log), "--json")
        assert p.returncode == 0, p.stderr
        d = json.loads(p.stdout)
        assert d["exception_type"] == "KeyError" and d["vllm_version"] == "0.9.2"
        assert any("not UTF-8" in n for n in d["notes"]), d["notes"]
    assert d["notes"] and "line 8" in next(n for n in d["notes"] if "UTF-8" in n)


def test_nul_padding_is_dropped_and_the_log_triaged(tmp_path):
    """A log as copied out of a container or rotated under its writer (copytruncate): NUL
    bytes before the text (more than a read block of them), runs of them between lines and
    after the text. Triaged as the same crash, line numbers as in the text, the padding noted."""
    lines = CRASH.encode().splitlines(keepends=True)
    data = (b"\x00" * (reader._CHUNK + 4096) + b"".join(lines[:3]) + b"\x00" * 512
            + b"".join(lines[3:]) + b"\x00" * 100)
    log = tmp_path / "padded.log"
    log.write_bytes(data)
    p = run(str(log), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert (d["exception_type"], d["vllm_version"]) == ("KeyError", "0.9.2")
    assert d["last_vllm_frame"]["module"] == "vllm/v1/core/sched/scheduler.py"
    assert d["root_cause"]["log_line"] == 7  # the text's own line numbers
    (note,) = [n for n in d["notes"] if "NUL" in n]
    assert note.startswith(f"{reader._CHUNK + 4096 + 512 + 100} NUL bytes of padding dropped "
                           "(before the text")


@pytest.mark.parametrize("block, binary", [
    (b"INFO a\n" * 50 + b"\x00" * 4000 + b"INFO b\n", False),           # padding between lines
    (b"\x00" * 10 + b"plain text\n", False),
    ("INFO x\n".encode("utf-16-le") * 20, True),                        # UTF-16 without a BOM
    (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4, True),         # an executable
    (b"SQLite format 3\x00\x10\x00\x01\x01\x00@  \x00\x00\x00\x02", True),
    (b"INFO \x1b[32mgreen\x1b[0m\r\n\tindented\x0c\n" * 20, False),     # colours, CR, tab
])
def test_only_truly_binary_data_is_binary(block, binary):
    assert reader.looks_binary(block) is binary


def test_a_traceback_cut_before_its_exception_reports_its_frames(tmp_path):
    log = tmp_path / "cut.log"
    log.write_bytes(CRASH.encode().rsplit(b"\n", 2)[0] + b"\n")
    p = run(str(log), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["truncated"] is True and d["exception_type"] is None
    assert d["last_vllm_frame"]["function"] == "update_from_output"
    assert d["stage"] == "runtime" and d["exit_kind"] == "python_exception"
    p = run(str(log))
    assert p.returncode == 0 and "cut off before its exception line" in p.stdout.decode()


def test_missing_file_and_folder_are_input_errors(tmp_path):
    for target in (tmp_path / "nope.log", tmp_path):
        p = run(str(target))
        assert p.returncode == 2 and len(p.stderr.decode().strip().splitlines()) == 1
        assert "Traceback" not in p.stderr.decode()


def test_bad_stdin_is_named(tmp_path):
    p = run("-", stdin=b"")
    assert p.returncode == 2 and "<stdin>" in p.stderr.decode()


def test_an_over_long_line_is_cut_not_held(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "MAX_LINE", 64)
    log = tmp_path / "long.log"
    long_line = "x" * 10_000 + "\u00e9" * 10
    log.write_text(long_line + "\n" + "second line\n", encoding="utf-8")
    lines = list(reader.iter_lines(log))
    assert [n for n, _ in lines] == [1, 2]
    assert len(lines[0][1]) <= 64 and lines[1][1] == "second line"


def test_a_utf8_byte_order_mark_is_ignored(tmp_path):
    log = tmp_path / "bom.log"
    log.write_bytes(b"\xef\xbb\xbf" + CRASH.encode())
    assert reader.iter_lines(log).__next__()[1].startswith("INFO 06-01")


def test_vllm_is_checked_against_the_index_as_run_checks_it(tmp_path):
    """`triage --vllm 9.9.9`: a release the index does not have is exit 2 in one line naming
    the flag, the nearest releases and how to list them, before the log is read or a draft
    written; a release the index (or the cache) has is taken; with no index to ask, a draft
    (which needs none) goes on and says the release was not checked, a replay stops (exit 3)."""
    import socket

    from .fake_index import FakeIndex, make_sdist

    log = tmp_path / "crash.log"
    log.write_text(CRASH)
    draft = tmp_path / "d.yaml"
    env = {**os.environ, "COLUMNS": "200", "VLLM_REPRO_CACHE": str(tmp_path / "cache")}

    def triage(*args, index):
        return subprocess.run([sys.executable, "-m", "vllm_repro.cli", "triage", str(log), *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env={**env, "PIP_INDEX_URL": index})

    with FakeIndex({"vllm-0.9.2.tar.gz": make_sdist("0.9.2"),
                    "vllm-0.10.0.tar.gz": make_sdist("0.10.0")}) as idx:
        p = triage("--vllm", "9.9.9", "--scenario", str(draft), index=idx.url)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, p.stderr
        assert lines[0].startswith("error: --vllm 9.9.9: vLLM 9.9.9 is not a release on the "
                                   "index; nearest releases: "), lines[0]
        assert "pip index versions vllm" in lines[0]
        assert not draft.exists()
        p = triage("--vllm", "v0.9.2", "--json", index=idx.url)
        assert p.returncode == 0, p.stderr
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    gone = f"http://127.0.0.1:{s.getsockname()[1]}/simple"
    s.close()  # nothing listens there now
    p = triage("--vllm", "0.9.2", "--json", index=gone)
    assert p.returncode == 0, p.stderr
    assert "--vllm 0.9.2: not checked against the index" in p.stderr
    p = triage("--vllm", "0.9.2", "--replay", "--reports", str(tmp_path / "r"), index=gone)
    assert p.returncode == 3 and "unreachable" in p.stderr, p.stderr


CHAINED_CUT = """\
ERROR 06-05 16:27:39 [core.py:502] EngineCore encountered a fatal error.
ERROR 06-05 16:27:39 [core.py:502] Traceback (most recent call last):
ERROR 06-05 16:27:39 [core.py:502]   File "/opt/venv/lib/python3.12/site-packages/vllm/distributed/device_communicators/shm_broadcast.py", line 427, in acquire_read
ERROR 06-05 16:27:39 [core.py:502]     raise TimeoutError
ERROR 06-05 16:27:39 [core.py:502] TimeoutError
ERROR 06-05 16:27:39 [core.py:502]
ERROR 06-05 16:27:39 [core.py:502] During handling of the above exception, another exception occurred:
ERROR 06-05 16:27:39 [core.py:502]
ERROR 06-05 16:27:39 [core.py:502] Traceback (most recent call last):
ERROR 06-05 16:27:39 [core.py:502]   File "/opt/venv/lib/python3.12/site-packages/vllm/v1/engine/core.py", line 493, in run_engine_core
ERROR 06-05 16:27:39 [core.py:502]     engine_core.run_busy_loop()
ERROR 06-05 16:27:39 [core.py:502]   File "/opt/venv/lib/python3.12/site-packages/vllm/v1/executor/multiproc_executor.py", line 158, in execute_model
"""


def test_a_log_cut_inside_the_outer_traceback_of_a_chained_exception_says_so_first(tmp_path):
    """The inner exception finished, the log ends in the traceback leading to the outer one (a
    newcomer's `head -c` of crash log 009): the report's first line says the log is cut off and
    that the inner exception may be the cause rather than the crash."""
    log = tmp_path / "cut.log"
    log.write_text(CHAINED_CUT)
    p = run(str(log), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["exception_type"] == "TimeoutError"
    assert d["cut_off"] and "ends inside a traceback" in d["cut_off"]
    first = run(str(log)).stdout.decode().splitlines()[1]
    assert first.startswith("cut off: the log ends inside a traceback")
    whole = tmp_path / "whole.log"  # the same log with its outer exception line is not cut
    whole.write_text(CHAINED_CUT + "ERROR 06-05 16:27:39 [core.py:502] TimeoutError: RPC call to "
                     "execute_model timed out.\n")
    assert json.loads(run(str(whole), "--json").stdout)["cut_off"] is None
