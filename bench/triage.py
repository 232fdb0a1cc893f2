"""Peak memory and time of `vllm-repro triage` on a big synthetic log (prints numbers; not a test).

    python bench/triage.py                 # a 1 GB log (written to a temp dir, then deleted)
    python bench/triage.py --size-mb 200   # smaller
    python bench/triage.py --log FILE      # an existing log
    python bench/triage.py --viewer        # every line under a log viewer's "time | " prefix

The synthetic log is what a long-running server writes: stats lines, request lines with colour
codes and process prefixes, HTTP access lines, a non-fatal warning traceback now and then,
then a dump_input.py dump with a multi-megabyte SchedulerOutput line and an EngineCore crash at
the very end (so the whole file must be read). ``--viewer`` puts a log viewer's
``2025-06-05 16:27:39.123 | `` on every line, a prefix triage must learn from the log (issue 17).
Goal (issues 5 and 17): under a minute and under 200 MB of peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SP = "/usr/local/lib/python3.12/dist-packages"
GOAL_MB = 200
GOAL_S = 60


def _viewer(text: str) -> str:
    """``text`` with a log viewer's timestamp-and-pipe prefix on every line."""
    lines = text.split("\n")
    tail = lines.pop() if not lines[-1] else None
    out = "\n".join(f"2025-06-05 16:{i % 60:02d}:{i * 7 % 60:02d}.{i % 1000:03d} | {line}"
                     for i, line in enumerate(lines))
    return out + ("\n" if tail is not None else "")


def _block(i: int) -> str:
    w = f"\x1b[36m(VllmWorker rank={i % 4} pid={1000 + i % 4})\x1b[0m"
    lines = [
        f"INFO 06-05 16:{i % 60:02d}:39 [loggers.py:116] Engine 000: Avg prompt throughput: "
        f"{i % 997}.0 tokens/s, Avg generation throughput: 88.1 tokens/s, Running: {i % 50} reqs, "
        f"Waiting: {i % 7} reqs, GPU KV cache usage: {i % 100}.5%, Prefix cache hit rate: 41.0%",
        f"INFO 06-05 16:27:39 [logger.py:43] Received request chatcmpl-{i:032x}: prompt: "
        "'<|im_start|>user\\nSummarise the following text ...', params: SamplingParams(n=1, "
        "temperature=0.7, max_tokens=512), prompt_token_ids: None, lora_request: None.",
        f"INFO 06-05 16:27:39 [async_llm.py:270] Added request chatcmpl-{i:032x}.",
        f'INFO:     10.0.{i % 255}.7:{40000 + i % 20000} - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        f"{w} INFO 06-05 16:27:39 [custom_all_reduce.py:240] Registering {i % 6000} cuda graph addresses",
    ]
    if i % 5000 == 0:  # a recovered request error with its traceback, logged as a warning
        tag = "WARNING 06-05 16:27:39 [serving_chat.py:200]"
        lines += [f"{tag} Traceback (most recent call last):",
                  f'{tag}   File "{SP}/vllm/entrypoints/openai/serving_chat.py", line 190, in '
                  "create_chat_completion",
                  f"{tag}     raise ValueError('bad tool call')",
                  f"{tag} ValueError: bad tool call {i}"]
    return "\n".join(lines) + "\n"


