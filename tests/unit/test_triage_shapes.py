"""Triage on logs as users paste them (issue 17, item 1): one log of each shape.

Each test writes a small log in the shape a user pastes it (a log viewer's per-line prefix,
CRLF, non-breaking spaces, lost indentation, Ray / DP process prefixes, an excerpt cut before its
exception line, retyped frame lines, a side thread's exception first, versions as people write
them) and checks the fields the shape used to break.
"""

from __future__ import annotations

import pytest

from vllm_repro.triage import triage_log
from vllm_repro.triage.normalize import learn_prefix, normalize

SP = "/usr/local/lib/python3.12/dist-packages"

# what vLLM 0.10.2's data-parallel EngineCore prints when the scheduler asserts
CORE = [
    "(EngineCore_DP0 pid=77) INFO 09-20 10:00:01 [core.py:75] Initializing a V1 LLM engine "
    "(v0.10.2) with config: model='m'",
    "(EngineCore_DP0 pid=77) ERROR 09-20 10:00:31 [core.py:712] EngineCore encountered a fatal "
    "error.",
    "(EngineCore_DP0 pid=77) ERROR 09-20 10:00:31 [core.py:712] Traceback (most recent call last):",
    f'(EngineCore_DP0 pid=77) ERROR 09-20 10:00:31 [core.py:712]   File "{SP}/vllm/v1/engine/'
    'core.py", line 703, in run_engine_core',
    "(EngineCore_DP0 pid=77) ERROR 09-20 10:00:31 [core.py:712]     engine_core.run_busy_loop()",
    f'(EngineCore_DP0 pid=77) ERROR 09-20 10:00:31 [core.py:712]   File "{SP}/vllm/v1/core/sched/'
    'scheduler.py", line 432, in schedule',
    "(EngineCore_DP0 pid=77) ERROR 09-20 10:00:31 [core.py:712]     assert num_new_tokens > 0",
    "(EngineCore_DP0 pid=77) ERROR 09-20 10:00:31 [core.py:712]            ^^^^^^^^^^^^^^^^^^",
    "(EngineCore_DP0 pid=77) ERROR 09-20 10:00:31 [core.py:712] AssertionError",
    "(APIServer pid=1) ERROR 09-20 10:00:31 [async_llm.py:480] AsyncLLM output_handler failed.",
    "(APIServer pid=1) ERROR 09-20 10:00:31 [async_llm.py:480] Traceback (most recent call last):",
    f'(APIServer pid=1) ERROR 09-20 10:00:31 [async_llm.py:480]   File "{SP}/vllm/v1/engine/'
    'async_llm.py", line 439, in output_handler',
    "(APIServer pid=1) ERROR 09-20 10:00:31 [async_llm.py:480]     outputs = await "
    "engine_core.get_output_async()",
    "(APIServer pid=1) ERROR 09-20 10:00:31 [async_llm.py:480] vllm.v1.engine.exceptions."
    "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
]


def tri(tmp_path, text: str | bytes, name: str = "crash.log") -> dict:
    p = tmp_path / name
    if isinstance(text, str):
        text = text.encode("utf-8")
    p.write_bytes(text)
    report, _ = triage_log(p)
    return report.as_dict()


def frame(d: dict) -> str | None:
    f = d["last_vllm_frame"]
    return f and f"{f['module']}:{f['function']}"


def assert_core_crash(d: dict) -> None:
    assert d["exception_type"] == "AssertionError", d
    assert frame(d) == "vllm/v1/core/sched/scheduler.py:schedule"
    assert d["stage"] == "runtime" and d["exit_kind"] == "python_exception"
    assert d["vllm_version"] == "0.10.2"
    assert d["truncated"] is False


# ---- per-line prefixes learned from the log ---------------------------------------------------
VIEWERS = {
    # Grafana / Loki "copy log lines": timestamp, a pipe
    "timestamp-pipe": lambda i, line: f"2025-09-20 10:00:{i:02d}.{i * 37 % 1000:03d} | {line}",
    # a viewer that numbers lines and adds a tab-separated ISO time
    "lineno-tab-iso": lambda i, line: f"{i + 1}\t2025-09-20T10:00:{i:02d}.123Z\t{line}",
    # a cloud console: "Sep 20, 2025 10:00:01.123 vllm-0 " (month name, a host)
    "console-host": lambda i, line: f"Sep 20, 2025 10:00:{i:02d}.5 vllm-0 {line}",
    # right-aligned line numbers from a paste site
    "gutter": lambda i, line: f"{i + 1:>4} │ {line}",
}


