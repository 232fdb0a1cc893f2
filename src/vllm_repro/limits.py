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


#: the largest value each setting takes (far above any machine's; a 5,000-digit setting is
#: refused, not carried into a worker)
_CEILINGS = {"max_kv_blocks": 10**12, "max_tokens": 10**13, "max_steps": 10**9,
             "max_trace_mb": 10**7, "worker_memory_mb": 1 << 40,
             # as a scenario's own limits.step_timeout_s (an hour); without an entry here any
             # value of VLLM_REPRO_STEP_TIMEOUT_S was a KeyError (exit 3)
             "step_timeout_s": 3600.0}


#: ``VLLM_REPRO_WORKER_STATE``'s values (engine/input_batch.py MODES: the release's own
#: ``InputBatch``, or the lab's ``PersistentBatch``)
WORKER_STATES = ("vllm", "lab")


def check_worker_state() -> str:
    """``VLLM_REPRO_WORKER_STATE`` (default ``vllm``), or :class:`~vllm_repro.errors.InputError`
    (exit 2, one line) for any other value, before a worker starts."""
    from .errors import InputError

    raw = os.environ.get("VLLM_REPRO_WORKER_STATE", "")
    mode = raw.strip() or "vllm"
    if mode not in WORKER_STATES:
        raise InputError(f"VLLM_REPRO_WORKER_STATE={raw[:40]!r}: expected one of "
                         f"{', '.join(WORKER_STATES)} (vllm: the release's own InputBatch, the "
                         "default; lab: the lab's slot model); set it to one, or unset it")
    return mode


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
            values[key] = kind(raw.replace("_", "")) if len(raw) <= 40 else 0
        except ValueError:
            values[key] = 0
        if not 0 < values[key] <= _CEILINGS[key]:
            what = "a positive number" if kind is float else "a positive whole number"
            raise InputError(f"{env}={raw[:40]!r}: expected {what} up to {_CEILINGS[key]:,} "
                             f"(default {defaults[key]} here); "
                             "set it to one, or unset it")
    max_log_bytes()  # (checked with the others, before anything runs)
    max_processes()
    check_worker_state()
    return RunLimits(**values, memory_gib=round(mem / (1 << 30), 1))


def over_limit(what: str, value: int, key: str, limits: RunLimits, why: str) -> str:
    """The one-line refusal for ``value`` over the ``key`` limit (set by hand, or this
    machine's default)."""
    env = SETTINGS[key]
    source = (f"the limit of {getattr(limits, key):,} {env} sets" if os.environ.get(env, "").strip()
              else f"this machine's limit of {getattr(limits, key):,} ({env}; {why}, "
                   f"{limits.memory_gib} GiB here)")
    return f"{what}: {value:,} is over {source}: lower it, or raise {env} if the machine can take it"


# ---- counts given on the command line ---------------------------------------------------
#: the most seeds a campaign takes (``--seeds``): one task per release and seed
MAX_SEEDS = 10_000
#: the most tasks a campaign makes (releases x seeds), each a record in campaign.json
MAX_CAMPAIGN_TASKS = 100_000
#: the most examples one search draws (``--examples``), the most runs a shrink makes
#: (``--shrink-runs``)
MAX_EXAMPLES = 10_000_000
#: the longest ``--time`` (seconds): a week
MAX_TIME_S = 7 * 24 * 3600.0
#: ``VLLM_REPRO_MAX_PROCESSES``' bounds: the most processes one command starts at once
#: (``fuzz --workers``, ``--jobs``)
MAX_PROCESSES_CEILING = 1024


def max_processes() -> int:
    """The most processes (search processes, release workers, campaign tasks) one command runs
    at once: ``VLLM_REPRO_MAX_PROCESSES`` (1 .. :data:`MAX_PROCESSES_CEILING`), default four
    per CPU (at least 8). Raises :class:`~vllm_repro.errors.InputError` for a bad setting."""
    default = max(8, 4 * (os.cpu_count() or 1))
    return env_int("VLLM_REPRO_MAX_PROCESSES", default, 1, MAX_PROCESSES_CEILING)


def max_log_bytes() -> int:
    """``VLLM_REPRO_MAX_LOG_MB`` (1 .. 100,000; default 64) in bytes: the most of a worker's
    output one run's ``engine.log`` keeps, and the size past which a worker's log under
    ``_engine/`` is rotated."""
    return env_int("VLLM_REPRO_MAX_LOG_MB", 64, 1, 100_000) << 20


def env_int(name: str, default: int, low: int, high: int) -> int:
    """An integer setting from the environment, ``default`` when unset or blank. Raises
    :class:`~vllm_repro.errors.InputError` (one line naming the variable and its range) for
    text that is not a whole number or one outside ``low .. high``."""
    from .errors import InputError

    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    text = raw.strip().replace("_", "")
    value = int(text) if text.lstrip("+-").isdigit() and len(text) <= 20 else None
    if value is None or not low <= value <= high:
        raise InputError(f"{name}={raw[:40]!r}: expected a whole number from {low:,} to "
                         f"{high:,} (default {default:,}); set it to one, or unset it")
    return value


def check_jobs(jobs: int | None, option: str = "--jobs") -> int | None:
    """``--jobs`` (None: the default) bounded by ``VLLM_REPRO_MAX_PROCESSES``."""
    if jobs is not None:
        check_count(option, jobs, max_processes(), setting="VLLM_REPRO_MAX_PROCESSES")
    return jobs


def check_count(option: str, value: int, maximum: int, low: int = 1, setting: str = "") -> int:
    """``value`` of a command-line count ``option`` (``--seeds``), or
    :class:`~vllm_repro.errors.InputError`: ``--seeds 1,000,000,000: at most 10,000``."""
    from .errors import InputError

    if value < low:
        raise InputError(f"{option} {value}: at least {low:,}")
    if value > maximum:
        how = f" (raise {setting} if the machine can take it)" if setting else " (the lab's limit)"
        raise InputError(f"{option} {value:,}: at most {maximum:,}{how}; give a smaller "
                         f"{option}")
    return value


__all__ = ["RunLimits", "run_limits", "over_limit", "SETTINGS", "check_count", "check_jobs", "env_int",
           "max_processes", "MAX_SEEDS", "MAX_CAMPAIGN_TASKS", "MAX_EXAMPLES", "MAX_TIME_S"]
