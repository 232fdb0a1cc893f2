"""Each audit code fires at the step where a fault is planted into a real vLLM release, naming
the request and block the fault broke (issue #3).

The faults are patched into the release inside the engine worker by ``plant_faults.py`` (a
test-only plug-in, see ``vllm_repro.audit.plant``); each plant notes the step, request and
blocks it broke, and the test compares those with the audit's violation record. Releases:
``VLLM_REPRO_AUDIT_RELEASES`` (comma-separated), default 0.8.5, 0.10.1.1, 0.11.0 and 0.33.0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_repro.engine.host import Worker
from vllm_repro.records import RunResult, Violation
from vllm_repro.sources.prepare import prepare_release
from vllm_repro.scenario.schema import Scenario
from vllm_repro.verdict import judge

pytestmark = pytest.mark.slow

PLANTS = Path(__file__).resolve().parent / "plant_faults.py"
RELEASES = [v for v in os.environ.get("VLLM_REPRO_AUDIT_RELEASES",
                                      "0.8.5,0.10.1.1,0.11.0,0.33.0").split(",") if v]


def scenario(name: str, prefix_caching: bool = False, **limits) -> Scenario:
    """Three requests on a 32-block pool: A and B prefill at step 1 and decode; C's 200-token
    prompt arrives at step 2 and is prefilled in 64-token chunks."""
    shared = {"prefix": "p", "prefix_len": 32} if prefix_caching else {}
    return Scenario.model_validate({
        "name": name,
        "config": {"block_size": 16, "num_gpu_blocks": 32, "max_num_seqs": 4,
                   "max_num_batched_tokens": 64, "max_model_len": 512,
                   "enable_prefix_caching": prefix_caching, "policy": "fcfs"},
        "requests": [
            {"id": "A", "at_step": 1, "prompt_len": 40, "max_tokens": 6, **shared},
            {"id": "B", "at_step": 1, "prompt_len": 20, "max_tokens": 10},
            {"id": "C", "at_step": 2, "prompt_len": 200, "max_tokens": 4, **shared},
        ],
        "limits": {"max_steps": 60, **limits},
    })


@pytest.fixture(scope="module", params=RELEASES)
def worker(request, tmp_path_factory):
    version = request.param
    env = prepare_release(version)
    with Worker(env, tmp_path_factory.mktemp("engine") / f"{version}.log") as w:
        yield w


def run(worker, tmp_path, plant: str | None, sc: Scenario, keep_going=False, audit=True,
        **args) -> RunResult:
    out = tmp_path / sc.name
    res = worker.run(sc.child_payload(), out, audit=audit, keep_going=keep_going,
                     plant=f"{PLANTS}:{plant}" if plant else None, plant_args=args)
    assert res.outcome != "error", res.error
    # the worker writes the trace only; result.json is the host's (ReportDir), once
    assert (out / "trace.jsonl").is_file() and not (out / "result.json").exists()
    return res


def first(res: RunResult) -> Violation:
    assert res.outcome == "violation", (res.outcome, res.crash, res.stall)
    assert res.violations, res
    return res.violations[0]


def test_unplanted_scenarios_are_clean(worker, tmp_path):
    for sc in (scenario("plain"), scenario("plain-cached", prefix_caching=True)):
        res = run(worker, tmp_path, None, sc)
        # clean, or (0.8.x) only its real leak of cached request data (KNOWN_RESIDUE, below)
        assert res.outcome == "clean" or real_findings(res) == [], res.violations
        assert sorted(res.finished) == ["A", "B", "C"]
        assert res.audit.checks >= 2 * res.steps
        assert res.audit.hook_calls.get("free_blocks", 0) >= 3  # A, B, C freed


def test_double_free_is_caught_inside_the_free_with_the_callers_stack(worker, tmp_path):
    res = run(worker, tmp_path, "double_free", scenario("double-free"))
    v, planted = first(res), res.planted["notes"]
    assert v.code == "KV_DOUBLE_FREE"
    assert v.step == planted["step"]
    assert v.phase == "in update_from_output"  # A finishes there; caught inside that call
    assert "A" in v.requests
    assert v.blocks and set(v.blocks) <= set(planted["blocks"])
    assert "ref_cnt is 0" in v.message and "for A" in v.message
    stack = "\n".join(v.stack)
    assert "plant_faults.py" in stack and " in free" in stack  # the caller that freed again
    assert "vllm/v1/core/sched/scheduler.py" in stack and "update_from_output" in stack
    # stopped at once: the trace ends at that step, whose line carries the violation
    trace = [json.loads(x) for x in (tmp_path / "double-free" / "trace.jsonl").read_text().splitlines()]
    assert trace[-1]["step"] == planted["step"]
    assert trace[-1]["violations"][0]["code"] == "KV_DOUBLE_FREE"


def test_double_free_keep_going_collects_the_aftermath(worker, tmp_path):
    res = run(worker, tmp_path, "double_free", scenario("double-free-kg"), keep_going=True)
    planted = res.planted["notes"]
    codes = {(v.code, v.step) for v in res.violations}
    assert ("KV_DOUBLE_FREE", planted["step"]) in codes
    # the free went through: the pool's books now disagree at the end of that step
    below = [v for v in res.violations if v.code == "KV_REFCOUNT" and "below 0" in v.message]
    assert below and below[0].step == planted["step"]
    assert set(below[0].blocks) <= set(planted["blocks"])
    assert res.audit.keep_going is True and res.audit.stopped is None
    # the same run cut at max_steps, one step after the plant: a violation that did not finish,
    # and result.json says the limit was reached (it said false for any outcome but incomplete)
    short = run(worker, tmp_path, "double_free",
                scenario("double-free-kg-short", max_steps=planted["step"] + 1), keep_going=True)
    assert short.outcome == "violation" and short.unfinished, (short.outcome, short.unfinished)
    assert short.limit_reached is True


def test_without_the_audit_vllm_does_not_notice_at_the_planted_step(worker, tmp_path):
    res = run(worker, tmp_path, "double_free", scenario("double-free-off"), audit=False)
    planted = res.planted["notes"]
    assert res.violations is None
    assert res.outcome != "crash" or res.crash.step > planted["step"]


def test_extra_reference_is_a_refcount_violation(worker, tmp_path):
    res = run(worker, tmp_path, "extra_ref", scenario("extra-ref"), at_step=3)
    v, planted = first(res), res.planted["notes"]
    assert (v.code, v.step, v.phase) == ("KV_REFCOUNT", 3, "after schedule")
    assert v.blocks == planted["blocks"] and v.requests == ["A"]
    assert v.message == f"block {planted['blocks'][0]} ref_cnt 2 but held by A (expected 1)"


def test_block_dropped_from_the_free_queue(worker, tmp_path):
    res = run(worker, tmp_path, "drop_from_free_queue", scenario("drop-free"), at_step=3)
    v, planted = first(res), res.planted["notes"]
    assert (v.code, v.step) == ("KV_FREE_QUEUE", 3)
    lost = [x for x in res.violations if x.blocks == planted["blocks"]]
    assert lost and "ref_cnt 0 but is not in the free queue" in lost[0].message


def test_blocks_kept_by_a_finished_request_are_a_leak(worker, tmp_path):
    res = run(worker, tmp_path, "keep_blocks_of", scenario("leak"), request="B")
    v, planted = first(res), res.planted["notes"]
    assert (v.code, v.step, v.requests) == ("KV_LEAK", planted["step"], ["B"])
    assert v.blocks == planted["blocks"]
    assert "B is gone from the scheduler (FINISHED_LENGTH_CAPPED)" in v.message


def test_cached_block_without_its_hash_breaks_the_prefix_map(worker, tmp_path):
    res = run(worker, tmp_path, "unhash_cached_block", scenario("unhash", prefix_caching=True),
              at_step=3)
    v, planted = first(res), res.planted["notes"]
    assert (v.code, v.step, v.blocks) == ("KV_PREFIX_MAP", 3, planted["blocks"])
    assert "under a hash it does not carry (the block has no hash" in v.message


def test_request_in_two_queues(worker, tmp_path):
    res = run(worker, tmp_path, "two_queues", scenario("two-queues"), at_step=3)
    v = first(res)
    assert (v.code, v.step, v.requests) == ("REQ_STATE", 3, ["A"])
    assert v.message.startswith("A is in running and waiting")


def test_token_budget_overrun(worker, tmp_path):
    res = run(worker, tmp_path, "lift_token_budget", scenario("budget"), at_step=3)
    v = first(res)
    assert (v.code, v.step) == ("BATCH_LIMIT", 3)
    assert "C" in v.requests
    assert v.message.endswith("over max_num_batched_tokens 64")


def test_no_progress_names_the_first_step_without_progress(worker, tmp_path):
    res = run(worker, tmp_path, "refuse_allocations", scenario("refuse", stall_steps=5),
              from_step=3)
    planted = res.planted["notes"]
    assert res.outcome == "stall"
    [v] = [x for x in res.violations if x.code == "NO_PROGRESS"]
    assert v.step == planted["step"] == 3
    assert res.stall.since == v.step
    assert "for 5 steps (steps 3-7)" in v.message


def test_a_planted_run_is_never_a_verdict(worker, tmp_path):
    sc = scenario("planted-verdict")
    sc.vllm.clean_on = [worker.hello["vllm"]]
    res = run(worker, tmp_path, "two_queues", sc, at_step=3)
    verdict = judge(sc, worker.hello["vllm"], res)
    assert verdict.ok is False and "planted" in verdict.reason


# ---- issue 14: the audit sees more ------------------------------------------------------------

#: a real leak the residue check finds unplanted: 0.8.x's update_from_output hands a finished
#: request's CachedRequestData back to ``Scheduler._cached_reqs_data`` (a defaultdict) after
#: ``_free_request`` popped it (vLLM PR #17567, fixed after 0.8.5)
KNOWN_RESIDUE = "Scheduler._cached_reqs_data (dict"


def real_findings(res: RunResult) -> list[Violation]:
    """The run's violations less the known 0.8.x leak above."""
    return [v for v in res.violations or () if not (
        v.code == "REQ_RESIDUE" and v.message.count(" (dict") + v.message.count(" (set") == 1
        and KNOWN_RESIDUE in v.message)]


