"""Every real crash log in the shared crashlogs/ folder (``$VLLM_REPRO_SHARED/crashlogs``, else
``../shared/crashlogs`` beside the checkout) triages to its .expected.json answer.

Compared: exception type, first message line, innermost vLLM frame (module, function), stage,
exit kind and release (`also_acceptable` answers accepted; when the release is not printed in
the log itself -- `version_in_log: false` -- the triage may also say it does not know), and the
scheduler state's counts where the answer gives them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_repro.triage import triage_log

from ..conftest import CRASHLOGS, NO_CRASHLOGS

LOGS = sorted(CRASHLOGS.glob("*.log")) if CRASHLOGS.is_dir() else []

pytestmark = pytest.mark.skipif(not LOGS, reason=NO_CRASHLOGS)

STATE_KEYS = ("running", "waiting", "swapped", "pending", "kv_cache_usage_pct",
              "cpu_kv_cache_usage_pct", "prefix_cache_hit_rate_pct", "num_gpu_blocks",
              "num_cpu_blocks", "preemption_warnings")


def _accepted(expected: dict, key: str) -> list:
    return [expected[key], *expected.get("also_acceptable", {}).get(key, [])]


def _triage(log: Path) -> dict:
    report, _ = triage_log(log)
    return report.as_dict()


@pytest.fixture(params=LOGS, ids=[p.stem for p in LOGS])
def case(request):
    log: Path = request.param
    expected = json.loads(log.with_suffix(".expected.json").read_text())
    return _triage(log), expected


def test_root_cause_exception(case):
    got, exp = case
    assert got["exception_type"] in _accepted(exp, "exception_type")
    msg = exp["exception_message"]
    first = None if msg is None else msg.splitlines()[0] if msg else ""
    assert got["exception_message"] == first


def test_innermost_vllm_frame(case):
    got, exp = case
    frame = got["last_vllm_frame"]
    frame = None if frame is None else {"module": frame["module"], "function": frame["function"]}
    assert frame in _accepted(exp, "last_vllm_frame")


def test_stage_and_exit_kind(case):
    got, exp = case
    assert got["stage"] in _accepted(exp, "stage")
    assert got["exit_kind"] in _accepted(exp, "exit_kind")


def test_release(case):
    got, exp = case
    accepted = _accepted(exp, "vllm_version")
    if not exp.get("version_in_log", True):
        accepted.append(None)  # not printed in the log: "unknown" is honest
    assert got["vllm_version"] in accepted


def test_scheduler_state(case):
    got, exp = case
    want = exp.get("scheduler_state")
    if want is None:
        assert got["scheduler_state"] is None
        return
    state = got["scheduler_state"]
    assert state is not None
    for key in STATE_KEYS:
        if key in want:
            assert state.get(key) == want[key], key
