"""Tree choice and release preparation (``vllm_repro.sources.prepare``), without a release."""

from __future__ import annotations

import json
import tempfile
import threading
import time

import pytest

from vllm_repro.errors import InputError
from vllm_repro.sources.prepare import (check_tree, default_tree, release_lock, resolve_tree,
                                        slice_is_equivalent, slice_levels)


@pytest.fixture
def slices(tmp_path, monkeypatch):
    """A slices folder with 1.0.0 (equivalent), 2.0.0 (not equivalent), 3.0.0 (broken JSON)."""
    monkeypatch.setenv("VLLM_REPRO_SLICES", str(tmp_path))
    monkeypatch.delenv("VLLM_REPRO_TREE", raising=False)
    (tmp_path / "1.0.0.json").write_text(json.dumps({"equivalence": {"equal": True}}))
    (tmp_path / "2.0.0.json").write_text(json.dumps({"equivalence": {"equal": False}}))
    (tmp_path / "3.0.0.json").write_text("{not json")
    return tmp_path


def test_auto_takes_only_a_slice_recorded_equivalent(slices):
    assert [slice_is_equivalent(v) for v in ("1.0.0", "2.0.0", "3.0.0", "4.0.0")] == \
        [True, False, False, False]
    assert resolve_tree("1.0.0", "auto") == "slice"
    assert resolve_tree("2.0.0", "auto") == "full"
    assert resolve_tree("4.0.0", "auto") == "full"


def test_auto_gives_engine_core_runs_the_full_tree(slices, monkeypatch):
    # a slice traced before levels were recorded ran scheduler-level scenarios only: it lacks
    # the EngineCore's files
    assert resolve_tree("1.0.0", "auto", level="engine-core") == "full"
    # asked for at a level it never ran at: refused, naming what it serves (a newcomer's run
    # failed inside vLLM, blamed on the release: "the release has no V1 UniProcExecutor")
    with pytest.raises(InputError, match=r"--tree slice: vLLM 1.0.0's slice serves scheduler "
                                         r"runs .*not level: engine-core; use --tree auto"):
        resolve_tree("1.0.0", "slice", level="engine-core")
    with pytest.raises(InputError, match="not level: v0-engine"):
        resolve_tree("1.0.0", "slice", level="v0-engine")
    assert resolve_tree("1.0.0", "slice", level="scheduler") == "slice"
    assert resolve_tree("2.0.0", "slice", level="engine-core") == "slice"  # unproven: as asked
    # none at all: said as the option's error, not the scenario file's (a run blamed the file)
    with pytest.raises(InputError, match=r"^--tree slice: vLLM 4.0.0 has no slice .*; use --tree "
                                         r"auto or --tree full, or slice it"):
        resolve_tree("4.0.0", "slice")
    # asked through the environment (verify has no --tree): the variable is named, not an option
    monkeypatch.setenv("VLLM_REPRO_TREE", "slice")
    with pytest.raises(InputError, match=r"^VLLM_REPRO_TREE=slice: vLLM 1.0.0's slice serves "
                                         r"scheduler runs .*; use VLLM_REPRO_TREE=auto or full"):
        resolve_tree("1.0.0", None, level="engine-core")


def test_auto_gives_engine_core_runs_a_slice_proven_at_that_level(slices):
    """A slice traced and proven with engine-core scenarios too (traced.levels) serves
    engine-core runs; not the V0 engine's, which that slice does not hold."""
    (slices / "5.0.0.json").write_text(json.dumps({
        "equivalence": {"equal": True}, "traced": {"levels": ["scheduler", "engine-core"]}}))
    (slices / "6.0.0.json").write_text(json.dumps({
        "equivalence": {"equal": False}, "traced": {"levels": ["scheduler", "engine-core"]}}))
    assert slice_levels("5.0.0") == ("scheduler", "engine-core")
    assert slice_levels("1.0.0") == ("scheduler",) and slice_levels("6.0.0") == ()
    assert resolve_tree("5.0.0", "auto", level="engine-core") == "slice"
    assert resolve_tree("5.0.0", "auto", level="scheduler") == "slice"
    assert resolve_tree("5.0.0", "auto", level="v0-engine") == "full"
    assert resolve_tree("6.0.0", "auto", level="engine-core") == "full"


