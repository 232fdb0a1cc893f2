"""The catalog's evidence, entry by entry, on the real releases (issue #4): where an entry
reproduces it shows the issue's own signature (exception type and innermost vLLM frame, the
triage of the issue's log excerpt, or the violation code), every entry is clean on the newest
release, and the raw signal behind each entry is checked where the lab records it.

``test_catalog_verdicts.py`` judges every (entry, release) verdict; both use the session's
``catalog_runs`` (conftest.py), so the catalog runs once. Self-contained like the rest of
``tests/shared``. In installed mode (the CUDA image) only the installed release runs: checks
that need other releases are skipped, saying which. With a fix applied (``VLLM_REPRO_FIXED``)
this module expects pristine vLLM and is skipped (conftest.py).
"""

from __future__ import annotations

import json

import pytest

from vllm_repro.settings import newest_release

from .conftest import catalog_files

pytestmark = [pytest.mark.shared, pytest.mark.slow]

#: the lab's setting (settings.py NEWEST_RELEASE, VLLM_REPRO_NEWEST)
NEWEST = newest_release()


def _entries() -> dict:
    from vllm_repro.scenario import load_scenario

    return {sc.name: (p, sc) for p in catalog_files() for sc in [load_scenario(p)]}


def _installed() -> str | None:
    from vllm_repro.sources.installed import installed

    inst = installed()
    return inst.release if inst is not None else None


ENTRIES = _entries()
INSTALLED = _installed()


def _reproducing_pairs() -> list:
    out = []
    for name, (_, sc) in ENTRIES.items():
        versions = [INSTALLED] if INSTALLED else sc.vllm.concrete()
        out += [pytest.param(name, v, id=f"{name}@{v}") for v in versions
                if sc.vllm.expectation_for(v) == "reproduce"]
    return out


def needs(*versions: str):
    """Skip a check whose releases this run cannot have (installed mode has one release)."""
    return pytest.mark.skipif(INSTALLED is not None and set(versions) != {INSTALLED},
                              reason=f"needs vLLM {', '.join(versions)}; only {INSTALLED} here")


def item_of(catalog_runs, name, version):
    item = catalog_runs.get((name, version))
    if item is None:
        pytest.skip(f"{name} was not run on {version} here")
    assert item.result.outcome != "error", item.result.error
    return item


