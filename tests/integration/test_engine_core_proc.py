"""The engine core in its own process (issue 44): ``config.multiprocess_mode: true`` runs the
release's EngineCoreProc started by the release's own client, the scenario's requests and events
sent through it, the audit inside the engine core process. Through the CLI, as a user runs it."""

from __future__ import annotations

import json

import pytest
import yaml

from ..conftest import ROOT, SHARED
from .test_topology import TOPOLOGY, lab_processes, trace

pytestmark = pytest.mark.slow

CLIENT = TOPOLOGY / "engine-core-proc-client.yaml"


def variant(src, dst_dir, name, **config):
    d = yaml.safe_load(src.read_text())
    d["name"] = name
    d["config"].update(config)
    out = dst_dir / f"{name}.yaml"
    out.write_text(yaml.safe_dump(d, sort_keys=False))
    return out


@pytest.mark.parametrize("version", ["0.10.2", "0.34.0"])
def test_the_engine_core_process_behind_the_client_gives_the_in_process_trace(cli, tmp_path,
                                                                              version):
    """Requests, an abort and a reset_prefix_cache through SyncMPClient and through
    AsyncMPClient: the same steps, tokens and audit as the in-process engine core, and no
    process of the run left behind."""
    before = lab_processes()
    plain = variant(CLIENT, tmp_path, "in-process", multiprocess_mode=False)
    asyncio = variant(CLIENT, tmp_path, "asyncio", asyncio_mode=True)
    proc = cli("run", str(CLIENT), str(plain), str(asyncio), "--vllm", version, "--reports",
               str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "r" / "engine-core-proc-client" / version
    res = json.loads((run / "result.json").read_text())
    assert res["outcome"] == "clean"
    assert res["engine"]["process"] == "EngineCoreProc"
    assert res["engine"]["client"] == "SyncMPClient"
    assert res["audit"]["checks"] > 0
    assert res["finished"]["c"] == "FINISHED_ABORTED"
    lines = trace(run / "trace.jsonl")
    assert trace(tmp_path / "r" / "in-process" / version / "trace.jsonl") == lines
    assert trace(tmp_path / "r" / "asyncio" / version / "trace.jsonl") == lines
    res = json.loads((tmp_path / "r" / "asyncio" / version / "result.json").read_text())
    assert (res["outcome"], res["engine"]["client"]) == ("clean", "AsyncMPClient")
    assert all("audit" in line for line in lines if not line.get("idle"))
    assert lab_processes() - before == set()
    # vLLM's shutdown of a clean run leaves no traceback in the engine log: triage finds no crash
    for name in ("engine-core-proc-client", "asyncio"):
        log = tmp_path / "r" / name / version / "engine.log"
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
        assert cli("triage", str(log)).returncode == 2


def test_a_hung_rank_behind_the_client_ends_in_engine_dead_error_and_triage_reads_it_back(
        cli, tmp_path):
    """Crash log 009's shape in the production shape: the engine core process dies of vLLM's
    RPC timeout, the client raises EngineDeadError, and triage of the run's engine log gives
    009's exception and frame."""
    before = lab_processes()
    f = variant(TOPOLOGY / "tp2-rank-hang-rpc-timeout.yaml", tmp_path, "proc-hang",
                multiprocess_mode=True)
    proc = cli("run", str(f), "--vllm", "0.10.2", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "r" / "proc-hang" / "0.10.2"
    res = json.loads((run / "result.json").read_text())
    assert (res["crash"]["type"], res["crash"]["message"]) == \
        ("TimeoutError", "RPC call to execute_model timed out.")
    assert res["engine"]["executor"] == "MultiprocExecutor"
    assert res["engine"]["client_error"].startswith("EngineDeadError: EngineCore encountered")
    log = (run / "engine.log").read_text()
    assert "EngineCore encountered a fatal error." in log
    assert "vllm.v1.engine.exceptions.EngineDeadError" in log
    ours = json.loads(cli("triage", str(run / "engine.log"), "--json").stdout)
    assert ours["exception_type"] == "TimeoutError"
    assert ours["last_vllm_frame"]["function"] == "collective_rpc"
    log009 = SHARED / "crashlogs" / "009-v1-rpc-timeout-sched-stats.log"
    if log009.is_file():
        theirs = json.loads(cli("triage", str(log009), "--json").stdout)
        assert ours["exception_message"] == theirs["exception_message"]
        assert ours["last_vllm_frame"]["module"] == theirs["last_vllm_frame"]["module"]
        # vLLM's own busy loop ran: the stage frame is 009's
        assert ours["stage_reason"] == theirs["stage_reason"]
    assert lab_processes() - before == set()


def test_a_start_up_crash_in_the_engine_core_process_is_the_runs_crash(cli, tmp_path):
    """vLLM's own start-up check raising in the engine core process: a crash at step 0 with
    vLLM's frame, the client's "Engine core initialization failed"."""
    f = variant(CLIENT, tmp_path, "proc-start-up", max_model_len=2048, num_gpu_blocks=8)
    proc = cli("run", str(f), "--vllm", "0.34.0", "--reports", str(tmp_path / "r"))
    res = json.loads((tmp_path / "r" / "proc-start-up" / "0.34.0" / "result.json").read_text())
    assert res["outcome"] == "crash", proc.stdout + proc.stderr
    assert res["crash"]["phase"] == "engine-build"
    assert res["crash"]["type"] == "ValueError"
    assert res["crash"]["where"]["file"].startswith("vllm/v1/core/kv_cache_")  # _utils, _planning
    assert "Engine core initialization failed" in res["engine"]["client_error"]


def test_an_in_flight_abort_with_the_client_is_refused_naming_the_fix(cli, tmp_path):
    d = yaml.safe_load(CLIENT.read_text())
    d["events"][0]["when"] = "in_flight"
    f = tmp_path / "x.yaml"
    f.write_text(yaml.safe_dump(d))
    proc = cli("run", str(f), "--vllm", "0.34.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "when: before_step" in proc.stdout + proc.stderr


def test_an_interrupt_while_the_engine_core_process_waits_on_a_hung_rank_leaves_nothing(
        tmp_path):
    """SIGINT to ``vllm-repro run`` while the engine core process's rank 1 hangs: exit 130, no
    engine worker, engine core process or rank left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    d = yaml.safe_load((TOPOLOGY / "tp2-rank-hang-rpc-timeout.yaml").read_text())
    d["config"].update(execute_model_timeout_seconds=300, multiprocess_mode=True)
    d["events"][0]["fault"]["seconds"] = 300
    f = tmp_path / "hang.yaml"
    f.write_text(yaml.safe_dump(d))
    before = lab_processes()
    proc = subprocess.Popen([sys.executable, "-m", "vllm_repro.cli", "run", str(f), "--vllm",
                             "0.34.0", "--reports", str(tmp_path / "r")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ), cwd=ROOT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # the worker, the engine core process, two ranks
        if len(lab_processes() - before) >= 4:
            break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the engine core process and its ranks never started")
    time.sleep(8)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    time.sleep(1)
    assert lab_processes() - before == set()


def test_a_catalog_crash_through_the_client_keeps_its_verdict(cli, tmp_path):
    """#23215 (an empty grammar kills the engine) with the engine core behind the client: the
    same crash and verdict on the buggy release, the front door's refusal on the fixed one, and
    the client's EngineDeadError."""
    src = ROOT / "scenarios" / "vllm-23215-empty-grammar-kills-engine.yaml"
    d = yaml.safe_load(src.read_text())
    d["config"]["multiprocess_mode"] = True
    f = tmp_path / src.name
    f.write_text(yaml.safe_dump(d, sort_keys=False))
    proc = cli("run", str(f), "--vllm", "0.10.2", "--vllm", "0.33.0", "--json",
               "--reports", str(tmp_path / "r"))
    rows = {r["vllm"]: r for r in json.loads(proc.stdout)}
    assert rows["0.10.2"]["outcome"] == "crash" and rows["0.10.2"]["ok"], rows
    assert rows["0.33.0"]["outcome"] == "clean" and rows["0.33.0"]["ok"], rows
    run = tmp_path / "r" / d["name"]
    res = json.loads((run / "0.10.2" / "result.json").read_text())
    assert res["engine"]["client_error"].startswith("EngineDeadError")
    assert json.loads((run / "0.33.0" / "result.json").read_text())["refused"]


DP2 = TOPOLOGY / "dp2-engine-core-proc.yaml"


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0", "0.34.0"])
def test_data_parallel_2_runs_two_dp_engine_cores_and_the_coordinator_audited_with_throttling(
        cli, tmp_path, version):
    """data_parallel_size 2: the release's DPLBAsyncMPClient starts two DPEngineCoreProcs and
    its DP coordinator; each engine core runs its DP rank's requests under the audit, and with
    prefill_schedule_interval 2 vLLM throttles prefills on every other step: a request added on
    a throttled step waits for the next. No engine core or coordinator is left."""
    before = lab_processes()
    proc = cli("run", str(DP2), "--vllm", version, "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "r" / "dp2-engine-core-proc" / version
    res = json.loads((run / "result.json").read_text())
    assert res["outcome"] == "clean"
    eng = res["engine"]
    assert (eng["process"], eng["client"], eng["engine_cores"], eng["coordinator"]) == \
        ("DPEngineCoreProc", "DPLBAsyncMPClient", 2, True)
    assert set(res["finished"]) == set("abcdef")
    lines = trace(run / "trace.jsonl")
    ranks = {r: [line for line in lines if line.get("dp_rank") == r] for r in (0, 1)}
    assert len(lines) == len(ranks[0]) + len(ranks[1])
    # the requests went to the DP ranks in turn, each ran in its own engine core, audited
    assert {i for line in ranks[0] for i in line["added"]} == {"a", "c", "e"}
    assert {i for line in ranks[1] for i in line["added"]} == {"b", "d", "f"}
    assert all("audit" in line for line in lines)
    held = []
    for r, mine in ranks.items():
        throttled = [line for line in mine if line.get("throttle_prefills")]
        assert throttled and len(throttled) < len(mine), r  # every other step, not all
        held += [i for line in throttled for i in line["added"]
                 if i not in (line.get("scheduled") or {})]
    assert held, "no request added on a throttled step waited for the next"
    # vLLM's shutdown of a clean run: no traceback for triage to read as a crash
    assert "Traceback" not in (run / "engine.log").read_text()
    assert lab_processes() - before == set()


def test_data_parallel_with_a_dense_model_runs_vllms_independent_engine_cores(cli, tmp_path):
    """Without an MoE model vLLM runs each DP rank as a plain EngineCoreProc (independent
    ranks, no DP busy loop): the lab runs what vLLM chose, and no step is throttled."""
    d = yaml.safe_load(DP2.read_text())
    d["name"] = "dp2-dense"
    del d["config"]["model"]
    f = tmp_path / "dp2-dense.yaml"
    f.write_text(yaml.safe_dump(d, sort_keys=False))
    proc = cli("run", str(f), "--vllm", "0.34.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "r" / "dp2-dense" / "0.34.0"
    res = json.loads((run / "result.json").read_text())
    assert (res["outcome"], res["engine"]["process"], res["engine"]["engine_cores"]) == \
        ("clean", "EngineCoreProc", 2)
    assert not any(line.get("throttle_prefills") for line in trace(run / "trace.jsonl"))


def test_data_parallel_without_the_asyncio_client_is_refused_naming_the_fix(cli, tmp_path):
    d = yaml.safe_load(DP2.read_text())
    d["config"]["asyncio_mode"] = False
    f = tmp_path / "x.yaml"
    f.write_text(yaml.safe_dump(d))
    proc = cli("run", str(f), "--vllm", "0.34.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "asyncio_mode: true" in proc.stdout + proc.stderr


def test_data_parallel_on_a_release_without_the_dp_client_is_refused_in_one_line(cli, tmp_path):
    """0.9.0 has a DPEngineCoreProc but no DPLBAsyncMPClient (its capabilities record)."""
    d = yaml.safe_load(DP2.read_text())
    del d["config"]["prefill_schedule_interval"]  # no such SchedulerConfig field there
    f = tmp_path / "x.yaml"
    f.write_text(yaml.safe_dump(d))
    proc = cli("run", str(f), "--vllm", "0.9.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = next(x for x in (proc.stdout + proc.stderr).splitlines()
                if x.startswith("error:") and "config.data_parallel_size: 2" in x)
    assert "vLLM 0.9.0" in line and "DPLBAsyncMPClient" in line


def test_an_interrupt_during_a_data_parallel_run_leaves_no_engine_core_or_coordinator(tmp_path):
    """SIGINT to ``vllm-repro run`` once the DP coordinator has both engine cores subscribed
    (vLLM's own log line) and the run is stepping: exit 130, no engine core, coordinator or
    worker left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    d = yaml.safe_load(DP2.read_text())
    d["requests"] = [{"id": f"r{i}", "at_step": 1, "prompt_len": 20, "max_tokens": 400}
                     for i in range(8)]  # hundreds of steps per engine core
    d["limits"] = {"max_steps": 3000}
    f = tmp_path / "long.yaml"
    f.write_text(yaml.safe_dump(d))
    before = lab_processes()
    reports = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "vllm_repro.cli", "run", str(f), "--vllm",
                             "0.34.0", "--reports", str(reports)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ), cwd=ROOT)

    def stepping() -> bool:
        logs = "".join(p.read_text(errors="replace") for p in reports.rglob("*.log"))
        traces = [p for p in reports.rglob("trace.jsonl") if p.stat().st_size]
        return "All engine subscriptions received by DP coordinator" in logs and bool(traces)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None and not stepping():
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before the interrupt: lengthen it"
    assert stepping(), "the coordinator and both engine cores never started"
    assert len(lab_processes() - before) >= 4  # the worker, the coordinator, two engine cores
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    time.sleep(1)
    assert lab_processes() - before == set()
