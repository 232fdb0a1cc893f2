"""The catalog's files as a user reads them, without running vLLM: every entry says what it
reproduces and where, its releases are consistent with its own ranges, and its crash log excerpt
(where there is one) shows the exception the entry expects."""

from __future__ import annotations

import pytest
from packaging.version import InvalidVersion, Version

from vllm_repro.catalog import catalog_files, log_signature
from vllm_repro.decisions import has_decisions
from vllm_repro.scenario import load_scenario

from ..conftest import SCENARIOS

ENTRIES = catalog_files(SCENARIOS)
NEWEST = "0.33.0"


def _concrete(values):
    out = []
    for v in values:
        try:
            out.append(Version(v))
        except InvalidVersion:
            continue
    return out


def test_catalog_holds_the_issue_4_entries():
    names = {load_scenario(p).vllm.issue for p in ENTRIES}
    for issue in ("23347", "29747", "45856", "11562", "26372"):
        assert f"vllm-project/vllm#{issue}" in names


@pytest.mark.parametrize("path", ENTRIES, ids=lambda p: p.stem)
def test_entry_names_its_bug_and_releases(path):
    sc = load_scenario(path)
    assert sc.name == path.stem, "the file name is the entry name (reports/<name>/...)"
    assert sc.vllm.issue and sc.vllm.issue.startswith("vllm-project/vllm#")
    assert len(sc.description.split()) >= 40, "the description says what goes wrong and where"
    assert "vllm/" in sc.description or ".py" in sc.description or "Scheduler" in sc.description
    assert sc.expect is not None
    # a run that comes out clean is an entry only where the bug is a wrong decision or a
    # miscounted stat that expect.steps / expect.stats carry
    assert sc.expect.outcome != "clean" or has_decisions(sc.expect)
    assert _concrete(sc.vllm.reproduces_on), "at least one concrete buggy release is run"
    assert _concrete(sc.vllm.clean_on), "at least one concrete fixed release is run"
    # each concrete release falls under the expectation the file gives it, never both
    for v in _concrete(sc.vllm.reproduces_on):
        assert sc.vllm.expectation_for(str(v)) == "reproduce"
    for v in _concrete(sc.vllm.clean_on):
        assert sc.vllm.expectation_for(str(v)) == "clean"
    # the bug was fixed: every buggy release comes before every fixed one
    assert max(_concrete(sc.vllm.reproduces_on)) < min(_concrete(sc.vllm.clean_on))


@pytest.mark.parametrize("path", [p for p in ENTRIES if p.stem != "vllm-23347-priority-preempt-scheduled"],
                         ids=lambda p: p.stem)
def test_new_entries_are_clean_on_the_newest_release_by_their_own_words(path):
    sc = load_scenario(path)
    if sc.level == "v0-engine":  # the V0 engine is gone from 0.11.0: its entries end there
        assert NEWEST not in sc.vllm.clean_on and sc.vllm.expectation_for(NEWEST) is None
        assert max(_concrete(sc.vllm.clean_on)) < Version("0.11.0")
        return
    assert NEWEST in sc.vllm.clean_on
    assert sc.vllm.expectation_for(NEWEST) == "clean"


LOGS = [p.with_suffix(".log") for p in ENTRIES if p.with_suffix(".log").is_file()]


@pytest.mark.parametrize("log", LOGS, ids=lambda p: p.stem)
def test_log_excerpt_triages_to_the_expected_exception(log):
    """`vllm-repro triage` on the excerpt names the exception the entry expects; a whole
    traceback also names the innermost frame the entry expects."""
    sc = load_scenario(log.with_suffix(".yaml"))
    exc_type, frame, cut = log_signature(log)
    assert sc.expect.outcome == "crash"
    assert exc_type == sc.expect.exception
    assert frame is not None, "the excerpt quotes vLLM frames"
    if not cut:
        expected_file, _, expected_func = sc.expect.where.partition(":")
        assert (frame["module"], frame["function"]) == (expected_file, expected_func)


