"""Structured outputs without a release: the scenario fields (``requests[].structured_outputs``,
``model.tokens``), the adapter's mapping onto the release's params class (found by probing
``SamplingParams``' fields: ``structured_outputs`` / ``StructuredOutputsParams`` or
``guided_decoding`` / ``GuidedDecodingParams``), the bitmask rows the fake runner reads, and
sampling through them."""

from __future__ import annotations

import sys
import textwrap
import types
from dataclasses import dataclass, field

import numpy as np
import pytest

from vllm_repro.engine import state
from vllm_repro.engine.adapter import EOS_TOKEN_ID, RefusedByRelease, Scheduled, fields_of
from vllm_repro.engine.adapter.requests import RequestsMixin
from vllm_repro.engine.fake_runner import FakeModelRunner, allowed, highest_allowed
from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario

from .fakes import Request

SCENARIO = """
    name: so
    level: engine-core
    config: {num_gpu_blocks: 16}
    requests:
      - {id: A, prompt_len: 8, structured_outputs: {json: {type: object}, disable_any_whitespace: true}}
      - {id: B, prompt_len: 8, structured_outputs: {regex: "t4(t5)*"}}
      - {id: C, prompt_len: 8}
    model:
      tokens: {B: [4, 5]}
"""


def write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return p


# ---- the scenario fields ---------------------------------------------------------------------
def test_structured_outputs_load_under_vllms_names(tmp_path):
    sc = load_scenario(write(tmp_path, SCENARIO))
    a, b, c = sc.requests
    assert a.structured_outputs.params() == {"json": {"type": "object"},
                                             "disable_any_whitespace": True}
    assert b.structured_outputs.params() == {"regex": "t4(t5)*"}
    assert c.structured_outputs is None
    assert sc.model.tokens == {"B": [4, 5]}
    payload = sc.child_payload()  # what the worker receives: vLLM's spelling, `json`
    assert [r["structured_outputs"] for r in payload["requests"]] == [
        {"json": {"type": "object"}, "disable_any_whitespace": True}, {"regex": "t4(t5)*"}, None]


@pytest.mark.parametrize("mutation,words", [
    ('structured_outputs: {regex: "a", choice: [a]}', "exactly one of"),
    ("structured_outputs: {disable_any_whitespace: true}", "exactly one of"),
    ("structured_outputs: {regex: 3}", "regex"),
    ('structured_outputs: {regex: "a", _backend: xgrammar}', "not a structured-outputs parameter"),
    ('structured_outputs: {regex: "a", extra: [1]}', "only plain values"),
])
def test_a_bad_constraint_is_one_line_naming_the_field(tmp_path, mutation, words):
    text = SCENARIO.replace('structured_outputs: {regex: "t4(t5)*"}', mutation)
    with pytest.raises(InputError) as err:
        load_scenario(write(tmp_path, text))
    assert words in str(err.value) and "requests" in str(err.value)


def test_structured_outputs_need_level_engine_core(tmp_path):
    text = SCENARIO.replace("level: engine-core", "level: scheduler")
    with pytest.raises(InputError) as err:
        load_scenario(write(tmp_path, text))
    assert "level: engine-core" in str(err.value) and "structured_outputs" in str(err.value)


def test_scripted_tokens_name_known_requests(tmp_path):
    with pytest.raises(InputError) as err:
        load_scenario(write(tmp_path, SCENARIO.replace("tokens: {B:", "tokens: {Z:")))
    assert "model.tokens" in str(err.value) and "'Z'" in str(err.value)


# ---- the adapter's mapping -----------------------------------------------------------------------
@dataclass
class StructuredOutputsParams:  # vllm/sampling_params.py, 0.11+
    json: str | dict | None = None
    regex: str | None = None
    choice: list | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    _backend: str | None = field(default=None, init=False)


