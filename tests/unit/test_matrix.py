"""The release matrix without a release: the range, the final releases, the modes, a cell's
outcome and cause, the record, the table and the picture (vllm-repro matrix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from vllm_repro import matrix as mx
from vllm_repro.engine.capabilities import Capabilities
from vllm_repro.errors import InputError
from vllm_repro.records import MatrixCell, MatrixReport, RecordError, RunResult
from vllm_repro.scenario import parse_scenario
from vllm_repro.scenario.load import load_scenario

from .fake_index import FakeIndex, make_sdist

INDEX = ["0.6.4", "0.6.5", "0.6.6", "0.6.6.post1", "0.8.5", "0.8.5.post1", "0.11.0rc1",
         "0.10.1.1", "0.10.2", "0.15.1", "0.33.0", "0.34.0.dev0", "not-a-version"]


def test_the_range_is_a_pep440_specifier_set_and_a_bad_one_names_the_option():
    assert str(mx.parse_range(None)) == mx.DEFAULT_RANGE
    assert mx.parse_range(" >=0.10,<0.34 ").contains("0.15.1")
    for bad in ("0.10..0.33", "", "latest"):
        with pytest.raises(InputError, match="--releases"):
            mx.parse_range(bad)


def test_only_releases_in_the_range_oldest_first_post_releases_kept():
    # a post release is a release users install and bisect over (0.6.6.post1 is #11562's
    # buggy release in the catalog); rc, dev and non-versions are not
    assert mx.final_releases(INDEX, SpecifierSet(">=0.6.5")) == [
        "0.6.5", "0.6.6", "0.6.6.post1", "0.8.5", "0.8.5.post1", "0.10.1.1", "0.10.2", "0.15.1",
        "0.33.0"]
    assert mx.final_releases(INDEX, SpecifierSet(">=0.10,<0.34")) == [
        "0.10.1.1", "0.10.2", "0.15.1", "0.33.0"]
    assert mx.final_releases(INDEX, SpecifierSet("==0.15.1")) == ["0.15.1"]


def test_the_releases_come_from_the_index_sdists_and_wheel_only_ones(monkeypatch, tmp_path):
    from vllm_repro import settings

    files = {"vllm-0.6.4.tar.gz": make_sdist("0.6.4"), "vllm-0.6.5.tar.gz": make_sdist("0.6.5"),
             "vllm-0.15.1-cp38-abi3-manylinux_2_31_x86_64.whl": b"PK",
             "vllm-0.16.0rc1.tar.gz": make_sdist("0.16.0rc1")}
    with FakeIndex(files) as idx:
        monkeypatch.setenv("PIP_INDEX_URL", idx.url)
        settings.pip_config.cache_clear()
        assert mx.index_releases(mx.parse_range(None)) == ["0.6.5", "0.15.1"]
        with pytest.raises(InputError, match="no final vLLM release on the index"):
            mx.index_releases(mx.parse_range(">=1.0"))
    settings.pip_config.cache_clear()


def test_modes_in_order_and_a_bad_one_refused():
    assert mx.check_modes([]) == list(mx.MODES)
    assert mx.check_modes(["spec", "plain"]) == ["plain", "spec"]
    with pytest.raises(InputError, match="--mode 'fast'"):
        mx.check_modes(["fast"])


def test_each_mode_is_an_overlay_and_a_mode_the_scenario_already_is_left_out(root):
    plain = load_scenario(root / "scenarios/matrix/plain.yaml")
    assert mx.mode_scenario(plain, "plain") is plain
    a = mx.mode_scenario(plain, "async")
    assert (a.name, a.config.async_scheduling) == ("matrix-plain.async", True)
    s = mx.mode_scenario(plain, "spec")
    assert s.config.num_speculative_tokens == mx.SPEC_TOKENS
    assert s.model.draft_tokens == [plain.model.token] * mx.SPEC_TOKENS
    assert not s.config.async_scheduling
    # the rest of the scenario is as written
    assert [r.model_dump() for r in s.requests] == [r.model_dump() for r in plain.requests]
    assert s.events == plain.events and s.config.num_gpu_blocks == plain.config.num_gpu_blocks
    assert plain.config.enable_prefix_caching
    assert mx.mode_scenario(plain, "prefix-caching") is None  # it is the plain run
    off = plain.model_copy(update={"config": plain.config.model_copy(
        update={"enable_prefix_caching": False})})
    assert mx.mode_scenario(off, "prefix-caching").config.enable_prefix_caching is True


class _Verdict:
    def __init__(self, observed):
        self.observed = observed


def test_a_cell_says_its_outcome_exit_and_cause():
    no_async = Capabilities("0.9.2", spec_decode=True)
    refused = RunResult.failed("input", "config.async_scheduling: vLLM 0.9.2 has no "
                               "AsyncScheduler (vllm/v1/core/sched/async_scheduler.py); drop it")
    cell = mx.cell_for("0.9.2", "async", refused, _Verdict("error: ..."), no_async, None)
    assert (cell.outcome, cell.exit) == ("n/a", None)
    assert cell.cause == "vLLM 0.9.2 has no AsyncScheduler (vllm/v1/core/sched/async_scheduler.py)"
    # a refusal of a mode the release has is the release refusing the run: exit 2
    cell = mx.cell_for("0.9.2", "spec", RunResult.failed("input", "config.x: no such\nfield"),
                       _Verdict("error"), no_async, None)
    assert (cell.outcome, cell.exit, cell.cause) == ("refused", 2, "config.x: no such field")
    # a refusal with unknown capabilities (the worker never started) is not n/a
    cell = mx.cell_for("0.9.2", "async", refused, None, None, None)
    assert (cell.outcome, cell.exit) == ("refused", 2)
    # a release without the level's engine, as the worker recorded it (RunError.lacks_level):
    # n/a with the Capabilities' reason, or the refusal's own words where they are unknown
    no_v0 = Capabilities("0.11.0")
    lacks = RunResult.failed("input", f"level: v0-engine: {no_v0.refusal('v0-engine')}",
                             lacks_level="v0-engine")
    cell = mx.cell_for("0.11.0", "plain", lacks, None, no_v0, None, "v0-engine")
    assert (cell.outcome, cell.exit, cell.cause) == ("n/a", None, no_v0.refusal("v0-engine"))
    cell = mx.cell_for("0.11.0", "plain", lacks, None, None, None, "v0-engine")
    assert (cell.outcome, cell.exit, cell.cause) == ("n/a", None, lacks.error.message)
    # any other refusal on that release is the release refusing the run, not n/a
    other = RunResult.failed("input", "config.policy: vLLM 0.11.0's EngineArgs has no policy")
    cell = mx.cell_for("0.11.0", "plain", other, None, no_v0, None, "v0-engine")
    assert (cell.outcome, cell.exit) == ("refused", 2)
    env = RunResult.failed("env", "vLLM 0.17.1 failed to import: AttributeError: ...")
    cell = mx.cell_for("0.17.1", "plain", env, None, None, None)
    assert (cell.outcome, cell.exit, cell.cause) == ("error", 3, env.error.message)
    clean = RunResult("clean", steps=22, finished={"A": "FINISHED_LENGTH_CAPPED"})
    cell = mx.cell_for("0.33.0", "plain", clean, _Verdict("clean (1 finished, 22 steps)"), None,
                       None)
    assert (cell.outcome, cell.exit, cell.cause) == ("clean", 0, None)
    stall = RunResult("stall", steps=30)
    cell = mx.cell_for("0.33.0", "spec", stall, _Verdict("stall @10 (2 unfinished)"), None, None)
    assert (cell.outcome, cell.exit, cell.cause) == ("stall", 1, "stall @10 (2 unfinished)")


def _report(cells):
    releases = list(dict.fromkeys(c.release for c in cells))
    modes = list(dict.fromkeys(c.mode for c in cells))
    return MatrixReport(scenario="s", releases_range=">=0.6.5", releases=releases, modes=modes,
                        cells=cells, started="2026-12-03T07:00:00+00:00", seconds=12.5)


def test_the_record_round_trips_counts_and_exits_with_the_worst():
    cells = [MatrixCell("0.9.2", "plain", "clean", 0), MatrixCell("0.9.2", "async", "n/a", None,
                                                                  "no AsyncScheduler"),
             MatrixCell("0.33.0", "plain", "clean", 0), MatrixCell("0.33.0", "async", "clean", 0)]
    report = _report(cells)
    assert MatrixReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert report.exit_code() == 0, "n/a is not a failure"
    assert report.counts() == {"plain": {"clean": 2}, "async": {"n/a": 1, "clean": 1}}
    for extra, code in ((MatrixCell("0.8.1", "plain", "crash", 1, "crash ..."), 1),
                        (MatrixCell("0.8.1", "plain", "refused", 2, "..."), 2),
                        (MatrixCell("0.8.1", "plain", "error", 3, "..."), 3)):
        assert _report([*cells, extra]).exit_code() == code
    assert _report([MatrixCell("a", "plain", "refused", 2), MatrixCell("b", "plain", "error", 3)]
                   ).exit_code() == 3
    with pytest.raises(RecordError, match="MatrixCell.outcome"):
        MatrixCell("0.9.2", "plain", "fine", 0)


def test_the_table_the_causes_and_the_picture(tmp_path):
    from rich.console import Console

    report = _report([MatrixCell("0.9.2", "plain", "clean", 0),
                      MatrixCell("0.9.2", "async", "n/a", None, "no AsyncScheduler"),
                      MatrixCell("0.17.1", "plain", "error", 3, "failed to import"),
                      MatrixCell("0.17.1", "async", "clean", 0)])
    console = Console(width=200, record=True)
    console.print(mx.table(report))
    text = console.export_text()
    assert text.split("\n")[0].split() == ["release", "plain", "async"]
    assert "0.9.2" in text and "n/a" in text and "error" in text
    lines = mx.cause_lines(report)
    assert lines[0] == "0.17.1 plain: error (exit 3): failed to import"
    assert "plain: 1 of 2 clean (1 clean, 1 error)" in lines
    assert "async: 1 of 1 clean (1 clean, 1 n/a)" in lines
    # why a mode is n/a is said on stdout too, not only in matrix.json (newcomer P5)
    assert lines[-1] == "async: n/a on 1 release (0.9.2): no AsyncScheduler", lines
    png = mx.draw(report, tmp_path / "matrix.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = mx.write(report, tmp_path / "m")
    assert MatrixReport.from_dict(json.loads(path.read_text())) == report


def test_cli_bad_range_or_mode_is_exit_2_in_one_line(cli, root, tmp_path):
    # a mode is one of a fixed set: the command line refuses another, naming the choices
    for args, words in ((["--releases", "latest"], "--releases 'latest'"),
                        (["--mode", "fast"], "'fast' is not one of 'plain'")):
        p = cli("matrix", str(root / "scenarios/matrix/plain.yaml"), *args, "--reports",
                str(tmp_path / "r"))
        assert p.returncode == 2, p.stderr
        assert words in p.stderr and len(p.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "r").exists(), "bad input leaves nothing"


def test_several_ranges_are_their_union():
    specs = [SpecifierSet("==0.6.5"), SpecifierSet(">=0.15,<0.34")]
    assert mx.final_releases(INDEX, specs) == ["0.6.5", "0.15.1", "0.33.0"]


V0_SCENARIO = """
name: v0-matrix
level: v0-engine
config: {num_gpu_blocks: 64, block_size: 16}
requests:
  - {id: A, prompt_len: 20, max_tokens: 4}