@pytest.mark.parametrize("viewer", sorted(VIEWERS))
def test_a_per_line_prefix_is_learned_from_the_log(tmp_path, viewer):
    wrap = VIEWERS[viewer]
    d = tri(tmp_path, "\n".join(wrap(i, line) for i, line in enumerate(CORE)) + "\n")
    assert_core_crash(d)
    assert d["root_cause"]["process"] == "EngineCore_DP0 pid=77"


def test_no_prefix_is_learned_from_a_plain_vllm_log_or_from_too_few_lines():
    assert learn_prefix(CORE) is None  # vLLM's own header is content, not a prefix
    assert learn_prefix([f"2025-09-20 10:00:01 | {CORE[2]}", "hello"]) is None


def test_the_learned_prefix_keeps_indentation_and_is_not_stripped_from_other_lines():
    rx = learn_prefix([f"2025-09-20 10:00:{i:02d}.1 | {line}" for i, line in enumerate(CORE)])
    assert rx is not None
    _, _, _, text = normalize('2025-09-20 10:00:09.9 |   File "x.py", line 1, in f', rx)
    assert text == '  File "x.py", line 1, in f'
    assert normalize("12 | not a prefix here", rx)[3] == "12 | not a prefix here"


# ---- characters a paste brings ----------------------------------------------------------------
def test_crlf_ansi_and_non_breaking_spaces(tmp_path):
    lines = [line.replace("  ", "\u00a0\u00a0").replace("ERROR", "\x1b[1;31mERROR\x1b[0m")
             for line in CORE]
    d = tri(tmp_path, "\r\n".join(lines) + "\r\n")
    assert_core_crash(d)


def test_ray_actor_prefixes_with_colour_codes(tmp_path):
    log = [
        "INFO 05-10 08:00:00 [__init__.py:239] Automatically detected platform cuda.",
        "INFO 05-10 08:00:01 [api_server.py:1043] vLLM API server version 0.8.5.post1",
        "\x1b[36m(RayWorkerWrapper pid=2191, ip=192.0.2.7)\x1b[0m ERROR 05-10 08:01:00 "
        "[worker_base.py:620] Error executing method 'execute_model'. This might cause deadlock "
        "in distributed execution.",
        "\x1b[36m(RayWorkerWrapper pid=2191, ip=192.0.2.7)\x1b[0m ERROR 05-10 08:01:00 "
        "[worker_base.py:620] Traceback (most recent call last):",
        f'\x1b[36m(RayWorkerWrapper pid=2191, ip=192.0.2.7)\x1b[0m ERROR 05-10 08:01:00 '
        f'[worker_base.py:620]   File "{SP}/vllm/worker/worker_base.py", line 612, in '
        "execute_method",
        "\x1b[36m(RayWorkerWrapper pid=2191, ip=192.0.2.7)\x1b[0m ERROR 05-10 08:01:00 "
        "[worker_base.py:620]     return run_method(self, method, args, kwargs)",
        f'\x1b[36m(RayWorkerWrapper pid=2191, ip=192.0.2.7)\x1b[0m ERROR 05-10 08:01:00 '
        f'[worker_base.py:620]   File "{SP}/vllm/v1/worker/gpu_model_runner.py", line 1100, in '
        "execute_model",
        "\x1b[36m(RayWorkerWrapper pid=2191, ip=192.0.2.7)\x1b[0m ERROR 05-10 08:01:00 "
        "[worker_base.py:620]     self._update_states(scheduler_output)",
        "\x1b[36m(RayWorkerWrapper pid=2191, ip=192.0.2.7)\x1b[0m ERROR 05-10 08:01:00 "
        "[worker_base.py:620] KeyError: 'chatcmpl-1'",
    ]
    d = tri(tmp_path, "\n".join(log) + "\n")
    assert d["exception_type"] == "KeyError"
    assert frame(d) == "vllm/v1/worker/gpu_model_runner.py:execute_model"
    assert d["root_cause"]["process"] == "RayWorkerWrapper pid=2191, ip=192.0.2.7"
    assert d["stage"] == "runtime" and d["vllm_version"] == "0.8.5.post1"


