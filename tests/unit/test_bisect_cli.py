"""``vllm-repro bisect``: the classification through the verdict module (canned run results)
and the command's table, result line, input and environment errors. No vLLM release is run here
(tests/integration/test_bisect.py runs them)."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from vllm_repro.bisect.run import ReleaseClassifier, framed
from vllm_repro.bisect.search import BAD, GOOD, SKIP
from vllm_repro.errors import InputError
from vllm_repro.lab import RunItem
from vllm_repro.scenario import load_scenario
from vllm_repro.verdict import judge

from ..conftest import FLAGSHIP
from .builders import make_result
from .fake_index import FakeIndex, make_sdist
from .test_bisect_search import INDEX, Fake

# -- the classification: the verdict module's reproduces_on / clean_on judgements -----------------

CRASH = {"outcome": "crash", "steps": 3, "crash": {
    "type": "AssertionError", "message": "", "step": 3, "phase": "schedule",
    "where": {"file": "vllm/v1/core/sched/scheduler.py", "function": "schedule", "line": 1}}}
CLEAN = {"outcome": "clean", "steps": 31, "finished": {"H": "FINISHED_LENGTH_CAPPED", "L": "x"}}
OTHER = {"outcome": "crash", "steps": 2, "crash": dict(CRASH["crash"], type="TypeError", step=2)}
REFUSED = {"outcome": "error", "error": {"kind": "input", "message": "V1 does not support priority yet"}}
BROKEN = {"outcome": "error", "error": {"kind": "env", "message": "import failed"}}


class CannedClassifier(ReleaseClassifier):
    """The real classifier with the run replaced by a canned result per release."""

    def __init__(self, scenario, results):
        super().__init__(scenario, reports=None)
        self.results = results
        self.runs: list[tuple[str, str]] = []

    def _run(self, scenario, version):
        self.runs.append((version, scenario.vllm.expectation_for(version)))
        item = RunItem(scenario, version, result=make_result(**self.results[version]))
        item.verdict = judge(scenario, version, item.result)
        return item


def test_framing_makes_a_release_a_reproduces_on_or_clean_on_release_whatever_the_file_says():
    sc = load_scenario(FLAGSHIP)
    assert sc.vllm.expectation_for("0.10.2") == "clean"
    assert framed(sc, "0.10.2", "reproduce").vllm.expectation_for("0.10.2") == "reproduce"
    assert framed(sc, "0.10.1", "clean").vllm.expectation_for("0.10.1") == "clean"
    assert sc.vllm.expectation_for("0.10.1") == "reproduce", "the scenario itself is untouched"


def test_classification_bad_good_skip_from_the_verdicts():
    sc = load_scenario(FLAGSHIP)
    c = CannedClassifier(sc, {"0.1": CRASH, "0.2": CLEAN, "0.3": OTHER, "0.4": REFUSED, "0.5": BROKEN})
    got = {v: c(v) for v in c.results}
    assert got["0.1"].state == BAD and got["0.1"].observed.startswith("crash AssertionError")
    assert got["0.2"].state == GOOD and got["0.2"].observed == "clean (2 finished, 31 steps)"
    assert got["0.3"].state == SKIP and "exception TypeError != AssertionError" in got["0.3"].reason
    assert (got["0.4"].state, got["0.4"].error_kind) == (SKIP, "input")
    assert got["0.4"].observed == "error: V1 does not support priority yet"
    assert (got["0.5"].state, got["0.5"].error_kind) == (SKIP, "env")
    # a crash expectation audits the same way under both framings: one run a release
    assert [v for v, _ in c.runs] == ["0.1", "0.2", "0.3", "0.4", "0.5"]


def test_an_expected_violation_is_judged_clean_on_a_second_run_that_goes_to_the_end():
    sc = load_scenario(FLAGSHIP).model_copy(update={"expect": load_scenario(FLAGSHIP).expect.model_copy(
        update={"outcome": "violation", "code": "KV_REFCOUNT", "exception": None, "where": None,
                "step": None})})
    c = CannedClassifier(sc, {"0.7.0": CLEAN})
    assert c("0.7.0").state == GOOD
    assert c.runs == [("0.7.0", "reproduce"), ("0.7.0", "clean")]


def test_a_scenario_without_an_expectation_is_refused():
    sc = load_scenario(FLAGSHIP)
    with pytest.raises(InputError, match="expect: missing"):
        ReleaseClassifier(sc.model_copy(update={"expect": None}), reports=None)


# -- the command ------------------------------------------------------------------------------------

def test_cli_table_and_result_line_with_a_fake_classifier(monkeypatch, tmp_path):
    from vllm_repro.bisect import run as bisect_run
    from vllm_repro.cli import app
    from vllm_repro.sources import index

    states = {"0.10.0": BAD, "0.10.1": SKIP, "0.10.1.1": BAD, "0.10.2": GOOD}
    monkeypatch.setattr(index, "list_releases", lambda *a, **k: INDEX)
    monkeypatch.setattr(bisect_run.ReleaseClassifier, "__call__",
                        lambda self, v: Fake(states)(v))
    res = CliRunner().invoke(app, ["bisect", str(FLAGSHIP), "--bad", "0.10.0", "--good", "0.10.2",
                                   "--reports", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    lines = [x.split() for x in res.stdout.splitlines()]
    assert lines[0] == ["release", "observed", "classification"]
    assert [x[0] for x in lines[1:5]] == ["0.10.0", "0.10.1", "0.10.1.1", "0.10.2"]
    assert [x[-1] for x in lines[1:5]] == ["bad", "skip", "bad", "good"]
    assert res.stdout.splitlines()[-1] == "first fixed release: 0.10.2 (last bad: 0.10.1.1); 4 of 4 releases run"


def test_cli_defaults_from_the_scenario_and_input_errors(cli, tmp_path):
    bare = tmp_path / "bare.yaml"
    bare.write_text(FLAGSHIP.read_text().replace('reproduces_on: ["0.10.1.1", ">=0.9.2,<0.10.2"]',
                                                 'reproduces_on: [">=0.9.2,<0.10.2"]'))
    env = {"VLLM_REPRO_CACHE": str(tmp_path / "c")}
    proc = cli("bisect", str(bare), env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {bare}: vllm.reproduces_on names no release to start "
                                   'from; add one (e.g. reproduces_on: ["0.10.1.1"]) or pass --bad VERSION')
    noexp = tmp_path / "noexp.yaml"
    noexp.write_text(FLAGSHIP.read_text().split("\nexpect:")[0] + "\n")
    proc = cli("bisect", str(noexp), env=env)
    assert proc.returncode == 2 and f"{noexp}: expect: missing" in proc.stderr
    proc = cli("bisect", str(FLAGSHIP), "--good", "latest", env=env)
    assert proc.returncode == 2 and "'latest' is not a vLLM version number" in proc.stderr
    with FakeIndex({"vllm-0.10.1.1.tar.gz": make_sdist("0.10.1.1"),
                    "vllm-0.10.2.tar.gz": make_sdist("0.10.2")}) as idx:
        proc = cli("bisect", str(FLAGSHIP), "--good", "0.10.9", env=env | {"PIP_INDEX_URL": idx.url})
    assert proc.returncode == 2
    assert "--good 0.10.9: vLLM 0.10.9 is not a release on the index; nearest releases: 0.10.2" in proc.stderr


def test_cli_unreachable_index_is_exit_3(cli, tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    proc = cli("bisect", str(FLAGSHIP), env={"VLLM_REPRO_CACHE": str(tmp_path / "c"),
                                              "PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple"})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "unreachable" in proc.stderr and not proc.stdout.strip()


def test_each_release_is_prepared_with_the_tree_that_serves_the_scenarios_level(tmp_path, monkeypatch):
    """Under VLLM_REPRO_TREE=auto (the CPU image) a v0-engine entry ran on 0.10.2's slice,
    which serves only the V1 levels: "vllm.core.interfaces is not in the slice", read as
    "--good 0.10.2 does not run clean". Each release gets the tree its slice serves at the
    scenario's level, as `run` gives it."""
    from vllm_repro.sources import prepare as prep

    (tmp_path / "9.0.0.json").write_text('{"equivalence": {"equal": true}, "traced": {"levels": '
                                         '["scheduler", "engine-core"]}}')
    (tmp_path / "9.1.0.json").write_text('{"equivalence": {"equal": true}, "traced": {"levels": '
                                         '["scheduler", "engine-core", "v0-engine"]}}')
    monkeypatch.setenv("VLLM_REPRO_SLICES", str(tmp_path))
    asked = []
    monkeypatch.setattr(prep, "prepare_release", lambda v, say=None, tree=None: asked.append((v, tree)))
    v0 = load_scenario(FLAGSHIP).model_copy(update={"level": "v0-engine"})
    for scenario, want in ((v0, ["full", "slice"]), (load_scenario(FLAGSHIP), ["slice", "slice"])):
        asked.clear()
        runner = ReleaseClassifier(scenario, reports=tmp_path, tree="auto")
        for v in ("9.0.0", "9.1.0"):
            runner._prepare(v)
        assert [t for _, t in asked] == want, scenario.level


