"""Triage on the shapes real vLLM crash logs take (written here in the forms vLLM, Ray, torch,
faulthandler, the shell and log viewers print them)."""

from __future__ import annotations

import textwrap

import pytest

from vllm_repro.errors import InputError
from vllm_repro.triage import triage_log
from vllm_repro.triage.frames import vllm_module

SP = "/usr/local/lib/python3.12/dist-packages"


def tri(tmp_path, text: str, name: str = "crash.log") -> dict:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    report, _ = triage_log(p)
    return report.as_dict()


def frame(d: dict) -> str | None:
    f = d["last_vllm_frame"]
    return f and f"{f['module']}:{f['function']}"


# a V1 engine-core crash in the busy loop, as vLLM 0.10 logs it (EngineCore_0 process prefix)
ENGINE_CORE_CRASH = f"""
(APIServer pid=1) INFO 08-20 10:00:01 [api_server.py:1805] vLLM API server version 0.10.1.1
(APIServer pid=1) INFO 08-20 10:00:30 [loggers.py:123] Engine 000: Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 80.0 tokens/s, Running: 7 reqs, Waiting: 3 reqs, GPU KV cache usage: 91.2%, Prefix cache hit rate: 12.5%
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700] EngineCore encountered a fatal error.
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700] Traceback (most recent call last):
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]   File "{SP}/vllm/v1/engine/core.py", line 691, in run_engine_core
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]     engine_core.run_busy_loop()
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]   File "{SP}/vllm/v1/engine/core.py", line 718, in run_busy_loop
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]     self._process_engine_step()
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]   File "{SP}/vllm/v1/engine/core.py", line 743, in _process_engine_step
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]     outputs, model_executed = self.step_fn()
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]                               ^^^^^^^^^^^^^^
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]   File "{SP}/vllm/v1/engine/core.py", line 288, in step
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]     scheduler_output = self.scheduler.schedule()
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]                        ^^^^^^^^^^^^^^^^^^^^^^^^^
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]   File "{SP}/vllm/v1/core/sched/scheduler.py", line 432, in schedule
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]     assert num_new_tokens > 0
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700]            ^^^^^^^^^^^^^^^^^^
(EngineCore_0 pid=77) ERROR 08-20 10:00:31 [core.py:700] AssertionError
(APIServer pid=1) ERROR 08-20 10:00:31 [async_llm.py:480] AsyncLLM output_handler failed.
(APIServer pid=1) ERROR 08-20 10:00:31 [async_llm.py:480] Traceback (most recent call last):
(APIServer pid=1) ERROR 08-20 10:00:31 [async_llm.py:480]   File "{SP}/vllm/v1/engine/async_llm.py", line 439, in output_handler
(APIServer pid=1) ERROR 08-20 10:00:31 [async_llm.py:480]     outputs = await engine_core.get_output_async()
(APIServer pid=1) ERROR 08-20 10:00:31 [async_llm.py:480]   File "{SP}/vllm/v1/engine/core_client.py", line 846, in get_output_async
(APIServer pid=1) ERROR 08-20 10:00:31 [async_llm.py:480]     raise self._format_exception(outputs) from None
(APIServer pid=1) ERROR 08-20 10:00:31 [async_llm.py:480] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
"""


def test_engine_core_crash_under_process_prefixes(tmp_path):
    d = tri(tmp_path, ENGINE_CORE_CRASH)
    assert d["exception_type"] == "AssertionError" and d["exception_message"] == ""
    assert frame(d) == "vllm/v1/core/sched/scheduler.py:schedule"
    assert d["stage"] == "runtime" and d["exit_kind"] == "python_exception"
    assert d["vllm_version"] == "0.10.1.1"
    assert d["root_cause"]["process"] == "EngineCore_0 pid=77"
    assert [w["type"] for w in d["wrapper_exceptions"]] == ["vllm.v1.engine.exceptions.EngineDeadError"]
    st = d["scheduler_state"]
    assert (st["running"], st["waiting"], st["kv_cache_usage_pct"], st["prefix_cache_hit_rate_pct"]) \
        == (7, 3, 91.2, 12.5)