def test_lost_indentation_and_no_headers(tmp_path):
    # pasted into an issue outside a code block: the markdown ate every indent
    log = "\n".join([
        "Traceback (most recent call last):",
        f'File "{SP}/vllm/v1/engine/core.py", line 520, in run_busy_loop',
        "self._process_engine_step()",
        f'File "{SP}/vllm/v1/core/sched/scheduler.py", line 701, in update_from_output',
        "req_index = model_runner_output.req_id_to_index[req_id]",
        "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~^^^^^^^^",
        "KeyError: 'cmpl-9'",
    ]) + "\n"
    d = tri(tmp_path, log)
    assert d["exception_type"] == "KeyError" and d["exception_message"] == "'cmpl-9'"
    assert frame(d) == "vllm/v1/core/sched/scheduler.py:update_from_output"


def test_interleaved_engine_core_and_api_server_lines(tmp_path):
    core = [line for line in CORE if "EngineCore_DP0" in line]
    api = [line for line in CORE if "APIServer" in line]
    mixed = [core[0]]
    for i, line in enumerate(core[1:]):  # the two processes' lines alternate
        mixed.append(line)
        if i < len(api):
            mixed.append(api[i])
    mixed += api[len(core) - 1:]
    d = tri(tmp_path, "\n".join(mixed) + "\n")
    assert_core_crash(d)
    assert [w["type"].rsplit(".", 1)[-1] for w in d["wrapper_exceptions"]] == ["EngineDeadError"]


# ---- which exception ----------------------------------------------------------------------------
def test_a_side_threads_exception_printed_first_is_not_the_crash(tmp_path):
    side = [
        "Exception in thread Thread-3 (_report_usage_worker):",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.12/threading.py", line 1073, in _bootstrap_inner',
        "    self.run()",
        f'  File "{SP}/vllm/usage/usage_lib.py", line 170, in _report_usage_worker',
        "    self._report_usage_once(model_architecture, usage_context, extra_kvs)",
        f'  File "{SP}/vllm/usage/usage_lib.py", line 210, in _report_usage_once',
        "    info = cpuinfo.get_cpu_info()",
        "ValueError: could not read /proc/cpuinfo",
    ]
    d = tri(tmp_path, "\n".join(CORE[:1] + side + CORE[1:]) + "\n")
    assert_core_crash(d)
    # alone, the side thread's exception is still reported: it is all the log shows
    d = tri(tmp_path, "\n".join(side) + "\n", "side.log")
    assert d["exception_type"] == "ValueError"


def test_engine_dead_error_is_a_consequence(tmp_path):
    d = tri(tmp_path, "\n".join(CORE) + "\n")
    assert_core_crash(d)
    assert d["last_printed_exception"]["type"].endswith("EngineDeadError")


def test_a_truncated_traceback_reports_the_frames_it_shows(tmp_path):
    # an issue's excerpt: the EngineCore traceback stops before its exception line, the API
    # server's EngineDeadError follows
    cut = CORE[:7] + CORE[9:]
    d = tri(tmp_path, "\n".join(cut) + "\n")
    assert d["truncated"] is True
    assert d["exception_type"] is None
    assert frame(d) == "vllm/v1/core/sched/scheduler.py:schedule"
    assert d["stage"] == "runtime" and d["exit_kind"] == "python_exception"
    assert d["root_cause"]["process"] == "EngineCore_DP0 pid=77"
    assert any("cut off before its exception line" in n for n in d["notes"])
    # cut at the end of the log
    d = tri(tmp_path, "\n".join(CORE[:7]) + "\n", "end.log")
    assert d["truncated"] is True and frame(d) == "vllm/v1/core/sched/scheduler.py:schedule"


def test_abbreviated_frame_lines(tmp_path):
    log = "\n".join([
        "EngineCore hit an exception:",
        "Traceback (most recent call last):",
        "  vllm/v1/engine/core.py, in run_busy_loop",
        "  vllm/v1/core/sched/scheduler.py:812 in update_from_output",
        "  File vllm/v1/core/kv_cache_manager.py, line 350, in free",
        "AssertionError: block 17 freed twice",
    ]) + "\n"
    d = tri(tmp_path, log)
    assert d["exception_type"] == "AssertionError"
    assert d["last_vllm_frame"] == {"module": "vllm/v1/core/kv_cache_manager.py",
                                    "function": "free", "line": 350}
    assert d["crash_path"][:2] == ["vllm/v1/engine/core.py:run_busy_loop",
                                   "vllm/v1/core/sched/scheduler.py:update_from_output"]


def test_prose_naming_a_python_file_is_not_a_frame(tmp_path):
    log = "the bug is in vllm/v1/core/sched/scheduler.py in schedule, I think\n"
    with pytest.raises(Exception, match="no crash found"):
        tri(tmp_path, log)


