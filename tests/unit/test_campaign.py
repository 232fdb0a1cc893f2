"""The campaign's parts without a release: the release range over an index, merging tasks into
the table with first / last release, the task order, resuming, the executor's local back end."""

from __future__ import annotations

import json

import pytest

from vllm_repro.campaign.report import merge, span_lines
from vllm_repro.campaign.run import load_done, open_folder, save_task, task_order
from vllm_repro.campaign.spec import CampaignSpec, parse_features, select_releases
from vllm_repro.errors import InputError
from vllm_repro.task_executor import LocalExecutor, check_ray, is_loopback
from vllm_repro.records import CampaignFinding, CampaignTaskResult, RunResult

INDEX = {v: {"filename": f"vllm-{v}.tar.gz"} for v in (
    "0.5.4", "0.6.4", "0.6.5", "0.9.2", "0.10.0", "0.10.1", "0.10.1.1", "0.10.2", "0.11.0rc1",
    "0.11.0", "0.12.0.dev1", "0.33.0", "0.34.0", "0.6.6.post1", "0.8.5+cpu")}
INDEX["0.10.1"] = {"filename": "vllm-0.10.1.tar.gz", "yanked": True}


def test_range_selects_final_v1_releases_in_order():
    assert select_releases(INDEX, ">=0.10,<0.34", "0.6.5") == [
        "0.10.0", "0.10.1.1", "0.10.2", "0.11.0", "0.33.0"]  # no yanked, rc or dev
    assert select_releases(INDEX, None, "0.6.5")[0] == "0.6.5"  # default: every V1 release
    assert "0.5.4" not in select_releases(INDEX, None, "0.6.5")
    assert select_releases(INDEX, "==0.10.*", "0.6.5") == ["0.10.0", "0.10.1.1", "0.10.2"]


@pytest.mark.parametrize("text", [">=banana", "0.10", "", "  "])
def test_a_bad_range_is_one_input_error(text):
    with pytest.raises(InputError, match="--releases"):
        select_releases(INDEX, text, "0.6.5")


def test_an_empty_range_names_the_fix():
    with pytest.raises(InputError, match="widen it"):
        select_releases(INDEX, ">=0.40", "0.6.5")


def test_features_and_ray_values():
    assert parse_features("mixed, default,mixed") == ["mixed", "default"]
    with pytest.raises(InputError, match="--features"):
        parse_features("everything")
    assert check_ray(None) is None and check_ray("auto") == "auto"
    assert check_ray("127.0.0.1:6379") == "127.0.0.1:6379"
    assert check_ray("ray://head:10001", remote=True) == "ray://head:10001"
    with pytest.raises(InputError, match="--ray"):
        check_ray("yes please")


@pytest.mark.parametrize("address", ["127.0.0.1:6379", "127.0.0.2:6379", "localhost:6379",
                                     "ray://127.0.0.1:10001", "[::1]:6379"])
def test_loopback_ray_addresses_are_joined_without_ray_remote(address):
    assert check_ray(address) == address


@pytest.mark.parametrize("address", ["8.8.8.8:6379", "ray://10.0.0.5:10001", "head:6379",
                                     "[2001:db8::1]:6379", "127.0.0.1.example.com:6379"])
def test_a_remote_ray_address_is_refused_before_anything_is_contacted(address):
    # a newcomer's --ray 8.8.8.8:6379 was dialled; now it is exit 2 naming the flag that allows
    # it (names are not resolved: that would ask a DNS server)
    with pytest.raises(InputError, match="not this machine's loopback.*--ray-remote"):
        check_ray(address)
    assert check_ray(address, remote=True) == address
    assert not is_loopback(address.rsplit(":", 1)[0].removeprefix("ray://"))


@pytest.mark.parametrize("command", [["campaign", "--releases", "==0.10.2"],
                                     ["catalog", "run", "--only", "nothing"]])
def test_a_remote_ray_address_is_exit_2_in_one_line_before_ray(command, tmp_path, monkeypatch,
                                                              capsys):
    from vllm_repro import task_executor as executor
    from vllm_repro.cli import main

    def must_not_run(*a, **k):  # pragma: no cover - the point is that it is never reached
        raise AssertionError("the lab tried to open a Ray back end")

    monkeypatch.setattr(executor, "RayExecutor", must_not_run)
    with pytest.raises(SystemExit) as info:
        main([*command, "--ray", "8.8.8.8:6379", "--reports", str(tmp_path)], signals=False)
    out, err = capsys.readouterr()
    assert info.value.code == 2, out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "8.8.8.8" in lines[0] and "--ray-remote" in lines[0], err


def _finding(sig, release, seed, n_requests=1):
    sc = {"requests": [{"id": f"R{i}", "prompt_len": 4, "max_tokens": 2} for i in range(n_requests)]}
    return CampaignFinding(signature=sig, release=release, seed=seed, features="default",
                           scenario=sc, result=RunResult(scenario="fuzz", vllm=release, outcome="crash"))


def _task(release, seed, sigs=(), status="done"):
    return CampaignTaskResult(release=release, seed=seed, status=status,
                              findings=[_finding(s, release, seed) for s in sigs])


RELEASES = ["0.10.0", "0.10.1.1", "0.10.2", "0.11.0"]
TASKS = [_task("0.10.0", 0, ["A"]), _task("0.10.0", 1, ["A", "B"]), _task("0.10.1.1", 0, ["A"]),
         _task("0.10.1.1", 1), _task("0.10.2", 0), _task("0.10.2", 1), _task("0.11.0", 0, ["B"]),
         _task("0.11.0", 1, status="error")]