"""


def _fake_matrix(monkeypatch, results, caps):
    """``matrix.run`` without a release: ``run_pairs`` gives each item the result ``results``
    holds for its (release, mode) and a report folder under the reports folder; the
    Capabilities are ``caps``'s. Returns the (release, scenario name) pairs that ran."""
    from vllm_repro import lab
    from vllm_repro.engine import capabilities
    from vllm_repro.records import ReportDir

    ran = []

    def run_pairs(items, reports, **_kw):
        for item in items:
            ran.append((item.version, item.scenario.name))
            mode = item.scenario.name.partition(".")[2] or "plain"
            item.result = results(item.version, mode)
            item.verdict = _Verdict(item.result.outcome)
            item.report = ReportDir(reports, item.scenario.name, item.version)
            item.report.path.mkdir(parents=True, exist_ok=True)
        return items

    monkeypatch.setattr(lab, "run_pairs", run_pairs)
    monkeypatch.setattr(capabilities, "load", lambda _cache, v: caps[v])
    return ran


def test_a_v0_engine_scenario_shows_the_modes_it_has_no_meaning_for_as_n_a(
        tmp_path, monkeypatch, root):
    """level: v0-engine: async and spec set V1-only fields (the V0 adapter refuses them on every
    release): n/a on every release, never run and never 'refused'; a release without the V0
    engine is n/a too (its Capabilities' reason), so the matrix is clean where V0 runs clean."""
    sc = parse_scenario(yaml.safe_load(V0_SCENARIO))
    caps = {"0.9.2": Capabilities("0.9.2", spec_decode=True, v0_engine=True),
            "0.11.0": Capabilities("0.11.0", spec_decode=True, async_scheduling=True)}

    def results(version, mode):
        if version == "0.11.0":
            return RunResult.failed("input", f"level: v0-engine: {caps[version].refusal('v0-engine')}",
                                    lacks_level="v0-engine")
        return RunResult("clean", steps=6, finished={"A": "FINISHED_LENGTH_CAPPED"})

    ran = _fake_matrix(monkeypatch, results, caps)
    report = mx.run(sc, ["0.9.2", "0.11.0"], list(mx.MODES), tmp_path / "r", ">=0.9")
    assert sorted(ran) == [("0.11.0", "v0-matrix"), ("0.11.0", "v0-matrix.prefix-caching"),
                           ("0.9.2", "v0-matrix"), ("0.9.2", "v0-matrix.prefix-caching")]
    assert report.modes == ["plain", "async", "spec", "prefix-caching"]
    for release in ("0.9.2", "0.11.0"):
        for mode in ("async", "spec"):
            cell = report.cell(release, mode)
            assert (cell.outcome, cell.exit) == ("n/a", None), cell
            assert cell.cause.startswith("level: v0-engine: ") and "config." in cell.cause
    # V0 spec decode is served (n-gram), but the spec overlay names no drafter: still n/a
    assert "speculative_model" in report.cell("0.9.2", "spec").cause
    assert report.cell("0.9.2", "plain").outcome == "clean"
    no_v0 = report.cell("0.11.0", "plain")
    assert (no_v0.outcome, no_v0.cause) == ("n/a", caps["0.11.0"].refusal("v0-engine"))
    assert report.exit_code() == 0
    assert not [c for c in report.cells if c.outcome == "refused"]
    # a scheduler-level scenario still runs every mode (the overlay applies there)
    assert mx.level_refusal(load_scenario(root / "scenarios/matrix/plain.yaml"), "spec") is None