def _decorate(text: str, how: str) -> str:
    out = []
    for i, line in enumerate(textwrap.dedent(text).lstrip("\n").splitlines()):
        if how == "ansi":
            line = line.replace("ERROR", "\x1b[1;31mERROR\x1b[0m").replace("(EngineCore_0", "\x1b[36m(EngineCore_0")
        elif how == "kubectl":
            line = f"2025-08-20T10:00:{i % 60:02d}.123456789Z {line}"
        elif how == "compose":
            line = f"vllm-openai-1  | {line}"
        elif how == "journald":
            line = f"Aug 20 10:00:31 gpu-node-3 vllm[4711]: {line}"
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("how", ["ansi", "kubectl", "compose", "journald"])
def test_colour_codes_and_log_viewer_prefixes_do_not_change_the_answer(tmp_path, how):
    plain = tri(tmp_path, ENGINE_CORE_CRASH, "plain.log")
    d = tri(tmp_path, _decorate(ENGINE_CORE_CRASH, how), f"{how}.log")
    for key in ("exception_type", "exception_message", "last_vllm_frame", "stage", "exit_kind",
                "vllm_version", "scheduler_state"):
        assert d[key] == plain[key], key


def test_interleaved_worker_traceback_and_raw_stderr_stay_apart(tmp_path):
    w = "(VllmWorker rank=1 pid=301) ERROR 06-11 01:51:09 [multiproc_executor.py:527]"
    d = tri(tmp_path, f"""
        {w} WorkerProc hit an exception.
        {w} Traceback (most recent call last):
        {w}   File "{SP}/vllm/v1/executor/multiproc_executor.py", line 522, in worker_busy_loop
        terminate called after throwing an instance of 'c10::DistBackendError'
        {w}     output = func(*args, **kwargs)
          what():  [PG ID 2 PG GUID 3 Rank 1] Process group watchdog thread terminated with exception: CUDA error: an illegal memory access was encountered
        {w}   File "{SP}/vllm/v1/worker/gpu_model_runner.py", line 1374, in execute_model
        Exception raised from c10_cuda_check_implementation at /pytorch/c10/cuda/CUDAException.cpp:43 (most recent call first):
        {w}     valid_sampled_token_ids = sampled_token_ids.tolist()
        frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7fa563f785e8 in {SP}/torch/lib/libc10.so)
        {w} RuntimeError: CUDA error: an illegal memory access was encountered
        {w} CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
        ERROR 06-11 01:51:09 [core.py:517] EngineCore encountered a fatal error.
        ERROR 06-11 01:51:09 [core.py:517] Traceback (most recent call last):
        ERROR 06-11 01:51:09 [core.py:517]   File "{SP}/vllm/v1/executor/multiproc_executor.py", line 207, in get_response
        ERROR 06-11 01:51:09 [core.py:517]     raise RuntimeError(
        ERROR 06-11 01:51:09 [core.py:517] RuntimeError: Worker failed with error 'CUDA error: an illegal memory access was encountered
        ERROR 06-11 01:51:09 [core.py:517] ', please check the stack trace above for the root cause
        """)
    assert d["exception_message"] == "CUDA error: an illegal memory access was encountered"
    assert frame(d) == "vllm/v1/worker/gpu_model_runner.py:execute_model"
    assert d["root_cause"]["process"] == "VllmWorker rank=1 pid=301"
    assert d["exit_kind"] == "cuda_error" and d["stage"] == "runtime"


def test_explicit_chain_keeps_the_error_vllm_raised(tmp_path):
    d = tri(tmp_path, f"""
        Traceback (most recent call last):
          File "{SP}/vllm/distributed/device_communicators/shm_broadcast.py", line 427, in acquire_read
            raise TimeoutError
        TimeoutError

        The above exception was the direct cause of the following exception:

        Traceback (most recent call last):
          File "{SP}/vllm/v1/engine/core.py", line 520, in run_busy_loop
            self._process_engine_step()
          File "{SP}/vllm/v1/executor/multiproc_executor.py", line 221, in collective_rpc
            raise TimeoutError(f"RPC call to {{method}} timed out.") from e
        TimeoutError: RPC call to execute_model timed out.
        """)
    assert d["exception_message"] == "RPC call to execute_model timed out."
    assert frame(d) == "vllm/v1/executor/multiproc_executor.py:collective_rpc"
    assert d["cause_chain"][0]["last_vllm_frame"]["function"] == "acquire_read"


