"""``triage --replay`` on every crash log that carries vLLM's scheduler dump and names its
release (issue 17, item 2): the drafted scenario runs on that release without a lab or input
error, and the comparison table is written beside the run's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import CRASHLOGS, ROOT

pytestmark = pytest.mark.slow

CORPUS = ROOT / "tests" / "data" / "crashlogs"


def dumped_logs() -> list[Path]:
    logs = sorted(CORPUS.glob("*.log")) + (sorted(CRASHLOGS.glob("*.log")) if CRASHLOGS.is_dir() else [])
    return [p for p in logs if "Dumping scheduler output for model execution" in
            p.read_text(errors="replace")]


@pytest.mark.parametrize("log", dumped_logs(), ids=lambda p: p.stem)
def test_a_dumped_batch_replays_on_the_logged_release(cli, tmp_path, log):
    tri = cli("triage", str(log), "--json")
    assert tri.returncode == 0, tri.stderr
    if not json.loads(tri.stdout)["vllm_version"]:
        pytest.skip(f"{log.name} names no release (triage --replay --vllm X picks one)")
    proc = cli("triage", str(log), "--replay", "--json", "--reports", str(tmp_path / "r"))
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]  # never 2 or 3
    rep = json.loads(proc.stdout)["replay"]
    assert rep["outcome"] != "error"
    fields = [r["field"] for r in rep["rows"]]
    assert fields[:3] == ["step compared", "exception", "innermost vLLM frame"]
    assert "total_num_scheduled_tokens" in fields
    written = json.loads((Path(rep["report_dir"]) / "replay.json").read_text())
    assert written["rows"] == rep["rows"]
    assert rep["exit_code"] == proc.returncode  # the verdict's code: 0 the draft's expectation held
