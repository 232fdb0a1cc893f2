"""No process outlives its run (issue 47): a patched ``schedule()`` starts a ``sleep`` in a new
session and a double-forked one; once the worker is closed, warm or cold, neither is alive."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from vllm_repro.engine.host import Worker
from vllm_repro.scenario.schema import Scenario
from vllm_repro.sources.prepare import prepare_release

PLANT = Path(__file__).resolve().parent / "plant_detached.py"
RELEASE = os.environ.get("VLLM_REPRO_LEFTOVER_RELEASE", "0.10.1.1")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_detached_sleep_started_by_schedule_is_gone_after_the_run(tmp_path, warm):
    env = prepare_release(RELEASE)
    sc = Scenario.model_validate({
        "name": "leftover", "config": {"num_gpu_blocks": 16},
        "requests": [{"id": "A", "at_step": 1, "prompt_len": 10, "max_tokens": 2}]})
    pidfile = tmp_path / "pids"
    with Worker(env, tmp_path / "engine.log", warm=warm) as worker:
        res = worker.run(sc.child_payload(), tmp_path / "out", plant=f"{PLANT}:detached_sleep",
                         plant_args={"pidfile": str(pidfile)})
        assert res.outcome != "error", res.error
        pids = [int(p) for p in pidfile.read_text().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids), "the plant started nothing"
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:  # (not to leave them to the machine when the test fails)
        os.kill(p, 9)
    assert not left, f"still alive after the run: {left}"
