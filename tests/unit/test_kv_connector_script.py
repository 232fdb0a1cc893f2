"""The scripted KV connector's failure-path fields without a release (issue 45): per-group
failed loads (``load_fails_groups``), "not yet" lookups (``not_ready_lookups``), delayed frees
of aborted requests (``delay_free_on_abort``) and HMA support (``supports_hma``): what the
scenario accepts, the one-line errors naming field and fix, and what the worker half reports."""

from __future__ import annotations

import re
import textwrap
from types import SimpleNamespace

import pytest

from vllm_repro.engine.kv_worker import ScriptedWorker
from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario

SCENARIO = """
    name: kv
    level: engine-core
    config:
      num_gpu_blocks: 32
      kv_cache_groups: [{type: full}, {type: sliding_window, sliding_window: 32}]
    requests:
      - {id: A, prompt_len: 64}
      - {id: P, prompt_len: 32}
    kv_transfer_config:
      supports_hma: true
      requests:
        A: {external_hit_tokens: 48, load_fails: true, load_fails_groups: [1], not_ready_lookups: 3}
        P: {delay_free_on_abort: true, send_done_at_step: 6}
    limits: {max_steps: 20}
"""


def write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_the_new_fields_load_and_reach_the_worker(tmp_path):
    sc = load_scenario(write(tmp_path, SCENARIO))
    payload = sc.child_payload()["kv_transfer_config"]
    assert payload["supports_hma"] is True
    a, p = payload["requests"]["A"], payload["requests"]["P"]
    assert (a["load_fails_groups"], a["not_ready_lookups"]) == ([1], 3)
    assert (p["delay_free_on_abort"], p["delay_free"], p["send_done_at_step"]) == (True, False, 6)


@pytest.mark.parametrize("old,new,words", [
    ("load_fails: true, ", "",
     "kv_transfer_config.requests.A.load_fails_groups: goes with load_fails: true"),
    ("load_fails_groups: [1]", "load_fails_groups: [2]",
     "kv_transfer_config.requests.A.load_fails_groups: group 2 is past config.kv_cache_groups "
     "(2 group(s)); give indices below 2"),
    ("supports_hma: true", "supports_hma: false",
     "load_fails_groups: group 1 needs kv_transfer_config.supports_hma: true"),
    ("load_fails_groups: [1]", "load_fails_groups: [0, 0]", "a group is named twice"),
    ("load_fails_groups: [1]", "load_fails_groups: [-1]", "load_fails_groups"),
    ("not_ready_lookups: 3", "not_ready_lookups: 21",
     "kv_transfer_config.requests.A.not_ready_lookups: 21 is over limits.max_steps 20"),
    ("delay_free_on_abort: true, ", "",
     "send_done_at_step: goes with delay_free: true or delay_free_on_abort: true"),
    ("supports_hma: true", "supports_hma: true\n      kv_connector: NixlConnector",
     "kv_transfer_config.requests.A.external_hit_tokens: NixlConnector's scheduler half"),
    ("      requests:\n        A:", "      requests:\n        Z:",
     "unknown request id 'Z'"),
])
def test_bad_scripts_are_one_line_input_errors_naming_the_field(tmp_path, old, new, words):
    text = SCENARIO.replace(old, new)
    assert text != SCENARIO
    with pytest.raises(InputError) as e:
        load_scenario(write(tmp_path, text))
    msg = str(e.value)
    assert words in msg and "s.yaml" in msg and "\n" not in msg.strip()


def test_supports_hma_with_vllms_own_connector_is_refused(tmp_path):
    text = SCENARIO.replace("      requests:\n        A: {external_hit_tokens: 48, load_fails: "
                            "true, load_fails_groups: [1], not_ready_lookups: 3}\n        P: "
                            "{delay_free_on_abort: true, send_done_at_step: 6}\n",
                            "      kv_connector: NixlConnector\n")
    assert "NixlConnector" in text
    with pytest.raises(InputError, match="kv_transfer_config.supports_hma: NixlConnector "
                                         "declares its own HMA support"):
        load_scenario(write(tmp_path, text))


def meta(loads=None, sends=None, groups=None):
    """What the scheduler half's build_connector_meta hands the worker."""
    return SimpleNamespace(loads=loads or {}, sends=dict(sends or {}), load_groups=groups or {})


@pytest.mark.parametrize("chosen,invalid", [(None, {1, 2, 7, 8}), ([1], {7, 8}), ([0], {1, 2}),
                                            ([], set())])
def test_a_failed_load_reports_the_blocks_of_the_groups_the_script_names(chosen, invalid):
    """A's load writes blocks 1, 2 in group 0 and 7, 8 in group 1 (block ids are per group);
    the failure reports the named groups' blocks in invalid_block_ids, and the request in
    failed_recving where the release has it."""
    script = {"A": {"external_hit_tokens": 32, "load_fails": True, "load_fails_groups": chosen}}
    both = ScriptedWorker(script, {"invalid_block_ids", "failed_recving"})
    out = both.step(1, meta({"A": ([1, 2], False)}, groups={"A": [[1, 2], [7, 8]]}))
    assert out == (set(), set(), invalid, {"A"})
    only_blocks = ScriptedWorker(script, {"invalid_block_ids"})
    out = only_blocks.step(1, meta({"A": ([1, 2], False)}, groups={"A": [[1, 2], [7, 8]]}))
    assert out == (set(), set(), invalid, set())
    assert only_blocks.groups == {}  # nothing kept once the load is over


