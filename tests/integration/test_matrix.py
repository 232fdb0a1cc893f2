"""The release matrix on real releases, through the CLI, on a sample that covers each cause the
full matrix once failed on (issue 22): 0.7.3 (a Scheduler argument that became required),
0.8.1 (a pin the index no longer has), 0.9.2 (async on a release without an AsyncScheduler),
0.15.1 (no sdist: sources from a wheel), 0.16.0 and 0.33.0 (AsyncScheduler's ``*args,
**kwargs`` constructor), 0.17.1 (the torch it pins). Lean: plain, async and spec, on a tiny
scenario; every release's modes in one worker."""

from __future__ import annotations

import json

import pytest


pytestmark = pytest.mark.slow
SAMPLE = ("0.7.3", "0.8.1", "0.9.2", "0.15.1", "0.16.0", "0.17.1", "0.33.0")
TINY = """name: matrix-tiny
description: two requests sharing a prefix (prefix caching on), one aborted mid-decode
config: {block_size: 16, num_gpu_blocks: 16, max_num_seqs: 2, max_num_batched_tokens: 64,
  max_model_len: 256, enable_prefix_caching: true}
requests:
  - {id: A, at_step: 1, prompt_len: 40, max_tokens: 6, prefix: p, prefix_len: 32}
  - {id: B, at_step: 2, prompt_len: 36, max_tokens: 12, prefix: p, prefix_len: 32}
events:
  - {at_step: 5, abort: [B]}
limits: {max_steps: 40}
"""


def test_the_sample_runs_clean_in_every_mode_its_releases_have(cli, tmp_path):
    from vllm_repro.engine.capabilities import load
    from vllm_repro.settings import cache_dir

    sc = tmp_path / "tiny.yaml"
    sc.write_text(TINY)
    reports = tmp_path / "r"
    args = [a for v in SAMPLE for a in ("--releases", f"=={v}")]
    proc = cli("matrix", str(sc), *args, "--mode", "plain", "--mode", "async", "--mode", "spec",
               "--reports", str(reports))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    m = json.loads((reports / "_matrix" / "matrix-tiny" / "matrix.json").read_text())
    assert m["releases"] == list(SAMPLE) and m["modes"] == ["plain", "async", "spec"]
    assert (reports / "_matrix" / "matrix-tiny" / "matrix.png").stat().st_size > 0
    cells = {(c["release"], c["mode"]): c for c in m["cells"]}
    for v in SAMPLE:
        caps = load(cache_dir(), v)
        assert caps is not None, f"{v}: the worker probed no capabilities"
        plain = cells[(v, "plain")]
        assert plain["outcome"] == "clean", plain
        result = json.loads((reports / "matrix-tiny" / v / "result.json").read_text())
        assert sorted(result["finished"]) == ["A", "B"] and not result["unfinished"]
        for mode, feature in (("async", "async scheduling"), ("spec", "spec decode")):
            cell = cells[(v, mode)]
            if caps.supports(feature):
                assert cell["outcome"] == "clean", cell
                assert (reports / f"matrix-tiny.{mode}" / v / "result.json").is_file()
            else:  # refused by the release's adapter before anything ran, said in one line
                assert cell["outcome"] == "n/a" and f"vLLM {v}" in cell["cause"], cell
                # and no run report (it was an "error" run in the reports index)
                assert cell.get("report") is None, cell
                assert not (reports / f"matrix-tiny.{mode}" / v).exists()
    # async: an AsyncScheduler from 0.10.0 on (0.16.0 and 0.33.0: its forwarding constructor)
    assert [v for v in SAMPLE if cells[(v, "async")]["outcome"] == "clean"] == [
        "0.15.1", "0.16.0", "0.17.1", "0.33.0"]
    assert "no AsyncScheduler" in cells[("0.9.2", "async")]["cause"]
    # what stands in for the release's own is said with every run
    assert any("xgrammar==0.1.16 ->" in s for s in cells[("0.8.1", "plain")]["substitutions"])
    assert any(s.startswith("vllm sources from vllm-0.15.1-")
               for s in cells[("0.15.1", "plain")]["substitutions"])
    assert "0.9.2 async" not in proc.stdout, "an n/a cell is no cause line"
    assert "async: 4 of 4 clean" in proc.stdout


def test_async_on_a_release_without_an_async_scheduler_is_exit_2_naming_it(cli, tmp_path):
    sc = tmp_path / "tiny-async.yaml"
    sc.write_text(TINY.replace("enable_prefix_caching: true}",
                               "enable_prefix_caching: true, async_scheduling: true}"))
    proc = cli("run", str(sc), "--vllm", "0.9.2", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "vLLM 0.9.2 has no AsyncScheduler" in proc.stdout + proc.stderr
    assert "is importable" not in proc.stdout + proc.stderr