# -- bisect --on diff: the release that changed the scheduler's decisions ---------------------------

class CannedDiffClassifier:
    """``DiffClassifier`` with each release's run replaced by a canned trace (a step -> scheduled
    tokens map), ``None`` for a run that errs."""

    def __new__(cls, scenario, reference, traces):
        from vllm_repro.bisect.run import DiffClassifier
        from vllm_repro.records import TraceLine

        c = DiffClassifier(scenario, reference, reports=None)

        def fake_trace(version):
            steps = traces[version]
            item = RunItem(scenario, version, result=make_result(**(BROKEN if steps is None else CLEAN)))
            item.verdict = judge(scenario, version, item.result)
            lines = None if steps is None else [TraceLine(step=s, scheduled=dict(sch))
                                               for s, sch in sorted(steps.items())]
            c.runs.append(version)
            return item, lines

        c.runs = []
        c._trace = fake_trace
        return c


def test_on_diff_a_release_is_bad_where_a_step_differs_from_the_reference():
    sc = load_scenario(FLAGSHIP)
    same = {1: {"L": 30}, 2: {"L": 1, "H": 32}}
    traces = {"0.10.2": same, "0.10.1": dict(same), "0.10.0": {1: {"L": 30}, 2: {"L": 1}},
              "0.9.2": None}
    c = CannedDiffClassifier(sc, "0.10.2", traces)
    assert c("0.10.1").state == GOOD
    obs = c("0.10.0")
    assert obs.state == BAD and obs.observed == "differs from 0.10.2 at step 2 (scheduled)"
    assert c("0.9.2").state == SKIP
    assert c("0.10.2").state == GOOD
    assert c.runs.count("0.10.2") == 1, "the reference runs once"


