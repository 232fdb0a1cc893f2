"""Integrity of extracted trees (issue 18 item 7, sources/manifest.py): every file's sha256 is
written when a tree is extracted and checked before each run, so an edit to a cached tree is
reported (and recorded with the run) instead of silently changing a verdict; ``prepare
--restore`` extracts the release again; concurrent runs into one reports folder each get their
own worker log."""

from __future__ import annotations

import json
import os
import tarfile
import time

import pytest

from vllm_repro import lab
from vllm_repro.records import RunResult
from vllm_repro.sources import manifest
from vllm_repro.sources import sdist as sd
from vllm_repro.sources.env import ReleaseEnv

from .fake_index import FakeIndex, make_sdist

SCHED = "vllm/v1/core/sched/scheduler.py"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tree(monkeypatch):
    with FakeIndex({"vllm-9.9.9.tar.gz": make_sdist("9.9.9")}) as idx:
        monkeypatch.setenv("PIP_INDEX_URL", idx.url)
        from vllm_repro import settings

        settings.pip_config.cache_clear()
        rel = sd.fetch_sdist("9.9.9")
    return rel, sd.extract_tree(rel)


def test_a_fresh_tree_has_a_manifest_and_no_changes(tree):
    _, t = tree
    files = json.loads((t / manifest.MANIFEST).read_text())["files"]
    assert SCHED in files and files[SCHED][2] == sd.sha256_file(t / SCHED)
    assert manifest.changes(t) == []


def test_edits_additions_links_and_removals_are_each_reported(tree):
    _, t = tree
    with open(t / SCHED, "a") as f:
        f.write("# a debugger's edit\n")
    (t / "vllm/new_module.py").write_text("x = 1\n")
    os.symlink("/etc/passwd", t / "vllm/pw")
    removed = next(p for p in sorted((t / "vllm").rglob("*.py")) if p.name != "scheduler.py"
                   and p.name != "new_module.py")
    removed.unlink()
    found = {str(c) for c in manifest.changes(t)}
    assert found == {f"edited {SCHED}", "added vllm/new_module.py", "added vllm/pw",
                     f"removed {removed.relative_to(t).as_posix()}"}


def test_a_touch_or_an_edit_undone_or_bytecode_is_no_change(tree):
    _, t = tree
    original = (t / SCHED).read_bytes()
    (t / SCHED).write_bytes(original + b"#")
    (t / SCHED).write_bytes(original)  # undone: other mtime, same bytes
    later = time.time() + 5
    os.utime(t / "vllm/__init__.py", (later, later))
    (t / "vllm/__pycache__").mkdir(exist_ok=True)
    (t / "vllm/__pycache__/x.cpython-311.pyc").write_bytes(b"\0")
    assert manifest.changes(t) == []


def test_a_tree_extracted_before_manifests_is_checked_against_its_sdist(tree):
    rel, t = tree
    (t / manifest.MANIFEST).unlink()
    with open(t / SCHED, "a") as f:  # edited before the lab knew manifests
        f.write("# edited long ago\n")
    assert manifest.changes(t) is None  # no manifest: nothing to say
    sd.extract_tree(rel)  # the next prepare writes one, from the sdist's own hashes
    assert [str(c) for c in manifest.changes(t)] == [f"edited {SCHED}"]


def test_a_run_on_an_edited_tree_says_so_and_records_it(tree, tmp_path):
    _, t = tree
    env = ReleaseEnv("9.9.9", t, tmp_path / "env")
    said = []
    assert lab._tree_changes("9.9.9", env, said.append) is None and said == []
    with open(t / SCHED, "a") as f:
        f.write("# edit\n")
    changes = lab._tree_changes("9.9.9", env, said.append)
    assert changes == [f"edited {SCHED}"]
    assert len(said) == 1 and SCHED in said[0] and "prepare 9.9.9 --restore" in said[0]
    from vllm_repro.verdict import judge

    from .builders import make_scenario

    scenario = make_scenario(vllm={"reproduces_on": ["9.9.8"], "clean_on": ["9.9.9"]})
    result = RunResult("clean", scenario="s", vllm="9.9.9", tree_changes=changes)
    v = judge(scenario, "9.9.9", result)
    assert v.ok and v.observed.endswith("(on an edited tree: 1 file(s))")


