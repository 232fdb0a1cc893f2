"""Triage the whole corpus of real crash logs and score it per field (issue 17, item 3).

The corpus is every ``tests/data/crashlogs/*.log`` (logs pasted in public vLLM-related GitHub
threads, each with the answer read from the thread in ``<name>.expected.json``), plus the logs
in ``$VLLM_REPRO_SHARED/crashlogs`` when that is set. The test prints the accuracy of each field
(run pytest with ``-s`` to see it) and fails when a field is right on fewer than 90% of the logs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_repro.errors import InputError
from vllm_repro.triage import triage_log

from ..conftest import ROOT, SHARED

CORPUS = ROOT / "tests" / "data" / "crashlogs"
GOAL = 0.90
REQUIRED = ("exception_type", "exception_message", "last_vllm_frame", "stage", "exit_kind",
            "vllm_version", "issue")


def corpus_logs() -> list[Path]:
    logs = sorted(CORPUS.glob("*.log"))
    if os.environ.get("VLLM_REPRO_SHARED") and (SHARED / "crashlogs").is_dir():
        logs += sorted((SHARED / "crashlogs").glob("*.log"))
    return logs


def _accepted(exp: dict, key: str) -> list:
    return [exp[key], *exp.get("also_acceptable", {}).get(key, [])]


def score(got: dict | None, exp: dict) -> dict[str, bool]:
    """Which fields of one triage report (None: triage refused the log) match the answer."""
    if got is None:
        return {k: False for k in ("exception", "frame", "stage", "exit_kind", "version")}
    msg = exp["exception_message"]
    first = None if msg is None else (msg.splitlines()[0] if msg else "")
    frame = got["last_vllm_frame"]
    frame = None if frame is None else {"module": frame["module"], "function": frame["function"]}
    versions = _accepted(exp, "vllm_version")
    if not exp.get("version_in_log", True):
        versions.append(None)  # not printed in the log: "unknown" is honest
    out = {
        "exception": got["exception_type"] in _accepted(exp, "exception_type")
        and got["exception_message"] == first,
        "frame": frame in _accepted(exp, "last_vllm_frame"),
        "stage": got["stage"] in _accepted(exp, "stage"),
        "exit_kind": got["exit_kind"] in _accepted(exp, "exit_kind"),
        "version": got["vllm_version"] in versions,
    }
    if "truncated" in exp:
        out["truncated"] = got.get("truncated") == exp["truncated"]
    if exp.get("version_in_log") and exp["vllm_version"]:
        # the logs that print their release: "not named" is a miss there
        out["version_shown"] = got["vllm_version"] in _accepted(exp, "vllm_version")
    return out


def test_every_corpus_log_has_an_answer_naming_its_thread():
    logs = sorted(CORPUS.glob("*.log"))
    assert len(logs) >= 15
    for log in logs:
        exp = json.loads(log.with_suffix(".expected.json").read_text())
        missing = [k for k in REQUIRED if k not in exp]
        assert not missing, (log.name, missing)
        assert exp["source_url"].startswith("https://github.com/"), log.name


def test_corpus_accuracy_per_field(capsys):
    logs = corpus_logs()
    if not logs:
        pytest.skip("no corpus logs")
    totals: dict[str, list[int]] = {}
    misses: list[str] = []
    for log in logs:
        exp = json.loads(log.with_suffix(".expected.json").read_text())
        try:
            got = triage_log(log)[0].as_dict()
        except InputError as exc:
            got = None
            misses.append(f"{log.name}: refused ({exc})")
        for field, ok in score(got, exp).items():
            t = totals.setdefault(field, [0, 0])
            t[0] += ok
            t[1] += 1
            if not ok and got is not None:
                misses.append(f"{log.name}: {field}")
    with capsys.disabled():
        print(f"\ntriage corpus: {len(logs)} logs")
        for field, (ok, n) in totals.items():
            print(f"  {field:<13} {ok:>3}/{n:<3} {100 * ok / n:5.1f}%")
        for m in misses:
            print(f"  miss: {m}")
    low = {f: ok / n for f, (ok, n) in totals.items() if ok / n < GOAL}
    assert not low, f"fields under {GOAL:.0%}: {low}; misses: {misses}"