@dataclass
class GuidedDecodingParams:  # up to 0.10
    json: str | dict | None = None
    regex: str | None = None
    choice: list | None = None
    grammar: str | None = None
    backend: str | None = None


class NewSamplingParams:
    __struct_fields__ = ("max_tokens", "structured_outputs")

    def __init__(self, *args, **kwargs):
        self.__dict__.update(kwargs)


class OldSamplingParams:
    __struct_fields__ = ("max_tokens", "guided_decoding")

    def __init__(self, *args, **kwargs):
        self.__dict__.update(kwargs)


class FakeAdapter(RequestsMixin):
    version = "9.9.9"

    def __init__(self, sampling_params):
        self.SamplingParams = sampling_params


@pytest.fixture
def sampling_module(monkeypatch):
    mod = types.ModuleType("vllm.sampling_params")
    mod.StructuredOutputsParams = StructuredOutputsParams
    mod.GuidedDecodingParams = GuidedDecodingParams
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", mod)
    return mod


def test_the_params_class_follows_sampling_params_fields(sampling_module):
    new = FakeAdapter(NewSamplingParams)
    assert new.structured_params_class() == ("structured_outputs", StructuredOutputsParams)
    kw = new.structured_outputs_kwargs("A", {"json": {"type": "object"},
                                             "disable_any_whitespace": True})
    assert kw == {"structured_outputs": StructuredOutputsParams(json={"type": "object"},
                                                                disable_any_whitespace=True)}
    old = FakeAdapter(OldSamplingParams)
    assert old.structured_params_class() == ("guided_decoding", GuidedDecodingParams)
    assert old.structured_outputs_kwargs("A", {"regex": "a+"}) == {
        "guided_decoding": GuidedDecodingParams(regex="a+")}
    assert new.structured_outputs_kwargs("C", None) == {}


def test_a_key_the_release_lacks_is_refused_naming_it(sampling_module):
    with pytest.raises(RefusedByRelease) as err:
        FakeAdapter(OldSamplingParams).structured_outputs_kwargs(
            "A", {"regex": "a", "disable_any_whitespace": True})
    assert "requests[A].structured_outputs.disable_any_whitespace" in str(err.value)
    assert "9.9.9's GuidedDecodingParams has no such field" in str(err.value)


def test_a_release_without_structured_outputs_is_refused(sampling_module):
    class Plain:
        __struct_fields__ = ("max_tokens",)

    with pytest.raises(RefusedByRelease) as err:
        FakeAdapter(Plain).structured_outputs_kwargs("A", {"regex": "a"})
    assert "has no structured_outputs / guided_decoding" in str(err.value)


def test_fields_of_leaves_private_fields_out():
    assert "_backend" not in fields_of(StructuredOutputsParams)
    assert {"json", "regex", "disable_any_whitespace"} <= fields_of(StructuredOutputsParams)


# ---- bitmask rows and sampling through them ---------------------------------------------------
VOCAB = 96


