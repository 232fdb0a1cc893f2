"""``triage --replay`` on every crash log that carries vLLM's scheduler dump (issue 17, item 2):
the drafted scenario runs on the logged release without a lab or input error, and the
comparison table is written beside the run's report.

The release is the one the log prints. Where the log prints none, the answer file may name the
release the thread states elsewhere (``replay_release``: its ``version`` and ``source``, e.g.
the pod's image in the issue, checked against that release's dump repr); the replay then runs
with ``--vllm`` on it. A dumped log with neither is skipped, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import CRASHLOGS, ROOT, SHARED_HINT

pytestmark = pytest.mark.slow

CORPUS = ROOT / "tests" / "data" / "crashlogs"


def dumped_logs() -> list[Path]:
    logs = sorted(CORPUS.glob("*.log")) + (sorted(CRASHLOGS.glob("*.log")) if CRASHLOGS.is_dir() else [])
    return [p for p in logs if "Dumping scheduler output for model execution" in
            p.read_text(errors="replace")]


def _named_release(log: Path) -> str | None:
    exp = log.with_suffix(".expected.json")
    named = json.loads(exp.read_text()).get("replay_release") if exp.exists() else None
    return named["version"] if named else None


@pytest.mark.parametrize("log", dumped_logs(), ids=lambda p: p.stem)
def test_a_dumped_batch_replays_on_the_logged_release(cli, tmp_path, log):
    tri = cli("triage", str(log), "--json")
    assert tri.returncode == 0, tri.stderr
    release = []
    if not json.loads(tri.stdout)["vllm_version"]:
        named = _named_release(log)
        if not named:
            pytest.skip(f"{log.name} names no release, nor does its answer file "
                        "(triage --replay --vllm X picks one)")
        release = ["--vllm", named]
    proc = cli("triage", str(log), "--replay", "--json", "--reports", str(tmp_path / "r"),
               "--scenario", str(tmp_path / "draft.yaml"), *release)
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]  # never 2 or 3
    rep = json.loads(proc.stdout)["replay"]
    assert rep["outcome"] != "error"
    if release:
        assert rep["release"] == release[1]
    fields = [r["field"] for r in rep["rows"]]
    assert fields[:3] == ["step compared", "exception", "innermost vLLM frame"]
    assert "total_num_scheduled_tokens" in fields
    written = json.loads((Path(rep["report_dir"]) / "replay.json").read_text())
    assert written["rows"] == rep["rows"]
    assert rep["exit_code"] == proc.returncode  # the verdict's code: 0 the draft's expectation held


LOG_009 = next(iter(sorted(CRASHLOGS.glob("009-*.log"))), None)


@pytest.mark.skipif(LOG_009 is None, reason=f"{CRASHLOGS / '009-*.log'} absent; {SHARED_HINT}")
def test_the_009_scenario_runs_on_0_9_0(tmp_path, cli):
    """The scenario triage drafts from log 009 runs on the release it names (real 0.9.0: 71 s,
    moved here from tests/unit, which runs no release)."""
    from vllm_repro.scenario import load_scenario

    out = tmp_path / "009.yaml"
    assert cli("triage", str(LOG_009), "--scenario", str(out)).returncode == 0
    p = cli("run", str(out), "--vllm", "0.9.0", "--reports", str(tmp_path / "r"), "--json",
            "--jobs", "1")
    verdicts = json.loads(p.stdout)
    assert [v["vllm"] for v in verdicts] == ["0.9.0"]
    # the log's death is an RPC timeout outside the scheduler: the replay of its batch (every
    # dumped and waiting request) runs to the end, clean; the draft expects nothing of it (its
    # release is not under reproduces_on), so the run passes its own replay: exit 0
    n = len(load_scenario(out).requests)
    assert verdicts[0]["outcome"] == "clean", verdicts[0]["observed"]
    assert verdicts[0]["observed"].startswith(f"clean ({n} finished"), verdicts[0]["observed"]
    assert (verdicts[0]["expected"], verdicts[0]["ok"], p.returncode) == ("-", None, 0)