def test_an_async_load_fails_with_its_groups_when_it_is_reported():
    script = {"A": {"external_hit_tokens": 32, "load_async": True, "recv_done_at_step": 3,
                    "load_fails": True, "load_fails_groups": [1]}}
    w = ScriptedWorker(script, {"invalid_block_ids"})
    assert w.step(1, meta({"A": ([1, 2], True)}, groups={"A": [[1, 2], [7, 8]]})) == (
        set(), set(), set(), set())
    assert w.transfers_in_flight() == {"A": ("load", [1, 2])}
    assert w.step(3, None) == (set(), {"A"}, {7, 8}, set())



# ---- vLLM's own OffloadingConnector and MultiConnector ----------------------------------------
OWN = """
    name: kv-own
    level: engine-core
    config: {num_gpu_blocks: 32, enable_prefix_caching: true}
    requests:
      - {id: A, prompt_len: 64}
      - {id: C, prompt_len: 64}
    kv_transfer_config:
      kv_connector: OffloadingConnector
      kv_connector_extra_config: {cpu_bytes_to_use: 1000000}
      requests:
        C: {recv_done_at_step: 4}
"""

MULTI = """
    name: kv-multi
    level: engine-core
    config: {num_gpu_blocks: 32}
    requests:
      - {id: P, prompt_len: 48}
      - {id: A, prompt_len: 64}
    kv_transfer_config:
      kv_connector: MultiConnector
      connectors:
        - requests: {P: {delay_free: true, send_done_at_step: 4}}
        - requests: {A: {external_hit_tokens: 32, load_async: true}}
"""