def test_a_patched_copy_says_what_the_patch_changed_and_no_restore(tree, tmp_path):
    """verify's patched copy carries its marker (``.patched``): the note names the patch's
    files, not the marker, and does not suggest putting back a copy made on purpose."""
    _, t = tree
    env = ReleaseEnv("9.9.9", t, tmp_path / "env")
    with open(t / SCHED, "a") as f:
        f.write("# the fix\n")
    (t / ".patched").write_text("/some/fix.diff\nsha256-prefix 0123456789ab\n")
    said = []
    assert lab._tree_changes("9.9.9", env, said.append) == [f"edited {SCHED}"]
    assert len(said) == 1 and "patched copy" in said[0] and SCHED in said[0], said
    assert "--restore" not in said[0] and ".patched" not in said[0], said


def test_restore_extracts_the_release_again_without_the_edit(tree, isolated_cache):
    from vllm_repro.sources.prepare import restore_trees

    rel, t = tree
    with open(t / SCHED, "a") as f:
        f.write("# edit\n")
    (isolated_cache / "slices" / "9.9.9-abc").mkdir(parents=True)
    gone = restore_trees("9.9.9")
    assert gone == [t, isolated_cache / "slices" / "9.9.9-abc"] and not t.exists()
    assert manifest.changes(sd.extract_tree(rel)) == []


def test_two_runs_at_once_into_one_reports_folder_get_their_own_worker_log(tmp_path):
    log = tmp_path / "_engine" / "0.10.2.log"
    with lab._claimed_log(log) as first, lab._claimed_log(log) as second:
        assert first == log and second == log.with_name(f"0.10.2.{os.getpid()}.log")
        second.write_text("the other run's log\n")
    # its run's part is in that run's engine.log: nothing is left behind (issue 47)
    assert not second.exists()
    ended = log.with_name("0.10.2.999999999.log")  # of a run whose process is gone
    ended.write_text("old\n")
    with lab._claimed_log(log) as again:  # released: the next run has the usual name
        assert again == log
    assert not ended.exists()  # the run that wrote it has ended


@pytest.mark.parametrize("text", ["not json", "", "[1, 2]", '{"files": 5}', '{"files": []}',
                                  '{"files": {"pyproject.toml": 5}}',
                                  '{"files": {"pyproject.toml": [1, 2]}}'])
def test_a_damaged_manifest_is_written_again_from_the_sdist_and_an_edit_still_shows(tree, text):
    rel, t = tree
    with open(t / SCHED, "a") as f:
        f.write("# edit\n")
    (t / manifest.MANIFEST).write_text(text)
    assert manifest.changes(t) is None  # never a crash
    sd.extract_tree(rel)  # the next prepare
    assert [str(c) for c in manifest.changes(t)] == [f"edited {SCHED}"]


def test_a_manifest_that_cannot_be_written_leaves_nothing_behind(tree):
    rel, t = tree
    (t / manifest.MANIFEST).unlink()
    (t / manifest.MANIFEST).mkdir()  # cannot be replaced by a file
    sd.extract_tree(rel)
    assert not (t / f"{manifest.MANIFEST}.tmp").exists()
    assert manifest.changes(t) is None


def test_a_worker_that_cannot_start_replaces_the_previous_report_but_bad_input_does_not(
        tree, tmp_path, monkeypatch):
    """The previous run's "clean, yes" must not stand for a run that just failed (exit 3)."""
    from vllm_repro.records import ReportDir

    from .builders import make_scenario

    monkeypatch.setenv("VLLM_REPRO_WARM", "off")
    _, t = tree
    reports = tmp_path / "reports"
    scenario = make_scenario(name="stale", vllm={"reproduces_on": ["9.9.8"], "clean_on": ["9.9.9"]})
    old = ReportDir(reports, "stale", "9.9.9")
    old.begin()
    old.write_result(RunResult("clean", scenario="stale", vllm="9.9.9"))
    old.commit()
    broken = ReleaseEnv("9.9.9", t, tmp_path / "no-such-env")  # its python does not exist
    item = lab.RunItem(scenario, "9.9.9")
    lab.run_pairs([item], reports, prepare=lambda v: broken)
    assert item.result.outcome == "error" and item.result.error.kind == "env"
    written = json.loads(old.result_path.read_text())
    assert written["outcome"] == "error" and written["verdict"]["ok"] is False
    # an input error (here: a release the index does not have) leaves the report as it was
    from vllm_repro.errors import InputError

    def unknown(version):
        raise InputError(f"vLLM {version} is not on the package index")

    before = old.result_path.read_bytes()
    item = lab.RunItem(scenario, "9.9.9")
    lab.run_pairs([item], reports, prepare=unknown)
    assert item.result.error is not None and item.result.error.kind == "input", item.result
    assert old.result_path.read_bytes() == before