def test_reraise_outside_vllm_points_back_at_the_vllm_failure(tmp_path):
    d = tri(tmp_path, f"""
        Traceback (most recent call last):
          File "{SP}/vllm/model_executor/model_loader/weight_utils.py", line 88, in safetensors_weights_iterator
            with safe_open(st_file, framework="pt") as f:
        safetensors_rust.SafetensorError: Error while deserializing header: HeaderTooLarge

        During handling of the above exception, another exception occurred:

        Traceback (most recent call last):
          File "/home/u/app/serve.py", line 12, in main
            raise SystemError("model failed to load")
        SystemError: model failed to load
        """)
    assert d["exception_type"] == "safetensors_rust.SafetensorError"
    assert frame(d) == "vllm/model_executor/model_loader/weight_utils.py:safetensors_weights_iterator"


def test_only_a_wrapper_in_the_log_is_reported_with_a_note(tmp_path):
    d = tri(tmp_path, f"""
        Traceback (most recent call last):
          File "{SP}/vllm/v1/engine/utils.py", line 759, in wait_for_engine_startup
            raise RuntimeError("Engine core initialization failed. "
        RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{}}
        """)
    assert d["exception_type"] == "RuntimeError"
    assert d["stage"] == "engine-build"
    assert any("only exceptions that report another one" in n for n in d["notes"])


def test_an_earlier_recovered_error_is_not_the_root_cause(tmp_path):
    d = tri(tmp_path, f"""
        ERROR 01-02 03:04:05 [serving_chat.py:200] Error in preprocessing prompt inputs
        ERROR 01-02 03:04:05 [serving_chat.py:200] Traceback (most recent call last):
        ERROR 01-02 03:04:05 [serving_chat.py:200]   File "{SP}/vllm/entrypoints/openai/serving_chat.py", line 190, in create_chat_completion
        ERROR 01-02 03:04:05 [serving_chat.py:200]     raise ValueError("bad tool call")
        ERROR 01-02 03:04:05 [serving_chat.py:200] ValueError: bad tool call
        INFO 01-02 03:04:15 [loggers.py:116] Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.0%, Prefix cache hit rate: 0.0%
        INFO:     127.0.0.1:5000 - "POST /v1/chat/completions HTTP/1.1" 200 OK
        ERROR 01-02 03:05:00 [core.py:600] EngineCore encountered a fatal error.
        ERROR 01-02 03:05:00 [core.py:600] Traceback (most recent call last):
        ERROR 01-02 03:05:00 [core.py:600]   File "{SP}/vllm/v1/engine/core.py", line 600, in run_busy_loop
        ERROR 01-02 03:05:00 [core.py:600]     self._process_engine_step()
        ERROR 01-02 03:05:00 [core.py:600]   File "{SP}/vllm/v1/core/block_pool.py", line 300, in free_blocks
        ERROR 01-02 03:05:00 [core.py:600]     assert block.ref_cnt >= 0
        ERROR 01-02 03:05:00 [core.py:600] AssertionError
        """)
    assert d["exception_type"] == "AssertionError"
    assert frame(d) == "vllm/v1/core/block_pool.py:free_blocks"