def _crash(dump_tokens: int) -> str:
    p = "(EngineCore_0 pid=77) ERROR 06-05 16:27:40"
    toks = ", ".join(str(100 + k % 50000) for k in range(dump_tokens))
    return "\n".join([
        f"{p} [dump_input.py:69] Dumping input data",
        f"{p} [dump_input.py:71] V1 LLM engine (v0.9.0) with config: model='m', speculative_config="
        "None, max_seq_len=32768, enable_prefix_caching=True, chunked_prefill_enabled=True, ",
        f"{p} [dump_input.py:79] Dumping scheduler output for model execution:",
        f"{p} [dump_input.py:80] SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=["
        f"CachedRequestData(req_id='big', resumed_from_preemption=true, new_token_ids=[{toks}], "
        f"new_block_ids=[[1, 2, 3]], num_computed_tokens=16)], num_scheduled_tokens={{big: 32}}, "
        "total_num_scheduled_tokens=32, num_common_prefix_blocks=[0], finished_req_ids=[])",
        f"{p} [dump_input.py:82] SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, "
        "gpu_cache_usage=0.5, prefix_cache_stats=PrefixCacheStats(reset=False, requests=0, "
        "queries=0, hits=0), spec_decoding_stats=None)",
        f"{p} [core.py:500] EngineCore encountered a fatal error.",
        f"{p} [core.py:500] Traceback (most recent call last):",
        f'{p} [core.py:500]   File "{SP}/vllm/v1/engine/core.py", line 520, in run_busy_loop',
        f"{p} [core.py:500]     self._process_engine_step()",
        f'{p} [core.py:500]   File "{SP}/vllm/v1/core/block_pool.py", line 300, in free_blocks',
        f"{p} [core.py:500]     assert block.ref_cnt >= 0",
        f"{p} [core.py:500] AssertionError",
        "CRITICAL 06-05 16:27:40 [core_client.py:359] Got fatal signal from worker processes, "
        "shutting down. See stack trace above for root cause issue.",
        "Killed",
    ]) + "\n"


def write_log(path: Path, size_mb: int, viewer: bool = False) -> int:
    """Write about ``size_mb`` MB; returns the number of lines."""
    wrap = _viewer if viewer else (lambda text: text)
    target = size_mb * 1024 * 1024
    chunk = wrap("".join(_block(i) for i in range(1, 501))).encode()
    crash = wrap(_crash(400_000)).encode()  # a ~3 MB SchedulerOutput line
    lines = 0
    written = 0
    with path.open("wb") as fh:
        i = 0
        while written + len(chunk) + len(crash) < target:
            if i % 10 == 0:  # vary the content a little (and add a warning traceback)
                block = wrap(_block(i * 500)).encode()
                fh.write(block)
                written += len(block)
                lines += block.count(b"\n")
            fh.write(chunk)
            written += len(chunk)
            lines += chunk.count(b"\n")
            i += 1
        fh.write(crash)
        lines += crash.count(b"\n")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--log", type=Path, help="triage this file instead of a synthetic one")
    ap.add_argument("--viewer", action="store_true",
                    help="put a log viewer's 'time | ' prefix on every line of the synthetic log")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-triage-") as tmp:
        log = args.log
        if log is None:
            log = Path(tmp) / "big.log"
            t = time.perf_counter()
            lines = write_log(log, args.size_mb, viewer=args.viewer)
            print(f"wrote {log.stat().st_size / 2**20:.0f} MB, {lines:,} lines in "
                  f"{time.perf_counter() - t:.1f}s")
        size_mb = log.stat().st_size / 2**20
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "vllm_repro.cli", "triage", str(log), "--json"],
                              capture_output=True, text=True, env=dict(os.environ))
        wall = time.perf_counter() - t
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        peak_mb = usage.ru_maxrss / 1024  # Linux: KiB
        cpu = usage.ru_utime + usage.ru_stime  # what a busy shared machine does not inflate
        if proc.returncode != 0:
            sys.exit(f"triage failed ({proc.returncode}): {proc.stderr[-2000:]}")
        d = json.loads(proc.stdout)
        f = d["last_vllm_frame"] or {}
        print(f"triage: {d['exception_type']} at {f.get('module')}:{f.get('function')} "
              f"({d['stage']}, {d['exit_kind']}, vLLM {d['vllm_version']})")
        print(f"size_mb={size_mb:.0f} wall_s={wall:.1f} cpu_s={cpu:.1f} mb_per_s={size_mb / wall:.1f} "
              f"peak_rss_mb={peak_mb:.0f} goal_mb={GOAL_MB} goal_s={GOAL_S} "
              f"{'OK' if peak_mb < GOAL_MB and wall < GOAL_S else 'OVER'}")


if __name__ == "__main__":
    main()
