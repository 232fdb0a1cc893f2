"""The scripted KV connector without a release: the scenario's ``kv_transfer_config`` (its
checks, exit 2 for a script naming an unknown request), the worker half's reports
(:class:`~vllm_repro.engine.kv_worker.ScriptedWorker`), the capabilities' refusal, and the
audit's view of connector loads (KV_TRANSFER_FREED, a planted fault) and delayed frees
(not KV_LEAK)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from vllm_repro.audit import checks
from vllm_repro.audit.codes import KV_LEAK, KV_TRANSFER_FREED
from vllm_repro.engine.capabilities import Capabilities
from vllm_repro.engine.kv_worker import ScriptedWorker
from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario

from .fakes import make_books, vf

SCENARIO = """
    name: kv
    level: engine-core
    config: {num_gpu_blocks: 16}
    requests:
      - {id: A, prompt_len: 64}
      - {id: B, prompt_len: 32}
    kv_transfer_config:
      kv_role: kv_consumer
      requests:
        A: {external_hit_tokens: 48, load_async: true, recv_done_at_step: 4, load_fails: true}
        B: {delay_free: true, send_done_at_step: 9}
"""


def write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return p


# ---- the scenario field ----------------------------------------------------------------------
def test_kv_transfer_config_loads_under_vllms_names_and_reaches_the_worker(tmp_path):
    sc = load_scenario(write(tmp_path, SCENARIO))
    kv = sc.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role) == ("ScriptedConnector", "kv_consumer")
    assert kv.requests["A"].external_hit_tokens == 48 and kv.requests["A"].load_async
    payload = sc.child_payload()["kv_transfer_config"]
    assert payload["requests"]["A"] == {"external_hit_tokens": 48, "load_async": True,
                                        "recv_done_at_step": 4, "load_fails": True,
                                        "load_fails_groups": None, "delay_free": False,
                                        "delay_free_on_abort": False, "send_done_at_step": None,
                                        "not_ready_lookups": 0, "store_steps": None}
    assert payload["supports_hma"] is False
    assert payload["requests"]["B"]["send_done_at_step"] == 9
    # a scenario without one carries none
    plain = load_scenario(write(tmp_path, SCENARIO.split("    kv_transfer_config")[0]))
    assert plain.child_payload()["kv_transfer_config"] is None


@pytest.mark.parametrize("old,new,words", [
    ("A: {external", "X: {external",
     "kv_transfer_config.requests: unknown request id 'X' (no request has it)"),
    ("AA", "AA", None),
    ("external_hit_tokens: 48", "external_hit_tokens: 65",
     "external_hit_tokens: 65 is over its prompt_len 64"),
    ("external_hit_tokens: 48, ", "",
     "kv_transfer_config.requests.A.load_async: needs `external_hit_tokens: N`"),
    ("load_async: true, ", "",
     "kv_transfer_config.requests.A.recv_done_at_step: goes with load_async: true"),
    ("delay_free: true, ", "",
     "kv_transfer_config.requests.B.send_done_at_step: goes with delay_free: true"),
    ("kv_role: kv_consumer", "kv_role: kv_consumer\n      kv_connector: NixlConnector",
     "kv_transfer_config.requests.A.external_hit_tokens: NixlConnector's scheduler half"),
    ("kv_role: kv_consumer", "kv_role: kv_consumer\n      kv_connector: Nixl", "kv_connector"),
    ("send_done_at_step: 9", "send_done_at_step: 900",
     "send_done_at_step: step 900 is past limits.max_steps 500"),
    ("kv_role: kv_consumer", "kv_role: consumer", "kv_role"),
    ("level: engine-core", "level: scheduler", "add `level: engine-core`"),
])
def test_bad_scripts_are_input_errors_naming_the_field(tmp_path, old, new, words):
    if words is None:  # a near-miss id is named back
        text = SCENARIO.replace("A: {external", "Ax: {external")
        with pytest.raises(InputError, match="did you mean 'A'"):
            load_scenario(write(tmp_path, text))
        return
    text = SCENARIO.replace(old, new)
    assert text != SCENARIO
    with pytest.raises(InputError) as e:
        load_scenario(write(tmp_path, text))
    msg = str(e.value)
    assert words in msg and "s.yaml" in msg and "\n" not in msg.strip()


def test_a_script_naming_an_unknown_request_is_exit_2_with_one_line(tmp_path):
    """What a user sees: one line naming the file, the field and the fix; no release is
    prepared and no report is written."""
    path = write(tmp_path, SCENARIO.replace("B: {delay_free", "C: {delay_free"))
    proc = subprocess.run([sys.executable, "-m", "vllm_repro.cli", "run", str(path),
                           "--reports", str(tmp_path / "r")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "s.yaml" in lines[0] and "kv_transfer_config.requests" in lines[0]
    assert "unknown request id 'C'" in lines[0] and "requests[].id" in lines[0]
    assert not (tmp_path / "r" / "kv").exists()


# ---- the worker half -------------------------------------------------------------------------
def meta(loads=None, sends=None):
    """What the scheduler half's build_connector_meta hands the worker (its fields)."""
    return SimpleNamespace(loads=loads or {}, sends=dict(sends or {}))