FAULT = f"""
(RayWorkerWrapper pid=4242, ip=10.0.0.5) INFO 05-06 14:19:40 [gpu_model_runner.py:1200] Starting to load model /models/x...
(RayWorkerWrapper pid=4242, ip=10.0.0.5) Fatal Python error: {{kind}}
(RayWorkerWrapper pid=4242, ip=10.0.0.5)
(RayWorkerWrapper pid=4242, ip=10.0.0.5) Thread 0x00007f0000000001 (most recent call first):
(RayWorkerWrapper pid=4242, ip=10.0.0.5)   File "{SP}/vllm/v1/worker/gpu_worker.py", line 10 in some_other_thread
(RayWorkerWrapper pid=4242, ip=10.0.0.5)
(RayWorkerWrapper pid=4242, ip=10.0.0.5) Current thread 0x00007f0000000002 (most recent call first):
(RayWorkerWrapper pid=4242, ip=10.0.0.5)   File "{SP}/vllm/model_executor/layers/quantization/utils/marlin_utils.py", line 99 in apply_gptq_marlin_linear
(RayWorkerWrapper pid=4242, ip=10.0.0.5)   File "{SP}/vllm/v1/worker/gpu_model_runner.py", line 1441 in _dummy_run
(RayWorkerWrapper pid=4242, ip=10.0.0.5)   File "{SP}/vllm/v1/worker/gpu_model_runner.py", line 1600 in profile_run
(RayWorkerWrapper pid=4242, ip=10.0.0.5)   File "{SP}/ray/_private/worker.py", line 935 in main_loop
(RayWorkerWrapper pid=4242, ip=10.0.0.5)
ERROR 05-06 14:20:15 [core.py:387] EngineCore hit an exception: Traceback (most recent call last):
ERROR 05-06 14:20:15 [core.py:387]   File "{SP}/vllm/executor/ray_distributed_executor.py", line 521, in _run_workers
ERROR 05-06 14:20:15 [core.py:387]     ray_worker_outputs = ray.get(ray_worker_outputs)
ERROR 05-06 14:20:15 [core.py:387]   File "{SP}/ray/_private/worker.py", line 921, in get_objects
ERROR 05-06 14:20:15 [core.py:387]     raise value
ERROR 05-06 14:20:15 [core.py:387] ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
ERROR 05-06 14:20:15 [core.py:387] The actor is dead because its worker process has died. There are some potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage.
CRITICAL 05-06 14:20:15 [core_client.py:359] Got fatal signal from worker processes, shutting down. See stack trace above for root cause issue.
Killed
"""


@pytest.mark.parametrize("kind,sig", [("Segmentation fault", "SIGSEGV"), ("Aborted", "SIGABRT"),
                                      ("Bus error", "SIGBUS")])
def test_faulthandler_death_in_a_ray_worker(tmp_path, kind, sig):
    d = tri(tmp_path, FAULT.format(kind=kind))
    assert d["exception_type"] == "ray.exceptions.ActorDiedError"
    assert d["exit_kind"] == f"signal:{sig}"
    # the dying (current) thread's innermost vLLM frame, not another thread's
    assert frame(d) == "vllm/model_executor/layers/quantization/utils/marlin_utils.py:apply_gptq_marlin_linear"
    assert d["stage"] == "engine-build"
    assert d["signal"]["process"] == "RayWorkerWrapper pid=4242, ip=10.0.0.5"


@pytest.mark.parametrize("line,sig", [
    ("Worker proc VllmWorker-2 exited with exit code -9", "SIGKILL"),
    ("Process ForkProcess-1:3 exitcode=-11", "SIGSEGV"),
    ("ERROR 01-01 00:00:03 [multiproc_executor.py:140] Worker proc VllmWorker-0 died "
     "unexpectedly, shutting down executor. (exitcode=-6)", "SIGABRT"),
    ("subprocess.CalledProcessError: Command '['python', 'w.py']' died with <Signals.SIGSEGV: 11>.",
     "SIGSEGV"),
    ("command terminated with exit code 137", "SIGKILL"),
    ("vllm serve exited with code 139", "SIGSEGV"),
    ("Container exited with exit code 134", "SIGABRT"),
    ("Segmentation fault (core dumped)", "SIGSEGV"),
    ("Aborted (core dumped)", "SIGABRT"),
    ("[12345.678] Out of memory: Killed process 4242 (python3) total-vm:99999kB", "SIGKILL"),
    ("Killed", "SIGKILL"),
    ("Process 1234 died with signal 11", "SIGSEGV"),
    ("torch.distributed.elastic.multiprocessing.api.SignalException: Process 17 got signal: 11",
     "SIGSEGV"),
    ("[host:31797:0:31797] Caught signal 11 (Segmentation fault: address not mapped to object)",
     "SIGSEGV"),
    ("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): "
     "{'EngineCore_DP0': -9}", "SIGKILL"),
])
def test_signal_deaths_and_exit_codes(tmp_path, line, sig):
    d = tri(tmp_path, f"""
        INFO 01-01 00:00:01 [gpu_model_runner.py:1200] Starting to load model /models/big...
        INFO 01-01 00:00:02 [weight_utils.py:265] Using model weights format ['*.safetensors']
        {line}
        """)
    assert d["exit_kind"] == f"signal:{sig}"
    assert d["stage"] == "engine-build"  # from how far the log got