def test_unplanted_scenarios_have_no_residue_starvation_or_overflow(worker, tmp_path):
    """The new checks stay quiet on the plain runs (keep going: every finding would show),
    except for the real leak of 0.8.x (KNOWN_RESIDUE), which the residue check finds."""
    for sc in (scenario("plain-kg"), scenario("plain-cached-kg", prefix_caching=True)):
        res = run(worker, tmp_path, None, sc, keep_going=True)
        assert real_findings(res) == [], res.violations
        if res.violations:  # only the known leak: A and C finished before B's last step
            assert worker.hello["vllm"].startswith("0.8.")
            assert sorted(r for v in res.violations for r in v.requests) == ["A", "C"]
        else:
            assert res.outcome == "clean"


def test_a_key_left_behind_by_a_finished_request_is_residue(worker, tmp_path):
    res = run(worker, tmp_path, "residue_entry", scenario("residue"), request="A")
    planted = res.planted["notes"]
    assert res.outcome == "violation", (res.outcome, res.violations)
    [v] = real_findings(res)  # nothing else is wrong: no block is held, only the key stays
    assert (v.code, v.step, v.phase, v.requests) == ("REQ_RESIDUE", planted["step"], "end of run",
                                                     ["A"])
    assert f"A left the scheduler at step {planted['step']}" in v.message
    assert ".req_to_blocks (dict, value [])" in v.message