def test_stage_from_scheduler_frames_only(tmp_path):
    log = "\n".join([
        f'  File "{SP}/vllm/v1/core/kv_cache_manager.py", line 300, in allocate_slots',
        "    new_blocks = self.block_pool.get_new_blocks(num_new_blocks)",
        f'  File "{SP}/vllm/v1/core/block_pool.py", line 336, in get_new_blocks',
        "    ret = self.free_block_queue.popleft_n(num_blocks)",
        "AssertionError",
    ]) + "\n"
    d = tri(tmp_path, log)
    assert frame(d) == "vllm/v1/core/block_pool.py:get_new_blocks"
    assert d["stage"] == "runtime"
    # KV cache sizing in the same module family is engine build, not serving
    log = "\n".join([
        f'  File "{SP}/vllm/v1/core/kv_cache_utils.py", line 700, in check_enough_kv_cache_memory',
        "    raise ValueError(",
        "ValueError: No available memory for the cache blocks.",
    ]) + "\n"
    assert tri(tmp_path, log, "build.log")["stage"] == "engine-build"


def test_a_latin1_byte_does_not_refuse_the_log(tmp_path):
    data = ("\n".join(CORE[:1] + ["(EngineCore_DP0 pid=77) INFO 09-20 10:00:20 [logger.py:39] "
                                  "Received request 1: prompt: 'caf\u00e9'"] + CORE[1:]) + "\n")
    d = tri(tmp_path, data.encode("latin-1"))
    assert_core_crash(d)
    assert any("not UTF-8" in n and "line 2" in n for n in d["notes"])


# ---- versions as people write them --------------------------------------------------------------
@pytest.mark.parametrize("line,version", [
    ("Observed with vLLM 0.28.0 on 8xH100.", "0.28.0"),
    ("Running vLLM `0.28.0rc2` from the wheel", "0.28.0rc2"),
    ("- vllm 0.19.1", "0.19.1"),
    ("vLLM Version: 0.9.1", "0.9.1"),  # collect_env
    ("vLLM Version: 0.9.2.dev364+gb432b7a28 (git sha: b432b7a28)", "0.9.2.dev364+gb432b7a28"),
    ("vllm==0.9.1", "0.9.1"),
    ("[pip3] vllm==0.8.5.post1", "0.8.5.post1"),
    ("vllm                      0.9.1", "0.9.1"),  # pip list
    ("vllm                      0.10.0                   pypi_0    pypi", "0.10.0"),  # conda list
])
def test_versions_in_every_form(tmp_path, line, version):
    d = tri(tmp_path, line + "\n" + "\n".join(CORE[2:9]) + "\n")
    assert d["vllm_version"] == version


def test_pip_show_version_and_the_engine_banner_wins_over_prose(tmp_path):
    d = tri(tmp_path, "Name: vllm\nVersion: 0.8.4\nSummary: x\n" + "\n".join(CORE[2:9]) + "\n")
    assert d["vllm_version"] == "0.8.4"
    d = tri(tmp_path, "I saw it on vllm 0.9.0 too\n" + "\n".join(CORE) + "\n", "b.log")
    assert d["vllm_version"] == "0.10.2"  # the log's own banner beats what prose says


# ---- shapes the corpus brought -----------------------------------------------------------------
def test_indented_and_mangled_logger_headers(tmp_path):
    body = [line.split(" ", 2)[2] for line in CORE[2:9]]  # "ERROR 09-20 ... [core.py:712] ..."
    d = tri(tmp_path, "\n".join(" " + line for line in body) + "\n")  # one space in front
    assert d["exception_type"] == "AssertionError"
    assert frame(d) == "vllm/v1/core/sched/scheduler.py:schedule"
    mangled = "\n".join(line.replace("[core.py:712]", "[core.py:712[]") for line in body) + "\n"
    d = tri(tmp_path, mangled, "mangled.log")
    assert d["exception_type"] == "AssertionError"
    assert frame(d) == "vllm/v1/core/sched/scheduler.py:schedule"


def test_a_log_in_newest_first_order(tmp_path):
    log = "\n".join([
        "ERROR 05-29 07:34:21 [core.py:491] AssertionError",
        'ERROR 05-29 07:34:21 [core.py:491]   File "/workspace/vllm/vllm/v1/core/sched/'
        'scheduler.py", line 386, in schedule',
        "ERROR 05-29 07:34:21 [core.py:491]     assert num_new_tokens > 0",
    ]) + "\n"
    d = tri(tmp_path, log)
    assert d["exception_type"] == "AssertionError"
    assert frame(d) == "vllm/v1/core/sched/scheduler.py:schedule" and d["stage"] == "runtime"
    assert any("newest line first" in n for n in d["notes"])