@pytest.mark.parametrize("line", [
    "faulthandler, `*** SIGSEGV received`, `terminate called`, exit codes -9/-11/-6, 137/139/134,",
    "When a worker process gets a fatal signal from the driver (SIGSEGV, SIGKILL), it exits.",
    "Segmentation faults in worker processes show as signal:SIGSEGV.",
    "Killed workers are not restarted by vLLM.",
    "A process that received signal 11 and exited with code 139 leaves no traceback.",
    "the pod was OOMKilled, and Python's Fatal Python error: Segmentation fault banner is missing",
])
def test_prose_that_names_a_signal_is_not_one(tmp_path, line):
    with pytest.raises(InputError, match="no crash found"):
        tri(tmp_path, line + "\n")


def test_killed_after_vllms_own_fatal_signal_notice_is_not_a_sigkill(tmp_path):
    d = tri(tmp_path, f"""
        ERROR 04-21 00:33:55 [core.py:387] EngineCore hit an exception: Traceback (most recent call last):
        ERROR 04-21 00:33:55 [core.py:387]   File "{SP}/vllm/v1/engine/core.py", line 402, in run_busy_loop
        ERROR 04-21 00:33:55 [core.py:387]     self._process_engine_step()
        ERROR 04-21 00:33:55 [core.py:387] KeyError: 'chatcmpl-1'
        CRITICAL 04-21 00:33:55 [core_client.py:359] Got fatal signal from worker processes, shutting down. See stack trace above for root cause issue.
        Killed
        """)
    assert d["exit_kind"] == "python_exception"
    assert d["exception_type"] == "KeyError" and d["exception_message"] == "'chatcmpl-1'"


def test_signal_after_the_exception_is_teardown_not_the_cause(tmp_path):
    d = tri(tmp_path, f"""
        Traceback (most recent call last):
          File "{SP}/vllm/v1/engine/core.py", line 402, in run_busy_loop
            self._process_engine_step()
        ValueError: boom
        Worker proc VllmWorker-0 exited with exit code -15
        Worker proc VllmWorker-1 exited with exit code -9
        """)
    assert d["exit_kind"] == "python_exception"


@pytest.mark.parametrize("message,kind", [
    ("RuntimeError: CUDA error: device-side assert triggered", "cuda_error"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", "cuda_error"),
    ("RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error", "cuda_error"),
    ("ValueError: This may lead to incorrect model outputs or CUDA errors.", "python_exception"),
    ("ValueError: out of memory in the tokenizer cache", "python_exception"),
    # Ray's memory monitor SIGKILLs the worker: host memory, not the GPU
    ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.",
     "signal:SIGKILL"),
])
def test_cuda_errors_are_told_from_python_exceptions(tmp_path, message, kind):
    d = tri(tmp_path, f"""
        Traceback (most recent call last):
          File "{SP}/vllm/v1/worker/gpu_model_runner.py", line 1374, in execute_model
            valid_sampled_token_ids = sampled_token_ids.tolist()
        {message}
        """)
    assert d["exit_kind"] == kind


