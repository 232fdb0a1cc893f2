"""The committed slices on real releases: same verdicts and step traces as the full tree for every
scenario the lab has, through the CLI as a user runs it; a sliced-out module says how to fix it;
the materialised tree holds only the slice's files.

The core-test half of the equivalence is recorded by `vllm-repro slice` (see
tests/unit/test_slicing.py); these tests rerun the cheap half for real every time.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from vllm_repro.engine.draft_models import DRAFT_MODELS
from vllm_repro.engine.host import child_environment
from vllm_repro.sources.prepare import prepare_release, slice_levels
from vllm_repro.slicing.runs import normalise_clock, normalise_result, scenario_files
from vllm_repro.slicing.spec import load_spec

from ..conftest import ROOT
from ..unit.test_slicing import PROVEN

pytestmark = pytest.mark.slow


def _untraced(f) -> bool:
    """A scenario on a path the committed slices were traced without: a model-based drafter
    (its draft model's module, e.g. ``llama_eagle``), vLLM's own OffloadingConnector /
    MultiConnector, or a reasoning parser (``config.reasoning_parser``: its module, loaded
    lazily from 0.12, e.g. ``deepseek_r1_reasoning_parser``). On a slice such a run is the lab
    failure "the run left the slice" (tested below), on the full tree vLLM's outcome; the full
    tree runs them (``--tree full``). Rank processes (``distributed_executor_backend``, the
    catalog's PP entries #45014 / #48245 as the topology scenarios) are the full tree's only: a
    slice refuses them naming ``--tree full``. Requests with ``allowed_token_ids`` (#54196):
    their failure is the release's own ``InputBatch``'s, and the committed slices were cut
    before the fake worker drove it (a slice keeps the lab's ``PersistentBatch``)."""
    d = yaml.safe_load(f.read_text()) or {}
    config = d.get("config") or {}
    connector = (d.get("kv_transfer_config") or {}).get("kv_connector")
    worker_side = any(isinstance(r, dict) and r.get("allowed_token_ids") is not None
                      for r in d.get("requests") or ())
    return config.get("speculative_method") in DRAFT_MODELS or config.get("reasoning_parser") \
        or connector in ("OffloadingConnector", "MultiConnector") \
        or config.get("distributed_executor_backend") is not None or worker_side


def _run(cli, version, tree, reports):
    # the scenarios of every level the slice was proven at (engine-core too where it was traced)
    files = [str(f) for f in scenario_files(ROOT, levels=slice_levels(version))
             if "topology" not in f.parts  # rank processes: the full tree only (ranks.py)
             and not _untraced(f)]
    proc = cli("run", *files, "--vllm", version, "--tree", tree, "--reports", str(reports), "--json")
    # 1: a scenario not for this release; 2: only where the release refuses a field of a
    # scenario written for newer ones (stress-fcfs-hybrid's mamba_cache_mode before 0.12, an
    # engine-core event or connector report it lacks): each such refusal names the field
    assert proc.returncode in (0, 1, 2), proc.stdout + proc.stderr
    verdicts = {v["scenario"]: v for v in json.loads(proc.stdout)}
    if proc.returncode == 2:
        refused = [v for v in verdicts.values() if v["outcome"] == "error"]
        assert refused and all(re.match(r"error: [\w.\[\] -]+: ", v["observed"]) for v in refused), \
            proc.stdout + proc.stderr
    out = {}
    for name, v in verdicts.items():
        d = reports / name / version
        if not (d / "result.json").is_file():  # refused input: no report (it loses nothing)
            out[name] = (v["outcome"], v["observed"], v["ok"], None, None)
            continue
        raw = json.loads((d / "result.json").read_text())
        assert raw["tree"] == tree, name  # result.json says which tree ran
        res = normalise_result(raw, ROOT)
        res.pop("verdict", None)  # compared through the CLI's verdict above
        # which worker-side state ran: the committed slices were cut before the fake worker
        # drove the release's InputBatch, so a slice keeps the lab's PersistentBatch (said in
        # its note; engine/input_batch.py build); the decisions and traces are compared
        res.pop("worker_state", None)
        for key in ("crash", "refusal"):  # a frame's locals hold block hashes, which vLLM seeds
            if isinstance(res.get(key), dict) and isinstance(res[key].get("context"), dict):
                res[key]["context"].pop("locals", None)  # at random per process
        # tracebacks name the tree: trees/<version>/ (full) or slices/<version>-<key>/ (slice)
        text = re.sub(r'[^\s"\']*/(?:trees|slices)/[^/\s"\']+/', "<tree>/", json.dumps(res, sort_keys=True))
        text = re.sub(r'[^\s"\'\\]*/site-packages/', "<site-packages>/", text)  # full vs slice env
        # (xgrammar's errors carry the time of day)
        trace = normalise_clock((d / "trace.jsonl").read_text()) if (d / "trace.jsonl").is_file() else None
        out[name] = (v["outcome"], v["observed"], v["ok"], text, trace)
    return proc.returncode, out


@pytest.mark.parametrize("version", PROVEN)
def test_scenarios_same_verdicts_and_traces_on_slice_and_full(cli, tmp_path, version):
    rc_full, full = _run(cli, version, "full", tmp_path / "full")
    rc_slice, sliced = _run(cli, version, "slice", tmp_path / "slice")
    assert rc_full == rc_slice
    assert set(full) == set(sliced) and full
    for name in full:
        assert full[name][:3] == sliced[name][:3], name          # verdict
        assert full[name][4] == sliced[name][4], name            # step trace, line for line
        assert full[name][3] == sliced[name][3], name            # result.json less timings/paths


def test_sliced_out_module_names_the_slice_and_the_fix():
    version = PROVEN[-1]
    env = prepare_release(version, tree="slice")
    spec = load_spec(version)
    assert "vllm/entrypoints/openai/api_server.py" not in spec["files"]
    p = subprocess.run([str(env.python), "-c", "import vllm.entrypoints.openai.api_server"],
                       env=child_environment(env), cwd=str(env.tree), capture_output=True, text=True)
    assert p.returncode == 1
    assert (f"vllm.entrypoints.openai.api_server is not in the slice of vLLM {version}; "
            "re-slice with --include vllm.entrypoints.openai.api_server") in p.stderr


def test_a_run_that_leaves_the_slice_is_a_lab_failure_not_a_crash(cli, tmp_path):
    """A fix verified on the slice (as the CPU image runs, VLLM_REPRO_TREE=auto) that imports a
    module the slice leaves out: vLLM raises ModuleNotFoundError inside schedule(), which is the
    slice's doing, not the release's; the lab says so (exit 3), never a crash as the patched
    release's outcome (exit 1, "not verified")."""
    import difflib

    from ..conftest import FLAGSHIP

    version = "0.10.1.1"
    assert "vllm/entrypoints/openai/api_server.py" not in load_spec(version)["files"]
    env = prepare_release(version, tree="slice")
    installed = json.loads((env.root / ".ready.json").read_text())["freeze"]
    assert not any(line.lower().startswith("einops==") for line in installed)  # full env has it
    before = (env.tree / "vllm/v1/core/sched/scheduler.py").read_text().splitlines(keepends=True)
    at = next(i for i, ln in enumerate(before) if ln.startswith("    def schedule(self)")) + 1
    for line, said in (("import vllm.entrypoints.openai.api_server",
                        "it imported vllm.entrypoints.openai.api_server, which the slice leaves out"),
                       # a distribution the slice's environment does not hold
                       ("import einops", "it raised ModuleNotFoundError: No module named 'einops', "
                                         "and the slice's environment holds only")):
        after = [*before[:at], f"        {line}  # noqa\n", *before[at:]]
        patch = tmp_path / f"{line.split()[-1]}.diff"
        patch.write_text("".join(difflib.unified_diff(before, after, "a/vllm/v1/core/sched/scheduler.py",
                                                      "b/vllm/v1/core/sched/scheduler.py")))
        proc = cli("verify", str(FLAGSHIP), "--patch", str(patch), "--vllm", version,
                   "--reports", str(tmp_path / "r"), env={"VLLM_REPRO_TREE": "slice"})
        out = proc.stdout + proc.stderr
        assert proc.returncode == 3, out
        assert f"the run left the slice of vLLM {version}: {said}" in out
        assert "VLLM_REPRO_TREE=full" in out and "the lab failed to run the scenarios" in out
        assert "crash ModuleNotFoundError" not in out


def test_verify_on_auto_runs_each_entry_on_its_levels_tree_and_patches_each_tree(cli, tmp_path):
    """As the CPU image verifies (VLLM_REPRO_TREE=auto): the scheduler-level scenario on the
    slice, the release's V0-engine entry on the tree that serves its level (the slice since
    0.10.1.1 was sliced with its V0 engine on 2026-12-06, the full tree before; once it was run
    on a slice without the V0 engine, "has no V0 engine", the same error before and after
    counted as kept); the full tree's patched copy and the slice's are two, whichever was made
    first."""
    from ..conftest import FLAGSHIP

    fix = ROOT / "scenarios/fixes/vllm-23347-0.10.1.1.diff"
    for tree in ("full", "auto"):  # the full tree's patched copy first, then the slice's
        reports = tmp_path / tree
        proc = cli("verify", str(FLAGSHIP), "--patch", str(fix), "--vllm", "0.10.1.1",
                   "--reports", str(reports), env={"VLLM_REPRO_TREE": tree})
        assert proc.returncode == 0 and "verified" in proc.stdout, proc.stdout + proc.stderr
        bundle = next((reports / "verify").iterdir())
        for label in ("before", "after"):
            trees = {d.name: json.loads((d / "0.10.1.1" / "result.json").read_text())["tree"]
                     for d in (bundle / label).iterdir() if (d / "0.10.1.1" / "result.json").is_file()}
            assert trees[FLAGSHIP.stem] == ("slice" if tree == "auto" else "full"), trees
            v0 = [n for n in trees if n.startswith("vllm-18957")]
            v0_tree = "slice" if tree == "auto" and "v0-engine" in slice_levels("0.10.1.1") else "full"
            assert v0 and all(trees[n] == v0_tree for n in v0), trees
        verdict = json.loads((bundle / "verdict.json").read_text())
        assert all("no V0 engine" not in o["after"] for o in verdict["others"]), verdict["others"]


def test_verify_of_a_patch_that_changes_a_file_the_slice_leaves_out(cli, tmp_path):
    """The fix plus an edit of the OpenAI server (not in the slice; until 0.10.1.1's V0 engine
    was sliced too, V0's scheduler was the file): on auto (the CPU image's tree) every entry
    runs on the full tree, where the patch applies; asked for the slice by name, one line says
    why not and what to set (it read "does not apply cleanly to vLLM 0.10.1.1-<slice key>")."""
    import difflib

    from ..conftest import FLAGSHIP
    from vllm_repro.sources.sdist import tree_dir

    left_out = "vllm/entrypoints/openai/api_server.py"
    assert left_out not in load_spec("0.10.1.1")["files"]
    prepare_release("0.10.1.1", tree="full")
    text = (tree_dir("0.10.1.1") / left_out).read_text().splitlines(keepends=True)
    edit = "".join(difflib.unified_diff(text, [*text[:5], "# noted\n", *text[5:]],
                                        f"a/{left_out}", f"b/{left_out}"))
    patch = tmp_path / "fix-and-server.diff"
    patch.write_text((ROOT / "scenarios/fixes/vllm-23347-0.10.1.1.diff").read_text() + edit)
    proc = cli("verify", str(FLAGSHIP), "--patch", str(patch), "--vllm", "0.10.1.1",
               "--reports", str(tmp_path / "auto"), env={"VLLM_REPRO_TREE": "auto"})
    assert proc.returncode == 0 and "verified" in proc.stdout, proc.stdout + proc.stderr
    assert "every entry on the full tree" in proc.stderr
    bundle = next((tmp_path / "auto" / "verify").iterdir())
    for label in ("before", "after"):
        for d in (bundle / label).iterdir():
            if (d / "0.10.1.1" / "result.json").is_file():
                assert json.loads((d / "0.10.1.1" / "result.json").read_text())["tree"] == "full"
    proc = cli("verify", str(FLAGSHIP), "--patch", str(patch), "--vllm", "0.10.1.1",
               "--reports", str(tmp_path / "slice"), env={"VLLM_REPRO_TREE": "slice"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does not apply cleanly to vLLM 0.10.1.1: " in proc.stderr
    assert "leaves out: verify it on the full tree, VLLM_REPRO_TREE=full" in proc.stderr


def test_materialised_slice_holds_only_its_files():
    version = PROVEN[-1]
    env = prepare_release(version, tree="slice")
    spec = load_spec(version)
    on_disk = {str(p.relative_to(env.tree)) for p in (env.tree / "vllm").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}  # bytecode Python wrote
    assert on_disk == {f for f in spec["files"] if f.startswith("vllm/")}
    # the CUDA build's placeholder folder the traced runs listed is there, empty, as in the
    # full tree (0.16.0's model inspection imports vllm.vllm_flash_attn on the fake CUDA platform)
    if "vllm/vllm_flash_attn" in spec["listed_dirs"]:
        assert (env.tree / "vllm" / "vllm_flash_attn").is_dir()
    installed = {line.split("==")[0].lower().replace("_", "-")
                 for line in json.loads((env.root / ".ready.json").read_text())["freeze"]}
    for stub in spec["stubs"].values():
        assert stub["distribution"].lower().replace("_", "-") not in installed


def test_core_tests_on_the_0_11_slice_pass_exactly_the_recorded_full_set(tmp_path):
    """vLLM 0.11.0's own scheduler / KV-cache / prefix-caching tests, run now on the slice in its
    own environment: the passing set equals the one recorded on the full tree (the cheapest of the
    three releases to rerun; `vllm-repro slice` reran all three when it wrote their specs)."""
    from vllm_repro.slicing.runs import run_core_tests

    version = "0.11.0"
    env = prepare_release(version, tree="slice")
    run = run_core_tests(env, tmp_path / "tests")
    recorded = set(load_spec(version)["reference"]["tests_passed"])
    print(f"\nvLLM {version}: passing on the slice now {len(run.passed)}, recorded on full "
          f"{len(recorded)}; only full: {sorted(recorded - run.passed)}; "
          f"only slice: {sorted(run.passed - recorded)}")
    assert recorded and run.passed == recorded