def test_a_whole_log_in_newest_first_order(tmp_path):
    # a log viewer that lists newest first reverses every line: the exception line, then the
    # innermost frame's caret and source lines, then the frames innermost first, the header last
    forward = [
        "(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491] EngineCore encountered a "
        "fatal error.",
        "(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491] Traceback (most recent call "
        "last):",
        '(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491]   File "/usr/lib/python3.12/'
        'site-packages/vllm/v1/engine/core.py", line 480, in run_engine_core',
        "(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491]     engine_core.run_busy_loop()",
        '(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491]   File "/usr/lib/python3.12/'
        'site-packages/vllm/v1/engine/core.py", line 507, in run_busy_loop',
        "(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491]     self._process_engine_step()",
        '(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491]   File "/usr/lib/python3.12/'
        'site-packages/vllm/v1/core/sched/scheduler.py", line 386, in schedule',
        "(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491]     assert num_new_tokens > 0",
        "(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491]            ^^^^^^^^^^^^^^^^^^",
        "(EngineCore_DP0 pid=1) ERROR 05-29 07:34:21 [core.py:491] AssertionError",
    ]
    d = tri(tmp_path, "\n".join(reversed(forward)) + "\n")
    assert d["exception_type"] == "AssertionError" and not d["truncated"]
    assert frame(d) == "vllm/v1/core/sched/scheduler.py:schedule" and d["stage"] == "runtime"
    assert any("newest line first" in n for n in d["notes"])


def test_another_projects_vllm_integration_folder_is_not_vllm(tmp_path):
    from vllm_repro.triage.frames import vllm_module
    assert vllm_module("/x/lmcache/integration/vllm/vllm_v1_adapter.py") is None
    assert vllm_module("/x/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/"
                       "lmcache_connector.py") == ("vllm/distributed/kv_transfer/kv_connector/"
                                                   "v1/lmcache_connector.py")


def test_a_wrapper_then_its_own_cut_traceback_stays_the_wrapper(tmp_path):
    # the API server's EngineDeadError, then its stream generator's traceback, cut: the cut
    # traceback is the wrapper's fallout, not a better view of the crash
    log = CORE[9:] + [
        "(APIServer pid=1) ERROR 09-20 10:00:31 [serving_chat.py:1136] Traceback (most recent "
        "call last):",
        f'(APIServer pid=1) ERROR 09-20 10:00:31 [serving_chat.py:1136]   File "{SP}/vllm/'
        'entrypoints/openai/serving_chat.py", line 562, in chat_completion_stream_generator',
    ]
    d = tri(tmp_path, "\n".join(log) + "\n")
    assert d["exception_type"].endswith("EngineDeadError") and d["truncated"] is False


def test_python_313_multi_line_source_excerpts_stay_in_the_traceback(tmp_path):
    log = "\n".join([
        "Traceback (most recent call last):",
        f'  File "{SP}/vllm/v1/engine/core_client.py", line 600, in __init__',
        "    super().__init__(",
        "    ~~~~~~~~~~~~~~~~^",
        "        asyncio_mode=False,",
        "        ^^^^^^^^^^^^^^^^^^^",
        "    ...<2 lines>...",
        "    )",
        "    ^",
        f'  File "{SP}/vllm/v1/engine/utils.py", line 759, in wait_for_engine_startup',
        '    raise RuntimeError("Engine core initialization failed. "',
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]) + "\n"
    d = tri(tmp_path, log)
    assert d["exception_type"] == "RuntimeError"
    assert frame(d) == "vllm/v1/engine/utils.py:wait_for_engine_startup"
    assert d["crash_path"][0] == "vllm/v1/engine/core_client.py:__init__"


def test_only_vllms_crash_dump_is_a_cut_off_crash_not_no_crash(tmp_path):
    log = ("(EngineCore_0 pid=9) ERROR 09-02 08:04:02 [dump_input.py:69] Dumping input data for "
           "V1 LLM engine (v0.10.1.1) with config: model='m', speculative_config=None\n")
    d = tri(tmp_path, log)
    assert d["truncated"] is True and d["exception_type"] is None and d["exit_kind"] is None
    assert d["stage"] == "runtime" and d["vllm_version"] == "0.10.1.1"
    assert any("crash dump" in n for n in d["notes"])