@pytest.mark.parametrize("line,version", [
    ("INFO 08-20 10:00:01 [api_server.py:1805] vLLM API server version 0.10.1.1", "0.10.1.1"),
    ("INFO 06-01 00:00:00 [core.py:61] Initializing a V1 LLM engine (v0.9.2) with config: model='m'", "0.9.2"),
    ("INFO 09-27 03:03:51 llm_engine.py:223] Initializing an LLM engine (v0.6.1.post2) with config: model='m'", "0.6.1.post2"),
    ("vLLM Version: 0.11.0", "0.11.0"),
    ("(APIServer pid=1) INFO 01-01 00:00:00 [startup.py:38] vLLM server version 0.20.1, serving model m",
     "0.20.1"),
    ("(APIServer pid=1) INFO 01-01 00:00:00 [startup.py:38]  \x1b[93m\u2584\u2584\x1b[0m \x1b[1m\u2588 "
     "\u2580\u2584\u2580 \u2588\x1b[0m  version \x1b[1m0.33.0\x1b[0m", "0.33.0"),
    ("[pip3] vllm==0.8.5.post1", "0.8.5.post1"),
    ("docker run --gpus all vllm/vllm-openai:v0.10.2 --model m", "0.10.2"),
    ("vllm                              0.7.3", "0.7.3"),
    ("[pip3] torch==2.7.0 and Python version 3.12.3", None),
])
def test_version_strings(tmp_path, line, version):
    d = tri(tmp_path, f"""
        {line}
        Traceback (most recent call last):
          File "{SP}/vllm/v1/engine/core.py", line 402, in run_busy_loop
            self._process_engine_step()
        ValueError: boom
        """)
    assert d["vllm_version"] == version


def test_v0_stats_blocks_and_preemption_warnings(tmp_path):
    d = tri(tmp_path, """
        INFO 09-27 03:04:12 distributed_gpu_executor.py:57] # GPU blocks: 1200, # CPU blocks: 512
        INFO 09-27 03:05:40 metrics.py:352] Avg prompt throughput: 3.2 tokens/s, Avg generation throughput: 0.1 tokens/s, Running: 9 reqs, Swapped: 1 reqs, Pending: 4 reqs, GPU KV cache usage: 99.1%, CPU KV cache usage: 2.0%.
        WARNING 09-27 03:05:41 scheduler.py:1439] Sequence group cmpl-5 is preempted by PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. This can affect the end-to-end performance. Increase gpu_memory_utilization or tensor_parallel_size to provide more KV cache memory. total_num_cumulative_preemption=1
        WARNING 09-27 03:05:42 scheduler.py:1439] Sequence group cmpl-6 is preempted by PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. total_num_cumulative_preemption=2
        ERROR 09-27 03:05:43 async_llm_engine.py:58] Engine background task failed
        ERROR 09-27 03:05:43 async_llm_engine.py:58] Traceback (most recent call last):
        ERROR 09-27 03:05:43 async_llm_engine.py:58]   File "/home/user/vllm/vllm/core/scheduler.py", line 542, in _schedule_running
        ERROR 09-27 03:05:43 async_llm_engine.py:58]     assert len(self._async_stopped) == 0
        ERROR 09-27 03:05:43 async_llm_engine.py:58] AssertionError
        INFO 09-27 03:05:53 metrics.py:352] Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Swapped: 0 reqs, Pending: 0 reqs, GPU KV cache usage: 0.0%, CPU KV cache usage: 0.0%.
        """)
    st = d["scheduler_state"]
    assert (st["running"], st["swapped"], st["pending"]) == (9, 1, 4)  # the last line before the crash
    assert st["kv_cache_usage_pct"] == 99.1 and st["cpu_kv_cache_usage_pct"] == 2.0
    assert (st["num_gpu_blocks"], st["num_cpu_blocks"]) == (1200, 512)
    assert st["preemption_warnings"] is True and st["preemption_warning_count"] == 2
    assert frame(d) == "vllm/core/scheduler.py:_schedule_running"


