"""vLLM #23347 on the real releases, through the CLI as a user runs it (nothing of vLLM mocked).

These build the releases' environments on first use (cached afterwards under VLLM_REPRO_CACHE).
"""

from __future__ import annotations

import json

import pytest

from ..conftest import FLAGSHIP, ROOT

pytestmark = pytest.mark.slow


def trace(report_dir):
    return [json.loads(x) for x in (report_dir / "trace.jsonl").read_text().splitlines()]


def test_make_cpu_repro_table_reproduces_on_0_10_1_1_and_clean_on_0_10_2(cli, tmp_path):
    reports = tmp_path / "reports"
    proc = cli("run", str(FLAGSHIP), "--reports", str(reports))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[1]: line for line in proc.stdout.splitlines()
            if line.startswith("vllm-23347-priority-preempt-scheduled")}
    assert set(rows) == {"0.10.1.1", "0.10.2"}
    assert "crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3" in rows["0.10.1.1"]
    assert rows["0.10.1.1"].rstrip().endswith("yes")
    # the fix holds (no crash, both finish); the audit's finding of the residual defect at
    # step 3 is reported as 'also' without failing the clean_on verdict (issue #3)
    assert "ran to the end (2 finished" in rows["0.10.2"] and "also: REQ_STATE @3" in rows["0.10.2"]
    assert rows["0.10.2"].rstrip().endswith("yes")

    bad = reports / "vllm-23347-priority-preempt-scheduled" / "0.10.1.1"
    result = json.loads((bad / "result.json").read_text())
    assert result["vllm"] == "0.10.1.1"
    assert result["crash"]["phase"] == "schedule"
    assert "assert (len(scheduled_new_reqs)" in result["crash"]["traceback"]
    # the run's own part of vLLM's log sits in its report; no staging folder is left behind
    assert result["engine_log"] == str(bad / "engine.log") and (bad / "engine.log").is_file()
    assert sorted(p.name for p in bad.parent.iterdir()) == ["0.10.1.1", "0.10.2"]
    steps = trace(bad)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[1]["scheduled"] == {"L": 1, "H": 32}  # L decodes, H prefills: pool now full

    good = reports / "vllm-23347-priority-preempt-scheduled" / "0.10.2"
    steps = trace(good)
    # the fix: at step 3 L (already scheduled, lower priority) is preempted back to waiting;
    # 0.10.2 still leaves L's token in num_scheduled_tokens (later releases pop it)
    assert steps[2]["preempted"] == ["L"] and steps[2]["running"] == ["H"]
    assert steps[2]["scheduled"]["H"] == 1
    result = json.loads((good / "result.json").read_text())
    assert sorted(result["finished"]) == ["H", "L"]
    assert result["finished"]["H"] == "FINISHED_LENGTH_CAPPED"