def test_log_signature_marks_cut_excerpts(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        "# a note, ignored: [...]\n"
        "(EngineCore pid=7) ERROR 06-16 07:42:55 [core.py:1138] Traceback (most recent call last):\n"
        "(EngineCore pid=7) ERROR 06-16 07:42:55 [core.py:1138]   File "
        "\"/usr/lib/python3.12/site-packages/vllm/v1/core/sched/scheduler.py\", line 467, "
        "in schedule\n"
        "(EngineCore pid=7) ERROR 06-16 07:42:55 [core.py:1138]   [...]\n"
        "(EngineCore pid=7) ERROR 06-16 07:42:55 [core.py:1138] ValueError: Cannot get 3 free "
        "blocks from the pool\n")
    exc_type, frame, cut = log_signature(log)
    assert exc_type == "ValueError" and cut
    assert (frame["module"], frame["function"]) == ("vllm/v1/core/sched/scheduler.py", "schedule")
    whole = tmp_path / "y.log"
    whole.write_text(log.read_text().replace(
        "(EngineCore pid=7) ERROR 06-16 07:42:55 [core.py:1138]   [...]\n", ""))
    assert log_signature(whole)[2] is False


def test_catalog_command_lists_every_entry_with_its_releases(cli, tmp_path):
    proc = cli("catalog", "--reports", str(tmp_path / "none"))
    assert proc.returncode == 0, proc.stderr
    for p in ENTRIES:
        sc = load_scenario(p)
        row = next((ln for ln in proc.stdout.splitlines() if ln.strip().startswith(sc.name)), None)
        assert row is not None, f"{sc.name} missing from `vllm-repro catalog`"
        assert sc.vllm.issue in row
        for v in _concrete(sc.vllm.reproduces_on + sc.vllm.clean_on):
            assert f"{v}: never run" in row


def test_catalog_run_refuses_a_mistyped_selection_before_running(cli, tmp_path):
    """A typo in --only or --also-on is exit 2 at once, naming it, never an empty green run or
    a traceback after every release has run."""
    reports = tmp_path / "r"
    typo = cli("catalog", "run", "--only", "vllm-2347-priority", "--reports", str(reports))
    assert typo.returncode == 2, typo.stdout + typo.stderr
    assert "--only vllm-2347-priority: no such entry in scenarios" in typo.stderr
    assert "vllm-23347-priority-preempt-scheduled" in typo.stderr  # the entries it could be
    bad = cli("catalog", "run", "--also-on", "banana", "--only",
              "vllm-23347-priority-preempt-scheduled", "--reports", str(reports))
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "'banana' is not a vLLM version number" in bad.stderr
    assert "Traceback" not in bad.stderr and not reports.exists()


def test_a_release_the_index_lacks_is_refused_before_anything_runs(cli, tmp_path):
    """`catalog run --also-on 9.9.9` and `run S.yaml --vllm 9.9.9`: exit 2 in one line naming
    the flag, the nearest releases and how to list them (the check triage --vllm makes), before
    any run: never a column of errors, nor a table row expecting 9.9.9 'clean'."""
    from .fake_index import FakeIndex, make_sdist

    flagship = "vllm-23347-priority-preempt-scheduled"
    with FakeIndex({"vllm-0.10.1.1.tar.gz": make_sdist("0.10.1.1"),
                    "vllm-0.10.2.tar.gz": make_sdist("0.10.2")}) as idx:
        env = {"PIP_INDEX_URL": idx.url, "VLLM_REPRO_CACHE": str(tmp_path / "cache")}
        for args, flag in ((["catalog", "run", "--also-on", "9.9.9", "--only", flagship], "--also-on"),
                           (["run", str(SCENARIOS / f"{flagship}.yaml"), "--vllm", "9.9.9"], "--vllm")):
            proc = cli(*args, "--reports", str(tmp_path / "r"), env=env)
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
            assert lines[0].startswith(f"error: {flag} 9.9.9: vLLM 9.9.9 is not a release on the "
                                       "index; nearest releases: 0.10.1.1, 0.10.2"), lines[0]
            assert "pip index versions vllm" in lines[0]
            assert not proc.stdout.strip() and not (tmp_path / "r").exists(), "nothing ran"


