"""Every catalog entry on its buggy and fixed releases, for real, through the CLI as a user runs
it (``vllm-repro catalog run``): it reproduces where it says (the issue's exception type and
innermost vLLM frame, or its stall), it is clean where it says, and clean on the newest release.

The whole catalog runs once per module (one worker per release, ``--jobs 1``); each (entry,
release) pair is then its own test. Releases are built on first use (cached afterwards).

In an image with one vLLM installed (``VLLM_REPRO_VLLM`` set, the CUDA image), only that release
runs: every entry whose releases or ranges say what to expect there; the other pairs are skipped.
"""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
from packaging.version import InvalidVersion, Version

from vllm_repro.catalog import catalog_files, log_signature
from vllm_repro.scenario import load_scenario

from ..conftest import SCENARIOS, run_cli

pytestmark = [pytest.mark.shared, pytest.mark.slow]

NEWEST = "0.33.0"
FILES = catalog_files(SCENARIOS)
ENTRIES = {load_scenario(p).name: load_scenario(p) for p in FILES}


def _releases(sc) -> list[str]:
    out = list(sc.vllm.concrete())
    if NEWEST not in out:
        out.append(NEWEST)
    return out


def _installed() -> str | None:
    """The installed vLLM release when the lab runs against it (``VLLM_REPRO_VLLM``), else None."""
    if not os.environ.get("VLLM_REPRO_VLLM"):
        return None
    try:
        return importlib.metadata.version("vllm").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


INSTALLED = _installed()
if INSTALLED is None:
    CASES = [(name, v) for name, sc in ENTRIES.items() for v in _releases(sc)]
else:
    CASES = [(name, INSTALLED) for name, sc in ENTRIES.items()
             if sc.vllm.expectation_for(INSTALLED) is not None]


def needs(*versions: str):
    """Skip an entry-specific check whose releases are not the ones this run has."""
    return pytest.mark.skipif(INSTALLED is not None and set(versions) != {INSTALLED},
                              reason=f"needs vLLM {', '.join(versions)}; only {INSTALLED} here")


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    """``vllm-repro catalog run --also-on NEWEST --json`` (or, against an installed vLLM, ``run``
    on that release): (verdicts by (entry, release), reports folder)."""
    reports = tmp_path_factory.mktemp("catalog-reports")
    if INSTALLED is None:
        args = ["catalog", "run", "--also-on", NEWEST, "--jobs", "1"]
    else:
        files = [str(SCENARIOS / f"{name}.yaml") for name, _ in CASES]
        if not files:
            pytest.skip(f"no catalog entry says what to expect on vLLM {INSTALLED}")
        args = ["run", *files, "--vllm", INSTALLED]
    proc = run_cli(*args, "--json", "--reports", str(reports), timeout=3600)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    verdicts = {(v["scenario"], v["vllm"]): v for v in json.loads(proc.stdout)}
    return proc, verdicts, reports


def result_of(reports, name, version) -> dict:
    return json.loads((reports / name / version / "result.json").read_text())


def trace_of(reports, name, version) -> list[dict]:
    path = reports / name / version / "trace.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_catalog_run_exits_0_and_covers_every_entry_and_release(catalog):
    proc, verdicts, _ = catalog
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(verdicts) == set(CASES)


@pytest.mark.parametrize("name,version", CASES, ids=[f"{n}@{v}" for n, v in CASES])
def test_entry_on_release(catalog, name, version):
    _, verdicts, reports = catalog
    sc = ENTRIES[name]
    verdict = verdicts[(name, version)]
    result = result_of(reports, name, version)
    assert result["vllm"] == version
    kind = sc.vllm.expectation_for(version)
    if kind == "clean":
        # the lab's clean: no crash, no stall, every request finished, not the entry's own
        # violation code; other audit findings are reported beside it ("also")
        assert verdict["ok"] is True, verdict
        assert result["outcome"] in ("clean", "violation") and "crash" not in result, verdict
        assert "stall" not in result
        assert result["unfinished"] == [] and not result["limit_reached"]
        codes = {v["code"] for v in result.get("violations") or []}
        assert sc.expect.code not in codes
        if version == NEWEST:
            assert result["outcome"] == "clean" and not codes, "the newest release: no finding"
        return
    assert kind == "reproduce"
    assert verdict["ok"] is True, verdict
    assert result["outcome"] == sc.expect.outcome
    if sc.expect.outcome == "crash":
        crash = result["crash"]
        assert crash["type"] == sc.expect.exception
        file_, _, func = sc.expect.where.partition(":")
        assert (crash["where"]["file"], crash["where"]["function"]) == (file_, func)
        log = (SCENARIOS / name).with_suffix(".log")
        if log.is_file():
            exc_type, frame, cut = log_signature(log)  # what `vllm-repro triage` says
            assert exc_type == crash["type"], "the issue's exception type"
            inner = (frame["module"], frame["function"])
            observed = [(f["file"], f["function"]) for f in crash["vllm_frames"]]
            if cut:
                assert inner in observed, "the issue's innermost quoted frame is on our stack"
            else:
                assert inner == observed[-1], "the issue's innermost vLLM frame"
    elif sc.expect.outcome == "stall":
        stall = result["stall"]
        assert stall["unfinished"] and set(stall["unfinished"]) <= set(stall["waiting"])
    elif sc.expect.outcome == "violation":
        first = (result.get("violations") or [{}])[0]
        assert first.get("code") == sc.expect.code, "the audit's first finding is the entry's"
        if sc.expect.step:
            assert first.get("step") == sc.expect.step