@pytest.mark.parametrize("body,stage", [
    (f'''  File "/app/run.py", line 1, in <module>
    import vllm
  File "{SP}/vllm/__init__.py", line 7, in <module>
    from vllm.engine.arg_utils import EngineArgs
  File "{SP}/vllm/engine/arg_utils.py", line 20, in <module>
    from vllm.config import CacheConfig
AttributeError: module 'torch' has no attribute 'uint64'
''', "import"),
    (f'''  File "/app/run.py", line 1, in <module>
    from vllm import LLM
  File "{SP}/vllm/platforms/__init__.py", line 250, in <module>
    _current_platform = resolve_obj_by_qualname(resolve_current_platform_cls_qualname())
  File "{SP}/vllm/platforms/__init__.py", line 210, in resolve_current_platform_cls_qualname
    raise RuntimeError("multiple platform plugins activated")
RuntimeError: multiple platform plugins activated
''', "import"),
    (f'''  File "{SP}/vllm/entrypoints/llm.py", line 240, in __init__
    self.llm_engine = LLMEngine.from_engine_args(engine_args)
  File "{SP}/vllm/engine/arg_utils.py", line 1100, in create_engine_config
    model_config = self.create_model_config()
  File "{SP}/vllm/config.py", line 600, in __post_init__
    raise ValueError("max_model_len too large")
ValueError: max_model_len too large
''', "config"),
    (f'''  File "{SP}/vllm/v1/executor/multiproc_executor.py", line 311, in worker_main
    worker = WorkerProc(*args, **kwargs)
  File "{SP}/vllm/v1/worker/gpu_worker.py", line 136, in load_model
    self.model_runner.load_model()
  File "{SP}/vllm/model_executor/model_loader/utils.py", line 50, in get_model_architecture
    raise ValueError("Model architectures ['Foo'] are not supported for now.")
ValueError: Model architectures ['Foo'] are not supported for now.
''', "engine-build"),
    (f'''  File "{SP}/vllm/v1/executor/multiproc_executor.py", line 522, in worker_busy_loop
    output = func(*args, **kwargs)
  File "{SP}/vllm/v1/worker/gpu_worker.py", line 200, in determine_available_memory
    self.model_runner.profile_run()
  File "{SP}/vllm/v1/worker/gpu_model_runner.py", line 2000, in execute_model
    hidden_states = self.model(input_ids)
RuntimeError: shape mismatch
''', "engine-build"),
    (f'''  File "{SP}/vllm/v1/executor/multiproc_executor.py", line 522, in worker_busy_loop
    output = func(*args, **kwargs)
  File "{SP}/vllm/v1/worker/gpu_model_runner.py", line 2000, in execute_model
    hidden_states = self.model(input_ids)
RuntimeError: shape mismatch
''', "runtime"),
])
def test_stage_from_the_frames(tmp_path, body, stage):
    d = tri(tmp_path, "Traceback (most recent call last):\n" + body)
    assert d["stage"] == stage


def test_truncated_log_start_python_311_carets_and_lost_indentation(tmp_path):
    # starts mid-traceback, indentation lost by the paste, Python 3.11 carets
    d = tri(tmp_path, f"""
        File "{SP}/vllm/v1/core/kv_cache_manager.py", line 300, in allocate_slots
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
        File "{SP}/vllm/v1/core/block_pool.py", line 336, in get_new_blocks
        raise ValueError(f"Cannot get {{num_blocks}} free blocks from the pool")
        ValueError: Cannot get 3 free blocks from the pool
        """)
    assert d["exception_message"] == "Cannot get 3 free blocks from the pool"
    assert frame(d) == "vllm/v1/core/block_pool.py:get_new_blocks"


def test_plugin_frames_are_reported_separately(tmp_path):
    d = tri(tmp_path, f"""
        Traceback (most recent call last):
          File "{SP}/vllm/v1/engine/core.py", line 402, in run_busy_loop
            self._process_engine_step()
          File "{SP}/vllm_ascend/worker/model_runner_v1.py", line 900, in execute_model
            raise RuntimeError("npu failure")
        RuntimeError: npu failure
        """)
    assert frame(d) == "vllm/v1/engine/core.py:run_busy_loop"
    assert d["plugin_frame"]["module"] == "vllm_ascend/worker/model_runner_v1.py"