def test_a_v0_engine_slice_serves_v0_runs_and_says_when_re_slicing_cannot_help(slices):
    """Since 2026-12-06 the slicer traces the V0 engine too: 0.6.1.post2's slice serves
    ``level: v0-engine`` runs only (the release has no V1 engine). A V1 run asked of it on the
    slice is refused as what it is, a release without that engine, not with advice that cannot
    work (another tree, or re-slicing: the slicer tried that level); building the slice's
    environment checks no level (the runs were resolved before, at their own levels)."""
    (slices / "7.0.0.json").write_text(json.dumps({
        "equivalence": {"equal": True},
        "traced": {"levels": ["v0-engine"], "levels_tried": ["scheduler", "engine-core", "v0-engine"]}}))
    assert resolve_tree("7.0.0", "auto", level="v0-engine") == "slice"
    assert resolve_tree("7.0.0", "auto", level="scheduler") == "full"
    assert resolve_tree("7.0.0", "slice", level="v0-engine") == "slice"
    with pytest.raises(InputError, match=r"^level: scheduler: vLLM 7.0.0 has no engine of that "
                                         r"level .*serves v0-engine runs\); run the scenario on a "
                                         r"release that has one$") as refused:
        resolve_tree("7.0.0", "slice", level="scheduler")
    assert "--tree" not in str(refused.value) and "re-slice" not in str(refused.value)
    assert resolve_tree("7.0.0", "slice", None) == "slice"
    # a slice from before the slicer tried V0 (no levels_tried): re-slicing may add the level
    with pytest.raises(InputError, match=r"or re-slice it \(vllm-repro slice 1.0.0\)$"):
        resolve_tree("1.0.0", "slice", level="v0-engine")


def test_default_tree_comes_from_the_environment(slices, monkeypatch):
    assert default_tree() == "full"
    assert resolve_tree("1.0.0", None) == "full"
    monkeypatch.setenv("VLLM_REPRO_TREE", "auto")
    assert resolve_tree("1.0.0", None) == "slice"
    monkeypatch.setenv("VLLM_REPRO_TREE", "sliced")
    with pytest.raises(InputError, match="VLLM_REPRO_TREE='sliced': expected one of full, slice, auto"):
        default_tree()


def test_check_tree_names_the_choices():
    check_tree(None)
    check_tree("auto")
    with pytest.raises(InputError, match="--tree 'half': expected one of full, slice, auto"):
        check_tree("half")


def test_release_lock_excludes_a_second_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path))
    order: list[str] = []

    def second():
        with release_lock("9.9.9"):
            order.append("second")

    with release_lock("9.9.9"):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        order.append("first done")
    t.join(5)
    assert order == ["first done", "second"]
    assert (tmp_path / "locks" / "9.9.9.lock").is_file()


#: a folder nobody may write, root included (tests run as root too): /proc stands for the CPU
#: image's cache, read-only to its user (as in tests/unit/test_hostile_inputs.py)
NOBODY_WRITES = "/proc/self"


def _prepare(args: list[str], capsys) -> tuple[int, list[str]]:
    from vllm_repro.cli import main

    with pytest.raises(SystemExit) as info:
        main(["prepare", *args], signals=False)
    out, err = capsys.readouterr()
    return info.value.code, [ln for ln in (out + err).splitlines() if ln.strip()]


@pytest.fixture
def read_only_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(cache))
    for var in ("VLLM_REPRO_TREE", "VLLM_REPRO_VLLM"):
        monkeypatch.delenv(var, raising=False)
    return cache


