"""N GPUs on a CPU (issue 44): the emulated platform reports the devices a topology asks for, the
batch queue deepens with pipeline_parallel_size through vLLM's own config, and the release's own
MultiprocExecutor runs its rank processes with the lab's fake worker, faults injected into them.
Through the CLI, as a user runs it."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from ..conftest import ROOT, SHARED
from .test_engine_core import at_engine_core

pytestmark = pytest.mark.slow

STRESS = ROOT / "scenarios" / "stress"


def trace(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("versions", [("0.26.0", "0.33.0", "0.34.0")])
def test_pipeline_parallel_3_keeps_three_batches_in_flight_clean_on_the_stress_workload(
        cli, tmp_path, versions):
    f = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, pipeline_parallel_size=3,
                       max_concurrent_batches=3)
    args = [str(f)]
    for v in versions:
        args += ["--vllm", v]
    proc = cli("run", *args, "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = yaml.safe_load(f.read_text())["name"]
    for v in versions:
        run = tmp_path / "r" / name / v
        res = json.loads((run / "result.json").read_text())
        assert res["outcome"] == "clean", (v, res["outcome"], res.get("violations"))
        assert res["audit"]["checks"] > 0
        assert res["engine"]["batch_queue_size"] == 3
        assert res["engine"]["step_fn"] == "step_with_batch_queue"
        lines = trace(run / "trace.jsonl")
        assert max(line.get("in_flight") or 0 for line in lines) == 3
        # a batch is applied two steps after the step that scheduled it, once the pipe is full
        lags = {line["step"] - s for line in lines for s in line.get("applied_from") or ()}
        assert 2 in lags, sorted(lags)


def test_a_batch_queue_depth_vllms_config_does_not_give_is_refused_naming_the_fix(cli, tmp_path):
    f = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, max_concurrent_batches=4)
    proc = cli("run", str(f), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config.max_concurrent_batches" in proc.stdout + proc.stderr
    assert "pipeline_parallel_size: 4" in proc.stdout + proc.stderr


def test_data_parallelism_at_engine_core_level_is_refused_naming_what_runs(cli, tmp_path):
    f = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, data_parallel_size=2)
    proc = cli("run", str(f), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config.data_parallel_size: 2" in proc.stdout + proc.stderr
    assert "DPEngineCoreProc" in proc.stdout + proc.stderr


def test_a_world_over_the_lab_bound_is_an_input_error(cli, tmp_path):
    f = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, tensor_parallel_size=4,
                       pipeline_parallel_size=4)
    proc = cli("run", str(f), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "16 ranks" in proc.stdout + proc.stderr


TOPOLOGY = ROOT / "scenarios" / "topology"


def lab_processes() -> set[int]:
    """Live processes of this checkout's lab runs (their PYTHONPATH holds this checkout's lab
    link, engine/host.py lab_path), and vLLM's own titled processes (ranks, engine cores).
    Warm parents (docs/warm-runs.md: long-lived by design, registered in their parent.json) are
    not a run's processes."""
    from vllm_repro.engine.host import lab_path
    from vllm_repro.settings import cache_dir

    mark = str(lab_path()).encode()
    parents = set()
    for info in (cache_dir() / "warm").glob("*/parent.json"):
        try:
            parents.add(json.loads(info.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            pass
    found = set()
    for d in __import__("pathlib").Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if mark in env and int(d.name) not in parents:
            found.add(int(d.name))
        else:
            # vLLM titles its own processes (setproctitle: "VLLM::Worker", "VLLM::EngineCore"),
            # which overwrites what /proc shows of their environment: found by the title, an
            # orphan (its parent gone) included; only the lab starts vLLM on a test machine
            try:
                if (d / "cmdline").read_bytes().startswith(b"VLLM::"):
                    found.add(int(d.name))
            except OSError:
                pass
    return found


def test_tensor_parallel_2_runs_two_rank_processes_with_the_in_process_trace_and_leaves_none(
        cli, tmp_path):
    """TP=2 under the release's MultiprocExecutor gives step for step the trace of the
    in-process executor (same tokens, same scheduling), and no rank outlives the run."""
    before = lab_processes()
    plain = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path)
    tp2 = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, tensor_parallel_size=2,
                         distributed_executor_backend="mp")
    proc = cli("run", str(plain), str(tp2), "--vllm", "0.33.0", "--cold",
               "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [tmp_path / "r" / yaml.safe_load(f.read_text())["name"] / "0.33.0" for f in (plain, tp2)]
    res = json.loads((runs[1] / "result.json").read_text())
    assert res["outcome"] == "clean"
    assert res["engine"]["executor"] == "MultiprocExecutor"
    assert res["engine"]["topology"].startswith("TP=2")
    assert trace(runs[0] / "trace.jsonl") == trace(runs[1] / "trace.jsonl")
    assert "Parent process exited, terminating worker queues" in (runs[1] / "engine.log").read_text()
    assert lab_processes() - before == set()


@pytest.mark.parametrize("version,function", [("0.10.2", "collective_rpc"),
                                              ("0.33.0", "get_response")])
def test_a_hung_rank_replays_crash_log_009_and_triage_reads_it_back(cli, tmp_path, version,
                                                                     function):
    before = lab_processes()
    f = TOPOLOGY / "tp2-rank-hang-rpc-timeout.yaml"
    proc = cli("run", str(f), "--vllm", version, "--cold", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "r" / "tp2-rank-hang-rpc-timeout" / version
    res = json.loads((run / "result.json").read_text())
    assert res["crash"]["type"] == "TimeoutError"
    assert res["crash"]["message"] == "RPC call to execute_model timed out."
    assert res["faults"] == [{"rank": 1, "kind": "hang", "seconds": 60.0, "execute_model": 5}]
    lines = trace(run / "trace.jsonl")
    assert [x["fault"] for x in lines if x.get("fault")] == [{"rank": 1, "kind": "hang",
                                                             "seconds": 60.0}]
    ours = json.loads(cli("triage", str(run / "engine.log"), "--json").stdout)
    assert ours["exception_type"] == "TimeoutError"
    assert ours["exception_message"] == "RPC call to execute_model timed out."
    assert ours["last_vllm_frame"]["module"] == "vllm/v1/executor/multiproc_executor.py"
    assert ours["last_vllm_frame"]["function"] == function
    assert ours["cause_chain"][0]["type"] == "TimeoutError"
    assert ours["cause_chain"][0]["last_vllm_frame"]["module"] == \
        "vllm/distributed/device_communicators/shm_broadcast.py"
    if version == "0.10.2":  # the release whose collective_rpc raises as 0.9.0's did
        log009 = SHARED / "crashlogs" / "009-v1-rpc-timeout-sched-stats.log"
        if log009.is_file():  # the shared crash logs (VLLM_REPRO_SHARED)
            theirs = json.loads(cli("triage", str(log009), "--json").stdout)
            for key in ("exception_type", "exception_message"):
                assert ours[key] == theirs[key]
            assert (ours["last_vllm_frame"]["module"], ours["last_vllm_frame"]["function"]) == \
                (theirs["last_vllm_frame"]["module"], theirs["last_vllm_frame"]["function"])
    assert lab_processes() - before == set()


def test_a_fault_without_rank_processes_is_refused_naming_the_fix(cli, tmp_path):
    d = yaml.safe_load((TOPOLOGY / "tp2-rank-hang-rpc-timeout.yaml").read_text())
    del d["config"]["distributed_executor_backend"]
    f = tmp_path / "x.yaml"
    f.write_text(yaml.safe_dump(d))
    proc = cli("run", str(f), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "distributed_executor_backend: mp" in proc.stdout + proc.stderr


def _long_rank_hang(tmp_path):
    """The TP=2 rank-hang scenario with the hang and the RPC timeout 300 s away: a run that
    stays in its step until it is stopped."""
    d = yaml.safe_load((TOPOLOGY / "tp2-rank-hang-rpc-timeout.yaml").read_text())
    d["config"]["execute_model_timeout_seconds"] = 300
    d["events"][0]["fault"]["seconds"] = 300
    f = tmp_path / "hang.yaml"
    f.write_text(yaml.safe_dump(d))
    return f


def test_an_interrupt_while_a_rank_hangs_leaves_no_rank_process(tmp_path):
    """SIGINT to ``vllm-repro run`` while rank 1 hangs and rank 0 waits for it (the RPC timeout
    far away): exit 130, and neither the engine worker nor any rank survives."""
    import os
    import signal
    import subprocess
    import sys
    import time

    f = _long_rank_hang(tmp_path)
    before = lab_processes()
    proc = subprocess.Popen([sys.executable, "-m", "vllm_repro.cli", "run", str(f), "--vllm",
                             "0.33.0", "--cold", "--reports", str(tmp_path / "r")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ), cwd=ROOT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # the engine worker and its two ranks are up
        if len(lab_processes() - before) >= 3:
            break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the ranks never started")
    time.sleep(8)  # step 5 comes within a second: rank 1 hangs, rank 0 waits for it
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    time.sleep(1)
    assert lab_processes() - before == set()


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_a_cli_killed_with_sigkill_leaves_no_worker_or_rank_behind(tmp_path, start):
    """SIGKILL (no handler runs) to ``vllm-repro run`` while rank 1 hangs: warm, the parent
    sees the client's connection close and kills the forked worker's process group; cold, the
    worker sees its starter gone and kills its own group. Neither the worker nor a rank is left
    (they used to run on, re-parented, until the hang ended)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    f = _long_rank_hang(tmp_path)
    before = lab_processes()
    cold = ["--cold"] if start == "cold" else []
    proc = subprocess.Popen([sys.executable, "-m", "vllm_repro.cli", "run", str(f), "--vllm",
                             "0.33.0", *cold, "--reports", str(tmp_path / "r")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ), cwd=ROOT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # the CLI, the engine worker and its two ranks
        if len(lab_processes() - before) >= 4:
            break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the ranks never started")
    time.sleep(5)
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while lab_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert lab_processes() - before == set()


def _steps_left_out(row: dict) -> str:
    """A clean run's observation without its step count. Where a release's
    ``EngineCore.step_with_batch_queue`` waits on a batch whose Future is already done (up to
    0.22.0), the in-process fake executor never leaves a batch in flight, and the release's
    ``MultiprocExecutor`` does: an async-scheduling run then takes other steps to the same end
    (vllm-49097 on 0.10.2: 10 in-process, 13 at TP=2). A crash's or violation's step stays."""
    if row["outcome"] == "clean":
        return re.sub(r", \d+ steps\)$", ")", row["observed"])
    return row["observed"]


@pytest.mark.parametrize("versions", [("0.10.2", "0.33.0")])
def test_the_engine_core_catalog_gives_the_same_verdicts_at_tensor_parallel_2(cli, tmp_path,
                                                                              versions):
    """Every engine-core catalog entry, as written and with tensor_parallel_size: 2 under the
    release's MultiprocExecutor: the same outcome, observation and verdict on each release."""
    entries = [f for f in sorted((ROOT / "scenarios").glob("vllm-*.yaml"))
               if yaml.safe_load(f.read_text()).get("level") == "engine-core"]
    assert len(entries) >= 8
    tp2 = []
    for f in entries:
        d = yaml.safe_load(f.read_text())
        d["config"].update(tensor_parallel_size=2, distributed_executor_backend="mp")
        (tmp_path / "tp2").mkdir(exist_ok=True)
        tp2.append(tmp_path / "tp2" / f.name)
        tp2[-1].write_text(yaml.safe_dump(d, sort_keys=False))
    vs = [a for v in versions for a in ("--vllm", v)]
    before = lab_processes()
    tables = []
    for files, reports in ((entries, "plain"), (tp2, "tp2")):
        proc = cli("run", *map(str, files), *vs, "--json", "--reports", str(tmp_path / reports))
        tables.append({(r["scenario"], r["vllm"]): (r["outcome"], _steps_left_out(r), r["ok"])
                       for r in json.loads(proc.stdout)})
    assert tables[0] == tables[1]
    ran = [json.loads(p.read_text()).get("engine") or {}
           for p in (tmp_path / "tp2").glob("*/*/result.json")]
    assert sum(e.get("executor") == "MultiprocExecutor" for e in ran) >= len(entries)
    # start-up crashes (#35541) included: vLLM's shutdown never ran there, the lab reaps them
    assert lab_processes() - before == set()


@pytest.mark.parametrize("config", [
    {"pipeline_parallel_size": 3},
    {"tensor_parallel_size": 2, "async_scheduling": True},
], ids=["PP=3", "TP=2-async"])
def test_rank_processes_give_the_in_process_trace_with_a_batch_queue(cli, tmp_path, config):
    """The batch queue (PP=3: three batches in flight; async scheduling: two) over the
    release's MultiprocExecutor and its futures: the trace of the in-process executor."""
    plain = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, **config)
    mp = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, **config,
                        distributed_executor_backend="mp")
    proc = cli("run", str(plain), str(mp), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [tmp_path / "r" / yaml.safe_load(f.read_text())["name"] / "0.33.0" for f in (plain, mp)]
    res = [json.loads((r / "result.json").read_text()) for r in runs]
    assert res[1]["engine"]["executor"] == "MultiprocExecutor"
    assert res[0]["engine"]["batch_queue_size"] == res[1]["engine"]["batch_queue_size"] > 1
    assert trace(runs[0] / "trace.jsonl") == trace(runs[1] / "trace.jsonl")


@pytest.mark.parametrize("fault, outcome, exception, message", [
    ({"rank": 0, "kind": "raise", "on_execute_model": 4}, "crash", "RuntimeError",
     "Worker failed with error 'vllm-repro fault: rank 0 raised"),
    ({"rank": 1, "kind": "raise"}, "crash", "TimeoutError", "RPC call to execute_model timed out"),
    ({"rank": 1, "kind": "exit", "exit_code": 3}, "crash", "TimeoutError",
     "RPC call to execute_model timed out"),
    ({"rank": 1, "kind": "late", "seconds": 1}, "clean", None, None),
], ids=["raise-output-rank", "raise-rank-1", "exit", "late"])
def test_each_fault_kind_takes_vllms_own_path(cli, tmp_path, fault, outcome, exception, message):
    """The output rank raising answers vLLM with a failure (``collective_rpc``'s "Worker failed
    with error ..."); rank 1 raising or exiting leaves the output rank waiting at the forward
    pass's collective, and vLLM's RPC timeout ends the engine (its WorkerProc logs the raise,
    its worker monitor the exit); an answer late by less than the timeout is only late."""
    before = lab_processes()
    d = yaml.safe_load((TOPOLOGY / "tp2-rank-hang-rpc-timeout.yaml").read_text())
    d["name"] = f"fault-{fault['kind']}"
    d["events"] = [{"at_step": 3, "fault": fault}]
    d["expect"] = {"outcome": outcome, "fault": fault["kind"]}
    if outcome == "crash":
        d["expect"].update(exception=exception, message=message)
    f = tmp_path / "f.yaml"
    f.write_text(yaml.safe_dump(d))
    proc = cli("run", str(f), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "r" / d["name"] / "0.33.0"
    res = json.loads((run / "result.json").read_text())
    fired = res["faults"][0]
    assert (fired["rank"], fired["kind"]) == (fault["rank"], fault["kind"])
    assert fired["execute_model"] == fault.get("on_execute_model", 3)
    log = (run / "engine.log").read_text()
    if fault["kind"] == "raise":
        assert "WorkerProc hit an exception" in log
        assert f"vllm-repro fault: rank {fault['rank']} raised" in log
    if fault["kind"] == "exit":
        assert "died unexpectedly" in log
    assert lab_processes() - before == set()


def test_a_release_without_the_rpc_timeout_variable_refuses_the_setting(cli, tmp_path):
    """0.9.0's MultiprocExecutor times out after a module constant, not a setting: the lab does
    not patch it, and says so (exit 2) rather than run with a timeout that never applies."""
    proc = cli("run", str(TOPOLOGY / "tp2-rank-hang-rpc-timeout.yaml"), "--vllm", "0.9.0",
               "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "has no VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" in out
    assert "EXECUTE_MODEL_TIMEOUT_S, 300 s" in out