def test_matrix_json_names_each_run_relative_to_the_reports_folder(tmp_path, monkeypatch):
    """A copied (or mounted elsewhere) reports folder still leads from matrix.json to each run."""
    import shutil

    sc = parse_scenario(yaml.safe_load(V0_SCENARIO.replace("level: v0-engine\n", "")))
    caps = {"0.33.0": Capabilities("0.33.0", spec_decode=True, async_scheduling=True)}
    _fake_matrix(monkeypatch, lambda v, m: RunResult("clean", steps=6, finished={"A": "x"}),
                 caps)
    mx.run(sc, ["0.33.0"], ["plain", "spec"], tmp_path / "r", "==0.33.0")
    shutil.copytree(tmp_path / "r", tmp_path / "copy")
    shutil.rmtree(tmp_path / "r")
    written = (tmp_path / "copy" / "_matrix" / "v0-matrix" / "matrix.json").read_text()
    assert str(tmp_path) not in written
    report = MatrixReport.from_dict(json.loads(written))
    assert [c.report for c in report.cells] == ["v0-matrix/0.33.0", "v0-matrix.spec/0.33.0"]
    for cell in report.cells:
        assert mx.cell_report(tmp_path / "copy", cell).is_dir()
    old = MatrixCell("0.33.0", "plain", "clean", 0, report="/elsewhere/x/0.33.0")
    assert mx.cell_report(tmp_path / "copy", old) == Path("/elsewhere/x/0.33.0")