def test_a_tree_from_an_older_parts_list_gets_the_new_parts_and_keeps_its_edit(monkeypatch):
    """Trees extracted before tests/core/ was extracted (2026-12-06, for the V0 engine's tests
    in the slicer) get those files added on the next prepare, without being extracted again: a
    debugger's edit to the tree stays, and stays reported."""
    test_file = tarfile.TarInfo("vllm-9.9.8/tests/core/test_scheduler.py")
    test_file.size = 7
    with FakeIndex({"vllm-9.9.8.tar.gz": make_sdist("9.9.8", [test_file])}) as idx:
        monkeypatch.setenv("PIP_INDEX_URL", idx.url)
        from vllm_repro import settings

        settings.pip_config.cache_clear()
        rel = sd.fetch_sdist("9.9.8")
    old_parts = tuple(p for p in sd.DEFAULT_PARTS if p != "tests/core/")
    t = sd.extract_tree(rel, old_parts)
    assert not (t / "tests/core").exists()
    with open(t / SCHED, "a") as f:
        f.write("# a debugger's edit\n")
    assert sd.extract_tree(rel) == t
    assert (t / "tests/core/test_scheduler.py").read_bytes() == b"x" * 7
    assert {str(c) for c in manifest.changes(t)} == {f"edited {SCHED}"}
    assert "tests/core/" in json.loads((t / ".extracted.json").read_text())["parts"]
    assert "# a debugger's edit" in (t / SCHED).read_text()


def test_a_top_up_that_failed_midway_is_finished_and_recorded_by_the_next(monkeypatch):
    """A full disk halfway through adding tests/core/: the files written before the failure
    are recorded by the next prepare (they are the sdist's bytes), no temporary file is left,
    and the manifest reports nothing (they read "added tests/core/..." on every run)."""
    members = []
    for name in ("a", "b", "c"):
        info = tarfile.TarInfo(f"vllm-9.9.7/tests/core/test_{name}.py")
        info.size = 3
        members.append(info)
    with FakeIndex({"vllm-9.9.7.tar.gz": make_sdist("9.9.7", members)}) as idx:
        monkeypatch.setenv("PIP_INDEX_URL", idx.url)
        from vllm_repro import settings

        settings.pip_config.cache_clear()
        rel = sd.fetch_sdist("9.9.7")
    t = sd.extract_tree(rel, tuple(p for p in sd.DEFAULT_PARTS if p != "tests/core/"))
    real, calls = os.replace, []

    def full_disk(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(sd.os, "replace", full_disk)
    sd.extract_tree(rel)
    monkeypatch.setattr(sd.os, "replace", real)
    assert (t / "tests/core/test_a.py").is_file() and not (t / "tests/core/test_c.py").exists()
    assert not list((t / "tests/core").glob(".*.tmp"))
    sd.extract_tree(rel)
    assert sorted(p.name for p in (t / "tests/core").iterdir()) == ["test_a.py", "test_b.py", "test_c.py"]
    assert manifest.changes(t) == []


def test_a_dropped_sdist_leaves_its_record_its_trees_and_a_clear_error_for_a_new_tree(tree):
    """The CPU image drops each sdist once its trees are made (about 40 MB a release): the
    release is still known from its record and its tree still used, unchanged; only a tree
    that would have to be made from it again fails, saying why, as an environment error."""
    from vllm_repro.errors import EnvError

    rel, t = tree
    size = rel.sdist.stat().st_size
    assert sd.drop_sdist("9.9.9", "dropped by a test") == size
    assert not rel.sdist.exists() and sd.drop_sdist("9.9.9", "again") == 0
    known = sd.cached_release("9.9.9")
    assert known.sha256 == rel.sha256 and known.dropped == "dropped by a test"
    assert sd.extract_tree(known) == t and manifest.changes(t) == []
    import shutil

    shutil.rmtree(t)
    with pytest.raises(EnvError, match=r"^vLLM 9.9.9's sdist is not in this cache \(dropped by a "
                                       r"test\): no tree of it can be made or restored here"):
        sd.extract_tree(known)


def test_restore_refuses_before_removing_a_tree_whose_sdist_was_dropped(tree):
    """In the CPU image (sdists dropped), `prepare --restore` removed the baked tree and then
    could not make it again: the release was gone for that container. It refuses first."""
    from vllm_repro.errors import EnvError
    from vllm_repro.sources.prepare import restore_trees

    _, t = tree
    sd.drop_sdist("9.9.9", "dropped by a test")
    with pytest.raises(EnvError, match="sdist is not in this cache"):
        restore_trees("9.9.9")
    assert (t / SCHED).is_file()