def test_own_connectors_take_vllms_extra_config_and_children(tmp_path):
    own = load_scenario(write(tmp_path, OWN)).child_payload()["kv_transfer_config"]
    assert own["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1000000}
    assert own["requests"]["C"]["recv_done_at_step"] == 4
    multi = load_scenario(write(tmp_path, MULTI)).child_payload()["kv_transfer_config"]
    assert [sorted(c["requests"]) for c in multi["connectors"]] == [["P"], ["A"]]
    assert multi["requests"] == {}


@pytest.mark.parametrize("text,old,new,words", [
    (OWN, "kv_connector_extra_config: {cpu_bytes_to_use: 1000000}", "",
     "kv_transfer_config.kv_connector_extra_config.cpu_bytes_to_use: OffloadingConnector's "
     "CPU spec needs"),
    (OWN, "cpu_bytes_to_use: 1000000", "cpu_bytes_to_use: 10000000000000",
     "kv_connector_extra_config.cpu_bytes_to_use: 10000000000000 is outside 0..2**40"),
    (OWN, "cpu_bytes_to_use: 1000000", "cpu_bytes_to_use: '1e8'",
     "kv_connector_extra_config.cpu_bytes_to_use: '1e8' is not a number"),
    (OWN, "cpu_bytes_to_use: 1000000", "cpu_bytes_to_use: -1",
     "cpu_bytes_to_use: -1 is outside 0..2**40; give a number in that range"),
    (OWN, "C: {recv_done_at_step: 4}", "C: {external_hit_tokens: 16}",
     "kv_transfer_config.requests.C.external_hit_tokens: OffloadingConnector's scheduler half"),
    (MULTI, "kv_connector: MultiConnector",
     "kv_connector: MultiConnector\n      kv_connector_extra_config: {spec_name: X}",
     "kv_transfer_config.kv_connector_extra_config: the scripted connector reads only"),
    (MULTI, "kv_connector: MultiConnector", "kv_connector: ScriptedConnector",
     "kv_transfer_config.connectors: only MultiConnector has children"),
    (MULTI, "A: {external_hit_tokens: 32", "A: {external_hit_tokens: 99",
     "kv_transfer_config.connectors[1].requests.A.external_hit_tokens: 99 is over its "
     "prompt_len 64"),
    (MULTI, "P: {delay_free: true, send", "X: {delay_free: true, send",
     "kv_transfer_config.connectors[0].requests: unknown request id 'X'"),
    (MULTI, "A: {external_hit_tokens: 32, load_async: true}", "A: {load_async: true}",
     "kv_transfer_config.connectors[1].requests.A.load_async: needs `external_hit_tokens"),
    (MULTI, "      connectors:\n", "      requests: {A: {}}\n      connectors:\n",
     "kv_transfer_config.requests: with MultiConnector each child has its own script"),
    (MULTI, "        - requests: {A: {external_hit_tokens: 32, load_async: true}}\n",
     "        - requests: {}\n" * 4, "connectors"),
])
def test_bad_own_connector_configs_are_one_line_input_errors(tmp_path, text, old, new, words):
    bad = text.replace(old, new)
    assert bad != text
    with pytest.raises(InputError) as e:
        load_scenario(write(tmp_path, bad))
    msg = str(e.value)
    assert words in msg and "s.yaml" in msg and "\n" not in msg.strip()


def job(rid, blocks=(), sizes=None):
    """An offloading ``TransferJob`` as vLLM's scheduler half makes it (GPU side: dst of a
    load, ``block_ids`` ordered by group with ``group_sizes``)."""
    spec = SimpleNamespace(block_ids=list(blocks), group_sizes=sizes)
    return SimpleNamespace(req_id=rid, src_spec=None, dst_spec=spec)


def test_offloading_jobs_finish_at_their_steps_and_report_as_vllms_worker():
    """As OffloadingConnectorWorker: a load is reported in finished_recving when done, a store
    never in finished_sending; every finished job by id (completed_jobs); a flushed job is
    done at once (the worker waits for it before its blocks are reused)."""
    w = ScriptedWorker({"C": {"recv_done_at_step": 4}, "A": {"send_done_at_step": 3}}, set())
    offload = SimpleNamespace(load_jobs={7: job("C", [5, 6, 9], [2, 1])},
                              store_jobs={3: job("A"), 4: job("B")}, jobs_to_flush=set())
    assert w.step(2, offload) == (set(), set(), set(), set())
    assert w.completed_jobs == [4]  # B's store: no scripted step, done when learned of
    assert w.transfers_in_flight() == {"C": ("load", [5, 6])}  # group 0's blocks; no stores
    assert w.step(3, SimpleNamespace(load_jobs={}, store_jobs={}, jobs_to_flush=None)) == (
        set(), set(), set(), set())
    assert w.completed_jobs == [3]
    flush = SimpleNamespace(load_jobs={}, store_jobs={8: job("A")}, jobs_to_flush={8})
    w.script["A"]["send_done_at_step"] = 9
    assert w.step(3, flush)[1] == set() and w.completed_jobs == [8]
    assert w.step(4, SimpleNamespace(load_jobs={}, store_jobs={}, jobs_to_flush=None)) == (
        set(), {"C"}, set(), set())
    assert w.completed_jobs == [7] and w.jobs == {}
    assert [e for _, r, e in w.events if r == "C"] == ["load", "recv"]


def test_reset_connector_goes_with_reset_prefix_cache(tmp_path):
    ok = SCENARIO.replace("limits:", "events:\n      - {at_step: 2, reset_prefix_cache: true, "
                                     "reset_connector: true}\n    limits:")
    events = load_scenario(write(tmp_path, ok)).child_payload()["events"]
    assert events[0]["reset_connector"] is True
    bad = ok.replace("reset_prefix_cache: true, ", "pause: true, ")
    with pytest.raises(InputError, match="`reset_connector` goes with reset_prefix_cache: true"):
        load_scenario(write(tmp_path, bad))


def test_store_steps_time_each_store_job_and_old_jobs_carry_a_spec_pair():
    """``store_steps``: each of the request's store jobs is done that many steps after the
    worker learns of it; a load job whose GPU side is the second of a ``transfer_spec`` pair
    (the job's older shape) is watched by its blocks the same way."""
    w = ScriptedWorker({"A": {"store_steps": 2}}, set())
    def meta(loads=None, stores=None):
        return SimpleNamespace(load_jobs=loads or {}, store_jobs=stores or {},
                               jobs_to_flush=None)
    w.step(1, meta(stores={1: job("A")}))
    w.step(2, meta(stores={2: job("A")}))
    assert w.completed_jobs == []
    w.step(3, meta())
    assert w.completed_jobs == [1]
    w.step(4, meta())
    assert w.completed_jobs == [2]
    old = SimpleNamespace(req_id="C", transfer_spec=(None, SimpleNamespace(block_ids=[3, 4],
                                                                          group_sizes=None)))
    w.step(5, meta(loads={9: old}))
    assert w.transfers_in_flight() == {} and w.completed_jobs == [9]
    w.script["C"] = {"recv_done_at_step": 7}
    w.step(6, meta(loads={10: old}))
    assert w.transfers_in_flight() == {"C": ("load", [3, 4])}


@pytest.mark.parametrize("old,new,words", [
    ("C: {recv_done_at_step: 4}", "C: {recv_done_at_step: 4, store_steps: 600}",
     "kv_transfer_config.requests.C.store_steps: 600 is over limits.max_steps 500"),
    ("C: {recv_done_at_step: 4}", "C: {store_steps: 2, send_done_at_step: 3}",
     "store_steps: give it or send_done_at_step, not both"),
])
def test_bad_store_steps_are_input_errors(tmp_path, old, new, words):
    with pytest.raises(InputError, match=re.escape(words)):
        load_scenario(write(tmp_path, OWN.replace(old, new)))
    with pytest.raises(InputError, match="store_steps: times OffloadingConnector's store jobs"):
        load_scenario(write(tmp_path, MULTI.replace("send_done_at_step: 4", "store_steps: 2")))
