"""``vllm-repro doctor`` without a release: the smoke set read from the repository's scenarios,
a row per run as a user reads it (works / degraded / n/a / fails with its seam), the exit code,
and the partial audit's verdict text (issue #42)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_repro.doctor import SMOKE, DoctorReport, DoctorRow, row_of, seam_of, smoke_scenarios
from vllm_repro.engine.capabilities import Capabilities
from vllm_repro.records import AuditSummary, RunError, RunResult
from vllm_repro.verdict import describe_observed

from ..conftest import SCENARIOS

V1 = Capabilities(version="9.9.0", priority=True, engine_core=True, async_scheduling=True,
                  spec_decode=True, kv_cache_groups=True, structured_outputs=True,
                  kv_connectors=True, kv_block_hash="block_hash")


def item(res: RunResult | None):
    return SimpleNamespace(result=res, report_dir=None, scenario=SimpleNamespace(expect=None),
                           verdict=None)


def clean(off=()) -> RunResult:
    return RunResult("clean", finished={"A": "FINISHED_LENGTH_CAPPED"}, steps=7,
                     audit=AuditSummary(checks=7, off=list(off)))


def test_the_smoke_set_covers_every_mode_at_its_level():
    smoke = smoke_scenarios(SCENARIOS)
    assert len(smoke) == len(SMOKE)
    levels = {sc.level for _, sc, _ in smoke}
    assert levels == {"scheduler", "engine-core", "v0-engine"}
    by_mode = {m: sc for m, sc, _ in smoke}
    assert by_mode["async scheduling (engine-core)"].config.async_scheduling
    assert by_mode["async scheduling (engine-core)"].level == "engine-core"
    assert by_mode["spec decode (scheduler)"].config.num_speculative_tokens == 2
    assert any(r.structured_outputs for r in by_mode["structured outputs (engine-core)"].requests)
    assert by_mode["kv connector (engine-core)"].kv_transfer_config
    assert by_mode["hybrid kv cache groups"].config.kv_cache_groups
    # no row but the flagship (a catalog entry, judged by its expectation) carries one
    assert [m for m, sc, _ in smoke if sc.expect is not None] == ["flagship (scheduler)"]
    assert len({sc.name for _, sc, _ in smoke}) == len(smoke)


def test_rows_read_works_degraded_na_and_fails():
    off = ["vLLM 9.9.0's KVCacheBlock has none of the fields _block_hash, block_hash: "
           "KV hash checks off"]
    assert row_of("9.9.0", "m", ("v1-engine",), item(clean()), V1).status == "works"
    row = row_of("9.9.0", "m", ("v1-engine",), item(clean(off)), V1)
    assert (row.status, row.detail) == ("degraded", off[0])
    na = row_of("9.9.0", "V0 engine", ("v0-engine",), item(None), V1)
    assert na.status == "n/a" and "no V0 engine" in na.detail
    lab = RunResult.failed("lab", "the lab does not know vLLM 9.9.0's worker call `frob`")
    row = row_of("9.9.0", "m", ("v1-engine", "engine-core"), item(lab), V1)
    assert row.status == "fails" and row.detail.startswith("the fake worker (engine/fake_executor.py")
    assert row.detail.endswith("worker call `frob`")
    assert row_of("9.9.0", "m", (), item(RunResult("incomplete", steps=3)), V1).status == "finding"
    env = RunResult.failed("env", "cannot build the environment")
    assert row_of("9.9.0", "m", (), item(env), None).detail.startswith("environment: ")
    # a field the release lacks: the release's own refusal, not a failure of the lab
    refused = RunResult.failed("input", "config.mamba_cache_mode: vLLM 9.9.0 has no such field")
    row = row_of("9.9.0", "m", (), item(refused), V1)
    assert row.status == "n/a" and row.detail.endswith("has no such field")
    # a finding on a workload clean elsewhere: the lab ran it; the report says what vLLM did
    found = RunResult("violation", steps=9, finished={}, audit=AuditSummary(checks=9))
    assert row_of("9.9.0", "m", (), item(found), V1).status == "finding"


def test_the_seam_is_the_last_lab_frame():
    tb = ('File "/x/vllm_repro/engine/loop.py", line 1\n'
          'File "/x/vllm_repro/audit/checks.py", line 2\n')
    assert seam_of("Auditor.after_schedule: AttributeError: x", tb).startswith("the audit's books")
    assert seam_of("x", 'File "/x/vllm_repro/engine/adapter/build.py"').startswith("the adapter")
    assert seam_of("x", None).startswith("the lab")


def test_exit_zero_only_when_every_row_works():
    """0 all work (n/a aside), 3 a row fails (the lab cannot run a mode), else 1."""
    rows = [DoctorRow("9.9.0", "a", "works"), DoctorRow("9.9.0", "b", "n/a", "no V0")]
    assert DoctorReport(rows).exit_code() == 0
    assert DoctorReport(rows + [DoctorRow("9.9.0", "c", "degraded", "x")]).exit_code() == 1
    assert DoctorReport(rows + [DoctorRow("9.9.0", "c", "finding", "x")]).exit_code() == 1
    assert DoctorReport(rows + [DoctorRow("9.9.0", "c", "degraded", "x"),
                                DoctorRow("9.9.0", "d", "fails", "x")]).exit_code() == 3


def test_a_partial_audit_is_never_plain_clean():
    res = clean(["vLLM 9.9.0's KVCacheBlock has none of the fields _block_hash, block_hash: "
                 "KV hash checks off"])
    assert describe_observed(res) == "clean (audit partial: KV hash checks off; 1 finished, 7 steps)"
    assert describe_observed(clean()) == "clean (1 finished, 7 steps)"
    assert AuditSummary.from_dict(res.audit.to_dict()).off == res.audit.off
    assert "off" not in clean().audit.to_dict()


def test_the_capabilities_name_what_the_audit_turns_off():
    assert V1.audit_off() == []
    none = Capabilities(version="9.9.0", kv_block_hash=None)
    [line] = none.audit_off()
    assert "_block_hash, block_hash" in line and line.endswith("KV hash checks off")
    # a release without the V1 engine has no V1 audit to turn off
    assert Capabilities(version="0.5.0", v1_engine=False).audit_off() == []
    assert Capabilities.from_dict(V1.to_dict()).kv_block_hash == "block_hash"
    assert RunError("lab", "x").kind == "lab"


def test_cli_newest_asks_the_index_and_no_release_is_exit_2(cli, tmp_path):
    from .fake_index import FakeIndex, make_sdist

    r = cli("doctor", "--reports", str(tmp_path / "r"))
    assert r.returncode == 2 and "give a VERSION (e.g. 0.34.0) or --newest" in r.stderr
    files = {f"vllm-{v}.tar.gz": make_sdist(v) for v in ("0.33.0", "0.34.0", "0.35.0rc1")}
    with FakeIndex(files) as idx:
        # a scenarios folder without the smoke set's files: the newest is named, then exit 2
        r = cli("doctor", "--newest", "--directory", str(tmp_path), "--reports",
                str(tmp_path / "r"), env={"PIP_INDEX_URL": idx.url})
    assert "the index's newest release is 0.34.0" in r.stderr, r.stderr
    assert r.returncode == 2 and f"--directory {tmp_path}: no " in r.stderr and "scenarios/ folder" in r.stderr


def test_an_unknown_book_read_mid_run_turns_off_only_its_check_group():
    """A book renamed in a release the lab does not know, met while a check reads it: that
    group of checks is off for the rest of the run, one line names the class, the attribute and
    the checks; an AttributeError of the lab's own objects is still a lab error."""
    import pytest

    from vllm_repro.audit.auditor import KV_BOOKS, REQUEST_CHECKS, Auditor

    block_cls = type("KVCacheBlock", (), {"__module__": "vllm.v1.core.kv_cache_utils",
                                          "__slots__": ()})
    calls = []

    def reads_a_renamed_field():
        calls.append(1)
        return block_cls().block_hash

    aud = Auditor(SimpleNamespace(version="9.9.0"))
    assert aud._guarded(KV_BOOKS, reads_a_renamed_field) == []
    assert aud.off == ["vLLM 9.9.0's KVCacheBlock has no attribute block_hash: KV book checks off"]
    assert aud._guarded(KV_BOOKS, reads_a_renamed_field) == [] and len(calls) == 1
    assert aud._guarded(REQUEST_CHECKS, lambda: ["finding"]) == ["finding"]
    with pytest.raises(AttributeError):
        aud._guarded(REQUEST_CHECKS, lambda: SimpleNamespace().missing)
    res = clean(aud.off)
    assert describe_observed(res).startswith("clean (audit partial: KV book checks off; ")