def test_the_worker_reports_an_async_load_at_its_step_and_a_failed_one_by_the_release_fields():
    script = {"A": {"external_hit_tokens": 48, "load_async": True, "recv_done_at_step": 4},
              "F": {"external_hit_tokens": 16, "load_async": True, "load_fails": True},
              "S": {"external_hit_tokens": 16, "load_fails": True}}
    w = ScriptedWorker(script, {"invalid_block_ids"})
    # step 2: A's and F's loads start (F done at once: its step is the default), S loads
    # synchronously and fails inside the step
    out = w.step(2, meta({"A": ([1, 2, 3], True), "F": ([7], True), "S": ([9], False)}))
    assert out == (set(), {"F"}, {7, 9}, set())
    assert w.transfers_in_flight() == {"A": ("load", [1, 2, 3])}
    assert w.step(3, None) == (set(), set(), set(), set())
    assert w.step(4, None) == (set(), {"A"}, set(), set())
    assert w.transfers_in_flight() == {}
    # a second load of F (after a preemption) succeeds: only the first one fails
    assert w.step(5, meta({"F": ([8], True)})) == (set(), {"F"}, set(), set())
    # where the release reports failed requests (failed_recving) they are named there too
    w2 = ScriptedWorker(script, {"invalid_block_ids", "failed_recving"})
    assert w2.step(1, meta({"S": ([9], False)})) == (set(), set(), {9}, {"S"})
    assert [e for _, _, e in w.events].count("load_failed") == 2


def test_the_worker_reports_a_delayed_free_no_earlier_than_it_learns_of_it():
    w = ScriptedWorker({"B": {"delay_free": True, "send_done_at_step": 9},
                        "C": {"delay_free": True}}, set())
    assert w.step(5, meta(sends={"B": [4, 5], "C": [6]})) == ({"C"}, set(), set(), set())
    assert w.transfers_in_flight() == {"B": ("send", [4, 5])}
    assert w.step(8, None)[0] == set()
    assert w.step(9, None)[0] == {"B"}
    # a send it learns of after its scripted step is reported at once
    w.script["D"] = {"delay_free": True, "send_done_at_step": 2}
    assert w.step(10, meta(sends={"D": [7]}))[0] == {"D"}


def test_the_worker_half_reads_nixls_own_metadata_as_loads_and_sends():
    """vLLM's NixlConnector hands its worker ``reqs_to_recv`` (request id -> ReqMeta with the
    blocks a pull writes, one list per group) and ``reqs_to_send`` (request id -> expiry):
    the worker half reports the pulls in finished_recving and the sends in finished_sending,
    at their scripted steps, with the blocks the audit watches."""
    nixl = SimpleNamespace(reqs_to_recv={"D": SimpleNamespace(local_block_ids=([3, 4], [9]))},
                           reqs_to_send={"P": 1e9}, reqs_in_batch=set())
    w = ScriptedWorker({"D": {"recv_done_at_step": 3}, "P": {"send_done_at_step": 2}}, set(),
                       blocks_of=lambda rid: ([7, 8], [10]))
    assert w.step(1, nixl) == (set(), set(), set(), set())
    assert w.transfers_in_flight() == {"D": ("load", [3, 4]), "P": ("send", [7, 8])}
    empty = SimpleNamespace(reqs_to_recv={}, reqs_to_send={})
    assert w.step(2, empty) == ({"P"}, set(), set(), set())
    assert w.step(3, empty) == (set(), {"D"}, set(), set())
    assert [e for _, _, e in w.events] == ["load", "send", "recv"]


