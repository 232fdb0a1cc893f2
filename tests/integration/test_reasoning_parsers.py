"""Reasoning parsers for structured outputs on the real releases, through the CLI as a user runs
it: ``config.reasoning_parser`` reaches the field the release's StructuredOutputManager reads
(``StructuredOutputsConfig.reasoning_parser``; ``DecodingConfig.reasoning_backend`` on 0.10.2),
which builds vLLM's own parser on the packaged tokenizer (``<think>`` 355, ``</think>`` 356) and
holds the grammar back until reasoning ends. One release per test, each well under a minute
warm.
"""

from __future__ import annotations

import json

import pytest

from ..conftest import SCENARIOS

pytestmark = pytest.mark.slow

SCENARIO = SCENARIOS / "reasoning" / "grammar-after-think.yaml"
NAME = "reasoning-grammar-after-think"
THINK, END_THINK, NINE, EOS = 355, 356, 285, 2


def steps(reports, version) -> dict[int, dict]:
    text = (reports / NAME / version / "trace.jsonl").read_text()
    return {line["step"]: line for line in map(json.loads, text.splitlines())}


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0", "0.10.2"])
def test_the_grammar_waits_for_the_end_of_reasoning(cli, tmp_path, version):
    """What a user checks in the reports: the engine built vLLM's DeepSeek-R1 parser, the
    regex ``[0-9]+`` let t4 and t5 through while A reasoned (reasoning_ended false), the step
    sampling ``</think>`` latched it, and from the next step the grammar applied (t6 gave way
    to the digit 9); A then stopped on EOS. The scenario's own ``expect.steps`` hold."""
    proc = cli("run", str(SCENARIO), "--vllm", version, "--reports", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((tmp_path / NAME / version / "result.json").read_text())
    assert res["verdict"]["ok"] is True, res["verdict"]
    assert res["outcome"] == "clean" and res["finished"] == {"A": "FINISHED_STOPPED"}
    assert res["engine"]["reasoning_parser"] == "DeepSeekR1ReasoningParser"
    trace = steps(tmp_path, version)
    sampled = [trace[n]["sampled"]["A"] for n in range(1, 9)]
    assert sampled == [[THINK], [4], [5], [END_THINK], [NINE], [280], [278], [EOS]]
    ended = [trace[n]["reasoning_ended"]["A"] for n in range(1, 8)]
    assert ended == [False, False, False, True, True, True, True]


def test_a_parser_the_release_lacks_is_one_line_naming_it(cli, tmp_path):
    """A misspelt name: exit 2, one line naming the field, the release's parsers and the
    likely one; nothing ran."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(SCENARIO.read_text().replace("reasoning_parser: deepseek_r1",
                                                "reasoning_parser: deepseek_r2"))
    proc = cli("run", str(bad), "--vllm", "0.33.0", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "config.reasoning_parser: 'deepseek_r2' is not one of vLLM 0.33.0's reasoning" in line
    assert "qwen3" in line and line.endswith("did you mean deepseek_r1?")