def test_merge_gives_table_first_last_and_where_gone():
    rep = merge({}, RELEASES, [0, 1], TASKS)
    assert rep.table == {"A": {"0.10.0": 2, "0.10.1.1": 1}, "B": {"0.10.0": 1, "0.11.0": 1}}
    spans = {s.signature: s for s in rep.spans}
    assert (spans["A"].first, spans["A"].last, spans["A"].gone_from) == ("0.10.0", "0.10.1.1", "0.10.2")
    assert (spans["B"].first, spans["B"].last, spans["B"].gone_from) == ("0.10.0", "0.11.0", None)
    assert spans["B"].releases == ["0.10.0", "0.11.0"]
    assert "gone from 0.10.2" in span_lines(rep)[0]


def test_merge_does_not_depend_on_the_order_tasks_ended():
    a = merge({}, RELEASES, [0, 1], TASKS)
    b = merge({}, list(reversed(RELEASES)), [0, 1], list(reversed(TASKS)))
    assert a.to_dict() == b.to_dict()


def test_gone_from_skips_releases_not_searched():
    tasks = [_task("0.10.0", 0, ["A"]), _task("0.10.1.1", 0, status="error"), _task("0.10.2", 0)]
    rep = merge({}, RELEASES[:3], [0], tasks)
    assert rep.spans[0].gone_from == "0.10.2"  # 0.10.1.1 failed to run: not a clean release


def test_task_order_keeps_a_release_on_its_slot():
    assert task_order(["a", "b", "c"], [0, 1], 2) == [("a", 0), ("b", 0), ("a", 1), ("b", 1),
                                                        ("c", 0), ("c", 1)]
    assert sorted(task_order(RELEASES, [0, 1, 2], 3)) == sorted((r, s) for r in RELEASES for s in (0, 1, 2))


def test_resume_keeps_done_and_refused_and_runs_errors_again(tmp_path):
    spec = CampaignSpec(releases_range="", seeds=[0, 1], features=["default"])
    open_folder(tmp_path, spec)
    save_task(tmp_path, _task("0.10.0", 0, ["A"]))
    save_task(tmp_path, _task("0.10.0", 1, status="refused"))
    save_task(tmp_path, _task("0.10.2", 0, status="error"))
    (tmp_path / "tasks" / "0.10.2-seed1.json").write_text("{half a rec")  # interrupted write
    kept = load_done(tmp_path, ["0.10.0", "0.10.2"], [0, 1])
    assert sorted(kept) == [("0.10.0", 0), ("0.10.0", 1)]
    assert kept[("0.10.0", 0)].findings[0].signature == "A"
    open_folder(tmp_path, spec)  # the same campaign: fine
    other = CampaignSpec(releases_range="", seeds=[0], features=["default"])
    with pytest.raises(InputError, match="another campaign"):
        open_folder(tmp_path, other)
    assert json.loads((tmp_path / "spec.json").read_text()) == spec.to_dict()


def test_campaign_id_names_the_options_not_the_releases_found():
    a = CampaignSpec(releases_range=">=0.10", seeds=[0], features=["default"])
    assert a.campaign_id() == CampaignSpec(releases_range=">=0.10", seeds=[0], features=["default"]).campaign_id()
    assert a.campaign_id() != CampaignSpec(releases_range=">=0.10", seeds=[0, 1], features=["default"]).campaign_id()


def _square(x):
    if x == 3:
        raise ValueError("three")
    return x * x


def test_local_executor_runs_tasks_and_reports_a_failed_one():
    with LocalExecutor(2) as ex:
        got = dict(ex.run(_square, [1, 2, 3]))
    assert got[0].value == 1 and got[1].value == 4
    assert got[2].value is None and got[2].error.startswith("ValueError: three")


@pytest.mark.parametrize("args, says", [
    (["campaign", "--releases", ">=banana"], "--releases '>=banana': not a PEP 440 version range"),
    (["campaign", "--releases", ""], "--releases '': an empty range"),
    (["campaign", "--features", "everything"], "--features 'everything'"),
    (["campaign", "--ray", "yes please"], "--ray 'yes please'"),
    (["catalog", "run", "--ray", "yes please"], "--ray 'yes please'"),
    (["bisect", "scenarios/vllm-23347-priority-preempt-scheduled.yaml", "--ray", "x y"], "--ray 'x y'"),
])
def test_bad_campaign_and_ray_input_is_exit_2_in_one_line(cli, args, says):
    proc = cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr


def test_matrix_campaign_and_bisect_hold_the_same_releases_of_a_range():
    """One rule (sources.index.release_version): post releases kept, rc / dev / local / yanked
    left out, in matrix, campaign and bisect's span alike."""
    from packaging.specifiers import SpecifierSet

    from vllm_repro.bisect.search import release_span
    from vllm_repro.matrix import final_releases

    unyanked = [v for v, f in INDEX.items() if not f.get("yanked")]  # matrix reads them so
    want = ["0.6.5", "0.6.6.post1", "0.9.2", "0.10.0", "0.10.1.1", "0.10.2", "0.11.0", "0.33.0"]
    assert final_releases(unyanked, SpecifierSet(">=0.6.5,<0.34")) == want
    assert select_releases(INDEX, ">=0.6.5,<0.34", "0.6.5") == want
    assert release_span(INDEX, "0.6.5", "0.33.0")[2] == want
