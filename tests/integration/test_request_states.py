"""Issue #45 on the V2 model runner (0.34.0): the fake worker drives the release's own
``RequestState`` and ``BlockTables`` (``vllm/v1/worker/gpu/``), so the stress workload runs
clean under the audit with them, and the run says which worker-side state ran.

The disagreements they raise from vLLM's own frames (block ids past a row:
``BlockTables.append_block_ids``; more requests than slots: ``RequestState.add_request``'s "No
free indices", the audit's ``WORKER_BATCH_OVERFLOW``) are the plant tests of
``test_audit_plants.py`` with ``VLLM_REPRO_AUDIT_RELEASES=0.34.0``; the last test here runs
the overflow one on 0.34.0 always."""

from __future__ import annotations

import json

import pytest

from ..conftest import SCENARIOS

pytestmark = pytest.mark.slow

RELEASE = "0.34.0"
V2 = "RequestState + BlockTables"


def test_a_stress_workload_runs_clean_on_the_v2_runners_own_state(cli, tmp_path):
    """256 requests with prefix caching, preemption pressure and aborts: every step's
    ``SchedulerOutput`` goes through ``finish_requests`` / ``add_requests`` /
    ``update_requests`` / ``apply_staged_writes`` / ``post_update`` on the release's classes,
    and neither they nor the audit object."""
    path = SCENARIOS / "stress" / "stress-fcfs-cache.yaml"
    proc = cli("run", str(path), "--vllm", RELEASE, "--reports", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / path.stem / RELEASE / "result.json").read_text())
    assert res["outcome"] == "clean", (res.get("violations") or [])[:3] or res.get("crash")
    assert res["worker_state"].startswith(V2), res["worker_state"]
    assert len(res["finished"]) == 256 and not res["unfinished"]
    assert res["audit"]["checks"] >= res["steps"]
    lines = [json.loads(x) for x in
             (tmp_path / path.stem / RELEASE / "trace.jsonl").read_text().splitlines()]
    assert len({rid for ln in lines for rid in ln["preempted"]}) >= 10


def test_the_lab_model_is_still_there_on_request(cli, tmp_path):
    """``VLLM_REPRO_WORKER_STATE=lab`` (``--cold``: a warm parent keeps its environment) runs
    the same release on the lab's ``PersistentBatch``, and the result says so."""
    path = SCENARIOS / "vllm-23347-priority-preempt-scheduled.yaml"
    proc = cli("run", str(path), "--vllm", RELEASE, "--cold", "--reports", str(tmp_path),
               env={"VLLM_REPRO_WORKER_STATE": "lab"})
    res = json.loads((tmp_path / path.stem / RELEASE / "result.json").read_text())
    assert res["worker_state"].startswith("PersistentBatch"), (res, proc.stderr[-2000:])


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from vllm_repro.engine.host import Worker
    from vllm_repro.sources.prepare import prepare_release

    env = prepare_release(RELEASE)
    with Worker(env, tmp_path_factory.mktemp("engine") / f"{RELEASE}.log") as w:
        yield w


def _planted(worker, tmp_path, plant: str, sc, **args):
    from .test_audit_plants import PLANTS

    res = worker.run(sc.child_payload(), tmp_path / sc.name, audit=True, keep_going=True,
                     plant=f"{PLANTS}:{plant}", plant_args=args)
    assert res.outcome != "error", res.error
    assert res.worker_state.startswith(V2), res.worker_state
    return res


def test_more_requests_than_slots_fail_request_states_add_request(worker, tmp_path):
    """The scheduler's ``max_num_seqs`` limit lifted (a plant): six requests at step 1 on
    four slots. ``RequestState.add_request`` finds no free index for the last two (its
    ``assert len(self.free_indices) > 0, "No free indices"``): the audit's
    ``WORKER_BATCH_OVERFLOW`` at step 1, as V1's slot assert, and the run goes on."""
    from vllm_repro.scenario.schema import Scenario

    from .test_audit_plants import scenario

    data = scenario("v2-overflow").model_dump(exclude_none=True)
    data["requests"] = [{"id": rid, "at_step": 1, "prompt_len": 8, "max_tokens": 3}
                        for rid in "ABCDEF"]
    res = _planted(worker, tmp_path, "lift_seq_limit", Scenario.model_validate(data), at_step=1)
    over = [x for x in res.violations if x.code == "WORKER_BATCH_OVERFLOW"]
    assert {x.step for x in over} == {1}, res.violations
    # slots are handed out from the end of RequestState's free list, so which two of the six
    # are left out is the scheduler's order: the last two scheduled
    assert sorted(r for x in over for r in x.requests) == ["E", "F"]
    assert "has no slot for E: 4 of its 4 slots" in over[0].message


def test_block_ids_past_a_row_fail_in_block_tables_append_block_ids(worker, tmp_path):
    """A running request handed more new block ids than a row of the V2 runner's block table
    holds: ``BlockTables.append_block_ids`` raises ("exceeds row capacity") at that step, a
    crash in phase ``execute_model`` with vLLM's frame."""
    from .test_audit_plants import scenario

    res = _planted(worker, tmp_path, "block_row_overrun", scenario("v2-row-overrun"),
                   at_step=4, request="A")
    assert res.outcome == "crash", (res.outcome, res.violations)
    assert (res.crash.step, res.crash.phase) == (4, "execute_model"), res.crash
    assert res.crash.where.file.endswith("v1/worker/gpu/block_table.py"), res.crash
    assert res.crash.where.function == "append_block_ids", res.crash
    assert "exceeds row capacity" in res.crash.message, res.crash