def mask(*tokens: int) -> np.ndarray:
    """A packed int32 row allowing ``tokens`` (xgrammar's layout)."""
    row = np.zeros((VOCAB + 31) // 32, dtype=np.int64)
    for t in tokens:
        row[t // 32] |= 1 << (t % 32)
    return row.astype(np.uint32).view(np.int32)


def test_packed_rows_read_as_xgrammar_packs_them():
    row = mask(3, 31, 32, 95)
    assert [t for t in range(VOCAB) if allowed(row, t)] == [3, 31, 32, 95]
    assert not allowed(row, 96) and not allowed(row, -1)
    assert highest_allowed(row) == 95 and highest_allowed(mask()) == 0
    full = np.full(3, -1, dtype=np.int32)  # vLLM's "anything goes" row
    assert allowed(full, 0) and allowed(full, 95) and highest_allowed(full) == 95


@dataclass
class GrammarOutput:  # vllm/v1/core/sched/output.py
    structured_output_request_ids: list
    grammar_bitmask: np.ndarray


def test_grammar_rows_follow_the_schedulers_layout():
    bm = np.stack([mask(1), mask(2), mask(3), mask(4)])
    # A has 2 drafts scheduled (3 rows), B none (1 row)
    rows = state.grammar_rows(GrammarOutput(["A", "B"], bm), None, {"A": 2, "B": 0})
    assert [len(rows["A"]), len(rows["B"])] == [3, 1]
    assert allowed(rows["B"][0], 4) and allowed(rows["A"][2], 3)
    # older releases: the bitmask rides on the scheduler output, ids as a dict of rows
    so = types.SimpleNamespace(grammar_bitmask=bm[:2], structured_output_request_ids={"B": 1, "A": 0})
    rows = state.grammar_rows(None, so, {})
    assert allowed(rows["A"][0], 1) and allowed(rows["B"][0], 2)
    assert state.grammar_rows(None, types.SimpleNamespace(), {}) == {}


def test_sampling_through_the_bitmask():
    runner = FakeModelRunner({"token": 7}, None)
    ids, sampled = ["A", "B", "C", "D", "E"], [[7], [7], [7], [], [9]]
    rows = {"A": [mask(7, 9)],               # the model's token is allowed: kept
            "B": [mask(EOS_TOKEN_ID, 50)],   # forbidden: EOS where allowed
            "C": [mask(40, 60)],             # else the highest allowed id
            "D": [mask(1)],                  # a partial prefill samples nothing
            "E": [mask()]}                   # a dead end: argmax over -inf gives 0
    assert runner.apply_grammar(ids, sampled, rows) == [[7], [EOS_TOKEN_ID], [60], [], [0]]
    # drafts: a forbidden draft is rejected and that position resampled from its row
    runner = FakeModelRunner({"token": 7}, 2)
    assert runner.apply_grammar(["A"], [[8, 9, 7]], {"A": [mask(8), mask(5), mask(7)]}) == [[8, 5]]
    assert runner.apply_grammar(["A"], [[8, 9, 7]], {"A": [mask(8), mask(9), mask(7)]}) == [[8, 9, 7]]
    assert runner.apply_grammar(["Z"], [[7]], {}) == [[7]]  # no grammar: untouched


def test_scripted_tokens_are_the_models_per_output_position():
    runner = FakeModelRunner({"token": 7, "tokens": {"A": [11, 12]}}, None)
    r = {"A": Request("A", 4)}
    assert runner.execute(1, [Scheduled("A", 4, 0, [], True)], r)[1] == [[11]]
    r["A"].num_output_tokens = 1
    assert runner.execute(2, [Scheduled("A", 1, 4, [], False)], r)[1] == [[12]]
    r["A"].num_output_tokens = 2
    assert runner.execute(3, [Scheduled("A", 1, 5, [], False)], r)[1] == [[7]]  # then `token`


def test_the_params_classes_own_refusal_is_an_input_error_quoting_it(sampling_module):
    @dataclass
    class Picky(StructuredOutputsParams):
        def __post_init__(self):
            raise ValueError("You can only use one kind of structured outputs constraint")

    sampling_module.StructuredOutputsParams = Picky
    with pytest.raises(RefusedByRelease) as err:
        FakeAdapter(NewSamplingParams).structured_outputs_kwargs("A", {"regex": "a"})
    assert "requests[A].structured_outputs: vLLM 9.9.9's Picky refuses it: ValueError: You can" \
        in str(err.value)


def test_the_verdict_table_counts_refused_requests():
    from vllm_repro.records import RunResult
    from vllm_repro.verdict import describe_observed

    res = RunResult("clean", steps=4, finished={"A": "FINISHED_STOPPED"}, unfinished=[],
                    refused={"B": "VLLMValidationError: only one backend per engine"})
    assert describe_observed(res) == "clean (1 finished, 1 refused, 4 steps)"
    assert RunResult.from_json(res.to_json()).refused == res.refused
