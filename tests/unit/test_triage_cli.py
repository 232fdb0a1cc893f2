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
    "latin1": (CRASH.replace("cmpl-7", "caf\u00e9").encode("latin-1"), "not UTF-8"),
    "cut-utf8": (CRASH.encode() + "\u00e9".encode()[:1], "ends inside a UTF-8 character"),
    "cut-traceback": (CRASH.encode().rsplit(b"\n", 2)[0] + b"\n", "cut off before its exception"),
    "no-crash": (b"INFO 06-01 00:00:00 [api_server.py:1] all good\n", "no crash found"),
    "utf16": (CRASH.encode("utf-16"), "UTF-16"),
}


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