def test_a_read_only_cache_without_the_release_is_one_line_before_the_index(read_only_cache,
                                                                            monkeypatch, capsys):
    """`prepare 0.8.4` in the CPU image (its cache read-only to uid 1000, 0.8.4 not baked): one
    line naming the read-only cache and what to do, exit 3, and the index is never asked (it
    went to the index first, and without a network blamed the index)."""
    from vllm_repro.sources import sdist

    (read_only_cache / "sdists").symlink_to(NOBODY_WRITES)

    def asked(*args, **kwargs):
        raise AssertionError("the index was asked")

    monkeypatch.setattr(sdist, "find_sdist", asked)
    code, lines = _prepare(["0.8.4"], capsys)
    assert code == 3 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: vLLM 0.8.4 (full tree) is not ready in the cache {read_only_cache}, "
                               "and that cache is read-only here")
    assert "prepare it on the host (vllm-repro prepare 0.8.4)" in lines[0]
    assert 'make images VLLM_VERSIONS="catalog 0.8.4"' in lines[0]


def test_prepare_of_a_ready_release_logs_elsewhere_when_the_cache_is_read_only(tmp_path, read_only_cache,
                                                                            monkeypatch, capsys):
    """`prepare 0.10.1.1` (baked) in the CPU image as uid 1000 crashed opening
    <cache>/prepare/0.10.1.1.log (PermissionError, a lab failure); the log goes to a new folder
    in the temporary folder instead, and the release is ready (exit 0)."""
    from vllm_repro.engine import host
    from vllm_repro.sources import prepare
    from vllm_repro.sources.env import ReleaseEnv

    (read_only_cache / "prepare").symlink_to(NOBODY_WRITES)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    logs = []

    class Worker:  # the worker's start: its log opened for appending
        hello = {"platform": "cpu"}
        import_time = "0.1 s"

        def __init__(self, env, log_path, **kwargs):
            self.log_path = log_path

        def __enter__(self):
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.open("a").close()
            logs.append(self.log_path)
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(prepare, "prepare_release", lambda v, say, tree=None, progress=None: ReleaseEnv(
        v, tmp_path / "tree", tmp_path / "env"))
    monkeypatch.setattr(host, "WorkerHandle", Worker)
    code, lines = _prepare(["0.10.1.1"], capsys)
    assert code == 0, lines
    assert lines[-1].startswith("vLLM 0.10.1.1: ready, imported in 0.1 s under cpu")
    assert logs[0].name == "0.10.1.1.log" and logs[0].is_file()
    assert logs[0].parent.parent == tmp_path / "tmp"


def test_prepare_in_a_read_only_cache_reuses_one_private_log_folder_per_user(tmp_path, read_only_cache,
                                                                             monkeypatch):
    """Each `prepare` in the CPU image left a new <tmp>/vllm-repro-prepare-* folder behind; the
    log goes to one folder per user instead, <tmp>/vllm-repro-prepare-<uid> (mode 0700, narrowed
    if it was wider), the same every time. A name another user holds (not a folder of this
    user: here a link) is not used."""
    import os
    import stat

    from vllm_repro.commands.prepare import log_path

    (read_only_cache / "prepare").symlink_to(NOBODY_WRITES)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    own = tmp / f"vllm-repro-prepare-{os.getuid()}"
    first = log_path("0.10.1.1")
    assert first == own / "0.10.1.1.log"
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    own.chmod(0o755)
    assert log_path("0.10.1.1") == first and log_path("0.10.2") == own / "0.10.2.log"
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    assert [p.name for p in tmp.iterdir()] == [own.name]
    own.rmdir()
    (tmp / "elsewhere").mkdir()
    own.symlink_to(tmp / "elsewhere")
    other = log_path("0.10.1.1")
    assert other.parent.parent == tmp and other.parent not in (own, tmp / "elsewhere")
