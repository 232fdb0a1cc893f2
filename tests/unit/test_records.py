"""The typed records of result.json and trace.jsonl: what a reader of a report relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_repro.records import (Crash, Frame, RecordError, ReportDir, RunResult, TraceLine,
                                Violation, read_trace, schema)
from vllm_repro.verdict import describe_observed

from .builders import make_result

DATA = Path(__file__).resolve().parents[1] / "data" / "results"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "records.md"


def crash_result() -> RunResult:
    where = Frame("vllm/v1/core/sched/scheduler.py", "schedule", 530)
    return RunResult("crash", scenario="s", vllm="0.10.1.1", level="scheduler",
                     crash=Crash("AssertionError", "", where, [where], 3, "schedule", "Traceback"),
                     violations=[Violation("KV_LEAK", "L holds block 4", 2, "after update_from_output",
                                           ["L"], [4])],
                     steps=3, finished={}, unfinished=["L", "H"], limit_reached=False)


def test_a_result_survives_json_and_keeps_its_types():
    res = crash_result()
    back = RunResult.from_json(res.to_json(indent=1))
    assert back == res
    assert isinstance(back.crash.where, Frame) and back.crash.where.line == 530
    assert isinstance(back.violations[0], Violation) and back.violations[0].blocks == [4]
    assert describe_observed(back) == "crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3"


def test_absent_fields_are_left_out_of_the_json():
    d = make_result("clean", steps=31, finished={"A": "FINISHED_LENGTH_CAPPED"}, unfinished=[]).to_dict()
    assert d == {"outcome": "clean", "steps": 31, "finished": {"A": "FINISHED_LENGTH_CAPPED"},
                 "unfinished": []}
    # an empty list is not absent: "nothing unfinished" is said
    assert "crash" not in d and "violations" not in d and d["unfinished"] == []


@pytest.mark.parametrize("path", sorted(DATA.glob("*.json")), ids=lambda p: p.stem)
def test_result_files_of_every_outcome_load_and_round_trip(path):
    raw = json.loads(path.read_text())
    res = RunResult.from_dict(raw)
    assert res.outcome == path.stem.split("-")[0]
    assert res.to_dict() == raw  # nothing lost or added
    assert describe_observed(res)  # the verdict table can say what it saw


def test_a_result_of_the_wrong_shape_is_refused_naming_the_field():
    with pytest.raises(RecordError, match="outcome"):
        RunResult.from_dict({"outcome": "exploded"})
    with pytest.raises(RecordError, match="RunResult: unknown field"):
        RunResult.from_dict({"outcome": "clean", "outcom": "clean"})
    with pytest.raises(RecordError, match="RunResult.violations: expected a list"):
        RunResult.from_dict({"outcome": "violation", "violations": {"code": "KV_LEAK"}})
    with pytest.raises(RecordError, match="Crash"):
        RunResult.from_dict({"outcome": "crash", "crash": {"message": "no type"}})
    with pytest.raises(RecordError, match="not JSON"):
        RunResult.from_json("{half")


def test_trace_lines_read_back_with_their_crash_and_findings(tmp_path):
    lines = [TraceLine.begin(1), TraceLine.begin(2)]
    lines[0].scheduled = {"L": 16}
    lines[0].free_blocks = 0  # a zero is a figure, not an absent one
    lines[1].crash = crash_result().crash.brief()
    lines[1].violations = [crash_result().violations[0].brief()]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(x.to_json() + "\n" for x in lines))
    back = read_trace(path)
    assert back == lines
    assert json.loads(path.read_text().splitlines()[0])["free_blocks"] == 0
    # a trace line's copies are brief: no traceback, no stack, no step of their own
    crash = json.loads(path.read_text().splitlines()[1])["crash"]
    assert set(crash) == {"type", "message", "where", "phase"}
    assert set(json.loads(path.read_text().splitlines()[1])["violations"][0]) == {
        "code", "message", "phase", "requests", "blocks"}
    assert back[0].progressed() and not TraceLine.begin(3).progressed()


def test_a_damaged_trace_line_is_named(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(TraceLine.begin(1).to_json() + "\n" + '{"step": 2, "nonsense": 1}\n')
    with pytest.raises(RecordError, match=r"trace.jsonl:2: TraceLine: unknown field\(s\) nonsense"):
        read_trace(path)


def test_the_report_dir_is_the_one_writer_of_result_json(tmp_path):
    rd = ReportDir(tmp_path, "vllm-1-x", "0.10.2")
    assert rd.path == tmp_path / "vllm-1-x" / "0.10.2" and not rd.exists()
    res = crash_result()
    res.verdict = {"ok": True, "observed": "crash"}
    assert rd.write_result(res) == rd.result_path
    assert rd.read_result() == res
    assert [p.name for p in rd.path.iterdir()] == ["result.json"], "no temporary file left"
    assert ReportDir.results_under(tmp_path) == [rd.result_path]
    assert ReportDir.engine_log(tmp_path, "0.10.2") == tmp_path / "_engine" / "0.10.2.log"


def test_the_documented_schema_is_the_records_own():
    text = DOCS.read_text()
    assert schema() in text, "docs/records.md is out of date: paste vllm_repro.records.schema()"
    for name in ("RunResult", "Crash", "Frame", "Stall", "Violation", "TraceLine"):
        assert f"### `{name}`" in text


def test_a_report_is_staged_and_replaces_the_previous_one_only_when_whole(tmp_path):
    rd = ReportDir(tmp_path, "s", "0.10.2")
    old = crash_result()
    rd.write_result(old)  # the previous run's report
    (rd.path / "trace.jsonl").write_text("old trace\n")
    staged = rd.begin()
    assert staged != rd.path and staged.parent == rd.path.parent and staged.name.startswith(".")
    (staged / "trace.jsonl").write_text("new trace\n")
    new = make_result("clean", scenario="s", vllm="0.10.2", steps=3)
    rd.write_result(new)
    # until the commit, readers see the previous run whole, and the staged run is no report
    assert rd.read_result() == old and (rd.path / "trace.jsonl").read_text() == "old trace\n"
    assert ReportDir.results_under(tmp_path) == [rd.result_path]
    rd.commit()
    assert rd.read_result() == new and (rd.path / "trace.jsonl").read_text() == "new trace\n"
    assert sorted(p.name for p in rd.path.parent.iterdir()) == ["0.10.2"], "nothing left behind"
    # an interrupted run: its staging folder stays hidden and the next run starts clean
    rd.begin()
    (rd.staging / "trace.jsonl").write_text("half\n")
    assert rd.read_result() == new
    assert not any((rd.begin()).iterdir())


def test_a_release_without_the_scenarios_engine_is_recorded_as_such():
    """The engine loop records the release refusing a whole level (engine/loop.py's
    LevelMissing) as RunError.lacks_level, which catalog run --also-on and matrix read; other
    refusals carry none. No vLLM is needed: the refusal comes before any vLLM object."""
    from vllm_repro.engine.capabilities import Capabilities
    from vllm_repro.engine.run import run_scenario

    class NoV0:  # 0.33.0's V1 adapter, as far as the refusal reads it
        version = "0.33.0"
        caps = Capabilities("0.33.0")

    result = run_scenario(NoV0(), {"name": "v0", "level": "v0-engine"}, None)
    assert (result.outcome, result.error.kind, result.error.lacks_level) == (
        "error", "input", "v0-engine")
    assert result.error.message.startswith("level: v0-engine: vLLM 0.33.0 has no V0 engine")
    back = RunResult.from_json(result.to_json())
    assert back.error.lacks_level == "v0-engine"
    # a plain refusal is not one
    assert RunResult.failed("input", "config.x: no such field").to_dict()["error"] == {
        "kind": "input", "message": "config.x: no such field"}