def test_a_running_request_skipped_with_room_to_spare_is_starved(worker, tmp_path):
    res = run(worker, tmp_path, "starve", scenario("starve"), at_step=7, request="B")
    v, planted = first(res), res.planted["notes"]
    assert (v.code, v.step, v.phase, v.requests) == ("REQ_STARVED", 7, "after schedule", ["B"])
    assert planted["step"] == 7
    assert "B is running with 1 token(s) pending" in v.message and "of 64 tokens" in v.message


def test_a_preemption_missing_from_the_report_is_unreported(worker, tmp_path):
    res = run(worker, tmp_path, "preempt_unreported", scenario("preempt-unreported"), at_step=7)
    planted = res.planted["notes"]
    assert planted["preempted"], planted  # vLLM preempted somebody at the refused allocation
    if not planted["has_report"]:
        # the release's SchedulerOutput has no preempted_req_ids: nothing to compare
        assert real_findings(res) == [], res.violations
        return
    v = first(res)
    assert (v.code, v.step, v.requests) == ("PREEMPT_UNREPORTED", 7, planted["preempted"])
    assert "preempted in this step's schedule() but is not in its" in v.message


def test_a_reported_preemption_is_clean(worker, tmp_path):
    res = run(worker, tmp_path, "preempt_unreported", scenario("preempt-reported"), at_step=7,
              report=True, keep_going=True)
    planted = res.planted["notes"]
    assert planted["preempted"]
    if planted["has_report"]:
        assert set(planted["preempted"]) <= set(planted["reported"])
    assert real_findings(res) == [], res.violations


def test_more_requests_than_the_workers_slots_overflow_its_batch(worker, tmp_path):
    data = scenario("overflow").model_dump(exclude_none=True)
    # six short prompts at step 1 (48 tokens: within the 64-token budget), four slots
    data["requests"] = [{"id": rid, "at_step": 1, "prompt_len": 8, "max_tokens": 3}
                        for rid in "ABCDEF"]
    sc = Scenario.model_validate(data)
    res = run(worker, tmp_path, "lift_seq_limit", sc, keep_going=True, at_step=1)
    over = [x for x in res.violations if x.code == "WORKER_BATCH_OVERFLOW"]
    assert over, res.violations
    assert {x.step for x in over} == {1}
    # six requests scheduled at step 1 on four slots: the last two found none
    assert sorted(r for x in over for r in x.requests) == ["E", "F"]
    assert "has no slot for E: 4 of its 4 slots" in over[0].message
    # the scheduler's own books show it too
    assert any(x.code == "BATCH_LIMIT" and x.step == 1 for x in res.violations)


