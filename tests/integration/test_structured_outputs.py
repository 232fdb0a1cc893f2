"""Structured outputs on the real releases, through the CLI as a user runs it: the release's
own front-door validation, StructuredOutputManager and backend (xgrammar / guidance, as they
install in the release's environment) on the packaged tokenizer; only the sampler's bitmask
application is the fake worker's.

- vLLM #43920 (the catalog entry) on its buggy release (0.25.0: EngineCore dies in
  ``schedule()``), its fix (0.26.0: the request fails alone) and the newest (0.33.0: the
  engine refuses the request at ``grammar_init``).
- Bad input: a grammar the release refuses is that release's own answer (a refused request),
  never a lab traceback; a constraint key the release does not have is exit 2.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from ..conftest import SCENARIOS

pytestmark = pytest.mark.slow

ENTRY = SCENARIOS / "vllm-43920-grammar-compile-failure-after-valid.yaml"


def result(reports, name, version) -> dict:
    return json.loads((reports / name / version / "result.json").read_text())


def trace(reports, name, version) -> list[dict]:
    return [json.loads(x) for x in
            (reports / name / version / "trace.jsonl").read_text().splitlines()]


def test_43920_crashes_on_0_25_and_fails_the_request_alone_once_fixed(cli, tmp_path):
    name = ENTRY.stem
    proc = cli("run", str(ENTRY), "--reports", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = result(tmp_path, name, "0.25.0")
    assert bad["outcome"] == "crash"
    crash = bad["crash"]
    assert (crash["type"], crash["phase"], crash["step"]) == ("RuntimeError", "schedule", 3)
    assert "items must be a boolean or an object" in crash["message"]
    frames = [(f["file"], f["function"]) for f in crash["vllm_frames"]]
    assert ("vllm/v1/structured_output/request.py", "_check_grammar_completion") in frames
    assert frames[-1] == ("vllm/v1/structured_output/backend_xgrammar.py", "compile_grammar")
    assert sorted(bad["unfinished"]) == ["A", "B"]  # EngineCore died with A running
    assert trace(tmp_path, name, "0.25.0")[2]["added"] == ["B"]

    fixed = result(tmp_path, name, "0.26.0")
    assert fixed["outcome"] == "clean" and fixed["unfinished"] == []
    # A's grammar took it to EOS ({, }, EOS: stopped, not capped); B failed alone
    assert fixed["finished"] == {"A": "FINISHED_STOPPED", "B": "FINISHED_ERROR"}
    # what A sampled through its bitmask: "{" (id 260 + 123 - 32), "}", then EOS
    sampled = [line.get("sampled", {}).get("A") for line in trace(tmp_path, name, "0.26.0")]
    assert sampled[:3] == [[351], [353], [2]]

    newest = result(tmp_path, name, "0.33.0")
    assert newest["outcome"] == "clean" and newest["finished"] == {"A": "FINISHED_STOPPED"}
    assert "only supports one backend per engine" in newest["refused"]["B"]
    assert trace(tmp_path, name, "0.33.0")[2]["refused"] == newest["refused"]


def test_23215_a_blank_grammar_kills_engine_core_until_the_front_door_refuses_it(cli, tmp_path):
    """vLLM #23215 (the catalog entry): 0.10.2 (guided_decoding / GuidedDecodingParams, the
    bitmask on the scheduler output) and 0.11.0 crash compiling grammar ""; 0.12.0 and 0.33.0
    refuse it at the front door."""
    entry = SCENARIOS / "vllm-23215-empty-grammar-kills-engine.yaml"
    proc = cli("run", str(entry), "--reports", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for version in ("0.10.2", "0.11.0"):
        res = result(tmp_path, entry.stem, version)
        assert res["outcome"] == "crash" and res["crash"]["type"] == "RuntimeError", version
        assert (res["crash"]["phase"], res["crash"]["step"]) == ("schedule", 2), version
    for version in ("0.12.0", "0.33.0"):
        res = result(tmp_path, entry.stem, version)
        assert res["outcome"] == "clean" and res["finished"] == {"A": "FINISHED_STOPPED"}
        assert res["refused"]["E"].endswith("structured_outputs.grammar cannot be an empty string")


BAD_INPUT = """
    name: so-bad-input
    level: engine-core
    config: {num_gpu_blocks: 64, max_num_seqs: 4, max_num_batched_tokens: 256, max_model_len: 256}
    requests:
      - {id: G, prompt_len: 8, max_tokens: 8, structured_outputs: {grammar: "root ::= ??"}}
      - {id: R, prompt_len: 8, max_tokens: 8, structured_outputs: {regex: "t4(t5)*"}}
      - {id: C, prompt_len: 8, max_tokens: 8, structured_outputs: {choice: [ab, cd]}}
      - id: S
        at_step: 2
        prompt_len: 8
        max_tokens: 12
        structured_outputs: {json: {type: object, properties: {a: {type: integer}}, required: [a]}}
      - {id: T, at_step: 2, prompt_len: 8, max_tokens: 6, structured_outputs: {regex: "[a-z]+"}}
    model:
      tokens: {T: [325, 326, 300, 301]}   # "a", "b", then "H": forbidden by [a-z]+
    limits: {max_steps: 60}
"""


def test_a_grammar_the_release_refuses_is_its_own_answer(cli, tmp_path):
    sc = tmp_path / "bad.yaml"
    sc.write_text(textwrap.dedent(BAD_INPUT))
    proc = cli("run", str(sc), "--vllm", "0.25.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = result(tmp_path / "r", "so-bad-input", "0.25.0")
    assert res["outcome"] == "clean" and res["unfinished"] == []
    assert list(res["refused"]) == ["G"] and res["refused"]["G"].startswith("ValueError: ")
    # the grammars end their requests: EOS once they are complete, not max_tokens
    assert res["finished"] == {"R": "FINISHED_STOPPED", "C": "FINISHED_STOPPED",
                               "S": "FINISHED_STOPPED", "T": "FINISHED_STOPPED"}
    # T: "a" (step 2, its prefill), "b" (3), then "H", which the bitmask forbids: EOS (4)
    done = {rid: line["step"] for line in trace(tmp_path / "r", "so-bad-input", "0.25.0")
            for rid in line.get("finished", [])}
    assert done["T"] == 4

    typo = tmp_path / "typo.yaml"
    typo.write_text(textwrap.dedent(BAD_INPUT).replace('{regex: "t4(t5)*"}',
                                                       '{regex: "t4(t5)*", no_such_key: 1}'))
    proc = cli("run", str(typo), "--vllm", "0.25.0", "--reports", str(tmp_path / "r2"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "structured_outputs.no_such_key" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
