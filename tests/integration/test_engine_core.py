"""level: engine-core on the real releases: the release's own EngineCore with the fake executor,
through the CLI as a user runs it (nothing of vLLM mocked or re-enacted)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from ..conftest import ROOT

pytestmark = pytest.mark.slow

CATALOG = ROOT / "scenarios"
STRESS = CATALOG / "stress"


def at_engine_core(src, dst_dir, **config):
    """A copy of scenario ``src`` at level engine-core (config fields updated)."""
    d = yaml.safe_load(src.read_text())
    d["level"] = "engine-core"
    d["config"].update(config)
    if config:
        d["name"] = d["name"] + "-" + "-".join(f"{k}{v}" for k, v in sorted(config.items()))
    out = dst_dir / f"{d['name']}.yaml"
    out.write_text(yaml.safe_dump(d, sort_keys=False))
    return out


def rows(stdout: str) -> dict[tuple[str, str], str]:
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[-1] in ("yes", "NO", "ERROR", "-") and parts[1][0].isdigit():
            out[(parts[0], parts[1])] = line
    return out


def test_catalog_gives_the_same_verdicts_at_both_levels(cli, tmp_path):
    """Every scheduler-level catalog entry's releases from 0.8 on (0.6/0.7's first-generation
    EngineCore sizes no KV cache specs: scheduler level only), at scheduler level and at
    engine-core level, and the catalog's own engine-core entries (#35541, #42117, #46066) on
    their buggy and fixed releases, in one engine-core run."""
    ec_dir = tmp_path / "ec"
    ec_dir.mkdir()
    files, native = [], []
    for p in sorted(CATALOG.glob("*.yaml")):
        d = yaml.safe_load(p.read_text())
        if d.get("level") == "engine-core":
            native.append(d["name"])
            shutil.copy(p, ec_dir / p.name)
            continue
        if d.get("level") == "v0-engine" or any(
                v.startswith(("0.6.", "0.7.")) for v in d["vllm"].get("reproduces_on", [])):
            continue  # the V0 engine has no EngineCore to compare with
        files.append(p)
        at_engine_core(p, ec_dir)
    assert len(files) >= 4 and len(native) >= 3
    sched = cli("run", *map(str, files), "--reports", str(tmp_path / "s"))
    ec = cli("run", *map(str, sorted(ec_dir.glob("*.yaml"))), "--reports", str(tmp_path / "e"))
    assert ec.returncode == 0, ec.stdout + ec.stderr
    a, b = rows(sched.stdout), rows(ec.stdout)
    assert a.keys() == {k for k in b if k[0] not in native} and len(a) >= 8
    for key in a:
        assert a[key].split()[-1] == b[key].split()[-1] == "yes", (a[key], b[key])
    for key in b.keys() - a.keys():
        assert b[key].split()[-1] == "yes", b[key]
    # the flagship: the same crash, at the same step, from inside EngineCore.step
    flag = "vllm-23347-priority-preempt-scheduled"
    assert "crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3" in b[(flag, "0.10.1.1")]
    res = json.loads((tmp_path / "e" / flag / "0.10.1.1" / "result.json").read_text())
    assert res["level"] == "engine-core" and res["engine"]["num_gpu_blocks"] == 5
    assert "vllm/v1/engine/core.py" in res["crash"]["traceback"]
    # #35541: a stall before the fix, the engine's own start-up refusal after it
    k = "vllm-35541-prompt-larger-than-kv-pool"
    assert "stall" in b[(k, "0.19.1")] and "stall" in b[(k, "0.16.0")]
    assert "crash ValueError" in b[(k, "0.20.2")] and "_check_enough_kv_cache_memory @0" in b[(k, "0.20.2")]
    res = json.loads((tmp_path / "e" / k / "0.33.0" / "result.json").read_text())
    assert res["crash"]["phase"] == "engine-build"
    # #42117 hangs on 0.21.0 (the token dropped after the reset), finishes on 0.22.0
    k = "vllm-42117-async-reset-drops-first-token"
    assert "stall" in b[(k, "0.21.0")] and "clean" in b[(k, "0.22.0")]
    # #46066: vLLM's own assert under the batch queue; vLLM's crash dump in the engine log, which
    # triage reads back to the same exception and innermost frame as result.json
    k = "vllm-46066-async-spec-reset-placeholder-underflow"
    res = json.loads((tmp_path / "e" / k / "0.24.0" / "result.json").read_text())
    assert res["engine"]["step_fn"] == "step_with_batch_queue"
    assert res["engine"]["scheduler"] == "AsyncScheduler"
    for version, crash in (("0.10.1.1", flag), ("0.24.0", k)):
        res = json.loads((tmp_path / "e" / crash / version / "result.json").read_text())
        # the run's own part of the worker's output (issue 47: stored once, in its report)
        log = tmp_path / "e" / crash / version / "engine.log"
        text = log.read_text()
        assert "Dumping scheduler output for model execution" in text
        assert "EngineCore encountered a fatal error" in text
        tri = cli("triage", str(log), "--json")
        assert tri.returncode == 0, tri.stdout + tri.stderr
        found = json.loads(tri.stdout)
        where = res["crash"]["where"]
        assert found["exception_type"] == res["crash"]["type"]
        assert (found["last_vllm_frame"]["module"], found["last_vllm_frame"]["function"]) == \
            (where["file"], where["function"]), (found["last_vllm_frame"], where)


@pytest.mark.parametrize("versions", [("0.11.0", "0.20.2", "0.26.0", "0.33.0")])
def test_async_scheduling_runs_the_stress_workloads_clean(cli, tmp_path, versions):
    """The async-scheduling defect (AsyncScheduler(*args, **kwargs) read as 'any keyword', the CPU
    platform switching async off) is gone: AsyncScheduler runs under EngineCore's batch queue."""
    files = [at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, async_scheduling=True),
             at_engine_core(STRESS / "stress-priority-nocache.yaml", tmp_path, async_scheduling=True)]
    spec = at_engine_core(STRESS / "stress-fcfs-cache.yaml", tmp_path, async_scheduling=True,
                          num_speculative_tokens=2, speculative_method="ngram_gpu")
    args = [str(f) for f in files]
    for v in versions:
        args += ["--vllm", v]
    proc = cli("run", *args, "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for f in files:
        name = yaml.safe_load(f.read_text())["name"]
        for v in versions:
            res = json.loads((tmp_path / "r" / name / v / "result.json").read_text())
            assert res["engine"]["scheduler"] == "AsyncScheduler", res["engine"]
            assert res["engine"]["step_fn"] == "step_with_batch_queue" or v == "0.33.0"
            assert not res["unfinished"], (name, v, res["outcome"])
            if v == "0.11.0" and "priority" in name:
                # vLLM 0.11.0's priority preemption leaves the preempted request in
                # num_scheduled_tokens (scheduler.py: only scheduled_running_reqs is cleaned;
                # 0.12.0 also pops its count and gives the tokens back): the audit says so
                assert res["outcome"] == "violation", res["outcome"]
                assert {x["code"] for x in res["violations"]} == {"REQ_STATE"}
                assert all("was preempted in the same step" in x["message"]
                           for x in res["violations"]), res["violations"]
                continue
            assert res["outcome"] == "clean", (name, v, res["outcome"], res.get("violations"))
    # async + spec decode with the drafter async scheduling accepts there
    proc = cli("run", str(spec), "--vllm", "0.20.2", "--vllm", "0.26.0", "--vllm", "0.33.0",
               "--reports", str(tmp_path / "q"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for v in ("0.20.2", "0.26.0", "0.33.0"):
        res = json.loads((tmp_path / "q" / yaml.safe_load(spec.read_text())["name"] / v
                          / "result.json").read_text())
        assert res["outcome"] == "clean" and not res["unfinished"], (v, res.get("violations"))
    # 0.11.0 refuses this (no ngram_gpu method there; its EngineArgs refuses spec decode with
    # async scheduling): an input error quoting vLLM, never a lab one
    proc = cli("run", str(spec), "--vllm", "0.11.0", "--reports", str(tmp_path / "q2"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "refuses" in proc.stdout + proc.stderr


def test_async_scheduling_at_scheduler_level_is_no_lab_error(cli, tmp_path):
    sc = at_engine_core(CATALOG / "vllm-29747-priority-equal-arrival.yaml", tmp_path)
    d = yaml.safe_load(sc.read_text())
    d["level"] = "scheduler"
    d["config"]["async_scheduling"] = True
    d["config"]["policy"] = "fcfs"
    for r in d["requests"]:
        r.pop("priority", None)
    d.pop("expect", None)
    d["vllm"] = {"clean_on": ["0.20.2", "0.33.0"]}
    d["name"] = "async-plain"
    sc.write_text(yaml.safe_dump(d, sort_keys=False))
    proc = cli("run", str(sc), "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_config_field_the_release_lacks_is_exit_2_naming_it(cli, tmp_path):
    sc = at_engine_core(CATALOG / "vllm-29747-priority-equal-arrival.yaml", tmp_path,
                        max_num_partial_prefillz=2)
    proc = cli("run", str(sc), "--vllm", "0.33.0", "--reports", str(tmp_path / "r" / "a"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config.max_num_partial_prefillz: vLLM 0.33.0 has no such field" in proc.stdout + proc.stderr
    # as a load error, a refused run leaves no reports folder behind (nor the folders it would
    # have made above it), and says so
    assert not (tmp_path / "r").exists() and "no reports (every run refused its input)" in proc.stderr
    # a folder already there is left as it was, its index not rewritten
    (tmp_path / "old").mkdir()
    proc = cli("run", str(sc), "--vllm", "0.33.0", "--reports", str(tmp_path / "old"))
    assert proc.returncode == 2 and "no reports (every run refused" in proc.stderr
    assert not (tmp_path / "old" / "index.html").exists()


def test_a_triaged_start_up_crash_replays_at_engine_core(cli, tmp_path):
    """A user's log of a start-up crash ("No available memory for the cache blocks", 0.8.3) is
    drafted into an engine-core replay that shows the same exception at the same frame."""
    from ..conftest import CRASHLOGS, SHARED_HINT

    log = next(iter(sorted(CRASHLOGS.glob("019-*.log"))), None)
    if log is None:
        pytest.skip(f"{CRASHLOGS}/019-*.log absent: {SHARED_HINT}")
    draft = tmp_path / "draft.yaml"
    tri = cli("triage", str(log), "--scenario", str(draft))
    assert tri.returncode == 0, tri.stdout + tri.stderr
    d = yaml.safe_load(draft.read_text())
    assert d["level"] == "engine-core" and d["vllm"]["reproduces_on"] == ["0.8.3"]
    d["vllm"]["reproduces_on"] = ["0.10.1.1"]  # a release this machine already has
    draft.write_text(yaml.safe_dump(d, sort_keys=False))
    proc = cli("run", str(draft), "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the draft's own expect holds
    name = d["name"]
    res = json.loads((tmp_path / "r" / name / "0.10.1.1" / "result.json").read_text())
    assert res["outcome"] == "crash" and res["crash"]["phase"] == "engine-build"
    assert res["crash"]["type"] == "ValueError"
    assert res["crash"]["where"]["function"] == "check_enough_kv_cache_memory"


@pytest.mark.parametrize("version", ["0.24.0"])
def test_a_lab_failure_inside_vllms_step_is_a_lab_error_at_both_levels(tmp_path, version):
    """The fake model runner breaks (a planted TypeError) while vLLM's executor calls it from
    inside EngineCore.step_with_batch_queue: a lab error (exit 3), never a crash of vLLM."""
    from vllm_repro.engine.host import Worker
    from vllm_repro.sources.prepare import prepare_release
    from vllm_repro.scenario import load_scenario
    from vllm_repro.verdict import EXIT_ENV, exit_code, judge

    plants = ROOT / "tests" / "integration" / "plant_faults.py"
    sc = load_scenario(CATALOG / "vllm-46066-async-spec-reset-placeholder-underflow.yaml")
    with Worker(prepare_release(version), tmp_path / "engine.log") as worker:
        for level in ("engine-core", "scheduler"):
            payload = sc.child_payload()
            payload["level"] = level
            res = worker.run(payload, tmp_path / level, audit=True, keep_going=True,
                             plant=f"{plants}:broken_fake_model", plant_args={"at_step": 3})
            assert res.outcome == "error", (level, res.outcome, res.crash)
            assert res.error.kind == "lab", res.error
            assert "planted: the fake model runner is broken" in res.error.message
            res.planted = None  # judged as a real run would be
            assert exit_code([judge(sc, version, res)]) == EXIT_ENV == 3


def test_pause_keeps_or_aborts_as_the_release_says_and_is_no_stall(cli, tmp_path):
    """pause_scheduler(mode="keep") for 28 steps (longer than stall_steps), then resume: the
    request finishes on 0.21.0 and 0.33.0 (steps while paused are not a stall); 0.16.0's
    pause_scheduler() takes no mode (exit 2), and pauses without one."""
    sc = {"name": "pause-keep", "level": "engine-core",
          "vllm": {"clean_on": ["0.21.0", "0.33.0"]},
          "config": {"block_size": 16, "num_gpu_blocks": 64, "max_num_seqs": 4,
                     "max_num_batched_tokens": 256, "max_model_len": 256},
          "requests": [{"id": "A", "at_step": 1, "prompt_len": 20, "max_tokens": 8}],
          "events": [{"at_step": 2, "pause": True, "mode": "keep"},
                     {"at_step": 30, "resume": True}],
          "limits": {"max_steps": 80, "stall_steps": 20}}
    p = tmp_path / "pause-keep.yaml"
    p.write_text(yaml.safe_dump(sc))
    proc = cli("run", str(p), "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for v in ("0.21.0", "0.33.0"):
        res = json.loads((tmp_path / "r" / "pause-keep" / v / "result.json").read_text())
        assert res["finished"] == {"A": "FINISHED_LENGTH_CAPPED"}, (v, res["finished"])
        assert res["steps"] > 30
    proc = cli("run", str(p), "--vllm", "0.16.0", "--reports", str(tmp_path / "r2"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pause_scheduler() takes no mode" in proc.stdout + proc.stderr