@pytest.mark.parametrize("path,module", [
    (f"{SP}/vllm/v1/core/block_pool.py", "vllm/v1/core/block_pool.py"),
    ("/home/me/src/vllm/vllm/config.py", "vllm/config.py"),
    ("vllm\\v1\\engine\\core.py", "vllm/v1/engine/core.py"),
    ("C:\\Users\\me\\venv\\Lib\\site-packages\\vllm\\utils.py", "vllm/utils.py"),
    ("/root/.cache/vllm/torch_compile_cache/f8858bbc14/rank_1_0/inductor_cache/u4/cu4tum.py", None),
    ("/home/me/vllm/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py", None),
    ("/home/me/vllm/tests/v1/core/test_scheduler.py", None),
    (f"{SP}/langchain/llms/vllm.py", None),
    ("<frozen runpy>", None),
])
def test_what_counts_as_a_vllm_module(path, module):
    assert vllm_module(path) == module


@pytest.mark.parametrize("last,typ", [
    ("torch._dynamo.exc.Unsupported: call_function UserDefinedObjectVariable", "torch._dynamo.exc.Unsupported"),
    ("BackendCompilerFailed: backend='inductor' raised:", "BackendCompilerFailed"),
])
def test_exceptions_with_unusual_class_names_end_the_traceback(tmp_path, last, typ):
    d = tri(tmp_path, f"""
        Traceback (most recent call last):
          File "{SP}/vllm/compilation/backends.py", line 459, in __call__
            return self.compiled(*args)
        {last}
        """)
    assert d["exception_type"] == typ and frame(d) == "vllm/compilation/backends.py:__call__"


def test_a_process_that_died_without_a_trace_is_still_a_crash(tmp_path):
    d = tri(tmp_path, """
        (APIServer pid=1) INFO 10-01 00:00:00 [loggers.py:123] Engine 000: Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 1.0 tokens/s, Running: 3 reqs, Waiting: 0 reqs, GPU KV cache usage: 5.0%, Prefix cache hit rate: 0.0%
        (APIServer pid=1) ERROR 10-01 00:00:05 [core_client.py:564] Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.
        """)
    assert d["exception_type"] is None and d["exit_kind"] is None
    assert d["stage"] == "runtime"
    assert any("died without a Python traceback" in n for n in d["notes"])
    assert d["scheduler_state"]["running"] == 3


def test_a_logger_header_on_the_first_line_only_keeps_its_traceback_together(tmp_path):
    d = tri(tmp_path, f"""
        ERROR 01-23 21:18:03 async_llm_engine.py:30] Engine background task failed
        ERROR 01-23 21:18:03 async_llm_engine.py:30] Traceback (most recent call last):
          File "{SP}/vllm/engine/async_llm_engine.py", line 29, in _raise_exception_on_finish
            task.result()
          File "{SP}/vllm/worker/model_runner.py", line 500, in execute_model
            hidden_states = model_executable(input_ids)
        RuntimeError: CUDA error: misaligned address
        """)
    assert d["exception_message"] == "CUDA error: misaligned address"
    assert frame(d) == "vllm/worker/model_runner.py:execute_model"
    assert d["root_cause"]["logger"] == "async_llm_engine.py:30"
    assert d["exit_kind"] == "cuda_error"


def test_torch_segfault_banner_is_a_sigsegv(tmp_path):
    d = tri(tmp_path, """
        INFO 01-01 00:00:00 [core.py:61] Initializing a V1 LLM engine (v0.11.0) with config: model='m'
        INFO:     127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200 OK
        !!!!!!! Segfault encountered !!!!!!!
          File "<unknown>", line 0, in cuMemcpyBatchAsync
          File "<unknown>", line 0, in swap_blocks_batch(at::Tensor const&, bool)
        """)
    assert d["exit_kind"] == "signal:SIGSEGV" and d["stage"] == "runtime"