def test_a_name_that_is_no_release_is_exit_2_before_anything_runs(cli, tmp_path):
    """`doctor 9.9.9` (a newcomer's false green: twelve n/a rows and exit 0) is refused as `run`
    refuses it: one line naming the nearest releases on the index, exit 2."""
    from .fake_index import FakeIndex, make_sdist

    files = {f"vllm-{v}.tar.gz": make_sdist(v) for v in ("0.33.0", "0.34.0")}
    empty_cache = tmp_path / "cache"
    empty_cache.mkdir()
    with FakeIndex(files) as idx:
        env = {"PIP_INDEX_URL": idx.url, "VLLM_REPRO_CACHE": str(empty_cache)}
        r = cli("doctor", "9.9.9", "--reports", str(tmp_path / "r"), env=env)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "vLLM 9.9.9 is not a release on the index" in r.stderr and "0.34.0" in r.stderr
        assert "rows" not in r.stderr and not (tmp_path / "r").exists()
        r = cli("doctor", "0.34", "--reports", str(tmp_path / "r"), env=env)
        assert r.returncode == 2 and "published as 0.34.0" in r.stderr, r.stderr


def test_a_directory_that_is_not_a_folder_says_so():
    """`doctor --directory /etc/passwd` named a missing file inside it (issue 47's breaker)."""
    from pathlib import Path

    import pytest

    from vllm_repro.errors import InputError

    with pytest.raises(InputError, match="--directory /etc/passwd: not a folder"):
        smoke_scenarios(Path("/etc/passwd"))