@needs("0.6.6.post1", "0.7.0")
def test_11562_audit_names_the_leaked_references_and_without_it_the_pool_stalls(catalog, tmp_path):
    """The audit stops 0.6.6.post1 at B's first failed allocation (step 2) on the four prefix
    blocks it touched; 0.7.0 gives it nothing to report. Without the audit, the raw symptom: once
    A and B have finished nothing holds a block, yet 0.6.6.post1's free queue stays 4 blocks
    short of the 12-block pool and C never runs (a stall); 0.7.0 gets all 12 back and runs C."""
    _, _, reports = catalog
    name = "vllm-11562-prefix-touch-refcount-leak"
    found = result_of(reports, name, "0.6.6.post1")["violations"]
    assert {(v["code"], v["step"]) for v in found} == {("KV_REFCOUNT", 2)}
    assert sorted(b for v in found for b in v["blocks"]) == [0, 1, 2, 3]
    assert all("ref_cnt 2 but held by A (expected 1)" in v["message"] for v in found)
    assert not result_of(reports, name, "0.7.0").get("violations")

    raw = tmp_path / "raw"
    proc = run_cli("run", str(SCENARIOS / f"{name}.yaml"), "--no-audit", "--jobs", "1",
                   "--reports", str(raw), "--json")
    verdicts = {v["vllm"]: v for v in json.loads(proc.stdout)}
    assert verdicts["0.6.6.post1"]["outcome"] == "stall"
    assert verdicts["0.7.0"]["outcome"] == "clean"
    pool = ENTRIES[name].config.num_gpu_blocks
    for version, expect_free in (("0.6.6.post1", pool - 4), ("0.7.0", pool)):
        steps = trace_of(raw, name, version)
        idle = [s for s in steps if not s["running"] and 12 <= s["step"] < 20]
        assert idle, version
        assert {s["free_blocks"] for s in idle} == {expect_free}, version
    bad = trace_of(raw, name, "0.6.6.post1")
    assert all(s["scheduled"] == {} for s in bad if s["step"] >= 20)  # C waits, steps are empty
    assert bad[-1]["waiting"] == ["C"]


@needs("0.20.1", "0.20.2")
def test_45856_fixed_release_preempts_where_the_buggy_one_crashes(catalog):
    _, _, reports = catalog
    name = "vllm-45856-swa-admission-cap-undercount"
    crash = result_of(reports, name, "0.20.1")["crash"]
    assert crash["phase"] == "schedule" and crash["message"] == "Cannot get 2 free blocks from the pool"
    frames = [(f["file"], f["function"]) for f in crash["vllm_frames"]]
    assert ("vllm/v1/core/kv_cache_manager.py", "allocate_slots") in frames
    fixed = {s["step"]: s for s in trace_of(reports, name, "0.20.2")}
    assert fixed[4]["preempted"] == ["R"] and fixed[4]["running"] == ["S"]
    assert result_of(reports, name, "0.20.2")["finished"] == {
        "S": "FINISHED_LENGTH_CAPPED", "R": "FINISHED_LENGTH_CAPPED"}


@needs("0.11.0", "0.16.0", NEWEST)
def test_26372_crash_is_in_the_stat_loggers_after_drafts_were_verified(catalog):
    _, _, reports = catalog
    name = "vllm-26372-spec-empty-output-negative-accepted"
    crash = result_of(reports, name, "0.11.0")["crash"]
    assert crash["phase"] == "record_stats" and crash["step"] == 3
    for version in ("0.11.0", "0.16.0", NEWEST):
        steps = {s["step"]: s for s in trace_of(reports, name, version)}
        assert steps[2]["scheduled"] == {"R": 5}, "1 token + 4 drafts: drafts reached the scheduler"
    fixed = result_of(reports, name, "0.16.0")
    assert fixed["finished"] == {"R": "FINISHED_ABORTED", "O": "FINISHED_LENGTH_CAPPED"}


@needs("0.11.0", "0.12.0", NEWEST)
def test_29747_children_share_priority_and_arrival_and_both_finish_once_fixed(catalog):
    _, _, reports = catalog
    name = "vllm-29747-priority-equal-arrival"
    crash = result_of(reports, name, "0.11.0")["crash"]
    assert crash["phase"] == "add_request" and crash["step"] == 1
    for version in ("0.12.0", NEWEST):
        assert sorted(result_of(reports, name, version)["finished"].values()) == [
            "FINISHED_LENGTH_CAPPED"] * 2
