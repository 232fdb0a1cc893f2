"""Warm runs on a real release (vLLM 0.10.1.1, nothing mocked; docs/warm-runs.md): the flagship's
verdict and result do not change between a cold and a warm run; a line edited into a copy of
the release's ``scheduler.py`` that raises is seen on the next warm run (and the run says it ran
on an edited tree); killing the warm parent
mid-run is exit 3 naming it, and the next run starts a new parent."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from vllm_repro.slicing.runs import normalise_clock

from ..conftest import FLAGSHIP, ROOT, run_cli, warm_parent_pid

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "fork") or not Path("/proc").is_dir(),
                                 reason="warm parents fork (Linux)")]

VERSION = "0.10.1.1"
STRESS = ROOT / "scenarios" / "stress" / "stress-fcfs-nocache.yaml"
# parents these tests start retire soon after (a reused one keeps the idle time it started with)
ENV = {"VLLM_REPRO_WARM_IDLE_S": "120"}
#: what may differ between two runs of one scenario: times, where the log is, how it started
VOLATILE = {"timing", "engine_log", "python", "warm"}


def _result(reports: Path, scenario: str = FLAGSHIP.stem) -> dict:
    data = json.loads((reports / scenario / VERSION / "result.json").read_text())
    if data.get("crash"):
        data["crash"].pop("traceback", None)  # names the lab's path link and the tree's
    return {k: v for k, v in data.items() if k not in VOLATILE}


def _warm_parent() -> int | None:
    return warm_parent_pid(VERSION)


def test_the_flagship_verdict_and_result_are_the_same_cold_and_warm(tmp_path):
    runs = {}
    for mode in ("cold", "warm", "warm-again"):
        reports = tmp_path / mode
        args = ["run", str(FLAGSHIP), "--vllm", VERSION, "--reports", str(reports), "--json"]
        r = run_cli(*args, *(["--cold"] if mode == "cold" else []), env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("(warm)" in r.stderr) == (mode != "cold"), r.stderr[-2000:]
        verdicts = json.loads(r.stdout)
        runs[mode] = (verdicts, _result(reports))
        # result.json says how the run started and which tree it ran
        raw = json.loads((reports / FLAGSHIP.stem / VERSION / "result.json").read_text())
        assert (raw["warm"], raw["tree"]) == (mode != "cold", "full")
    assert runs["cold"][1]["outcome"] == "crash"
    assert runs["warm"] == runs["cold"]
    assert runs["warm-again"] == runs["cold"]


def test_an_edited_line_that_raises_is_seen_on_the_next_warm_run(tmp_path):
    from vllm_repro.lab import RunItem, run_pairs
    from vllm_repro.scenario.load import load_scenario
    from vllm_repro.sources.env import ReleaseEnv
    from vllm_repro.sources.prepare import prepare_release

    os.environ.update(ENV)
    cached = prepare_release(VERSION, lambda s: None, tree="full")
    tree = tmp_path / "tree"  # a copy: the cached tree is never edited
    shutil.copytree(cached.tree, tree, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    env = ReleaseEnv(VERSION, tree, cached.root)
    said: list[str] = []

    def run(name: str):
        item = RunItem(load_scenario(FLAGSHIP), VERSION)
        run_pairs([item], tmp_path / name, prepare=lambda v: env, say=said.append)
        return item.result

    before = run("before")
    assert before.crash and before.crash.type == "AssertionError"
    assert before.tree_changes is None  # the copy is the release, file for file (its manifest)
    sched = tree / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
    src = sched.read_text()
    marker = "    def schedule(self) -> SchedulerOutput:\n"
    assert marker in src
    sched.write_text(src.replace(marker, marker + "        raise RuntimeError('warm-edit-marker')\n", 1))
    after = run("after")
    assert [s for s in said if "imported in" in s and "(warm)" in s][-1:], said
    assert after.crash and after.crash.type == "RuntimeError", after
    assert "warm-edit-marker" in after.crash.message
    assert after.crash.where.file.endswith("vllm/v1/core/sched/scheduler.py")
    assert after.crash.step == 1  # the first schedule() call
    # never silent (issue 18 item 7): the run says it ran on an edited tree, and records which
    assert after.tree_changes == ["edited vllm/v1/core/sched/scheduler.py"]
    assert any("tree differs" in s and "scheduler.py" in s for s in said), said


def test_killing_the_warm_parent_mid_run_is_exit_3_and_the_next_run_starts_a_new_one(tmp_path):
    import subprocess
    import sys

    warm_up = run_cli("run", str(FLAGSHIP), "--vllm", VERSION, "--reports", str(tmp_path / "w"),
                      env=ENV)
    assert warm_up.returncode == 0, warm_up.stderr[-2000:]
    parent = _warm_parent()
    assert parent, "no warm parent after a warm run"
    reports = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "vllm_repro.cli", "run", str(STRESS), "--vllm",
                             VERSION, "--reports", str(reports)], cwd=ROOT,
                            env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # mid-run: the staged trace has steps in it
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "never got mid-run"
            staged = next(iter(reports.glob(f"{STRESS.stem}/.{VERSION}.partial-*/trace.jsonl")), None)
            if staged is not None and staged.read_text().count("\n") > 20:
                break
            time.sleep(0.02)
        os.kill(parent, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, (out, err)
    assert f"its warm parent (pid {parent}) died" in out + err, out + err
    assert "the next run starts a new one" in out + err
    again = run_cli("run", str(FLAGSHIP), "--vllm", VERSION, "--reports", str(tmp_path / "n"),
                    env=ENV)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(warm)" in again.stderr
    assert _warm_parent() not in (None, parent)


@pytest.mark.parametrize("scenario", [FLAGSHIP.name, "vllm-23215-empty-grammar-kills-engine.yaml"])
def test_a_slice_runs_warm_with_the_same_result_as_cold(tmp_path, scenario):
    """A slice's environment lacks the packages its tree stubs: its warm parent preloads with
    those stubs, as each child runs (a newcomer found every slice run cold: huggingface_hub
    printed "No module named 'yaml'" on the parent's stdout; then, with stdout guarded, the
    half-imported huggingface_hub broke every child). 0.10.2's slice serves both levels."""
    runs = {}
    for mode in ("cold", "warm", "warm-again"):
        reports = tmp_path / mode
        r = run_cli("run", str(ROOT / "scenarios" / scenario), "--vllm", "0.10.2", "--tree", "slice",
                    "--reports", str(reports), "--json", *(["--cold"] if mode == "cold" else []),
                    env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("(warm)" in r.stderr) == (mode != "cold"), r.stderr[-2000:]
        data = json.loads((reports / Path(scenario).stem / "0.10.2" / "result.json").read_text())
        if data.get("crash"):
            data["crash"].pop("traceback", None)
        kept = {k: v for k, v in data.items() if k not in VOLATILE}
        # (xgrammar's error names the time of day)
        runs[mode] = (json.loads(r.stdout), json.loads(normalise_clock(json.dumps(kept))))
    assert runs["cold"][0][0]["ok"] is True
    assert runs["warm"] == runs["cold"] and runs["warm-again"] == runs["cold"]