def test_other_releases_follow_the_bug_range(cli, tmp_path):
    proc = cli("run", str(FLAGSHIP), "--vllm", "0.9.2", "--vllm", "0.10.0", "--vllm", "0.11.0",
               "--vllm", "0.33.0", "--reports", str(tmp_path / "r"), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdicts = {v["vllm"]: v for v in json.loads(proc.stdout)}
    for v in ("0.9.2", "0.10.0"):
        assert verdicts[v]["outcome"] == "crash" and verdicts[v]["ok"] is True
        assert "AssertionError vllm/v1/core/sched/scheduler.py:schedule @3" in verdicts[v]["observed"]
    for v in ("0.11.0", "0.33.0"):
        assert verdicts[v]["ok"] is True
    # 0.11.0 keeps 0.10.2's residual defect (REQ_STATE at step 3, see the audit); 0.33 pops it
    assert verdicts["0.11.0"]["outcome"] == "violation"
    assert [a["code"] for a in verdicts["0.11.0"]["also"]] == ["REQ_STATE"]
    assert verdicts["0.33.0"]["outcome"] == "clean"


def test_0_9_0_front_door_refuses_priorities_and_lab_refuses_too(cli, tmp_path):
    proc = cli("run", str(FLAGSHIP), "--vllm", "0.9.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "priority" in text and "0.9.0" in text and "does not support priority" in text
    assert "crash" not in text and "clean" not in text


def test_plain_fcfs_runs_on_0_8_5_and_0_9_0(cli, tmp_path):
    """Both releases run the workload to its end. On 0.8.5 the audit's REQ_RESIDUE names vLLM's
    own leak there: a finished request's CachedRequestData put back into
    Scheduler._cached_reqs_data after it was freed (fixed in 0.9.0 by vLLM PR #17567); the
    scenario expects nothing on either release, so that finding is exit 1."""
    proc = cli("run", str(ROOT / "tests/data/fcfs-basic.yaml"), "--vllm", "0.8.5", "--vllm", "0.9.0",
               "--reports", str(tmp_path / "r"), "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdicts = json.loads(proc.stdout)
    assert [v["outcome"] for v in verdicts] == ["violation", "clean"]
    leak = json.loads((tmp_path / "r" / "fcfs-basic" / "0.8.5" / "result.json").read_text())
    assert [(v["code"], v["requests"]) for v in leak["violations"]] == [("REQ_RESIDUE", ["B"])]
    assert "Scheduler._cached_reqs_data" in leak["violations"][0]["message"]
    for v in ("0.8.5", "0.9.0"):
        res = json.loads((tmp_path / "r" / "fcfs-basic" / v / "result.json").read_text())
        assert res["vllm"] == v
        assert res["finished"] == {"A": "FINISHED_LENGTH_CAPPED", "B": "FINISHED_STOPPED",
                                   "C": "FINISHED_ABORTED"}


def test_a_configuration_vllms_own_validators_refuse_is_an_input_error(cli, tmp_path):
    """vLLM 0.33.0's SchedulerConfig (a pydantic dataclass) refuses a long-prefill threshold over
    max_model_len: its ValidationError comes out of pydantic, and it is the input that is wrong,
    so exit 2 with vLLM's reason, never a lab error (3), a crash or clean."""
    bad = tmp_path / "lpt.yaml"
    bad.write_text("name: lpt\nconfig: {block_size: 16, num_gpu_blocks: 4, max_model_len: 48,"
                   " long_prefill_token_threshold: 64}\n"
                   "requests:\n  - {id: A, at_step: 1, prompt_len: 10, max_tokens: 3}\n")
    proc = cli("run", str(bad), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # the table's cell begins the sentence; the whole of it is the line under the table
    assert ("vLLM 0.33.0 refuses this configuration: ValidationError: 1 validation error for "
            "SchedulerConfig") in proc.stdout
    line = next(x for x in proc.stderr.splitlines() if x.startswith(f"error: {bad}: "))
    assert "long_prefill_token_threshold (64) cannot be greater than the max_model_len (48)" in line


def test_a_run_stopped_by_max_steps_is_incomplete_not_clean(cli, tmp_path):
    """0.10.2 with too few steps for both requests to finish: the run did not finish, so the
    clean_on verdict is a mismatch (exit 1), result.json says incomplete (issue 18)."""
    text = FLAGSHIP.read_text().replace("limits: {max_steps: 200}", "limits: {max_steps: 6}")
    assert "max_steps: 6" in text
    short = tmp_path / "short.yaml"
    short.write_text(text.replace("name: vllm-23347-priority-preempt-scheduled", "name: short"))
    proc = cli("run", str(short), "--vllm", "0.10.2", "--no-audit", "--reports", str(tmp_path / "r"),
               "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (verdict,) = json.loads(proc.stdout)
    assert verdict["outcome"] == "incomplete" and verdict["ok"] is False
    assert "did not finish" in verdict["reason"]
    res = json.loads((tmp_path / "r" / "short" / "0.10.2" / "result.json").read_text())
    assert res["outcome"] == "incomplete" and res["limit_reached"] is True
    assert res["steps"] == 6 and sorted(res["unfinished"]) == ["H", "L"]


def test_a_trace_over_its_limit_stops_the_run_as_an_input_error(cli, tmp_path, monkeypatch):
    """VLLM_REPRO_MAX_TRACE_MB (issue 18: 20,000 requests wrote a 559 MB trace): the 256-request
    stress workload on 0.10.2 with a quarter-MB limit stops where its trace reaches it, exit 2,
    the trace no longer than the limit."""
    monkeypatch.setenv("VLLM_REPRO_MAX_TRACE_MB", "0.25")
    proc = cli("run", str(ROOT / "scenarios/stress/stress-fcfs-cache.yaml"), "--vllm", "0.10.2",
               "--reports", str(tmp_path / "r"), "--json")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (verdict,) = json.loads(proc.stdout)
    assert verdict["outcome"] == "error" and "VLLM_REPRO_MAX_TRACE_MB" in verdict["observed"]
    trace = tmp_path / "r" / "stress-fcfs-cache" / "0.10.2" / "trace.jsonl"
    assert 0 < trace.stat().st_size <= 0.25 * (1 << 20)


def test_a_run_that_exhausts_the_workers_memory_limit_says_out_of_memory(cli, tmp_path):
    """The worker limits its own address space (VLLM_REPRO_WORKER_MEMORY_MB, RLIMIT_AS) before
    it imports vLLM: a 20-million-block pool (the KV limit raised on purpose) in a 1.4 GB worker
    is 'error: out of memory (limit 1400 MB)', exit 2, never a crash of vLLM or a dead worker."""
    s = tmp_path / "mem.yaml"
    s.write_text("name: mem\nvllm: {clean_on: ['0.10.2']}\nconfig: {num_gpu_blocks: 20000000}\n"
                 "requests:\n  - {id: A, prompt_len: 10}\n")
    proc = cli("run", str(s), "--reports", str(tmp_path / "r"), "--no-audit", "--json",
               env={"VLLM_REPRO_WORKER_MEMORY_MB": "1400", "VLLM_REPRO_MAX_KV_BLOCKS": "30000000"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (verdict,) = json.loads(proc.stdout)
    assert verdict["outcome"] == "error"
    assert "out of memory (limit 1400 MB, VLLM_REPRO_WORKER_MEMORY_MB)" in verdict["observed"]


def test_a_memory_limit_too_small_to_import_vllm_names_the_setting(cli, tmp_path):
    """A newcomer's find: VLLM_REPRO_WORKER_MEMORY_MB=300 cannot even import vLLM; that is the
    setting's fault, said as such (exit 2 naming it), not a cryptic environment error."""
    proc = cli("run", str(FLAGSHIP), "--vllm", "0.10.2", "--reports", str(tmp_path / "r"), "--json",
               env={"VLLM_REPRO_WORKER_MEMORY_MB": "300"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (verdict,) = json.loads(proc.stdout)
    assert "out of memory while importing vLLM (limit 300 MB, VLLM_REPRO_WORKER_MEMORY_MB)" in \
        verdict["observed"]


def test_a_memory_limit_below_a_warm_workers_mapping_names_the_setting(cli, tmp_path):
    """A warm worker is forked from a parent that already maps gigabytes (torch preloaded): a
    300 MB limit cannot be set on it without every allocation failing as anything (CI saw
    SystemError, a crash is as likely). The worker says so instead: exit 2 naming the setting,
    as on a cold start."""
    warm = cli("run", str(FLAGSHIP), "--vllm", "0.10.2", "--reports", str(tmp_path / "w"))
    assert warm.returncode == 0 and "(warm" in warm.stderr, warm.stderr[-2000:]
    proc = cli("run", str(FLAGSHIP), "--vllm", "0.10.2", "--reports", str(tmp_path / "r"), "--json",
               env={"VLLM_REPRO_WORKER_MEMORY_MB": "300"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (verdict,) = json.loads(proc.stdout)
    assert "out of memory while importing vLLM (limit 300 MB, VLLM_REPRO_WORKER_MEMORY_MB)" in \
        verdict["observed"]
    assert "is below the" in verdict["observed"] and "MB this worker maps" in verdict["observed"]


# a stand-in for a C extension whose allocation fails under RLIMIT_AS without saying so: the
# worker imports _vllm_slice (from the extra path) before vLLM, and this one breaks the import
_SILENT_OOM = '''
import resource, __main__
_make = __main__.make_adapter
def _broken(model_dir):
    if {always} or resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        raise SystemError("error return without exception set")
    return _make(model_dir)
__main__.make_adapter = _broken
'''


@pytest.mark.parametrize("always", [False, True], ids=["the-limit", "not-the-limit"])
def test_an_import_that_fails_near_the_memory_limit_is_asked_again_without_it(
        tmp_path, monkeypatch, always):
    """Under RLIMIT_AS an import may fail with an error that names no memory at all (CI saw
    'SystemError: error return without exception set' at 300 MB). When the worker's peak came
    near the limit, the lab imports once more without it: an import that then succeeds was the
    limit's doing (exit 2 naming VLLM_REPRO_WORKER_MEMORY_MB); one that fails again is the
    environment's (exit 3, the release's own error)."""
    from vllm_repro.engine.host import Worker
    from vllm_repro.errors import EnvError, InputError
    from vllm_repro.sources.prepare import prepare_release

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "_vllm_slice.py").write_text(_SILENT_OOM.format(always=always))
    monkeypatch.setenv("VLLM_REPRO_WORKER_MEMORY_MB", "1500")
    worker = Worker(prepare_release("0.10.2"), tmp_path / "engine.log", extra_path=(str(shim),))
    expected = EnvError if always else InputError
    with pytest.raises(expected) as err:
        worker.start()
    assert "SystemError: error return without exception set" in str(err.value)
    said = "out of memory while importing vLLM (limit 1500 MB, VLLM_REPRO_WORKER_MEMORY_MB)"
    assert (said in str(err.value)) is not always