def test_kv_transfer_params_need_a_connector_and_reach_the_worker(tmp_path):
    text = SCENARIO.replace("{id: B, prompt_len: 32}",
                            "{id: B, prompt_len: 32, kv_transfer_params: {do_remote_decode: true}}")
    sc = load_scenario(write(tmp_path, text))
    assert sc.child_payload()["requests"][1]["kv_transfer_params"] == {"do_remote_decode": True}
    bare = text.split("    kv_transfer_config")[0]
    with pytest.raises(InputError, match=r"requests\[1\]\.kv_transfer_params: no KV connector"):
        load_scenario(write(tmp_path, bare))


def test_a_release_without_the_seam_refuses_with_its_version():
    caps = Capabilities(version="0.8.5")
    assert not caps.supports("kv connectors")
    assert "0.8.5" in caps.refusal("kv connectors")
    assert Capabilities(version="0.33.0", kv_connectors=True).supports("kv connectors")


# ---- the audit -------------------------------------------------------------------------------
def test_transfer_freed_fires_when_an_in_flight_load_lost_its_blocks():
    """A planted fault: A's load writes blocks 1-3; the scheduler freed A (aborted while its
    load was in flight) and handed block 2 to B."""
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1, 2, 3], "B": [4]},
                          statuses={"A": "WAITING_FOR_REMOTE_KVS"})
    assert checks.check_transfer_blocks(books, {"A": ("load", [1, 2, 3])}) == []
    assert checks.check_transfer_blocks(books, {}) == []
    mgr = books.managers[0]
    mgr.req_to_blocks.pop("A")
    mgr.req_to_blocks["B"].append(books.blocks[2])
    out = checks.check_transfer_blocks(books, {"A": ("load", [1, 2, 3])})
    assert [(vf(v, "code"), vf(v, "requests"), vf(v, "blocks")) for v in out] == [
        (KV_TRANSFER_FREED, ["A", "B"], [1, 2, 3])]
    assert "A's asynchronous KV load is still writing block(s) 1, 2, 3" in vf(out[0], "message")
    assert "now held by B" in vf(out[0], "message")


def test_transfer_freed_fires_when_a_delayed_free_is_freed_before_its_send():
    """A planted fault: P finished and its connector delayed the free for a send (blocks 5, 6);
    a second free (an abort of the finished request) gave them back before finished_sending."""
    books, s = make_books(num_gpu_blocks=8, tables={"P": [5, 6]},
                          statuses={"P": "FINISHED_STOPPED"})
    s.connector = object()
    assert checks.check_transfer_blocks(books, {"P": ("send", [5, 6])}) == []
    books.managers[0].req_to_blocks.pop("P")
    del s.requests["P"]
    out = checks.check_transfer_blocks(books, {"P": ("send", [5, 6])})
    assert [(vf(v, "code"), vf(v, "requests"), vf(v, "blocks")) for v in out] == [
        (KV_TRANSFER_FREED, ["P"], [5, 6])]
    assert "P's KV send (a delayed free) is still reading block(s) 5, 6 (not reported in " \
        "finished_sending)" in vf(out[0], "message")


def test_a_delayed_free_is_not_a_leak_while_the_scheduler_has_a_connector():
    """A finished request the scheduler keeps (request_finished returned True, or an aborted
    load in flight) holds its blocks legitimately; without a connector it is a leak."""
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1, 2]},
                          statuses={"A": "FINISHED_ABORTED"})
    s.waiting.clear()
    out = checks.check_leaks(books, s.requests, {})
    assert [(vf(v, "code"), vf(v, "requests")) for v in out] == [(KV_LEAK, ["A"])]
    s.connector = object()
    assert checks.check_leaks(books, s.requests, {}) == []
    # gone from the scheduler with its blocks still held: a leak, connector or not
    del s.requests["A"]
    assert [vf(v, "code") for v in checks.check_leaks(books, s.requests, {})] == [KV_LEAK]