def trace_of(item) -> list[dict]:
    return [json.loads(x) for x in (item.report_dir / "trace.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def newest_runs(catalog_runs, suite_reports):
    """Every entry on the newest release: the catalog's own runs, plus the entries that do not
    name it (run here, once)."""
    from vllm_repro.lab import RunItem, run_pairs

    if INSTALLED is not None:
        return {n: catalog_runs.get((n, INSTALLED)) for n in ENTRIES} if INSTALLED == NEWEST else {}
    extra = [RunItem(sc, NEWEST) for n, (_, sc) in ENTRIES.items()
             if (n, NEWEST) not in catalog_runs and sc.level != "v0-engine"]
    if extra:
        run_pairs(extra, suite_reports / "newest", jobs=1)
    runs = {n: catalog_runs.get((n, NEWEST)) for n in ENTRIES}
    runs.update({i.scenario.name: i for i in extra})
    return runs


@pytest.mark.parametrize("name,version", _reproducing_pairs())
def test_buggy_release_shows_the_issue_signature(catalog_runs, name, version):
    path, sc = ENTRIES[name]
    result = item_of(catalog_runs, name, version).result
    assert result.outcome == sc.expect.outcome, result.crash or result.stall
    if sc.expect.outcome == "crash":
        crash = result.crash
        assert crash.type == sc.expect.exception
        file_, _, func = sc.expect.where.partition(":")
        assert (crash.where.file, crash.where.function) == (file_, func)
        log = path.with_suffix(".log")
        if log.is_file():
            from vllm_repro.catalog import log_signature

            exc_type, frame, cut = log_signature(log)  # what `vllm-repro triage` reads in it
            assert exc_type == crash.type, "the issue's exception type"
            inner = (frame["module"], frame["function"])
            observed = [(f.file, f.function) for f in crash.vllm_frames]
            if cut:  # the issue's traceback is only partly available: its last frame is ours too
                assert inner in observed
            else:
                assert inner == observed[-1], "the issue's innermost vLLM frame"
    elif sc.expect.outcome == "violation":
        assert result.violations, "a violation outcome lists its findings"
        first = result.violations[0]
        assert first.code == sc.expect.code, "the audit's first finding is the entry's"
        if sc.expect.step:
            assert first.step == sc.expect.step
    elif sc.expect.outcome == "stall":
        stall = result.stall
        # never admitted (waiting), or admitted and going nowhere (running: a livelock or hang)
        assert stall.unfinished and \
            set(stall.unfinished) <= set(stall.waiting or ()) | set(stall.running or ())


@pytest.mark.skipif(INSTALLED is not None and INSTALLED != NEWEST,
                    reason=f"needs vLLM {NEWEST}; only {INSTALLED} here")
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_every_entry_is_clean_on_the_newest_release(newest_runs, name):
    if ENTRIES[name][1].level == "v0-engine":
        pytest.skip(f"{NEWEST} has no V0 engine (gone from 0.11.0): a V0 entry is judged on "
                    "its clean_on releases")
    item = newest_runs.get(name)
    assert item is not None and item.version == NEWEST
    res = item.result
    fixed = ENTRIES[name][1].fixed
    if fixed is not None and fixed.outcome != "clean":
        # what the fix makes the release do (#35541: refuse the config at start-up)
        assert res.outcome == fixed.outcome and item.verdict.ok is True, item.verdict.observed
        return
    assert res.outcome == "clean", item.verdict.observed
    assert res.unfinished == [] and not res.limit_reached and not res.violations


@needs("0.6.6.post1", "0.7.0")
def test_11562_audit_names_the_leaked_references_and_without_it_the_pool_stalls(
        catalog_runs, tmp_path):
    """The audit stops 0.6.6.post1 at B's first failed allocation (step 2) on the four prefix
    blocks it touched; 0.7.0 gives it nothing to report. Without the audit, the raw symptom: once
    A and B have finished nothing holds a block, yet 0.6.6.post1's free queue stays 4 blocks
    short of the 12-block pool and C never runs (a stall); 0.7.0 gets all 12 back and runs C."""
    from vllm_repro.lab import RunItem, run_pairs

    name = "vllm-11562-prefix-touch-refcount-leak"
    found = item_of(catalog_runs, name, "0.6.6.post1").result.violations
    assert {(v.code, v.step) for v in found} == {("KV_REFCOUNT", 2)}
    assert sorted(b for v in found for b in v.blocks) == [0, 1, 2, 3]
    assert all("ref_cnt 2 but held by A (expected 1)" in v.message for v in found)
    assert not item_of(catalog_runs, name, "0.7.0").result.violations

    sc = ENTRIES[name][1]
    raw = {v: RunItem(sc, v) for v in ("0.6.6.post1", "0.7.0")}
    run_pairs(list(raw.values()), tmp_path, audit=False, jobs=1)
    assert raw["0.6.6.post1"].result.outcome == "stall"
    assert raw["0.7.0"].result.outcome == "clean"
    pool = sc.config.num_gpu_blocks
    for version, expect_free in (("0.6.6.post1", pool - 4), ("0.7.0", pool)):
        idle = [s for s in trace_of(raw[version]) if not s["running"] and 12 <= s["step"] < 20]
        assert idle, version
        assert {s["free_blocks"] for s in idle} == {expect_free}, version
    bad = trace_of(raw["0.6.6.post1"])
    assert all(s["scheduled"] == {} for s in bad if s["step"] >= 20)  # C waits, steps are empty
    assert bad[-1]["waiting"] == ["C"]


@needs("0.20.1", "0.20.2")
def test_45856_fixed_release_preempts_where_the_buggy_one_crashes(catalog_runs):
    name = "vllm-45856-swa-admission-cap-undercount"
    crash = item_of(catalog_runs, name, "0.20.1").result.crash
    assert crash.phase == "schedule" and crash.message == "Cannot get 2 free blocks from the pool"
    frames = [(f.file, f.function) for f in crash.vllm_frames]
    assert ("vllm/v1/core/kv_cache_manager.py", "allocate_slots") in frames
    fixed = item_of(catalog_runs, name, "0.20.2")
    steps = {s["step"]: s for s in trace_of(fixed)}
    assert steps[4]["preempted"] == ["R"] and steps[4]["running"] == ["S"]
    assert fixed.result.finished == {"S": "FINISHED_LENGTH_CAPPED", "R": "FINISHED_LENGTH_CAPPED"}


@needs("0.11.0", "0.16.0")
def test_26372_crash_is_in_the_stat_loggers_after_drafts_were_verified(catalog_runs):
    name = "vllm-26372-spec-empty-output-negative-accepted"
    bad = item_of(catalog_runs, name, "0.11.0")
    assert bad.result.crash.phase == "record_stats" and bad.result.crash.step == 3
    fixed = item_of(catalog_runs, name, "0.16.0")
    for item in (bad, fixed):
        steps = {s["step"]: s for s in trace_of(item)}
        assert steps[2]["scheduled"] == {"R": 5}, "1 token + 4 drafts: drafts reached the scheduler"
    assert fixed.result.finished == {"R": "FINISHED_ABORTED", "O": "FINISHED_LENGTH_CAPPED"}


@needs("0.11.0", "0.12.0")
def test_29747_children_share_priority_and_arrival_and_both_finish_once_fixed(catalog_runs):
    name = "vllm-29747-priority-equal-arrival"
    crash = item_of(catalog_runs, name, "0.11.0").result.crash
    assert crash.phase == "add_request" and crash.step == 1
    fixed = item_of(catalog_runs, name, "0.12.0").result
    assert sorted(fixed.finished.values()) == ["FINISHED_LENGTH_CAPPED"] * 2


@needs("0.25.0", "0.26.0")
def test_43920_the_fix_fails_the_bad_grammar_alone(catalog_runs):
    """0.25.0: the latched xgrammar's compile failure escapes Future.result() inside
    schedule(); 0.26.0 (PR #47312) keeps it as the request's grammar and finishes that request
    alone as FINISHED_ERROR, while A's grammar takes it to EOS."""
    name = "vllm-43920-grammar-compile-failure-after-valid"
    crash = item_of(catalog_runs, name, "0.25.0").result.crash
    assert (crash.phase, crash.step) == ("schedule", 3)
    frames = [(f.file, f.function) for f in crash.vllm_frames]
    assert ("vllm/v1/structured_output/request.py", "_check_grammar_completion") in frames
    fixed = item_of(catalog_runs, name, "0.26.0").result
    assert fixed.finished == {"A": "FINISHED_STOPPED", "B": "FINISHED_ERROR"}


@needs("0.26.0", "0.27.0")
def test_34650_an_accepted_think_end_draft_leaves_the_grammar_off_until_fixed(catalog_runs):
    """0.26.0: </think>, accepted as a draft at step 4, is outside should_advance's window, so
    A's reasoning_ended never latches and t7 goes through "[0-9]+"; 0.27.0 (PR #44993) latches
    at step 4 and the grammar ends A with EOS at step 5."""
    name = "vllm-34650-reasoning-end-in-accepted-draft-missed"
    buggy = {line["step"]: line for line in trace_of(item_of(catalog_runs, name, "0.26.0"))}
    assert [buggy[n]["reasoning_ended"]["A"] for n in (4, 5, 6)] == [False, False, False]
    assert buggy[5]["sampled"]["A"] == [7]
    fixed_item = item_of(catalog_runs, name, "0.27.0")
    fixed = {line["step"]: line for line in trace_of(fixed_item)}
    assert fixed[4]["reasoning_ended"]["A"] is True and fixed[5]["sampled"]["A"] == [2]
    assert fixed_item.result.finished == {"A": "FINISHED_STOPPED"}


@needs("0.12.0", "0.16.0")
def test_32255_an_aborted_async_load_keeps_its_blocks_once_fixed(catalog_runs):
    """0.12.0 frees a request aborted while its KV connector load is in flight at once (the
    audit sees the load's blocks leave its table at step 3); 0.16.0 (PR #32255) holds them
    until the worker reports the load."""
    name = "vllm-32255-abort-async-load-frees-blocks"
    bad = item_of(catalog_runs, name, "0.12.0").result
    (v,) = bad.violations
    assert (v.code, v.step, v.requests) == ("KV_TRANSFER_FREED", 3, ["A"])
    fixed = item_of(catalog_runs, name, "0.16.0").result
    assert fixed.finished == {"A": "FINISHED_ABORTED", "B": "FINISHED_LENGTH_CAPPED"}


@needs("0.10.2", "0.12.0")
def test_25067_an_abort_of_a_finished_request_leaves_its_send_alone_once_fixed(catalog_runs):
    """0.10.2 frees the blocks of a finished request whose free the connector delayed for a
    send when the client aborts it (step 4); 0.12.0 ignores the abort and the send frees them."""
    name = "vllm-25067-abort-after-finish-frees-sent-blocks"
    (v,) = item_of(catalog_runs, name, "0.10.2").result.violations
    assert (v.code, v.step, v.requests) == ("KV_TRANSFER_FREED", 4, ["P"])
    fixed = item_of(catalog_runs, name, "0.12.0").result
    assert fixed.finished == {"P": "FINISHED_LENGTH_CAPPED", "Q": "FINISHED_LENGTH_CAPPED"}


@needs("0.11.0", "0.12.0")
def test_23215_the_fixed_front_door_refuses_the_blank_grammar(catalog_runs):
    """0.11.0 lets grammar "" through and EngineCore dies compiling it, with A; 0.12.0 (PR
    #28210) refuses it at the front door and A runs to its end."""
    name = "vllm-23215-empty-grammar-kills-engine"
    bad = item_of(catalog_runs, name, "0.11.0").result
    assert bad.crash.phase == "schedule" and sorted(bad.unfinished) == ["A", "E"]
    fixed = item_of(catalog_runs, name, "0.12.0").result
    assert fixed.finished == {"A": "FINISHED_STOPPED"}
    assert fixed.refused == {"E": "ValueError: structured_outputs.grammar cannot be an empty string"}


@needs("0.28.0", "0.29.0")
def test_53514_the_fixed_nixl_truncates_before_the_lookup(catalog_runs):
    """0.28.0: NixlConnector's scheduler half drops B's last prompt token after the local hit
    covered the rest, and schedule() asserts num_new_tokens > 0 with B still waiting; 0.29.0
    (PR #53523) truncates in on_new_request: B computes, finishes after one token and its
    blocks wait for the decode side's read, which the worker half reports."""
    name = "vllm-53514-nixl-mamba-truncation-zero-tokens"
    bad = item_of(catalog_runs, name, "0.28.0")
    assert (bad.result.crash.phase, bad.result.crash.step) == ("schedule", 3)
    assert trace_of(bad)[-1]["waiting"] == ["B"]
    fixed = item_of(catalog_runs, name, "0.29.0")
    assert fixed.result.finished == {"A": "FINISHED_LENGTH_CAPPED",
                                     "B": "FINISHED_LENGTH_CAPPED"}
    steps = trace_of(fixed)
    assert sum(s["scheduled"].get("B", 0) for s in steps) > 0
    assert any("B" in ((s.get("kv_connector") or {}).get("send") or []) for s in steps)