def test_computed_tokens_past_max_model_len(worker, tmp_path):
    res = run(worker, tmp_path, "overrun_max_len", scenario("max-len"), at_step=7, request="B")
    v, planted = first(res), res.planted["notes"]
    assert (v.code, v.step, v.phase, v.requests) == ("REQ_OVER_MAX_LEN", 7, "after schedule", ["B"])
    assert v.message.startswith(f"B num_computed_tokens {planted['value']} is over max_model_len 512")


@pytest.mark.parametrize("plant,code,args", [
    ("starve", "REQ_STARVED", {"at_step": 7, "request": "B"}),
    ("preempt_unreported", "PREEMPT_UNREPORTED", {"at_step": 7}),
    ("lift_seq_limit", "WORKER_BATCH_OVERFLOW", {"at_step": 1}),
    ("residue_entry", "REQ_RESIDUE", {"request": "A"}),
])
def test_the_new_codes_fire_at_engine_core_level(worker, tmp_path, plant, code, args):
    """Through the release's own EngineCore: the scheduler's schedule() is already observed
    (wrapped on the instance) by the engine-core loop, and the fake runner runs inside vLLM's
    executor; the codes fire at the same steps."""
    data = scenario(f"ec-{plant}").model_dump(exclude_none=True)
    data["level"] = "engine-core"
    # vLLM's start-up check wants room for one max_model_len request besides the null block
    data["config"]["num_gpu_blocks"] = 33
    if plant == "lift_seq_limit":
        data["requests"] = [{"id": rid, "at_step": 1, "prompt_len": 8, "max_tokens": 3}
                            for rid in "ABCDEF"]
    sc = Scenario.model_validate(data)
    out = tmp_path / sc.name
    res = worker.run(sc.child_payload(), out, audit=True, keep_going=True,
                     plant=f"{PLANTS}:{plant}", plant_args=args)
    if res.outcome == "error" and res.error.kind == "input":
        pytest.skip(f"{worker.hello['vllm']} refuses level engine-core: {res.error.message}")
    assert res.outcome != "error", res.error
    # vLLM's own assert on its running queue (len(running) <= max_num_running_reqs) may end an
    # over-admitted run at a later step, once the planted limit is back
    assert res.outcome != "crash" or (plant == "lift_seq_limit" and res.crash.step > 1), res.crash
    planted = res.planted["notes"]
    if plant == "preempt_unreported" and not planted["has_report"]:
        assert real_findings(res) == [], res.violations
        return
    found = [v for v in real_findings(res) if v.code == code]
    assert found and found[0].step == args.get("at_step", planted["step"]), res.violations
    want = {"starve": ["B"], "preempt_unreported": planted.get("preempted"),
            "lift_seq_limit": ["E", "F"], "residue_entry": ["A"]}[plant]
    assert sorted(r for v in found for r in v.requests) == want


def test_a_scheduled_count_of_zero(worker, tmp_path):
    """Every scheduled count is > 0: BATCH_LIMIT already says so (issue 14 extends it to draft
    counts rather than adding a code)."""
    res = run(worker, tmp_path, "zero_count", scenario("zero-count"), at_step=3, request="A")
    v = first(res)
    assert (v.code, v.step, v.phase, v.requests) == ("BATCH_LIMIT", 3, "after schedule", ["A"])
    assert v.message == "A is scheduled with 0 tokens (expected > 0)"


def test_the_releases_own_block_table_refuses_a_row_past_its_width(worker, tmp_path):
    """Issue #45: the worker-side state is the release's own ``InputBatch`` (on the V2 runner its
    ``BlockTables``), so new block ids past a row of its ``MultiGroupBlockTable`` fail in
    vLLM's ``append_row`` (``append_block_ids``) at that step (a
    crash with vLLM's frame), where the scheduler's books alone show nothing. Releases whose
    ``SchedulerOutput`` lists one ``CachedRequestData`` per request keep the lab's
    ``PersistentBatch`` (the plant finds no batched ``req_ids`` there and does nothing)."""
    res = run(worker, tmp_path, "block_row_overrun", scenario("row-overrun"), keep_going=True,
              at_step=4, request="A")
    planted = res.planted["notes"]
    if "step" not in planted:
        assert res.outcome != "crash", res.crash
        pytest.skip(f"{worker.hello['vllm']}: no batched scheduled_cached_reqs to plant into")
    assert res.outcome == "crash", (res.outcome, res.violations)
    assert res.crash.step == 4, res.crash
    # V1's MultiGroupBlockTable.append_row, or (0.34 on) the V2 runner's
    # BlockTables.append_block_ids ("exceeds row capacity")
    assert res.crash.where is not None and res.crash.where.file.endswith(
        ("v1/worker/block_table.py", "v1/worker/gpu/block_table.py")), res.crash
    assert res.crash.phase == "execute_model", res.crash
