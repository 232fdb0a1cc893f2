"""Slicing without a release: JUnit parsing, result comparison, the tracer's records, and the
committed slice specs (what they hold and the equivalence they record)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_repro.errors import EnvError
from vllm_repro.sources.prepare import V0_ENGINE_FILES, V1_SCHEDULER_FILES
from vllm_repro.slicing import runs
from vllm_repro.slicing.runs import normalise_result, parse_junit
from vllm_repro.slicing.slicer import compare
from vllm_repro.slicing.spec import Trace, load_spec, slices_dir

ROOT = Path(__file__).resolve().parents[2]
#: The releases whose slices the acceptance names: the newest and two older ones (one <= 0.11).
ACCEPTANCE = ("0.10.1.1", "0.11.0", "0.33.0")
#: Each has a committed slice (0.33.0 since it was traced): a missing one fails its tests.
#: 0.6.1.post2 too: a slice of the V0 engine alone (level: v0-engine; its release has no V1
#: engine). And 0.10.2: with 0.10.1.1 it makes the flagship image (issue 20) of slices only.
PROVEN = ACCEPTANCE + ("0.6.1.post2", "0.10.2")
#: Every committed slice (more are added as releases get sliced for the catalog image): each
#: spec must hold what the slicer proved, whether or not the heavy integration runs re-check it.
COMMITTED = tuple(sorted({p.stem for p in slices_dir().glob("*.json")} | set(PROVEN)))


def test_parse_junit_names_tests_like_pytest(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="tests.v1.core.test_scheduler" name="test_a[1]"/>
      <testcase classname="tests.v1.core.test_scheduler" name="test_b"><failure message="x"/></testcase>
      <testcase classname="tests.v1.core.test_kv.TestPool" name="test_c"><skipped/></testcase>
      <testcase classname="tests.v1.core.test_kv" name="test_d"><error message="e"/></testcase>
    </testsuite></testsuites>""")
    assert parse_junit(xml) == {
        "tests/v1/core/test_scheduler.py::test_a[1]": "passed",
        "tests/v1/core/test_scheduler.py::test_b": "failed",
        "tests/v1/core/test_kv.py::TestPool::test_c": "skipped",
        "tests/v1/core/test_kv.py::test_d": "error",
    }


def _results(passed, failed=(), scen=None):
    tests = {t: "passed" for t in passed} | {t: "failed" for t in failed}
    return {"tests": tests, "scenarios": scen or {"s": {"result": {"outcome": "clean"}, "trace": [{"step": 1}]}}}


def test_compare_reports_both_sets_and_the_difference():
    full = _results(["a", "b", "c"], ["d"])
    same = compare(full, _results(["c", "b", "a"], ["d"]))
    assert same["equal"] and same["only_full"] == [] and same["only_slice"] == []
    assert same["passed_full"] == same["passed_slice"] == ["a", "b", "c"]
    worse = compare(full, _results(["a", "b"], ["c", "d"]))
    assert not worse["equal"] and worse["only_full"] == ["c"]


def test_compare_catches_a_different_trace_or_verdict():
    full = _results(["a"])
    other = _results(["a"], scen={"s": {"result": {"outcome": "clean"}, "trace": [{"step": 2}]}})
    assert compare(full, other)["scenarios_differing"] == ["s"]
    other = _results(["a"], scen={"s": {"result": {"outcome": "crash"}, "trace": [{"step": 1}]}})
    assert not compare(full, other)["equal"]


def test_normalise_result_removes_only_what_differs_between_trees(tmp_path):
    res = {"outcome": "crash", "timing": {"run_s": 1}, "engine_log": "x",
           "substitutions": ["pyairports==0.0.1 (uploaded after the release's date)"],  # full env's
           "crash": {"traceback": f'File "{tmp_path}/vllm/a.py", line 3', "step": 3}}
    out = normalise_result(res, tmp_path)
    assert out == {"outcome": "crash", "crash": {"traceback": 'File "<tree>/vllm/a.py", line 3', "step": 3}}
    lab = {"crash": {"traceback": 'File "/x/vllm_repro/engine/loop.py", line 139, in run\n'
                                  'File "/t/vllm/v1/core/sched/scheduler.py", line 530'}}
    text = normalise_result(lab, tmp_path)["crash"]["traceback"]
    assert 'loop.py", line ?' in text and 'scheduler.py", line 530' in text
    # the lab as two checkouts' workers import it: the same frame (a traced run reused by a
    # slice run from another clone differed in this folder alone: "not equivalent")
    a, b = ({"crash": {"traceback": f'File "/c/vllm-repro/labpath/{key}/vllm_repro/engine/loop.py", '
                                    'line 139, in run'}} for key in ("fdc098224f19", "6f887ec4a8bc"))
    assert normalise_result(a, tmp_path) == normalise_result(b, tmp_path)
    assert "<lab>/vllm_repro/engine/loop.py" in normalise_result(a, tmp_path)["crash"]["traceback"]


