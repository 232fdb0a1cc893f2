"""``requests[].allowed_token_ids`` without a release: the scenario field (bounded, engine-core
only, handed to the worker as written) and the front door that judges it with the release's own
input processor (``_validate_params``), whose refusal propagates as vLLM's."""

from __future__ import annotations

import textwrap

import pytest

from vllm_repro.engine.adapter import AdapterError
from vllm_repro.engine.adapter.requests import RequestsMixin
from vllm_repro.engine.spec import ScenarioRequest
from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario

SCENARIO = """
    name: allowed
    level: engine-core
    config: {num_gpu_blocks: 16}
    requests:
      - {id: A, prompt_len: 8}
      - {id: B, prompt_len: 8, allowed_token_ids: [100, 50272]}
"""


def write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_allowed_token_ids_reach_the_worker_as_written(tmp_path):
    sc = load_scenario(write(tmp_path, SCENARIO))
    payload = sc.child_payload()
    assert [r["allowed_token_ids"] for r in payload["requests"]] == [None, [100, 50272]]
    b = ScenarioRequest.from_mapping(payload["requests"][1])
    assert b.allowed_token_ids == (100, 50272)


@pytest.mark.parametrize("level", ["scheduler", "v0-engine"])
def test_allowed_token_ids_need_level_engine_core(tmp_path, level):
    with pytest.raises(InputError) as err:
        load_scenario(write(tmp_path, SCENARIO.replace("level: engine-core", f"level: {level}")))
    assert "allowed_token_ids" in str(err.value) and "level: engine-core" in str(err.value)


@pytest.mark.parametrize("value,words", [
    ("[" + ", ".join(["1"] * 4097) + "]", "4096"),
    ("[1, 4294967296]", "allowed_token_ids"),
    ("[a]", "allowed_token_ids"),
])
def test_a_bad_list_is_one_line_naming_the_field(tmp_path, value, words):
    with pytest.raises(InputError) as err:
        load_scenario(write(tmp_path, SCENARIO.replace("[100, 50272]", value)))
    assert words in str(err.value) and "requests" in str(err.value)


class Refusal(ValueError):
    pass


class Processor:  # the release's input processor: what the front end calls per request
    def __init__(self, vocab: int):
        self.vocab, self.calls = vocab, []

    def _validate_params(self, params, supported_tasks):
        self.calls.append((params, supported_tasks))
        if any(t >= self.vocab for t in params["allowed_token_ids"]):
            raise Refusal("allowed_token_ids contains out-of-vocab token id!")


def adapter(processor):
    a = RequestsMixin()
    a.version = "9.9"
    a.__dict__["_front_processors"] = {"Processor": None, "InputProcessor": processor}
    return a


def test_the_release_front_door_judges_the_ids_and_its_refusal_propagates():
    proc = Processor(vocab=50272)
    a = adapter(proc)
    a.validate_sampling_params({"allowed_token_ids": [100]})
    assert proc.calls == [({"allowed_token_ids": [100]}, ("generate",))]
    with pytest.raises(Refusal, match="out-of-vocab"):
        a.validate_sampling_params({"allowed_token_ids": [100, 50272]})


def test_no_front_door_processor_is_a_lab_error_naming_it():
    with pytest.raises(AdapterError, match="_validate_params"):
        adapter(None).validate_sampling_params({"allowed_token_ids": [1]})
