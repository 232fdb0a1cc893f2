"""level: v0-engine on a real release: vLLM 0.6.3.post1's own V0 LLMEngine (scheduler, block
manager, swap, output processing) with the fake V0 worker, through the CLI as a user runs it."""

from __future__ import annotations

import json

import pytest
import yaml

from ..conftest import ROOT

pytestmark = pytest.mark.slow

RELEASE = "0.6.3.post1"


def scenario(tmp_path, name: str, config: dict, expect: dict | None = None, **extra) -> str:
    d = {"name": name, "level": "v0-engine",
         "config": {"block_size": 16, "max_model_len": 160, "max_num_batched_tokens": 256,
                    "enable_chunked_prefill": False, "max_num_seqs": 4, **config},
         "requests": [{"id": "A", "prompt_len": 40, "max_tokens": 60},
                      {"id": "B", "prompt_len": 40, "max_tokens": 60},
                      {"id": "C", "prompt_len": 40, "max_tokens": 60},
                      {"id": "D", "at_step": 3, "prompt_len": 30, "max_tokens": 40}], **extra}
    if expect:
        d["expect"] = expect
        d["vllm"] = {"reproduces_on": [RELEASE]}
    else:
        d["vllm"] = {"clean_on": [RELEASE]}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(p)


def test_v0_start_up_without_gpu_blocks_and_a_swapping_pool(cli, tmp_path):
    """0 GPU blocks: vLLM's own start-up error at engine-build (ValueError, "No available memory
    for the cache blocks", raised by the release's raise_if_cache_size_invalid); a 12-block pool
    that swaps requests out to CPU blocks and back runs clean under the audit, with the
    release's swap really happening (swapped requests in the trace, CPU blocks given back)."""
    reports = tmp_path / "r"
    startup = scenario(tmp_path, "v0-no-gpu-blocks", {"num_gpu_blocks": 0, "num_cpu_blocks": 0},
                       {"outcome": "crash", "phase": "engine-build", "exception": "ValueError",
                        "message": "^No available memory for the cache blocks"})
    swap = scenario(tmp_path, "v0-swap", {"num_gpu_blocks": 12, "num_cpu_blocks": 40,
                                          "preemption_mode": "swap"})
    res = cli("run", startup, swap, "--vllm", RELEASE, "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    crash = json.loads((reports / "v0-no-gpu-blocks" / RELEASE / "result.json").read_text())
    assert crash["outcome"] == "crash" and crash["level"] == "v0-engine"
    assert crash["crash"]["message"] == ("No available memory for the cache blocks. Try "
                                         "increasing `gpu_memory_utilization` when "
                                         "initializing the engine.")
    assert crash["crash"]["where"]["file"] == "vllm/worker/worker.py"
    assert [f["function"] for f in crash["crash"]["vllm_frames"]][:2] == [
        "__init__", "_initialize_kv_caches"]
    clean = json.loads((reports / "v0-swap" / RELEASE / "result.json").read_text())
    assert clean["outcome"] == "clean" and sorted(clean["finished"]) == ["A", "B", "C", "D"]
    assert clean["engine"]["num_gpu_blocks"] == 12
    assert clean["audit"]["checks"] > 100 and not clean["audit"]["by_code"]
    assert clean["audit"]["hook_calls"].get("CPU.decr", 0) > 0  # blocks swapped back in
    lines = [json.loads(x) for x in
             (reports / "v0-swap" / RELEASE / "trace.jsonl").read_text().splitlines()]
    assert any(line["preempted"] for line in lines)  # V0's swapped queue
    assert lines[-1]["free_blocks"] == 12


def test_v0_field_the_release_lacks_is_exit_2_naming_field_and_release(cli, tmp_path):
    """A field the release's EngineArgs lacks is exit 2 in one line; multi-step scheduling
    (num_scheduler_steps 8, async output processing on: the release's MultiStepWorker answers,
    per engine step, as the lab's V0 worker does) runs clean under the audit in the same run,
    every request finishing (it used to lose every step's tokens but the last: requests that
    never finished, then KV_LEAK), with the engine scheduling once per 8 steps; and V0
    speculative decoding with the n-gram drafter (3 drafts, the fake SpecDecodeWorker accepting
    some or all) runs clean too, every request finishing at its max_tokens or its EOS in about
    half the steps of the same scenario without spec decode (62 steps there)."""
    bad = scenario(tmp_path, "v0-newer-field", {"num_gpu_blocks": 12,
                                                "max_num_partial_prefills": 2})
    # stall_steps 5: the later steps of a multi-step batch, which vLLM runs without calling
    # schedule(), are progress (they were traced as scheduling nothing: a false stall @6)
    multi = scenario(tmp_path, "v0-multi-step", {"num_gpu_blocks": 12, "num_scheduler_steps": 8},
                     limits={"max_steps": 300, "stall_steps": 5})
    # a prompt over max_model_len, which 0.6.3.post1's add_request lets in (before 0.8.4, PR
    # #16156): the V0 scheduler ignores it ("Input prompt ... exceeds limit of 160") and vLLM
    # finishes it with reason "length"; the lab records FINISHED_IGNORED and says so
    ignored = scenario(tmp_path, "v0-ignored", {"num_gpu_blocks": 12},
                       requests=[{"id": "A", "prompt_len": 170, "max_tokens": 8},
                                 {"id": "B", "prompt_len": 40, "max_tokens": 10}])
    spec = scenario(tmp_path, "v0-spec-ngram",
                    {"num_gpu_blocks": 24, "speculative_model": "[ngram]",
                     "num_speculative_tokens": 3, "ngram_prompt_lookup_max": 3},
                    model={"spec_decode": {"accept": {"B": [1, 0, 2], "C": 1}},
                           "eos_at": {"D": 17}})
    # a truthy string vLLM's command line could never have produced ("no" would turn the
    # setting on): refused against EngineArgs' annotation, not run
    quoted = scenario(tmp_path, "v0-quoted-no", {"num_gpu_blocks": 12,
                                                 "disable_async_output_proc": "no"})
    reports = tmp_path / "r"
    res = cli("run", bad, quoted, multi, spec, ignored, "--vllm", RELEASE, "--reports", str(reports))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "config.max_num_partial_prefills" in res.stdout + res.stderr
    assert f"vLLM {RELEASE} has no EngineArgs field" in res.stdout + res.stderr
    assert ("config.disable_async_output_proc: 'no' does not fit "
            f"EngineArgs.disable_async_output_proc (bool) of vLLM {RELEASE}; write true or false "
            "(without quotes)"
            in res.stderr), res.stderr
    clean = json.loads((reports / "v0-multi-step" / RELEASE / "result.json").read_text())
    assert clean["outcome"] == "clean", clean
    assert clean["finished"] == {"A": "length", "B": "length", "C": "length", "D": "length"}
    assert clean["audit"]["checks"] > 50 and not clean["audit"]["by_code"]
    log = (reports / "v0-multi-step" / RELEASE / "engine.log").read_text()
    assert "num_scheduler_steps=8" in log and "use_async_output_proc=True" in log
    lines = [json.loads(x) for x in
             (reports / "v0-multi-step" / RELEASE / "trace.jsonl").read_text().splitlines()]
    running = [line for line in lines if line["running"]]
    # every engine step with a running request decodes, scheduled or run from the cached batch
    assert running and all(line["scheduled"] for line in running)
    spec_run = json.loads((reports / "v0-spec-ngram" / RELEASE / "result.json").read_text())
    assert spec_run["outcome"] == "clean", spec_run
    # "length" is vLLM's stop checker seeing output_len == max_tokens (spec decode's extra
    # tokens cut by MultiStepOutputProcessor); D stops at its EOS, the 17th token
    assert spec_run["finished"] == {"A": "length", "B": "length", "C": "length", "D": "stop"}
    assert not spec_run["audit"]["by_code"]
    assert spec_run["steps"] < 40  # without spec decode: 62 steps
    assert "speculative_config=SpeculativeConfig(draft_model='[ngram]'" in (
        reports / "v0-spec-ngram" / RELEASE / "engine.log").read_text()
    ign = json.loads((reports / "v0-ignored" / RELEASE / "result.json").read_text())
    assert ign["outcome"] == "clean", ign
    assert ign["finished"] == {"A": "FINISHED_IGNORED", "B": "length"}, ign["finished"]
    assert "1 ignored by the scheduler" in res.stdout, res.stdout


def test_8881_async_stopped_assertion_on_0_6_1_and_refused_prompt_from_0_8_4(cli, tmp_path):
    """The catalog's V0 entry for vLLM #8881 (crash log 013): on 0.6.1.post2 (the log's release)
    async output processing is on (the emulated CUDA device), B's over-long prompt is chunked in,
    parked in _async_stopped and never freed, and the next schedule() dies on the issue's
    assertion in _schedule_running; 0.8.4's front door refuses B (ValueError at add_request)."""
    entry = "scenarios/vllm-8881-v0-async-stopped-long-prompt.yaml"
    name = "vllm-8881-v0-async-stopped-long-prompt"
    reports = tmp_path / "r"
    res = cli("run", entry, "--vllm", "0.6.1.post2", "--vllm", "0.8.4", "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    bad = json.loads((reports / name / "0.6.1.post2" / "result.json").read_text())
    assert bad["verdict"]["ok"] is True, bad["verdict"]
    crash = bad["crash"]
    assert (crash["type"], crash["step"], crash["phase"]) == ("AssertionError", 5, "step")
    assert [f["function"] for f in crash["vllm_frames"]][-2:] == [
        "_schedule_chunked_prefill", "_schedule_running"]
    log = (reports / name / "0.6.1.post2" / "engine.log").read_text()
    assert "device_config=cuda" in log and "use_async_output_proc=True" in log
    lines = [json.loads(x) for x in
             (reports / name / "0.6.1.post2" / "trace.jsonl").read_text().splitlines()]
    assert lines[2]["scheduled"] == {"B": 63, "A": 1}  # B's first chunk: admitted past the limit
    assert "B" not in bad["finished"] and "B" in bad["unfinished"]  # parked, never freed
    fixed = json.loads((reports / name / "0.8.4" / "result.json").read_text())
    assert fixed["verdict"]["ok"] is True, fixed["verdict"]
    assert (fixed["crash"]["type"], fixed["crash"]["phase"]) == ("ValueError", "add_request")
    assert fixed["crash"]["message"].startswith(
        "The decoder prompt (length 150) is longer than the maximum model length of 128.")


def test_14326_abort_of_an_n2_request_leaves_its_children_running_until_0_8_0(cli, tmp_path):
    """The catalog's V0 entry for PR #14326: aborting A (n=2) at step 4 leaves both of its child
    groups running on 0.7.3 (the audit's REQ_STATE there; without the audit A decodes on to
    max_tokens and finishes "length"); 0.8.0 takes both children out and A comes out aborted."""
    entry = "scenarios/vllm-14326-v0-abort-n-children-keep-running.yaml"
    name = "vllm-14326-v0-abort-n-children-keep-running"
    reports, raw = tmp_path / "r", tmp_path / "raw"
    res = cli("run", entry, "--vllm", "0.7.3", "--vllm", "0.8.0", "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    bad = json.loads((reports / name / "0.7.3" / "result.json").read_text())
    assert bad["verdict"]["ok"] is True, bad["verdict"]
    assert {(v["code"], v["step"], v["message"]) for v in bad["violations"]} == {
        ("REQ_STATE", 4, f"A (its group A_parallel_sample_{i}) is in running after "
         "LLMEngine.abort_request(A)") for i in (0, 1)}
    fixed = json.loads((reports / name / "0.8.0" / "result.json").read_text())
    assert fixed["outcome"] == "clean" and fixed["finished"] == {"A": "aborted", "B": "length"}
    steps = [json.loads(x) for x in
             (reports / name / "0.8.0" / "trace.jsonl").read_text().splitlines()]
    assert steps[3]["scheduled"] == {"B": 1} and steps[3]["running"] == ["B"]

    res = cli("run", entry, "--vllm", "0.7.3", "--no-audit", "--reports", str(raw))
    assert res.returncode == 1, res.stdout + res.stderr  # the verdict: not the expected violation
    plain = json.loads((raw / name / "0.7.3" / "result.json").read_text())
    assert plain["finished"] == {"A": "length", "B": "length"} and plain["steps"] == 41
    steps = [json.loads(x) for x in (raw / name / "0.7.3" / "trace.jsonl").read_text().splitlines()]
    assert steps[39]["scheduled"] == {"A_parallel_sample_0": 1, "A_parallel_sample_1": 1}


def test_14353_finished_n2_children_stay_in_seq_id_to_seq_group_until_0_8_0(cli, tmp_path):
    """The catalog's V0 entry for issue #14353 (fixed by PR #14326): A (n=2) finishes while B
    keeps the engine stepping; on 0.7.3 both child groups stay keys of the engine's
    seq_id_to_seq_group after the engine collected their finish (REQ_RESIDUE at the end of the
    run, both requests finished normally); 0.8.0 deletes them and runs clean. The same requests
    with A at n=1 run clean on 0.7.3 (no child groups, nothing left behind)."""
    entry = ROOT / "scenarios" / "vllm-14353-v0-n-children-stay-in-seq-id-map.yaml"
    d = yaml.safe_load(entry.read_text())
    name = d["name"]
    ctl = {**d, "name": "v0-n1-control", "vllm": {"clean_on": ["0.7.3"]},
           "requests": [{**d["requests"][0], "n": 1}, d["requests"][1]]}
    ctl.pop("expect")
    ctl_file = tmp_path / "v0-n1-control.yaml"
    ctl_file.write_text(yaml.safe_dump(ctl, sort_keys=False))
    reports = tmp_path / "r"
    res = cli("run", str(entry), "--vllm", "0.7.3", "--vllm", "0.8.0", "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    bad = json.loads((reports / name / "0.7.3" / "result.json").read_text())
    assert bad["verdict"]["ok"] is True, bad["verdict"]
    assert bad["finished"] == {"A": "length", "B": "length"}
    assert {(v["code"], v["step"], v["message"]) for v in bad["violations"]} == {
        ("REQ_RESIDUE", 6, f"A (its group A_parallel_sample_{i}, finished (length)) left the "
         "scheduler by step 6 "
         "but is still a key of LLMEngine.seq_id_to_seq_group at the end of the run (step 13); "
         "expected the entry dropped when the engine collects the finished request")
        for i in (0, 1)}
    fixed = json.loads((reports / name / "0.8.0" / "result.json").read_text())
    assert fixed["outcome"] == "clean" and fixed["finished"] == {"A": "length", "B": "length"}
    assert fixed["audit"]["checks"] > 20 and not fixed["audit"]["by_code"]
    res = cli("run", str(ctl_file), "--vllm", "0.7.3", "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    plain = json.loads((reports / "v0-n1-control" / "0.7.3" / "result.json").read_text())
    assert plain["outcome"] == "clean" and plain["finished"] == {"A": "length", "B": "length"}


def test_18957_stale_cached_count_makes_the_worker_skip_fresh_blocks_until_0_9_2(cli, tmp_path):
    """The catalog's V0 entry for PR #18957: W is counted with 32 cached prompt tokens while
    P's blocks are cached, waits behind max_num_seqs while R1 and R2 evict them, and on 0.8.4
    is handed two fresh blocks as computed_block_nums when it is scheduled at step 47 (the
    audit's KV_PREFIX_MAP, inside Worker.execute_model); 0.10.1.1 counts again and runs clean.
    Without P (nothing cached, nothing stale) 0.8.4 runs clean too."""
    entry = ROOT / "scenarios" / "vllm-18957-v0-stale-prefix-cache-count.yaml"
    d = yaml.safe_load(entry.read_text())
    name = d["name"]
    ctl = {**d, "name": "v0-no-cached-prefix", "vllm": {"clean_on": ["0.8.4", "0.10.1.1"]},
           "requests": d["requests"][1:]}
    ctl.pop("expect")
    ctl_file = tmp_path / "v0-no-cached-prefix.yaml"
    ctl_file.write_text(yaml.safe_dump(ctl, sort_keys=False))
    reports = tmp_path / "r"
    res = cli("run", str(entry), str(ctl_file), "--vllm", "0.8.4", "--vllm", "0.10.1.1",
              "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    bad = json.loads((reports / name / "0.8.4" / "result.json").read_text())
    assert bad["verdict"]["ok"] is True, bad["verdict"]
    (v,) = bad["violations"]
    assert (v["code"], v["step"], v["phase"], v["requests"]) == (
        "KV_PREFIX_MAP", 47, "in Worker.execute_model", ["W"])
    assert v["message"].startswith("W (sequence 3): the worker is told to skip GPU block ")
    fixed = json.loads((reports / name / "0.10.1.1" / "result.json").read_text())
    assert fixed["outcome"] == "clean" and sorted(fixed["finished"]) == ["P", "R1", "R2", "W"]
    plain = json.loads((reports / "v0-no-cached-prefix" / "0.8.4" / "result.json").read_text())
    assert plain["outcome"] == "clean" and sorted(plain["finished"]) == ["R1", "R2", "W"]


def _open_with_control(cli, tmp_path, file: str, control: str, config: dict, version: str):
    """Run ``scenarios/open/<file>`` and its control (named ``control``: the same scenario with
    ``config`` changed, no expectation, expected clean) on ``version`` in one ``run``, which must
    exit 0. Returns the open scenario's dict, the control's dict and the reports folder."""
    src = ROOT / "scenarios" / "open" / file
    d = yaml.safe_load(src.read_text())
    plain = {**d, "name": control, "config": {**d["config"], **config}}
    plain.pop("expect")
    plain["vllm"] = {"clean_on": [version]}
    ctl = tmp_path / f"{control}.yaml"
    ctl.write_text(yaml.safe_dump(plain, sort_keys=False))
    reports = tmp_path / "r"
    res = cli("run", str(src), str(ctl), "--vllm", version, "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    return d, plain, reports


def test_11168_sliding_window_prompt_passes_can_allocate_then_runs_out_of_blocks(cli, tmp_path):
    """Crash log 012 (vLLM #11168, open: never fixed while V0 shipped): with the packaged
    sliding-window Mistral config, 0.8.5's can_allocate caps B's need at the window's 6 blocks,
    allocate takes all 13 and dies in the naive allocator; the same requests on the default OPT
    config (no window) run clean. An unknown config.model is exit 2 naming the packaged ones."""
    d, plain, reports = _open_with_control(
        cli, tmp_path, "vllm-11168-v0-swa-prefill-no-free-blocks.yaml", "v0-no-window",
        {"model": "opt"}, "0.8.5")
    name = d["name"]
    bad = json.loads((reports / name / "0.8.5" / "result.json").read_text())
    assert bad["verdict"]["ok"] is True, bad["verdict"]
    assert (bad["crash"]["type"], bad["crash"]["step"]) == ("NoFreeBlocksError", 2)
    frames = [(f["file"], f["function"]) for f in bad["crash"]["vllm_frames"]]
    assert ("vllm/core/scheduler.py", "_allocate_and_set_running") in frames
    assert frames[-1] == ("vllm/core/block/naive_block.py", "_allocate_block_id")
    assert "models/mistral-swa" in (reports / name / "0.8.5" / "engine.log").read_text()
    lines = [json.loads(x) for x in
             (reports / name / "0.8.5" / "trace.jsonl").read_text().splitlines()]
    assert lines[0]["free_blocks"] == 10  # fewer than B's 13 blocks, more than the window's 6
    ok = json.loads((reports / "v0-no-window" / "0.8.5" / "result.json").read_text())
    assert ok["outcome"] == "clean" and sorted(ok["finished"]) == ["A", "B"]

    unknown = {**plain, "name": "v0-unknown-model", "config": {**d["config"], "model": "nope"}}
    bad_file = tmp_path / "v0-unknown-model.yaml"
    bad_file.write_text(yaml.safe_dump(unknown, sort_keys=False))
    res = cli("run", str(bad_file), "--vllm", "0.8.5", "--reports", str(tmp_path / "u"))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "config.model: 'nope' is not one of the lab's packaged model configs (mistral-swa, " \
           "opt)" in res.stdout + res.stderr


def test_chunked_prefill_abort_leaves_uncomputed_blocks_that_count_as_cached(cli, tmp_path):
    """Found by ``fuzz --level v0-engine`` on 0.10.1.1 (#18957's fixed release; open, not
    #18957): A's 7 prompt blocks are hashed when allocated, only 4 computed (chunked prefill)
    before A is aborted, and all 7 go to the evictor, where ``block_is_computed`` says computed;
    B, A's prompt and a token, is told to skip all 7. The audit names the first block that
    never held KV. Without chunked prefill the same requests are clean (A computed whole)."""
    d, _, reports = _open_with_control(
        cli, tmp_path, "v0-chunked-prefill-abort-uncomputed-prefix-hit.yaml", "v0-no-chunking",
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 320}, "0.10.1.1")
    name = d["name"]
    bad = json.loads((reports / name / "0.10.1.1" / "result.json").read_text())
    assert bad["verdict"]["ok"] is True, bad["verdict"]
    v = bad["violations"][0]
    assert (v["code"], v["step"], v["requests"]) == ("KV_PREFIX_MAP", 3, ["B"])
    assert v["message"].startswith("B (sequence 1): the worker is told to skip GPU block ")
    assert "(prompt tokens 64 to 79)" in v["message"]
    assert v["message"].endswith("holds no KV of those tokens (nothing was ever computed into it); "
                                 "a prefix-cache hit on a block sequence 0 was given for the same "
                                 "tokens and never computed")
    ok = json.loads((reports / "v0-no-chunking" / "0.10.1.1" / "result.json").read_text())
    assert ok["outcome"] == "clean" and sorted(ok["finished"]) == ["A", "B"]


def test_chunked_prefill_preemption_leaves_uncomputed_blocks_that_count_as_cached(cli, tmp_path):
    """The same V0 mechanism without an abort (found by the fuzzer on 0.10.1.1 once the finding
    told a prefix-cache hit from #18957's fresh block): R2's 7 prompt blocks are hashed when
    allocated, 3 computed at step 1, R2 is preempted at step 2 (the pool is full) and its
    blocks go to the evictor; rescheduled at step 3, R2 hits its own blocks and is told to skip
    all 7. Without chunked prefill its prompt is computed whole at step 1: clean."""
    d, _, reports = _open_with_control(
        cli, tmp_path, "v0-chunked-prefill-preempt-uncomputed-prefix-hit.yaml", "v0-no-chunking",
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 144}, "0.10.1.1")
    bad = json.loads((reports / d["name"] / "0.10.1.1" / "result.json").read_text())
    assert bad["verdict"]["ok"] is True, bad["verdict"]
    v = bad["violations"][0]
    assert (v["code"], v["step"], v["requests"]) == ("KV_PREFIX_MAP", 3, ["R2"])
    assert "(prompt tokens 48 to 63)" in v["message"]
    assert v["message"].endswith("(nothing was ever computed into it); a prefix-cache hit on a "
                                 "block this sequence was given before (preempted or rescheduled "
                                 "since) for the same tokens and never computed")
    lines = [json.loads(x) for x in
             (reports / d["name"] / "0.10.1.1" / "trace.jsonl").read_text().splitlines()]
    assert lines[0]["scheduled"]["R2"] == 48 and lines[1]["waiting"] == ["R2"]
    ok = json.loads((reports / "v0-no-chunking" / "0.10.1.1" / "result.json").read_text())
    assert ok["outcome"] == "clean" and sorted(ok["finished"]) == ["R0", "R1", "R2"]


def test_an_abort_while_the_last_output_is_queued_ends_the_request(cli, tmp_path):
    """Found by ``fuzz --level v0-engine`` on 0.8.5: R0 (1 token) is scheduled at step 1 and,
    with async output processing, its output waits in the engine's output queue; aborting it
    at step 2 leaves the engine with no unfinished request, so it never steps again. R0 is over
    for its caller (the abort ended its stream): aborted, clean, not a stall."""
    d = {"name": "v0-abort-queued-output", "level": "v0-engine",
         "config": {"block_size": 16, "num_gpu_blocks": 3, "max_num_seqs": 1,
                    "max_num_batched_tokens": 2048, "max_model_len": 32,
                    "enable_chunked_prefill": True},
         "requests": [{"id": "R0", "prompt_len": 1, "max_tokens": 1}],
         "events": [{"at_step": 2, "abort": ["R0"]}],
         "limits": {"max_steps": 60, "stall_steps": 10},
         "vllm": {"clean_on": ["0.8.5"]}}
    p = tmp_path / "v0-abort-queued-output.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    reports = tmp_path / "r"
    res = cli("run", str(p), "--reports", str(reports))
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads((reports / d["name"] / "0.8.5" / "result.json").read_text())
    assert "use_async_output_proc=True" in (reports / d["name"] / "0.8.5" / "engine.log").read_text()
    assert (result["outcome"], result["finished"], result["steps"]) == ("clean", {"R0": "aborted"}, 2)
