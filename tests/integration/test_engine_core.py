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
    """Every catalog entry's releases from 0.8 on (0.6/0.7's first-generation EngineCore sizes
    no KV cache specs: scheduler level only), at scheduler level and at engine-core level."""
    ec_dir = tmp_path / "ec"
    ec_dir.mkdir()
    files = []
    for p in sorted(CATALOG.glob("*.yaml")):
        d = yaml.safe_load(p.read_text())
        if any(v.startswith(("0.6.", "0.7.")) for v in d["vllm"].get("reproduces_on", [])):
            continue
        files.append(p)
        at_engine_core(p, ec_dir)
    assert len(files) >= 4
    sched = cli("run", *map(str, files), "--reports", str(tmp_path / "s"))
    ec = cli("run", *map(str, sorted(ec_dir.glob("*.yaml"))), "--reports", str(tmp_path / "e"))
    assert ec.returncode == 0, ec.stdout + ec.stderr
    a, b = rows(sched.stdout), rows(ec.stdout)
    assert a.keys() == b.keys() and len(a) >= 8
    for key in a:
        assert a[key].split()[-1] == b[key].split()[-1] == "yes", (a[key], b[key])
    # the flagship: the same crash, at the same step, from inside EngineCore.step
    flag = "vllm-23347-priority-preempt-scheduled"
    assert "crash AssertionError vllm/v1/core/sched/scheduler.py:schedule @3" in b[(flag, "0.10.1.1")]
    res = json.loads((tmp_path / "e" / flag / "0.10.1.1" / "result.json").read_text())
    assert res["level"] == "engine-core" and res["engine"]["num_gpu_blocks"] == 5
    assert "vllm/v1/engine/core.py" in res["crash"]["traceback"]
    # vLLM's own crash dump in the engine log, which triage reads back to the same crash
    log = tmp_path / "e" / "_engine" / "0.10.1.1.log"
    text = log.read_text()
    assert "Dumping input data for V1 LLM engine" in text
    assert "EngineCore encountered a fatal error" in text
    tri = cli("triage", str(log), "--json")
    if tri.returncode == 0:
        found = json.loads(tri.stdout)
        assert "AssertionError" in json.dumps(found)
        assert "scheduler.py" in json.dumps(found)


def test_35541_stalls_before_the_fix_and_is_refused_at_start_up_after(cli, tmp_path):
    sc = CATALOG / "engine-core" / "vllm-35541-prompt-larger-than-kv-pool.yaml"
    proc = cli("run", str(sc), "--vllm", "0.19.1", "--vllm", "0.20.2", "--reports", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = rows(proc.stdout)
    name = "vllm-35541-prompt-larger-than-kv-pool"
    assert "stall" in r[(name, "0.19.1")] and r[(name, "0.19.1")].endswith("yes")
    fixed = r[(name, "0.20.2")]
    assert "crash ValueError" in fixed and "_check_enough_kv_cache_memory @0" in fixed
    res = json.loads((tmp_path / name / "0.20.2" / "result.json").read_text())
    assert res["crash"]["phase"] == "engine-build"


@pytest.mark.parametrize("versions", [("0.11.0", "0.20.2", "0.33.0")])
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
            assert res["outcome"] in ("clean", "violation") and not res["unfinished"], res["outcome"]
    # async + spec decode with the drafter async scheduling accepts there
    proc = cli("run", str(spec), "--vllm", "0.20.2", "--vllm", "0.33.0", "--reports", str(tmp_path / "q"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
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
    proc = cli("run", str(sc), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config.max_num_partial_prefillz: vLLM 0.33.0 has no such field" in proc.stdout + proc.stderr
    shutil.rmtree(tmp_path / "r", ignore_errors=True)