def test_a_fixed_release_run_clean_with_an_audit_finding_is_clean_as_run_says(root, tmp_path):
    """The flagship on 0.10.2 (clean_on): the run goes to its end without the bug, the audit
    finds REQ_STATE @3 outside it. `vllm-repro run` says ok (exit 0, the finding as `also`);
    the matrix's cell says the same: clean, exit 0, the finding named, not `violation` / exit 1.
    On 0.10.1.1 (reproduces_on, expect a crash) the same result is not the bug: violation."""
    from vllm_repro.verdict import exit_code, judge

    from .builders import make_result, make_violation

    sc = load_scenario(root / "scenarios/vllm-23347-priority-preempt-scheduled.yaml")
    result = make_result("violation", steps=34, finished={"L": "FINISHED_LENGTH_CAPPED",
                                                         "H": "FINISHED_LENGTH_CAPPED"},
                         violations=[make_violation().to_dict()])
    verdict = judge(sc, "0.10.2", result)
    assert verdict.ok is True and exit_code([verdict]) == 0  # what `run` says
    cell = mx.cell_for("0.10.2", "plain", result, verdict, None, None)
    assert (cell.outcome, cell.exit, cell.audit_findings) == ("clean", 0, 1)
    assert cell.label() == "clean (+1 audit finding)"
    assert cell.cause.startswith("1 audit finding outside the scenario's own bug: REQ_STATE @3; ")
    buggy = mx.cell_for("0.10.1.1", "plain", result, judge(sc, "0.10.1.1", result), None, None)
    assert (buggy.outcome, buggy.exit, buggy.label()) == ("violation", 1, "violation")
    # the bug itself on 0.10.1.1 (reproduces_on): `run` says ok, exit 0; so does its cell
    crash = make_result("crash", steps=3, crash={
        "type": "AssertionError", "step": 3, "message": "",
        "where": {"file": "vllm/v1/core/sched/scheduler.py", "function": "schedule"}})
    verdict = judge(sc, "0.10.1.1", crash)
    assert verdict.ok is True and exit_code([verdict]) == 0
    bug = mx.cell_for("0.10.1.1", "plain", crash, verdict, None, None)
    assert (bug.outcome, bug.exit, bug.expected, bug.label()) == ("crash", 0, True,
                                                                  "crash (expected)")
    assert bug.cause.startswith("as the scenario expects on 0.10.1.1: crash AssertionError")
    assert _report([bug, cell]).exit_code() == 0

    report = _report([cell, MatrixCell("0.33.0", "plain", "clean", 0)])
    assert report.exit_code() == 0
    assert report.counts() == {"plain": {"clean": 2}}
    assert mx.cause_lines(report)[0].startswith(
        "0.10.2 plain: clean (+1 audit finding) (exit 0): 1 audit finding outside")
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(mx.table(report))
    assert "clean (+1 audit finding)" in console.export_text()
    assert MatrixReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_a_clean_run_where_the_bug_is_expected_is_a_mismatch_as_run_says(root):
    """The flagship's bug did not show on 0.10.1.1 (a reproduces_on release; e.g. its spec-mode
    variant): `vllm-repro run` says NO, exit 1; the cell must not read as a plain clean, exit 0,
    nor let the whole matrix exit 0."""
    from vllm_repro.verdict import exit_code, judge

    from .builders import make_result

    sc = load_scenario(root / "scenarios/vllm-23347-priority-preempt-scheduled.yaml")
    result = make_result("clean", steps=31, finished={"L": "FINISHED_LENGTH_CAPPED",
                                                     "H": "FINISHED_LENGTH_CAPPED"})
    verdict = judge(sc, "0.10.1.1", result)
    assert verdict.ok is False and exit_code([verdict]) == 1  # what `run` says
    cell = mx.cell_for("0.10.1.1", "spec", result, verdict, None, None)
    assert (cell.outcome, cell.exit, cell.label()) == ("clean", 1, "clean (unexpected)")
    assert cell.cause.startswith("not what the scenario expects on 0.10.1.1: ")
    assert _report([cell, MatrixCell("0.10.2", "spec", "clean", 0)]).exit_code() == 1
    fixed = mx.cell_for("0.10.2", "spec", result, judge(sc, "0.10.2", result), None, None)
    assert (fixed.outcome, fixed.exit, fixed.label()) == ("clean", 0, "clean")
