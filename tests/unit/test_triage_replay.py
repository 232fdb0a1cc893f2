"""The replay's comparison table (no release): the dump's batch beside the replay's step."""

from __future__ import annotations

from vllm_repro.triage.analyze import TriageReport
from vllm_repro.triage.dump import DumpedRequest, SchedulerOutputDump
from vllm_repro.triage.replay import compare

from .builders import make_result, make_trace


def report(exc="AssertionError", frame=("vllm/v1/core/sched/scheduler.py", "schedule")):
    return TriageReport("x.log", exc, "", {"module": frame[0], "function": frame[1], "line": 1},
                        "runtime", "python_exception", "0.10.1.1", None)


def dump():
    return SchedulerOutputDump(requests=[DumpedRequest("L", False, 32, 1), DumpedRequest("H", True, 0, 32)],
                               total_num_scheduled_tokens=33)


def rows_of(rows):
    return {r.field: (r.dumped, r.replayed, r.agree) for r in rows}


def test_a_replay_that_crashes_where_the_log_did_is_compared_at_the_crash():
    res = make_result("crash", crash={"type": "AssertionError", "step": 3, "phase": "schedule",
                                      "where": {"file": "vllm/v1/core/sched/scheduler.py",
                                                "function": "schedule"}},
                      engine={"num_gpu_blocks": 5})
    trace = make_trace({"step": 1, "added": ["L"], "scheduled": {"L": 32}, "running": ["L"],
                        "waiting": [], "free_blocks": 2},
                       {"step": 3, "added": ["H"], "scheduled": {"L": 1, "H": 32}, "running": ["L", "H"],
                        "waiting": [], "free_blocks": 0, "crash": {"type": "AssertionError"}})
    got = rows_of(compare(report(), dump(), {"running": 2, "waiting": 0, "kv_cache_usage_pct": 100.0},
                          res, trace))
    assert got["step compared"][1] == "3 (the crash)"
    assert got["exception"] == ("AssertionError", "AssertionError", True)
    assert got["innermost vLLM frame"][2] is True
    assert got["requests in the batch"] == (2, 2, True)
    assert got["new requests in the batch"] == (1, 1, True)
    assert got["total_num_scheduled_tokens"] == (33, 33, True)
    assert got["running"] == (2, 2, True) and got["waiting"] == (0, 0, True)
    assert got["KV cache usage %"] == (100.0, 100.0, True)  # 0 of 4 usable blocks free


def test_a_clean_replay_is_compared_at_its_fullest_batch_and_says_it_differs():
    res = make_result("clean", steps=9)
    trace = make_trace({"step": 1, "scheduled": {"L": 32}}, {"step": 2, "scheduled": {"L": 1, "H": 32}},
                       {"step": 9, "scheduled": {"H": 1}})
    got = rows_of(compare(report(), dump(), None, res, trace))
    assert got["step compared"][1] == "2 (the fullest batch)"
    assert got["exception"] == ("AssertionError", "clean", False)
    assert got["innermost vLLM frame"][1] is None and got["innermost vLLM frame"][2] is None
    assert got["total_num_scheduled_tokens"] == (33, 33, True)
    assert "running" not in got  # no stats dumped: nothing to compare