def test_tracer_records_imports_probes_opens_and_calls(tmp_path):
    """The tracer in a fresh interpreter: a module imported, a probe that imports nothing, a
    data file read, and a call into a 'third-party' package from outside it."""
    root = tmp_path / "root"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("def f():\n    return 1\n")
    (root / "data.json").write_text("{}")
    out = tmp_path / "trace"
    code = textwrap.dedent(f"""
        import importlib.util, sys
        sys.path.insert(0, {str(root)!r})
        from vllm_repro.slicing import tracer
        tracer.install({str(out)!r}, [{str(root)!r}], calls=True)
        importlib.util.find_spec("probed_only_xyz")
        import pkg
        open({str(root / 'data.json')!r}).read()
        pkg.f()
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    t = Trace.load(out)
    assert t.processes == 1
    assert t.modules["pkg"].endswith("pkg/__init__.py")
    assert "probed_only_xyz" in t.probed and "probed_only_xyz" not in t.modules
    assert str((root / "data.json").resolve()) in t.opened
    assert t.calls.get("pkg"), t.calls  # pkg.f called from __main__ (outside pkg)


# ---- the committed slices -------------------------------------------------------------------

def committed() -> list[str]:
    return sorted(p.stem for p in slices_dir().glob("*.json"))


@pytest.mark.xfail(not (slices_dir() / "0.33.0.json").is_file(), strict=True,
                   reason="issue #6: slices/0.33.0.json not traced yet (run `vllm-repro slice 0.33.0`)")
def test_the_acceptance_releases_have_committed_slices():
    assert set(ACCEPTANCE) <= set(committed()), committed()


@pytest.mark.parametrize("version", COMMITTED)
def test_committed_slice_is_complete_and_pinned(version):
    spec = load_spec(version)
    files = spec["files"]
    assert "vllm/__init__.py" in files
    levels = spec["traced"].get("levels") or ["scheduler"]
    if {"scheduler", "engine-core"} & set(levels):  # the V1 scheduler (0.6.6 to 0.7: in core/)
        assert any(f in files for f in V1_SCHEDULER_FILES), levels
    if "v0-engine" in levels:  # the V0 engine the lab drives
        assert all(f in files for f in V0_ENGINE_FILES), levels
    assert all(len(h) == 64 for h in files.values())
    n_vllm = sum(1 for f in files if f.startswith("vllm/"))
    assert 0 < n_vllm < spec["package"]["vllm_files"] / 2
    reqs = spec["requirements"]
    assert "torch" in reqs and all(r["version"] for r in reqs.values())
    assert len(reqs) < spec["summary"]["full_environment_distributions"]
    for top, stub in spec["stubs"].items():
        assert canon(stub["distribution"]) not in reqs, f"{top} is both stubbed and installed"
        assert stub["imported_by"] and stub["why"] and stub["modules_imported"] >= 1
    assert spec["traced"]["scenarios"] and spec["traced"]["tests"]


def canon(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("version", COMMITTED)
def test_recorded_equivalence_lists_both_sets_and_no_difference(version):
    """The heavy part (vLLM's core tests and every scenario, on the full tree with the full
    environment and on the slice with its own) ran once per release in `vllm-repro slice`;
    its record must show the same passing tests and the same scenario results and traces."""
    eq = load_spec(version)["equivalence"]
    full, sliced = set(eq["passed_full"]), set(eq["passed_slice"])
    print(f"\nvLLM {version}: passing on full {len(full)}, on slice {len(sliced)}; "
          f"only full: {sorted(full - sliced)}; only slice: {sorted(sliced - full)}")
    spec = load_spec(version)
    if spec["traced"]["tests"].startswith("none"):  # an sdist without tests (0.6.1.post2): the
        # scenarios alone were compared, so some must have run at each level the slice serves
        ran = {v["outcome"] for v in spec["reference"]["scenarios"].values()} - {"error", "load_error"}
        assert ran and spec["traced"]["levels"], spec["traced"]
    else:
        assert full, "no core test passed on the full tree: the comparison would be empty"
    assert full - sliced == set() and sliced - full == set()
    assert eq["only_full"] == sorted(full - sliced) and eq["only_slice"] == sorted(sliced - full)
    assert eq["scenarios"] >= 1 and eq["scenarios_differing"] == []
    assert eq["equal"] is True
    assert load_spec(version)["reference"]["tests_passed"] == sorted(full)


def test_recheck_reruns_only_differing_tests_and_keeps_real_differences(monkeypatch, tmp_path):
    """A test that failed on one side only (a timeout under a traced, loaded run) is rerun on
    both sides: if the rerun agrees it is flaky and both take the rerun's outcome; a
    difference that repeats stays a difference."""
    from types import SimpleNamespace

    from vllm_repro.slicing import slicer

    rerun = {"full": {"t::flaky": "passed", "t::real": "passed"},
             "other": {"t::flaky": "passed", "t::real": "failed"}}
    asked = []

    def fake_run(env, work, say=None, nodeids=None, **kw):
        asked.append((env.version, sorted(nodeids)))
        return SimpleNamespace(outcomes=rerun[env.version])

    monkeypatch.setattr(slicer.runs, "run_core_tests", fake_run)
    full = {"tests": {"t::flaky": "failed", "t::real": "passed", "t::same": "passed"}}
    other = {"tests": {"t::flaky": "passed", "t::real": "failed", "t::same": "passed"}}
    flaky = slicer.recheck(full, other, SimpleNamespace(version="full"),
                           SimpleNamespace(version="other"), tmp_path, lambda s: None)
    assert asked == [("full", ["t::flaky", "t::real"]), ("other", ["t::flaky", "t::real"])]
    assert flaky == {"t::flaky": {"first": ["failed", "passed"], "rerun": ["passed", "passed"]}}
    assert full["tests"]["t::flaky"] == other["tests"]["t::flaky"] == "passed"
    assert full["tests"]["t::real"] == "passed" and other["tests"]["t::real"] == "failed"
    assert slicer.compare({**full, "scenarios": {}}, {**other, "scenarios": {}})["only_full"] == ["t::real"]


def test_listed_folders_without_python_are_the_build_placeholders():
    """A folder the traced runs listed is made in the slice tree only where the sdist has no
    Python in it (a CUDA build's placeholder): an empty folder where the sdist has a package
    would be taken for a placeholder by the lab's stand-in finder."""
    from vllm_repro.slicing.spec import _no_python

    members = ["vllm/__init__.py", "vllm/vllm_flash_attn/.gitkeep", "vllm/pkg/__init__.py",
               "vllm/pkg/data.json", "vllm/ext/_C.so", "tests/v1/core/test_x.py",
               "vllm/bare"]  # (a folder's own tar entry, nothing in it)
    listed = ["vllm", "vllm/vllm_flash_attn", "vllm/pkg", "vllm/ext", "vllm/never_there",
              "vllm/bare"]
    assert _no_python(listed, members) == ["vllm/bare", "vllm/vllm_flash_attn"]


def _tree(tmp_path, files):
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    return tmp_path


V0_FILES = ("vllm/engine/llm_engine.py", "vllm/core/scheduler.py")


def test_core_tests_of_a_release_with_both_engines_are_v1s_and_v0s(tmp_path):
    """0.8.5 has both engines: the V1 core test files and the V0 engine's tests/core, which
    slicing its V0 engine needs (block/e2e loads a model on a GPU: not selected)."""
    t = _tree(tmp_path, [*V0_FILES, "tests/v1/core/test_scheduler.py", "tests/v1/core/test_prefix_caching.py",
                         "tests/core/test_scheduler.py", "tests/core/block/test_block_table.py",
                         "tests/core/block/e2e/test_correctness.py", "tests/core/utils.py"])
    args, said = runs.core_test_selection(t)
    assert args == ["tests/v1/core/test_scheduler.py", "tests/v1/core/test_prefix_caching.py",
                    "tests/core/test_scheduler.py", "tests/core/block/test_block_table.py"]
    assert said == ("tests/v1/core/{test_scheduler.py,test_prefix_caching.py} "
                    "tests/core/{test_scheduler.py,block/test_block_table.py}")


def test_core_tests_of_a_v0_only_release_and_of_a_tree_without_tests(tmp_path):
    t = _tree(tmp_path / "a", [*V0_FILES, "tests/core/test_scheduler.py"])
    assert runs.core_test_selection(t)[0] == ["tests/core/test_scheduler.py"]
    # V0 tests of a tree without the V0 engine are not run (nothing of the engine to test)
    t = _tree(tmp_path / "b", ["tests/core/test_scheduler.py"])
    with pytest.raises(EnvError, match="neither tests/v1/core nor tests/core"):
        runs.core_test_selection(t)
    # an sdist that ships no tests (0.6.1.post2): the scenarios alone are compared
    t = _tree(tmp_path / "c", [*V0_FILES, "tests/__init__.py"])
    assert runs.core_test_selection(t) == ([], "none (the release's sdist ships no tests)")


def test_core_tests_by_marker_cannot_be_joined_with_v0_files(tmp_path):
    t = _tree(tmp_path, [*V0_FILES, "tests/v1/core/test_scheduler.py", "tests/core/test_scheduler.py"])
    (t / "pyproject.toml").write_text("[tool.pytest.ini_options]\nmarkers = ['cpu_test: ...']\n")
    with pytest.raises(EnvError, match="cpu_test marker"):
        runs.core_test_selection(t)
    (t / "vllm/core/scheduler.py").unlink()  # no V0 engine: the marker alone, as 0.12.0 on
    assert runs.core_test_selection(t) == (["-m", "cpu_test", "tests/v1/core"], "tests/v1/core -m cpu_test")


def test_a_slice_serves_the_levels_at_which_a_scenario_ran_not_those_refused():
    def rec(level, lacks=None, outcome="clean"):
        res = {"level": level, "outcome": outcome}
        if lacks:
            res.update(outcome="error", error={"kind": "input", "message": "no", "lacks_level": lacks})
        return {"result": res}

    # 0.6.1.post2: V1 scenarios refused (no V1 engine), V0 ones ran
    v0_only = {"a": rec("scheduler", "scheduler"), "b": rec("engine-core", "engine-core"),
               "c": rec("v0-engine", outcome="violation"), "bad": {"load_error": "x"}}
    assert runs.served_levels(v0_only) == ["v0-engine"]
    # 0.6.6.post1: the first-generation V1 engine has no engine-core level
    assert runs.served_levels({"a": rec("scheduler"), "b": rec("engine-core", "engine-core"),
                               "c": rec("v0-engine")}) == ["scheduler", "v0-engine"]
    # an input error that is not a missing level (a field the release refuses) still ran there
    refused = rec("engine-core")
    refused["result"]["error"] = {"kind": "input", "message": "config.x: refused"}
    assert runs.served_levels({"b": refused}) == ["engine-core"]


def test_a_distribution_whose_metadata_alone_was_read_keeps_only_its_metadata(tmp_path):
    """huggingface_hub asks for hf-xet's version and never imports it (128 MB over the catalog
    image): the slice environment keeps hf-xet's dist-info, so importlib.metadata finds the
    same version, and nothing of its package; a distribution that was imported is untouched."""
    from vllm_repro.slicing.spec import METADATA_ONLY, keep_metadata_only, metadata_only

    spec = {"requirements": {
        "hf-xet": {"name": "hf-xet", "version": "1.5.0", "modules": 0, "why": METADATA_ONLY},
        "numpy": {"name": "numpy", "version": "2.3.5", "modules": 104}}}
    assert metadata_only(spec) == ["hf-xet"]
    site = tmp_path / "site-packages"
    for dist, files in (("hf_xet-1.5.0", ["hf_xet/__init__.py", "hf_xet/hf_xet.abi3.so", "ns/__init__.py"]),
                        ("numpy-2.3.5", ["numpy/__init__.py", "ns/__init__.py"])):
        info = site / f"{dist}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Name: {dist.split('-')[0]}\nVersion: {dist.split('-')[1]}\n")
        for f in files:
            (site / f).parent.mkdir(parents=True, exist_ok=True)
            (site / f).write_bytes(b"x" * 10)
        (info / "RECORD").write_text("".join(f"{f},sha256=x,10\n" for f in files)
                                     + f"{dist}.dist-info/METADATA,,\n../../../bin/tool,,\n")
    assert keep_metadata_only(site, ["hf-xet"]) == 20
    assert not (site / "hf_xet").exists() and (site / "hf_xet-1.5.0.dist-info/METADATA").is_file()
    assert (site / "numpy/__init__.py").is_file()
    assert (site / "ns/__init__.py").is_file()  # numpy's RECORD lists it too (a shared namespace)
    import importlib.metadata as md

    found = {d.metadata["Name"]: d.version for d in md.distributions(path=[str(site)])}
    assert found == {"hf_xet": "1.5.0", "numpy": "2.3.5"}
