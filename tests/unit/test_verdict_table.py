"""The verdict table keeps its columns when a run's error is a long sentence (the whole
sentence is the line under the table, ``FILE: MESSAGE``)."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from vllm_repro.console import OBSERVED_WIDTH, verdict_table


def test_a_long_error_is_cut_in_the_table_and_every_column_stays():
    long = "error: config.num_speculative_tokens: " + "a very long refusal sentence " * 20
    rows = [SimpleNamespace(scenario="specnodraft", vllm="0.6.3.post1", expected="clean",
                            observed=long, ok_text="ERROR"),
            SimpleNamespace(scenario="flagship", vllm="0.10.2", expected="clean",
                            observed="ran to the end (2 finished, 31 steps)", ok_text="yes")]
    console = Console(width=400, record=True)
    console.print(verdict_table(rows))
    lines = console.export_text().splitlines()
    assert lines[0].split() == ["scenario", "vllm", "expect", "observed", "ok"]
    bad = next(line for line in lines if line.startswith("specnodraft"))
    assert bad.split()[:3] == ["specnodraft", "0.6.3.post1", "clean"] and bad.rstrip().endswith("ERROR")
    assert long[:OBSERVED_WIDTH - 3].rstrip() + "..." in bad
    assert "ran to the end (2 finished, 31 steps)" in next(line for line in lines if line.startswith("flagship"))



def test_a_release_error_names_no_file_and_is_said_once():
    """Under the table: a refusal of the scenario names its file; an error of the release itself
    (it could not be prepared) names none, once for every scenario it stopped."""
    from vllm_repro.console import input_error_lines
    from vllm_repro.records import RunResult

    def item(path, vllm, message, release_failed=False):
        return SimpleNamespace(
            verdict=SimpleNamespace(error_kind="input", vllm=vllm, scenario=path),
            result=RunResult.failed("input", message), release_failed=release_failed,
            scenario=SimpleNamespace(source_path=path))

    gone = "vLLM 9.9.9 is not on the package index; a release from pypi.org/project/vllm"
    lines = input_error_lines([
        item("a.yaml", "9.9.9", gone, True), item("b.yaml", "9.9.9", gone, True),
        item("a.yaml", "0.10.2", "config.blok_size: vLLM 0.10.2 has no such field"),
        item("a.yaml", "0.10.1.1", "config.blok_size: vLLM 0.10.1.1 has no such field")])
    assert lines == [gone, "a.yaml: config.blok_size: vLLM 0.10.2, 0.10.1.1 have no such field"]