def test_on_diff_refuses_a_reference_that_does_not_run():
    sc = load_scenario(FLAGSHIP)
    c = CannedDiffClassifier(sc, "0.10.2", {"0.10.2": None, "0.10.1": {1: {"L": 30}}})
    with pytest.raises(InputError, match="the reference release 0.10.2 did not run"):
        c("0.10.1")


def test_cli_on_diff_needs_no_expectation_and_names_its_rule(monkeypatch, tmp_path):
    from vllm_repro.bisect import run as bisect_run
    from vllm_repro.cli import app
    from vllm_repro.sources import index

    states = {"0.10.0": BAD, "0.10.1": BAD, "0.10.1.1": GOOD, "0.10.2": GOOD}
    monkeypatch.setattr(index, "list_releases", lambda *a, **k: INDEX)
    monkeypatch.setattr(bisect_run.DiffClassifier, "__call__", lambda self, v: Fake(states)(v))
    plain = tmp_path / "plain.yaml"
    text = FLAGSHIP.read_text()
    plain.write_text(text[:text.index("expect:")])  # no expectation: --on expect refuses it
    args = ["bisect", str(plain), "--bad", "0.10.0", "--good", "0.10.2", "--reports",
            str(tmp_path / "r")]
    assert isinstance(CliRunner().invoke(app, args).exception, InputError)
    res = CliRunner().invoke(app, [*args, "--on", "diff"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[-1].startswith(
        "first release with 0.10.2's decisions: 0.10.1.1 (last differing: 0.10.1)")
    assert isinstance(CliRunner().invoke(app, [*args, "--on", "nonsense"]).exception, InputError)