def test_catalog_list_refuses_a_missing_folder(cli, tmp_path):
    proc = cli("catalog", "--directory", str(tmp_path / "nodir"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "nodir: no such catalog folder (--directory)" in proc.stderr


def test_the_docs_count_the_catalog_as_it_is(root, monkeypatch):
    """docs/catalog.md's entries, runs and releases are the catalog's own (a stale '10
    releases' misled a newcomer), with the lab's newest release (settings.NEWEST_RELEASE, which
    the Makefile's NEWEST reads) as the extra release of CATALOG=all."""
    import re

    from vllm_repro.catalog import catalog_items
    from vllm_repro.sources.installed import MODE_VAR

    monkeypatch.delenv(MODE_VAR, raising=False)  # release mode: each entry on its own releases

    from vllm_repro.settings import NEWEST_RELEASE

    newest = NEWEST_RELEASE
    assert "NEWEST_RELEASE" in re.search(r"^NEWEST \?= (.+)$", (root / "Makefile").read_text(),
                                         re.M).group(1), "the Makefile's NEWEST reads settings.py"
    text = " ".join((root / "docs" / "catalog.md").read_text().split())
    m = re.search(r"The whole catalog is (\d+) entries: (\d+) runs on (\d+) releases with "
                  r"`vllm-repro catalog run` \((\d+) with `--also-on ([\d.]+)`", text)
    assert m, "docs/catalog.md no longer says how many entries, runs and releases"
    runs = catalog_items(SCENARIOS)
    with_newest = catalog_items(SCENARIOS, extra=[newest])
    assert (int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5]) == (
        len(ENTRIES), len(runs), len({r.version for r in runs}),
        # the V0 entries are left out on NEWEST, which has no V0 engine (catalog._lacks_level)
        len([r for r in with_newest if not (r.also_on and r.scenario.level == "v0-engine")]), newest)
    assert not re.search(r"runs in about \d+ s", text), "a wall time kept in the docs goes stale"


def test_an_also_on_release_without_the_entrys_engine_is_left_out_not_an_error(tmp_path):
    """`catalog run --also-on 0.33.0` (make cpu-repro CATALOG=all): a V0 entry on a release with
    no V0 engine is left out with a line saying why; on a release the entry names, the same
    refusal stays an error (the entry is wrong), and any other input error stays one."""
    from vllm_repro.catalog import run_catalog
    from vllm_repro.lab import RunItem
    from vllm_repro.records import RunResult

    v0 = next(sc for sc in map(load_scenario, ENTRIES) if sc.level == "v0-engine")
    own = v0.vllm.reproduces_on[0]
    refusal = "level: v0-engine: vLLM {} has no V0 engine (vllm/engine/llm_engine.py ...)"
    items = [RunItem(v0, "0.33.0", also_on=True), RunItem(v0, own),
             RunItem(v0, "0.33.1", also_on=True), RunItem(v0, "0.34.0", also_on=True)]
    # the worker records the refusal as typed (RunError.lacks_level, engine/loop.py's LevelMissing)
    items[0].result = RunResult.failed("input", refusal.format("0.33.0"), lacks_level="v0-engine")
    items[1].result = RunResult.failed("input", refusal.format(own), lacks_level="v0-engine")
    items[2].result = RunResult.failed("input", "config.foo: not a field of vLLM 0.33.1")
    # the same words without the typed record are some other refusal: kept, never guessed at
    items[3].result = RunResult.failed("input", refusal.format("0.34.0"))
    said = []
    import vllm_repro.lab as lab

    orig = lab.run_pairs
    lab.run_pairs = lambda *a, **k: None
    try:
        kept = run_catalog(items, tmp_path, say=said.append)
    finally:
        lab.run_pairs = orig
    assert [(i.version, i.also_on) for i in kept] == [(own, False), ("0.33.1", True),
                                                       ("0.34.0", True)]
    assert said == [f"{v0.name}: not on 0.33.0 ({refusal.format('0.33.0')})"]


def test_the_catalog_does_not_credit_a_variant_run_of_the_same_name_to_the_entry(tmp_path):
    """A variant of the flagship run from another file (same ``name:``, block_size 17) wrote
    the report the catalog reads: it is not the entry's verdict (it showed a false MISMATCH)."""
    import shutil

    from vllm_repro.catalog import catalog_rows
    from vllm_repro.records import ReportDir

    from .builders import make_result

    cat = tmp_path / "cat"
    cat.mkdir()
    entry = cat / "flagship.yaml"
    shutil.copy(SCENARIOS / "vllm-23347-priority-preempt-scheduled.yaml", entry)
    name = load_scenario(entry).name
    reports = tmp_path / "reports"
    for version, text in (("0.10.1.1", entry.read_text().replace("block_size: 16",
                                                                  "block_size: 17")),
                          ("0.10.2", entry.read_text())):
        rd = ReportDir(reports, name, version)
        rd.path.mkdir(parents=True)
        rd.write_result(make_result("crash", scenario=name, vllm=version,
                                    verdict={"ok": False, "observed": "crash X @5"}))
        (rd.path / "scenario.yaml").write_text(text)
    (row,) = catalog_rows(cat, reports)
    lasts = row[-1]
    assert "0.10.1.1: not run as in the catalog (the last run was of another file named" in lasts
    assert "0.10.2: crash X @5 [MISMATCH]" in lasts
