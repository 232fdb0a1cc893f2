"""The audit's host-side pieces: timeline.png, [SCHED]/[AUDIT] lines, the plant loader, the
violation record."""

from __future__ import annotations

import json

import pytest

from vllm_repro.audit.codes import CODES, make_violation, names
from vllm_repro.audit.registry import registered_codes
from vllm_repro.audit.plant import PlantContext, PlantError, load_plant
from vllm_repro.report.index import write_index
from vllm_repro.report.sched_log import sched_log_lines
from vllm_repro.report.timeline import labels, marks, write_timeline

from .builders import make_result, make_trace


def trace_lines():
    base = {"added": [], "aborted": [], "finished": []}
    return [
        {**base, "step": 1, "waiting": [], "running": ["L"], "preempted": [], "free_blocks": 2,
         "audit": {"free": 2, "used": 2, "total": 5}},
        {**base, "step": 2, "waiting": [], "running": ["L", "H"], "preempted": [], "free_blocks": 0,
         "audit": {"free": 0, "used": 4, "total": 5},
         "violations": [{"code": "KV_LEAK", "phase": "after update_from_output",
                         "message": "H holds block 4", "requests": ["H"], "blocks": [4]}]},
        {**base, "step": 3, "waiting": ["L"], "running": ["H"], "preempted": ["L"],
         "free_blocks": 1, "crash": {"type": "AssertionError", "message": "", "where": None,
                                     "phase": "schedule"}},
    ]


def write_run(tmp_path, lines, result):
    run = tmp_path / "reports" / "scn" / "0.10.1.1"
    run.mkdir(parents=True)
    (run / "trace.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "result.json").write_text(json.dumps(result))
    return run


def test_marks_name_the_crash_and_violation_steps():
    assert marks(make_trace(*trace_lines()),
                 make_result(violations=[{"code": "KV_LEAK", "step": 9}])) == [
        (2, "violation", "KV_LEAK @2"),
        (3, "crash", "crash AssertionError in schedule @3"),
        (9, "violation", "KV_LEAK @9"),  # an end-of-run finding has no trace line
    ]


def test_labels_name_each_code_once_with_its_steps():
    ms = [(22, "violation", "REQ_STATE @22"), (25, "violation", "REQ_STATE @25"),
          (30, "crash", "crash X in schedule @30"), (81, "violation", "REQ_STATE @81"),
          (40, "violation", "KV_LEAK @40")]
    assert labels(ms) == [(22, "violation", "REQ_STATE @22 (3 steps, last @81)"),
                          (30, "crash", "crash X in schedule @30"),
                          (40, "violation", "KV_LEAK @40")]


def test_timeline_png_is_written_and_linked_from_the_index(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    result = {"scenario": "scn", "vllm": "0.10.1.1", "outcome": "crash",
              "verdict": {"expected": "crash", "observed": "crash AssertionError @3", "ok": True}}
    run = write_run(tmp_path, trace_lines(), result)
    png = write_timeline(run, make_result(**result))
    assert png == run / "timeline.png"
    from matplotlib import image

    h, w = image.imread(png).shape[:2]
    assert w > 600 and h > 400
    index = write_index(tmp_path / "reports").read_text()
    assert 'href="scn/0.10.1.1/timeline.png"' in index and "<img" in index
    assert matplotlib is not None


def test_no_trace_no_picture(tmp_path):
    assert write_timeline(tmp_path, None) is None


def test_sched_log_prints_each_finding_under_its_state_line(tmp_path):
    run = write_run(tmp_path, trace_lines(), {})
    lines = list(sched_log_lines(run / "trace.jsonl"))
    assert lines[1] == ("[SCHED] step=2 waiting=[] running=[L,H] preempted=[] free_blocks=0 "
                        "VIOLATION KV_LEAK")
    assert lines[2] == "[AUDIT] step=2 KV_LEAK (after update_from_output): H holds block 4"
    assert lines[3].endswith("CRASH AssertionError in schedule")


def test_violation_record_and_codes():
    v = make_violation("KV_REFCOUNT", "block 7 ref_cnt 0 but held by A and B (expected 2)",
                       requests=["B", "A", "A"], blocks=[7])
    # requests sorted and once each; as result.json has it (no step yet: the auditor sets it)
    assert v.to_dict() == {"code": "KV_REFCOUNT", "phase": "", "requests": ["A", "B"],
                           "blocks": [7],
                           "message": "block 7 ref_cnt 0 but held by A and B (expected 2)"}
    with pytest.raises(ValueError):
        make_violation("KV_OOPS", "x")
    # every code some registered check records (audit/registry.py), and only those
    assert set(CODES) == registered_codes() and "KV_REFCOUNT" in CODES
    assert names(["A", "B", "C"]) == "A, B and C" and names([]) == "nobody"


def test_plants_load_only_from_absolute_plant_files(tmp_path):
    good = tmp_path / "plant_x.py"
    good.write_text("def boom(ctx, n=1):\n    ctx.note('n', n)\n")
    ordinary = tmp_path / "faults.py"
    ordinary.write_text(good.read_text())
    ctx = PlantContext(adapter=None)
    load_plant(f"{good}:boom")(ctx, n=3)
    assert ctx.notes == {"n": 3}
    for spec in (f"{ordinary}:boom", "plant_x.py:boom", f"{good}:missing", f"{good}",
                 f"{tmp_path / 'plant_none.py'}:boom"):
        with pytest.raises(PlantError):
            load_plant(spec)


def test_plant_patches_are_undone():
    class Target:
        def method(self):
            return "real"

    ctx = PlantContext(adapter=None)
    ctx.patch(Target, "method", lambda self: "fault")
    ctx.patch(Target, "added", 1)
    assert Target().method() == "fault" and Target.added == 1
    ctx.restore()
    assert Target().method() == "real" and not hasattr(Target, "added")


def test_a_stall_says_where_its_requests_are_stuck_under_the_table_and_in_the_sched_log(
        tmp_path, capsys):
    """A stalled run prints its Stall.message under the verdict table and ends its --sched-log
    with a STALL line: before, the message was only in result.json."""
    from vllm_repro.console import print_results
    from vllm_repro.lab import RunItem
    from vllm_repro.verdict import judge

    from .builders import make_scenario

    msg = "huge in waiting, needs 64 KV blocks for its 1009 tokens, more than the pool's 50"
    result = make_result("stall", scenario="s", vllm="0.19.1", steps=28,
                         stall={"step": 28, "since": 9, "unfinished": ["huge"],
                                "waiting": ["huge"], "running": [], "free_blocks": 49,
                                "message": msg})
    sc = make_scenario(expect={"outcome": "stall"}, vllm={"reproduces_on": ["0.19.1"]})
    item = RunItem(sc, "0.19.1", result=result)
    item.verdict = judge(sc, "0.19.1", result)
    print_results([item], as_json=False, sched_log=False)
    out = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert f"stall: s on 0.19.1 @28: {msg}" in out, out
    run = write_run(tmp_path, trace_lines()[:2], {})
    lines = list(sched_log_lines(run / "trace.jsonl", result.stall))
    assert lines[-1] == f"[SCHED] STALL at step 28, no progress since step 9: {msg}"
