"""The lab's own limits: how big a run may be on this machine, as settings with defaults a
laptop survives (docs/inputs.md).

A scenario is checked against them when it is loaded, before any release is prepared, so a
pool or a workload that would exhaust the machine is exit 2 in well under a second, naming the
setting that allows it:

- ``VLLM_REPRO_MAX_KV_BLOCKS``: KV cache blocks in the pool (``config.num_gpu_blocks``, or what
  an engine-core run's ``kv_cache_memory_bytes`` sizes it to). vLLM's ``BlockPool`` makes one
  Python ``KVCacheBlock`` per block at start-up (hundreds of bytes each, plus the free queue's
  links). Default: this machine's memory / 8 KiB (3.1 million blocks on 24 GiB).
- ``VLLM_REPRO_MAX_TOKENS``: prompt + output tokens over all requests (each a Python int in the
  requests' token lists and the fake model's streams). Default: memory / 2 KiB.
- ``VLLM_REPRO_MAX_STEPS``: ``limits.max_steps``. Default 200,000.
- ``VLLM_REPRO_MAX_TRACE_MB``: the size of one run's ``trace.jsonl``; a run that reaches it stops
  there with ``error`` (input) saying so. Default 256 MB.
- ``VLLM_REPRO_WORKER_MEMORY_MB``: the address space of an engine worker (``RLIMIT_AS``, set by
  the worker on itself before it imports vLLM); a run that exhausts it is ``error: out of memory
  (limit N MB)``, never a crash of vLLM. Default: three quarters of this machine's memory.
- ``VLLM_REPRO_STEP_TIMEOUT_S``: the watchdog (``engine/watchdog.py``): a step, or an engine's
  start-up, that has not returned after this many seconds ends the run as ``hang``, with every
  thread's stack. Default 300 s, far above the slowest catalog step (start-ups included, under
  a minute on a busy two-core machine); a scenario's ``limits.step_timeout_s`` sets its own.

Standard library only: the trace limit is applied inside the worker (it arrives in the job).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a small laptop
        return 8 << 30


@dataclass(frozen=True)
class RunLimits:
    """The limits in force (blocks, tokens, steps, MB of trace) and where each comes from."""

    max_kv_blocks: int
    max_tokens: int
    max_steps: int
    max_trace_mb: float
    worker_memory_mb: int
    memory_gib: float
    step_timeout_s: float = 300.0

    def as_dict(self) -> dict:
        return asdict(self)


SETTINGS = {"max_kv_blocks": "VLLM_REPRO_MAX_KV_BLOCKS", "max_tokens": "VLLM_REPRO_MAX_TOKENS",
            "max_steps": "VLLM_REPRO_MAX_STEPS", "max_trace_mb": "VLLM_REPRO_MAX_TRACE_MB",
            "worker_memory_mb": "VLLM_REPRO_WORKER_MEMORY_MB",
            "step_timeout_s": "VLLM_REPRO_STEP_TIMEOUT_S"}


def run_limits() -> RunLimits:
    """The limits from the environment, else the defaults for this machine's memory. Raises
    :class:`~vllm_repro.errors.InputError` for a setting that is not a positive integer."""
    from .errors import InputError

    mem = _memory_bytes()
    defaults = {"max_kv_blocks": mem // 8192, "max_tokens": mem // 2048, "max_steps": 200_000,
                "max_trace_mb": 256, "worker_memory_mb": (mem * 3 // 4) >> 20,
                "step_timeout_s": 300.0}
    values = {}
    for key, env in SETTINGS.items():
        raw = os.environ.get(env)
        if raw is None or raw.strip() == "":
            values[key] = defaults[key]
            continue
        # the trace's size may be a fraction of a MB, the watchdog's time of a second; the
        # others are counts
        kind = float if key in ("max_trace_mb", "step_timeout_s") else int
        try:
            values[key] = kind(raw.replace("_", ""))
        except ValueError:
            values[key] = 0
        if not values[key] > 0 or values[key] == float("inf"):
            what = "a positive number" if kind is float else "a positive whole number"
            raise InputError(f"{env}={raw!r}: expected {what} (default {defaults[key]} here); "
                             "set it to one, or unset it")
    return RunLimits(**values, memory_gib=round(mem / (1 << 30), 1))


def over_limit(what: str, value: int, key: str, limits: RunLimits, why: str) -> str:
    """The one-line refusal for ``value`` over the ``key`` limit (set by hand, or this
    machine's default)."""
    env = SETTINGS[key]
    source = (f"the limit of {getattr(limits, key):,} {env} sets" if os.environ.get(env, "").strip()
              else f"this machine's limit of {getattr(limits, key):,} ({env}; {why}, "
                   f"{limits.memory_gib} GiB here)")
    return f"{what}: {value:,} is over {source}: lower it, or raise {env} if the machine can take it"


__all__ = ["RunLimits", "run_limits", "over_limit", "SETTINGS"]
