"""The dump_input.py dump read back, and the replay scenario drafted from it."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario
from vllm_repro.triage import triage_log
from vllm_repro.triage.dump import parse_repr, read_config, read_scheduler_output, read_stats
from vllm_repro.triage.scenario import draft_scenario

from ..conftest import CRASHLOGS, SHARED_HINT

LOG_009 = next(iter(sorted(CRASHLOGS.glob("009-*.log"))), None)
needs_009 = pytest.mark.skipif(LOG_009 is None,
                               reason=f"{CRASHLOGS / '009-*.log'} absent; {SHARED_HINT}")

# vLLM 0.9.x: one CachedRequestData per request, a numpy grammar bitmask over two lines
DUMP_09 = (
    "SchedulerOutput(scheduled_new_reqs=[NewRequestData(req_id=cmpl-a,prompt_token_ids_len=40,"
    "mm_inputs=[],mm_hashes=[],mm_positions=[],sampling_params=SamplingParams(n=1, temperature=0.7,"
    " stop=[], stop_token_ids=[], max_tokens=64, min_tokens=0),block_ids=[[1, 2, 3]],"
    "num_computed_tokens=0,lora_request=None)], scheduled_cached_reqs=[CachedRequestData("
    "req_id='cmpl-b', resumed_from_preemption=true, new_token_ids=[5, 6], new_block_ids=[[4, 5]],"
    " num_computed_tokens=16)], num_scheduled_tokens={cmpl-a: 40, cmpl-b: 4},"
    " total_num_scheduled_tokens=44, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},"
    " num_common_prefix_blocks=[0], finished_req_ids=['cmpl-z'], free_encoder_input_ids=[],"
    " structured_output_request_ids={}, grammar_bitmask=array([[ 0, 1, ..., 0],\n"
    "       [ 0, 2, ..., 0]], shape=(2, 4752), dtype=int32), kv_connector_metadata=null)")


def test_the_0_9_scheduler_output_is_read():
    so = read_scheduler_output(DUMP_09)
    assert so is not None
    a, b = so.requests
    assert (a.id, a.new, a.prompt_len, a.max_tokens, a.num_blocks, a.num_scheduled) == \
        ("cmpl-a", True, 40, 64, 3, 40)
    assert (b.id, b.new, b.resumed, b.num_computed_tokens, b.num_scheduled, b.num_blocks) == \
        ("cmpl-b", False, True, 16, 4, 2)
    assert so.total_num_scheduled_tokens == 44 and so.finished_req_ids == ["cmpl-z"]


def test_the_0_10_and_0_33_batched_layouts_are_read():
    v010 = ("SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData("
            "req_ids=['x', 'y'], resumed_from_preemption=[false, true], new_token_ids=[[], []], "
            "new_block_ids=[null, [[7, 8]]], num_computed_tokens=[100, 33]), "
            "num_scheduled_tokens={x: 1, y: 17}, total_num_scheduled_tokens=18)")
    so = read_scheduler_output(v010)
    assert [(r.id, r.resumed, r.num_computed_tokens, r.num_scheduled) for r in so.requests] == \
        [("x", False, 100, 1), ("y", True, 33, 17)]
    v033 = ("SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData("
            "req_ids=['x'],resumed_req_ids={'x'},new_token_ids_lens=[],all_token_ids_lens={},"
            "new_block_ids=[None],num_computed_tokens=[120],num_output_tokens=[20]), "
            "num_scheduled_tokens={x: 1}, total_num_scheduled_tokens=1, preempted_req_ids=set())")
    (x,) = read_scheduler_output(v033).requests
    assert (x.resumed, x.num_output_tokens, x.num_computed_tokens) == (True, 20, 120)


def test_stats_config_and_arguments_are_read():
    assert read_stats("SchedulerStats(num_running_reqs=8, num_waiting_reqs=0, step_counter=0, "
                      "kv_cache_usage=0.1295, prefix_cache_stats=PrefixCacheStats(reset=False, "
                      "requests=1, queries=70730, hits=528), spec_decoding_stats=None)") == {
        "running": 8, "waiting": 0, "kv_cache_usage_pct": 13.0, "gpu_cache_usage_raw": 0.1295,
        "prefix_cache": "queries=70730 hits=528", "prefix_cache_queries": 70730,
        "prefix_cache_hits": 528}
    cfg = read_config("model='m', speculative_config=SpeculativeConfig(method='ngram', model=None,"
                      " num_spec_tokens=3), max_seq_len=4096, enable_prefix_caching=False, "
                      "enable_chunked_prefill=True, compilation_config={\"level\":3}, ")
    assert (cfg["max_model_len"], cfg["enable_prefix_caching"], cfg["enable_chunked_prefill"],
            cfg["num_speculative_tokens"], cfg["speculative_method"]) == (4096, False, True, 3, "ngram")
    ns = read_config("Namespace(host=None, block_size=32, max_num_seqs=8, "
                     "scheduling_policy='priority', speculative_config=None)")
    assert (ns["block_size"], ns["max_num_seqs"], ns["scheduling_policy"]) == (32, 8, "priority")
    nd = read_config("{'model': 'm', 'max_num_batched_tokens': 4096, 'enable_prefix_caching': True}")
    assert nd["max_num_batched_tokens"] == 4096 and nd["enable_prefix_caching"] is True


@pytest.mark.parametrize("junk", ["", "SchedulerOutput(", "[[[[", "Foo(a=)", "x" * 1000,
                                  "(" * 500 + ")" * 10])
def test_the_repr_reader_never_raises(junk):
    parse_repr(junk)
    assert read_scheduler_output(junk) is None or junk.startswith("SchedulerOutput")


def _write_log(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "crash.log"
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


P = "(EngineCore_DP0 pid=9) ERROR 01-01 00:00:00"
SP = "/usr/local/lib/python3.12/dist-packages"
LOG_033 = f"""
(APIServer pid=1) INFO 01-01 00:00:00 [api_server.py:1] args: Namespace(host=None, block_size=32, max_num_seqs=8, scheduling_policy='fcfs')
{P} [dump_input.py:72] Dumping input data for V1 LLM engine (v0.11.0) with config: model='m', speculative_config=SpeculativeConfig(method='eagle', model='d', num_spec_tokens=2), max_seq_len=4096, enable_prefix_caching=False, enable_chunked_prefill=True, 
{P} [dump_input.py:79] Dumping scheduler output for model execution: SchedulerOutput(scheduled_new_reqs=[NewRequestData(req_id=r-new,prompt_token_ids_len=300,prefill_token_ids_len=None,mm_features=[],sampling_params=SamplingParams(n=1, temperature=0.0, max_tokens=50, stop=[]),block_ids=([5, 6, 7, 8, 9, 10, 11, 12, 13, 14],),num_computed_tokens=0,lora_request=None,prompt_embeds_shape=None)], scheduled_cached_reqs=CachedRequestData(req_ids=['r-old'],resumed_req_ids=set(),new_token_ids_lens=[],all_token_ids_lens={{}},new_block_ids=[None],num_computed_tokens=[520],num_output_tokens=[20]), num_scheduled_tokens={{r-new: 300, r-old: 3}}, total_num_scheduled_tokens=303, scheduled_spec_decode_tokens={{r-old: [1, 2]}}, finished_req_ids=[], num_common_prefix_blocks=[0])
{P} [dump_input.py:81] Dumping scheduler stats: SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5, prefix_cache_stats=PrefixCacheStats(reset=False, requests=1, queries=0, hits=0))
{P} [core.py:710] EngineCore encountered a fatal error.
{P} [core.py:710] Traceback (most recent call last):
{P} [core.py:710]   File "{SP}/vllm/v1/engine/core.py", line 701, in run_busy_loop
{P} [core.py:710]     self._process_engine_step()
{P} [core.py:710]   File "{SP}/vllm/v1/core/sched/scheduler.py", line 900, in update_from_output
{P} [core.py:710]     assert num_tokens_rejected >= 0
{P} [core.py:710] AssertionError
"""


def test_a_scenario_from_a_dump_uses_the_logs_values_and_marks_guesses(tmp_path):
    report, sc = triage_log(_write_log(tmp_path, LOG_033))
    text, scenario = draft_scenario(report, sc)
    cfg = scenario.config
    assert scenario.vllm.reproduces_on == ["0.11.0"]
    assert cfg.block_size == 32 and cfg.max_num_seqs == 8  # the server arguments win
    assert cfg.max_model_len == 4096 and cfg.enable_prefix_caching is False
    assert cfg.num_speculative_tokens == 2 and cfg.policy == "fcfs"
    reqs = {r.id: r for r in scenario.requests}
    assert (reqs["r-new"].prompt_len, reqs["r-new"].max_tokens) == (300, 50)
    assert reqs["r-old"].prompt_len == 520 + 3 - 20  # context minus the outputs the dump counts
    assert "waiting-1" in reqs and len(reqs) == 3  # the stats' waiting request
    assert all(r.priority == 0 for r in scenario.requests)
    # the crash is in scheduler code the lab drives: the draft expects it
    assert scenario.expect.outcome == "crash" and scenario.expect.exception == "AssertionError"
    assert scenario.expect.where == "vllm/v1/core/sched/scheduler.py:update_from_output"
    lines = text.splitlines()
    guessed = [ln for ln in lines if "# guess" in ln]
    assert any(ln.strip().startswith("num_gpu_blocks:") for ln in guessed)
    assert any(ln.strip().startswith("max_num_batched_tokens:") for ln in guessed)
    assert not any(ln.strip().startswith("block_size:") for ln in guessed)
    assert any("eagle" in ln for ln in lines)  # the method the lab does not model is noted


def test_the_block_size_is_derived_from_the_dump_when_not_given(tmp_path):
    log = LOG_033.replace("block_size=32, ", "")
    report, sc = triage_log(_write_log(tmp_path, log))
    text, scenario = draft_scenario(report, sc)
    assert scenario.config.block_size == 32  # 10 blocks hold 300 tokens
    assert any(ln.strip().startswith("block_size:") and "# derived" in ln for ln in text.splitlines())


def test_no_release_in_the_log_needs_vllm(tmp_path):
    log = LOG_033.replace("(v0.11.0)", "(vX)")
    report, sc = triage_log(_write_log(tmp_path, log))
    with pytest.raises(InputError, match="--vllm"):
        draft_scenario(report, sc)
    _, scenario = draft_scenario(report, sc, version="0.10.2")
    assert scenario.vllm.reproduces_on == ["0.10.2"]


def test_a_log_without_dump_or_stats_gives_no_scenario(tmp_path):
    log = _write_log(tmp_path, f"""
        INFO 01-01 00:00:00 [core.py:61] Initializing a V1 LLM engine (v0.9.2) with config: model='m'
        Traceback (most recent call last):
          File "{SP}/vllm/v1/worker/gpu_worker.py", line 136, in load_model
            self.model_runner.load_model()
        ValueError: no weights
        """)
    report, sc = triage_log(log)
    with pytest.raises(InputError, match="nothing to build"):
        draft_scenario(report, sc)


@needs_009
def test_the_009_scenario_validates_and_names_its_release(tmp_path, cli):
    out = tmp_path / "009.yaml"
    p = cli("triage", str(LOG_009), "--scenario", str(out), "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)["scenario"]
    sc = load_scenario(out)
    # an RPC timeout is outside the code the lab drives: no expect, so no reproduces_on either
    assert sc.expect is None and info["expects"] is None
    assert sc.vllm.concrete() == [] and info["vllm"] == "0.9.0"
    ids = [r.id for r in sc.requests]
    assert "chatcmpl-35245641e2d2465aa6c7abdfc6cbd8a2" in ids
    assert sum(i.startswith("waiting-") for i in ids) == 193  # SchedulerStats: 193 waiting
    assert all(r.priority == 0 for r in sc.requests)  # 0.9.0's front door refuses priorities
    cfg = sc.config
    assert (cfg.max_model_len, cfg.enable_prefix_caching, cfg.enable_chunked_prefill) == (20000, True, True)
    assert cfg.block_size == 16  # derived: 721 blocks for 11533 tokens
    # the engine config line's TP=4, and the executor vLLM picks for it on one node
    assert cfg.model_extra["tensor_parallel_size"] == 4
    assert cfg.model_extra["distributed_executor_backend"] == "mp"
    assert "pipeline_parallel_size" not in cfg.model_extra  # 1 in the log: vLLM's default
    text = out.read_text()
    assert "tensor_parallel_size: 4  # dump_input.py config, line 2" in text
    assert "# guess" in text and info["guesses"] == text.count("# guess")
    assert yaml.safe_load(text)["name"] == sc.name


LOG_019 = next(iter(sorted(CRASHLOGS.glob("019-*.log"))), None)


@pytest.mark.skipif(LOG_019 is None, reason=f"{CRASHLOGS / '019-*.log'} absent; {SHARED_HINT}")
def test_a_start_up_crash_drafts_an_engine_core_replay(tmp_path, monkeypatch):
    """'No available memory for the cache blocks' in EngineCore._initialize_kv_caches: no
    request ever ran, and the scheduler level never runs start-up. The draft is level
    engine-core, with no memory for the KV cache and the start-up crash expected."""
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path))  # no capabilities cached
    report, sc = triage_log(LOG_019)
    text, scenario = draft_scenario(report, sc)
    assert scenario.level == "engine-core"
    assert scenario.config.kv_cache_memory_bytes == 0
    assert scenario.expect.outcome == "crash" and scenario.expect.phase == "engine-build"
    assert scenario.expect.where == "vllm/v1/core/kv_cache_utils.py:check_enough_kv_cache_memory"
    assert "its capabilities record" in text
    # a release whose cached record says its EngineCore cannot run keeps the scheduler level
    from vllm_repro.engine.capabilities import Capabilities, save

    save(tmp_path, Capabilities(version=report.vllm_version))
    with pytest.raises(InputError):  # and at scheduler level there is nothing to replay
        draft_scenario(report, sc)


@pytest.mark.skipif(LOG_019 is None, reason=f"{CRASHLOGS / '019-*.log'} absent; {SHARED_HINT}")
def test_a_data_parallel_log_drafts_the_releases_dp_shape_where_it_has_one(tmp_path, monkeypatch):
    """Crash log 019 with its engine config saying data_parallel_size=2: the draft runs two DP
    ranks the release's way (an engine core process each behind the asyncio client, the
    packaged MoE config), unless the release's cached record says it has no DP engine cores;
    then it replays one rank and says why."""
    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path))
    log = tmp_path / "dp.log"
    log.write_text(LOG_019.read_text().replace("data_parallel_size=1", "data_parallel_size=2"))
    report, sc = triage_log(log)
    text, scenario = draft_scenario(report, sc)
    cfg = scenario.config
    assert scenario.level == "engine-core"
    assert cfg.model_extra["data_parallel_size"] == 2
    assert (cfg.multiprocess_mode, cfg.asyncio_mode, cfg.model_extra.get("model")) == (
        True, True, "mixtral-moe")
    from vllm_repro.engine.capabilities import Capabilities, save

    save(tmp_path, Capabilities(version=report.vllm_version, engine_core=True))
    text, scenario = draft_scenario(report, sc)
    assert "data_parallel_size" not in scenario.config.model_extra
    assert not scenario.config.multiprocess_mode
    assert "ran data_parallel_size 2, but" in text and "one DP rank's engine core" in text


def test_whether_a_release_defaults_to_v1_is_read_from_its_tree_not_its_number(tmp_path, monkeypatch):
    """The draft's chunked-prefill / prefix-caching defaults follow the V1 engine where the
    release runs it by default: read from the cached tree's vllm/envs.py (VLLM_USE_V1's default,
    or no switch at all beside a vllm/v1 package), never from a version comparison."""
    from vllm_repro.triage.scenario import _v1_default

    monkeypatch.setenv("VLLM_REPRO_CACHE", str(tmp_path))

    def tree(version, envs, v1=True):
        d = tmp_path / "trees" / version / "vllm"
        (d / "v1").mkdir(parents=True) if v1 else d.mkdir(parents=True)
        (d / "envs.py").write_text(envs)

    tree("9.0.0", '"VLLM_USE_V1":\n    lambda: bool(int(os.getenv("VLLM_USE_V1", "0"))),\n')
    tree("0.1.0", '"VLLM_USE_V1":\n    lambda: bool(int(os.getenv("VLLM_USE_V1", "1"))),\n')
    tree("1.0.0", "# no switch: V0 is gone\n")
    tree("2.0.0", "# no switch and no V1\n", v1=False)
    assert _v1_default("9.0.0")[0] is False  # a high number, but its default is V0
    assert _v1_default("0.1.0")[0] is True
    assert _v1_default("1.0.0")[0] is True
    assert _v1_default("2.0.0")[0] is False
    got, why = _v1_default("3.0.0")
    assert got is None and "not in the cache" in why


def _outside_reach_log(tmp_path: Path) -> Path:
    """LOG_033 with its crash moved into the model runner (outside the code the lab drives)."""
    log = LOG_033.replace("vllm/v1/core/sched/scheduler.py\", line 900, in update_from_output",
                          "vllm/v1/worker/gpu_model_runner.py\", line 1200, in execute_model")
    log = log.replace("    assert num_tokens_rejected >= 0", "    out = self.model(x)")
    log = log.replace("{P} [core.py:710] AssertionError",
                      "{P} [core.py:710] RuntimeError: CUDA error: an illegal memory access")
    return _write_log(tmp_path, log)


def test_a_draft_without_expect_runs_clean_on_its_release_instead_of_failing(tmp_path, cli):
    """The log's crash is outside the lab's reach: the draft has no expect, so it must not list
    the release under reproduces_on (which would demand a crash the replay cannot show, and fail
    its own replay); the release is named for --vllm, and a clean replay there is exit 0."""
    from vllm_repro.records import RunResult
    from vllm_repro.verdict import exit_code, judge

    report, sc = triage_log(_outside_reach_log(tmp_path))
    assert report.last_vllm_frame["module"] == "vllm/v1/worker/gpu_model_runner.py"
    text, scenario = draft_scenario(report, sc)
    assert scenario.expect is None and scenario.vllm.concrete() == []
    assert "--vllm 0.11.0" in text and "None" not in text
    clean = RunResult("clean", steps=60, finished={r.id: "FINISHED_LENGTH_CAPPED"
                                                   for r in scenario.requests})
    v = judge(scenario, "0.11.0", clean)
    assert (v.ok, exit_code([v])) == (None, 0)
    crash = RunResult.failed("input", "x")  # anything else is not clean: says so, exit != 0
    assert exit_code([judge(scenario, "0.11.0", crash)]) != 0
    # the command says what the draft expects and how to run it
    out = tmp_path / "d.yaml"
    p = cli("triage", str(tmp_path / "crash.log"), "--scenario", str(out))
    assert p.returncode == 0, p.stderr
    said = " ".join(p.stdout.split())
    assert "no expect: the log's crash is outside the code the lab drives" in said
    assert said.endswith(f"vllm-repro run {out} --vllm 0.11.0")
    # a hand-written reproduces_on without expect that runs clean says why it is a mismatch
    listed = scenario.model_copy(update={"vllm": scenario.vllm.model_copy(
        update={"reproduces_on": ["0.11.0"]})})
    v = judge(listed, "0.11.0", clean)
    assert v.ok is False and "no expect" in v.reason and "was clean" in v.reason


def test_the_description_names_only_what_triage_knows(tmp_path):
    """A log whose stage and exit triage cannot tell: no 'None' in the drafted description."""
    report, sc = triage_log(_write_log(tmp_path, LOG_033))
    report.stage, report.exit_kind = None, None
    text, scenario = draft_scenario(report, sc)
    assert "None" not in scenario.description and "None" not in text
    assert scenario.description.endswith("AssertionError")
    report.stage, report.exit_kind = "runtime", "python_exception"
    _, scenario = draft_scenario(report, sc)
    assert scenario.description.endswith("AssertionError (stage runtime, python_exception)")


# a 0.9.0 log cut off right after vLLM's crash dump (no traceback): three running requests
CUT_DUMP_09 = (
    "SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[CachedRequestData("
    "req_id='r1', resumed_from_preemption=false, new_token_ids=[5], new_block_ids=[[]], "
    "num_computed_tokens=100), CachedRequestData(req_id='r2', resumed_from_preemption=false, "
    "new_token_ids=[6], new_block_ids=[[]], num_computed_tokens=200), CachedRequestData("
    "req_id='r3', resumed_from_preemption=false, new_token_ids=[7], new_block_ids=[[]], "
    "num_computed_tokens=300)], num_scheduled_tokens={r1: 1, r2: 1, r3: 1}, "
    "total_num_scheduled_tokens=3, scheduled_spec_decode_tokens={}, num_common_prefix_blocks=[0],"
    " finished_req_ids=[], kv_connector_metadata=null)")
CUT_LOG = (
    "ERROR 06-05 16:27:39 [dump_input.py:68] Dumping input data\n"
    "ERROR 06-05 16:27:39 [dump_input.py:70] V1 LLM engine (v0.9.0) with config: model='m', "
    "max_seq_len=4096, enable_prefix_caching=False, chunked_prefill_enabled=True\n"
    "ERROR 06-05 16:27:39 [dump_input.py:78] Dumping scheduler output for model execution:\n"
    "ERROR 06-05 16:27:39 [dump_input.py:79] {dump}\n")


def test_a_log_cut_off_after_the_dump_says_so_first_in_the_report_and_the_draft(tmp_path, cli):
    """A log that ends with vLLM's crash dump (no traceback after it): the report and the draft
    say first that the log is cut off and the crash is not in it, never a confident 'no Python
    exception' / 'outside the code the lab drives'; the command's summary says it too."""
    log = _write_log(tmp_path, CUT_LOG.format(dump=CUT_DUMP_09))
    report, sc = triage_log(log)
    assert report.truncated and report.cut_off.startswith(
        "the log ends after vLLM's crash dump (line 1), before the exception")
    text, scenario = draft_scenario(report, sc)
    assert scenario.expect is None and len(scenario.requests) == 3
    lines = text.splitlines()
    assert lines[1].startswith("# CUT OFF: the log ends after vLLM's crash dump")
    assert "outside" not in text and "no Python exception" not in text
    assert "# no expect: the log is cut off before its crash" in text
    assert "the log is cut off before its crash" in scenario.description
    out = tmp_path / "d.yaml"
    p = cli("triage", str(log), "--scenario", str(out))
    assert p.returncode == 0, p.stderr
    said = p.stdout.splitlines()
    assert said[1].startswith("cut off: the log ends after vLLM's crash dump"), said[:3]
    summary = " ".join(p.stdout.split())
    assert "scenario (drafted from a log cut off before its crash):" in summary
    assert "outside the code the lab drives" not in summary
    assert "no expect: the log is cut off before its crash" in summary


@pytest.mark.parametrize("cut_after, read, left_out", [
    # inside r3's req_id: r3 is left out, named by what of its id is there
    ("req_id='r3", 2, "r3..."),
    # inside r3's num_computed_tokens value (300 cut to 30): left out, never read as 30
    ("num_computed_tokens=30", 2, "r3"),
    # right after r3's opening bracket: no id at all
    ("CachedRequestData(req_id='r2', resumed_from_preemption=false, new_token_ids=[6], "
     "new_block_ids=[[]], num_computed_tokens=200), CachedRequestData(", 2, "(id cut off)"),
])
def test_a_dump_line_cut_mid_line_says_how_many_requests_it_read(tmp_path, cli, cut_after, read,
                                                                  left_out):
    """The dump's SchedulerOutput line is itself cut: the request the cut fell in is not
    dropped silently (nor read with a cut-short number): a warning names the requests read,
    how many were announced where the log says, and the one left out, in the report and the
    draft."""
    end = CUT_DUMP_09.rindex(cut_after) + len(cut_after)
    log = _write_log(tmp_path, CUT_LOG.format(dump=CUT_DUMP_09[:end]))
    report, sc = triage_log(log)
    assert report.cut_off.startswith("the log ends inside vLLM's crash dump (line 1)")
    warning = next(n for n in report.notes if n.startswith("warning: "))
    assert warning == (f"warning: the dumped SchedulerOutput (line 4) is cut off mid-line: {read} "
                       "request(s) read from it; how many it held is not in the log (its "
                       f"num_scheduled_tokens is cut off); left out: {left_out} (the cut fell in "
                       "it before its lengths)")
    text, scenario = draft_scenario(report, sc)
    assert [r.id for r in scenario.requests] == ["r1", "r2"]
    head = " ".join(line.lstrip("# ") for line in text.splitlines()[1:8])
    assert f"WARNING: the dumped SchedulerOutput (line 4) is cut off mid-line: {read} request(s)" \
        in head and f"left out: {left_out}" in head
    p = cli("triage", str(log))
    assert p.returncode == 0 and "warning" in p.stdout and f"left out: {left_out}" in \
        " ".join(p.stdout.split())


def test_a_dump_cut_after_its_request_map_says_read_against_announced():
    """Cut after num_scheduled_tokens: the count it announces is known and said."""
    cut = CUT_DUMP_09[:CUT_DUMP_09.index("scheduled_spec_decode_tokens")]
    so = read_scheduler_output(cut)
    assert so.cut and so.announced == 3 and len(so.requests) == 3
    assert so.cut_warning(4) == ("the dumped SchedulerOutput (line 4) is cut off mid-line: 3 "
                                 "request(s) read from it of 3 its num_scheduled_tokens announces")
    # cut between two requests, with no map: the scheduler stats' running count stands for it,
    # and the request missing is said
    cut = CUT_DUMP_09[:CUT_DUMP_09.index("CachedRequestData(req_id='r3'")]
    so = read_scheduler_output(cut)
    assert so.cut_warning(4, 3, "stats line at log line 2") == (
        "the dumped SchedulerOutput (line 4) is cut off mid-line: 2 request(s) read from it of 3 "
        "running by the scheduler stats (stats line at log line 2); its num_scheduled_tokens is "
        "cut off; 1 request(s) missing from the draft")
    assert read_scheduler_output(CUT_DUMP_09).cut_warning(4) is None


def test_a_dump_cut_before_any_request_is_refused_saying_the_log_is_cut(tmp_path, cli):
    """`head -c` through the dump's first request (crash log 009 at 20000 bytes): --scenario has
    nothing to build requests from and says why: the log is cut, not 'no SchedulerOutput'."""
    first = CUT_DUMP_09.index("CachedRequestData(")
    log = _write_log(tmp_path, CUT_LOG.format(dump=CUT_DUMP_09[:first]))
    out = tmp_path / "d.yaml"
    p = cli("triage", str(log), "--scenario", str(out))
    assert p.returncode == 2 and not out.exists()
    assert "cut off before any request of vLLM's crash dump" in p.stderr, p.stderr
    assert "no dump_input.py SchedulerOutput" not in p.stderr
