"""Draft a replay scenario from what a crash log shows (``vllm-repro triage --scenario``).

Sources, strongest first: the server arguments (``args: Namespace(...)`` / ``non-default
args: {...}``), the ``dump_input.py`` config string and ``SchedulerOutput`` / ``SchedulerStats``,
the ``# GPU blocks`` / ``GPU KV cache size`` / ``Chunked prefill is enabled with
max_num_batched_tokens=N`` lines, the last stats line. Every value the log does not state is
marked ``# guess: ...`` in a YAML comment, every derived one ``# derived: ...``. The result is
validated with :func:`vllm_repro.scenario.parse_scenario` before it is returned.

Requests: one per request in the dumped ``SchedulerOutput`` (ids kept), all arriving before
step 1 in dump order (the arrival order is not in the dump). A new request's prompt length and
``max_tokens`` are in the dump; for a running one only its tokens in the KV cache are, so its
whole context is taken as prompt. The waiting requests the stats count are added with guessed
lengths. Requests never get a priority (0.8/0.9's V1 front door refuses them).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

import yaml
from packaging.version import InvalidVersion, Version

from ..errors import InputError
from ..scenario import parse_scenario
from ..scenario.schema import Scenario
from .analyze import TriageReport
from .dump import DumpedRequest, read_config, read_scheduler_output
from .scan import LogScanner

MAX_WAITING = 256  # waiting requests synthesised from the stats, at most
MAX_GPU_BLOCKS = 200_000
_STANDARD_BLOCK_SIZES = (16, 32, 64, 128, 8, 256, 1, 2, 4, 512, 1024)
_BATCH_DEFAULTS = (2048, 8192, 16384)
GUESSED_MAX_TOKENS = 16


class _Val:
    """A value and where it came from: ``kind`` is log | derived | guess."""

    def __init__(self, value: Any, kind: str, why: str):
        self.value, self.kind, self.why = value, kind, why

    def comment(self) -> str:
        if self.kind == "log":
            return f"  # {self.why}" if self.why else ""
        return f"  # {self.kind}: {self.why}"


def _q(v: Any) -> str:
    """A YAML scalar: JSON encoding (YAML flow scalars accept it), bools/None YAML-style."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps(str(v))


def _safe_id(raw: str, used: set[str]) -> str:
    rid = re.sub(r"[^A-Za-z0-9_.:-]", "_", raw)[:64] or "req"
    base, n = rid, 1
    while rid in used:
        n += 1
        rid = f"{base[:58]}-{n}"
    used.add(rid)
    return rid


def _scenario_name(source: str) -> str:
    stem = "stdin" if source in ("-", "<stdin>") else Path(source).name
    stem = re.sub(r"\.(log|txt|out|err)$", "", stem)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "log"
    return f"triage-{slug}"[:80]


def _bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    return None


def _posint(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int) and v > 0:
        return v
    if isinstance(v, str) and v.isdigit() and int(v) > 0:
        return int(v)
    return None


def _infer_block_size(reqs: list[DumpedRequest]) -> tuple[int, str] | None:
    """A block size that explains every (tokens, blocks) pair the dump shows, when only one
    standard size does."""
    pairs = [(r.num_computed_tokens + (r.num_scheduled or 0), r.num_blocks) for r in reqs
             if r.num_blocks and r.num_scheduled is not None]
    if not pairs:
        return None
    fits = [b for b in _STANDARD_BLOCK_SIZES
            if all(math.ceil(t / b) <= n <= math.ceil(t / b) + 1 for t, n in pairs)]
    if len(fits) != 1:
        return None
    t, n = max(pairs)
    return fits[0], f"{n} blocks hold {t} tokens in the dumped SchedulerOutput"


#: vLLM code only level engine-core runs: EngineCore itself, start-up's KV cache sizing, the
#: executor (where a crash's innermost frame in them is still the lab's to reproduce)
ENGINE_CORE_MODULES = ("vllm/v1/engine/core.py", "vllm/v1/core/kv_cache_utils.py",
                       "vllm/v1/executor/abstract.py", "vllm/v1/executor/uniproc_executor.py")
#: EngineCore functions on a crash path that the scheduler level never calls
_ENGINE_CORE_ONLY = ("vllm/v1/engine/core.py:_initialize_kv_caches",
                     "vllm/v1/engine/core.py:step_with_batch_queue",
                     "vllm/v1/engine/core.py:_process_aborts_queue",
                     "vllm/v1/engine/core.py:reset_prefix_cache",
                     "vllm/v1/engine/core.py:pause_scheduler",
                     "vllm/v1/engine/core.py:post_step",
                     "vllm/v1/core/kv_cache_utils.py:get_kv_cache_config",
                     "vllm/v1/core/kv_cache_utils.py:get_kv_cache_configs",
                     "vllm/v1/core/kv_cache_utils.py:check_enough_kv_cache_memory",
                     "vllm/v1/core/kv_cache_utils.py:_check_enough_kv_cache_memory")


def _choose_level(report: TriageReport, version: str, notes: list[str]) -> tuple[str, str, str | None]:
    """``(level, why, expected phase or None)`` for the replay: ``engine-core`` when the crash
    path goes through EngineCore code the scheduler level never runs (start-up's KV sizing, the
    batch queue, ...) and the release's capabilities record (cached when it last ran here,
    :mod:`vllm_repro.engine.capabilities`) does not rule it out."""
    from ..engine.capabilities import load
    from ..settings import cache_dir

    hits = [p for p in report.crash_path if p in _ENGINE_CORE_ONLY]
    if not hits:
        return "scheduler", "the crash path runs through the scheduler, not EngineCore's own code", None
    caps = load(cache_dir(), version)
    if caps is not None and not caps.engine_core:
        notes.append(f"the crash went through {hits[0]}, but {caps.refusal('engine-core')}")
        return "scheduler", f"vLLM {version} runs at level scheduler only", None
    if caps is None:
        notes.append(f"vLLM {version} has not run here yet: its capabilities record (what its "
                     "EngineCore supports) is not cached; the run checks it")
    phase = "engine-build" if any(":_initialize_kv_caches" in p or "kv_cache_utils" in p
                                  for p in hits) else None
    return "engine-core", f"the crash went through {hits[0]}", phase


def _version_default_v1(version: str | None) -> bool:
    try:
        return version is None or Version(version) >= Version("0.8")
    except InvalidVersion:
        return True


def draft_scenario(report: TriageReport, sc: LogScanner, *, version: str | None = None,
                   name: str | None = None) -> tuple[str, Scenario]:
    """The scenario YAML text (with ``# guess`` / ``# derived`` comments) and its validated
    :class:`Scenario`, for the release ``version`` (default: the one the log names).

    Raises :class:`InputError` when the log names no release and none is given, or shows
    neither a dumped SchedulerOutput nor scheduler stats to build requests from.
    """
    src = report.source
    version = version or report.vllm_version
    if not version:
        raise InputError(f"{src}: the log names no vLLM release; pass --vllm VERSION to draft "
                         "a scenario for one")
    try:
        Version(version)
    except InvalidVersion:
        raise InputError(f"{src}: {version!r} is not a vLLM release version; pass --vllm "
                         "VERSION") from None

    dump = sc.dump
    so = read_scheduler_output(dump.scheduler_output) if dump and dump.scheduler_output else None
    state = report.scheduler_state or {}
    notes: list[str] = []
    level, level_why, phase = _choose_level(report, version, notes)
    at_start_up = level == "engine-core" and phase == "engine-build"
    if (so is None or not so.requests) and not state.get("running") and not state.get("waiting") \
            and not state.get("pending") and not at_start_up:
        raise InputError(f"{src}: no dump_input.py SchedulerOutput and no scheduler stats with "
                         "requests in the log: nothing to build the scenario's requests from")

    dumped_cfg = read_config(dump.config) if dump and dump.config else {}
    args_cfg = read_config(sc.args[1]) if sc.args else {}
    cfg_line = f"dump_input.py config, line {dump.config_line}" if dumped_cfg else ""
    args_line = f"server arguments, line {sc.args[0]}" if sc.args else ""

    def known(key: str, conv) -> _Val | None:
        if key in args_cfg and conv(args_cfg[key]) is not None:
            return _Val(conv(args_cfg[key]), "log", args_line)
        if key in dumped_cfg and conv(dumped_cfg[key]) is not None:
            return _Val(conv(dumped_cfg[key]), "log", cfg_line)
        return None

    reqs = so.requests if so else []
    c: dict[str, _Val] = {}

    # --- block size ---------------------------------------------------------------------------
    bs = known("block_size", _posint)
    if bs is None:
        inferred = _infer_block_size(reqs)
        bs = _Val(inferred[0], "derived", inferred[1]) if inferred else \
            _Val(16, "guess", "vLLM's default block size on CUDA")
    c["block_size"] = bs
    B = bs.value

    # --- feature switches ---------------------------------------------------------------------
    v1_default = _version_default_v1(version)
    if not v1_default:
        notes.append(f"vLLM {version} predates the V1 engine the lab drives (0.8 and later): "
                     "replay the draft with --vllm on a V1 release")
    default_why = f"vLLM {version}'s default" + (" (V1 engine)" if v1_default else "")
    c["enable_chunked_prefill"] = known("enable_chunked_prefill", _bool) or _Val(
        v1_default, "guess", default_why)
    c["enable_prefix_caching"] = known("enable_prefix_caching", _bool) or _Val(
        v1_default, "guess", default_why)
    pol = args_cfg.get("scheduling_policy")
    c["policy"] = _Val(pol, "log", args_line) if pol in ("fcfs", "priority") else \
        _Val("fcfs", "guess", "vLLM's default scheduling policy")

    # --- requests -----------------------------------------------------------------------------
    used: set[str] = set()
    common = so.num_common_prefix_blocks[0] if so and so.num_common_prefix_blocks else 0
    req_rows: list[tuple[dict, str]] = []
    for r in reqs:
        rid = _safe_id(r.id, used)
        tokens = r.num_computed_tokens + (r.num_scheduled or 0)
        why: list[str] = []
        if r.new and r.prompt_len:
            plen = r.prompt_len
        elif r.num_output_tokens is not None and tokens > r.num_output_tokens:
            plen = tokens - r.num_output_tokens
            why.append(f"derived prompt_len: {tokens} tokens - {r.num_output_tokens} output")
        else:
            plen = max(tokens, 1)
            why.append(f"guess prompt_len: whole context ({r.num_computed_tokens} computed + "
                       f"{r.num_scheduled or 0} scheduled), prompt/output split not in the dump")
        if r.max_tokens:
            mt = r.max_tokens
        else:
            mt = GUESSED_MAX_TOKENS
            why.append("guess max_tokens")
        if r.resumed:
            why.append("resumed from preemption in the crashing step")
        row = {"id": rid, "at_step": 1, "prompt_len": plen, "max_tokens": mt}
        req_rows.append((row, "; ".join(why)))

    n_wait = int(state.get("waiting") or state.get("pending") or 0)
    if not req_rows and at_start_up and not state.get("running"):
        req_rows.append(({"id": "first", "at_step": 1, "prompt_len": 16,
                          "max_tokens": GUESSED_MAX_TOKENS},
                         "guess: the engine died at start-up, before any request; one request "
                         "stands for the first"))
    if not req_rows:
        n_run = int(state.get("running") or 0)
        for i in range(n_run):
            req_rows.append(({"id": f"running-{i + 1}", "at_step": 1, "prompt_len": 1024,
                              "max_tokens": GUESSED_MAX_TOKENS},
                             "guess: a running request from the stats; lengths not in the log"))
    if n_wait:
        known_lens = [row["prompt_len"] for row, _ in req_rows] or [1024]
        wlen = int(statistics.median(known_lens))
        for i in range(min(n_wait, MAX_WAITING)):
            rid = _safe_id(f"waiting-{i + 1}", used)
            req_rows.append(({"id": rid, "at_step": 1, "prompt_len": wlen,
                              "max_tokens": GUESSED_MAX_TOKENS}, ""))
        if n_wait > MAX_WAITING:
            notes.append(f"the stats showed {n_wait} waiting requests; the first {MAX_WAITING} "
                         "are drafted")

    # --- lengths --------------------------------------------------------------------------------
    need = max(row["prompt_len"] + row["max_tokens"] for row, _ in req_rows)
    mml = known("max_model_len", _posint)
    if mml is None:
        mml = _Val(max(2048, 1 << (need - 1).bit_length()), "guess",
                   "not in the log; the smallest power of two that fits every request")
    c["max_model_len"] = mml
    for row, _ in req_rows:
        if row["prompt_len"] + row["max_tokens"] > mml.value:
            row["max_tokens"] = max(1, mml.value - row["prompt_len"])
            if row["prompt_len"] + row["max_tokens"] > mml.value:
                row["prompt_len"] = mml.value - 1
                row["max_tokens"] = 1
    if common and c["enable_prefix_caching"].value:
        plen_common = common * B
        for row, _ in req_rows[:len(reqs)]:
            if row["prompt_len"] >= plen_common:
                row["prefix"], row["prefix_len"] = "common", plen_common

    c["max_num_seqs"] = known("max_num_seqs", _posint) or _Val(
        max(256, len(req_rows)), "guess", "vLLM's default (256), or enough for every request")
    total = so.total_num_scheduled_tokens if so else None
    mnbt = known("max_num_batched_tokens", _posint)
    if mnbt is None and sc.max_num_batched_tokens:
        mnbt = _Val(sc.max_num_batched_tokens, "log", "'Chunked prefill is enabled' line")
    if mnbt is None:
        if total:
            pick = next((d for d in _BATCH_DEFAULTS if d >= total), None) or \
                1024 * math.ceil(total / 1024)
            mnbt = _Val(pick, "guess", f"the smallest vLLM default >= the {total} tokens the "
                                       "crashing step scheduled")
        else:
            mnbt = _Val(8192, "guess", "vLLM's default for the OpenAI server on large GPUs")
    if not c["enable_chunked_prefill"].value and mnbt.value < mml.value:
        mnbt = _Val(mml.value, "derived", "without chunked prefill vLLM needs >= max_model_len")
    c["max_num_batched_tokens"] = mnbt

    # --- KV cache size ----------------------------------------------------------------------------
    blocks_per_req = [math.ceil((row["prompt_len"] + row["max_tokens"]) / B) for row, _ in req_rows]
    floor_blocks = max(blocks_per_req) + 1
    if sc.gpu_blocks:
        nb = _Val(sc.gpu_blocks[0], "log", f"'# GPU blocks' line {sc.gpu_blocks[2]}")
    elif sc.kv_cache_tokens:
        kind = "derived" if bs.kind != "guess" else "guess"
        nb = _Val(max(2, sc.kv_cache_tokens[0] // B), kind,
                  f"GPU KV cache size {sc.kv_cache_tokens[0]} tokens (line "
                  f"{sc.kv_cache_tokens[1]}) / block_size")
    else:
        used_blocks = sum(math.ceil((r.num_computed_tokens + (r.num_scheduled or 0)) / B)
                          for r in reqs)
        used_blocks -= max(0, len(reqs) - 1) * common
        pct = state.get("kv_cache_usage_pct")
        if used_blocks > 0 and isinstance(pct, (int, float)) and pct >= 1.0:
            nb = _Val(math.ceil(used_blocks * 100 / pct) + 1, "guess",
                      f"{used_blocks} blocks held by the dumped requests at {pct}% KV cache usage")
        else:
            nb = _Val(max(2 * floor_blocks, 64), "guess", "the KV cache size is not in the log")
    if nb.value > MAX_GPU_BLOCKS:
        nb = _Val(MAX_GPU_BLOCKS, "guess", f"{nb.value} capped to keep the replay fast")
    if nb.value < floor_blocks:
        nb = _Val(floor_blocks, "derived", "raised so that the longest request fits")
    c["num_gpu_blocks"] = nb
    if at_start_up and "no available memory for the cache blocks" in (
            report.exception_message or "").lower():
        c["kv_cache_memory_bytes"] = _Val(0, "derived", "the log: no memory was left for the "
                                          "KV cache after profiling")

    # --- speculative decoding / async scheduling ------------------------------------------------
    nspec = known("num_speculative_tokens", _posint)
    if nspec:
        c["num_speculative_tokens"] = nspec
        method = args_cfg.get("speculative_method") or dumped_cfg.get("speculative_method")
        if method and method != "ngram":
            notes.append(f"the log's speculative method is {method!r}; the lab drafts "
                         "ngram-style tokens")
    if known("async_scheduling", _bool) and known("async_scheduling", _bool).value:
        c["async_scheduling"] = known("async_scheduling", _bool)

    # --- level: what of vLLM the replay runs (chosen above) -------------------------------------
    if level == "engine-core" and "step_with_batch_queue" in " ".join(report.crash_path) \
            and "async_scheduling" not in c:
        c["async_scheduling"] = _Val(True, "guess", "the crash went through "
                                     "EngineCore.step_with_batch_queue (async scheduling, or a "
                                     "pipeline-parallel batch queue)")

    # --- expectation ------------------------------------------------------------------------------
    frame = report.last_vllm_frame
    expect_lines: list[str] = []
    module = (frame or {}).get("module", "")
    in_reach = module.startswith("vllm/v1/core/") or (
        level == "engine-core" and module in ENGINE_CORE_MODULES)
    if report.exception_type and frame and in_reach:
        exc = report.exception_type.split("(")[0].rsplit(".", 1)[-1]
        expect_lines = [f"expect:  # the log's crash is in the vLLM code the lab drives at level {level}",
                        "  outcome: crash",
                        f"  exception: {_q(exc)}",
                        f"  where: {_q(frame['module'] + ':' + frame['function'])}"]
        if phase:
            expect_lines.append(f"  phase: {phase}")
    else:
        where = f"{frame['module']}:{frame['function']}" if frame else "no vLLM frame"
        expect_lines = [f"# no expect: the log's crash ({report.exception_type or report.exit_kind}"
                        f" in {where}) is outside the scheduler/KV code the lab drives; the",
                        "# replay shows whether vLLM's scheduler side stays sound under this load"]

    # --- the text -----------------------------------------------------------------------------------
    max_steps = min(100_000, max(500, 4 * (sum(r["prompt_len"] for r, _ in req_rows)
                                            // max(1, mnbt.value) + max(r["max_tokens"] for r, _ in
                                                                        req_rows) + len(req_rows))))
    what = report.exception_type or "no Python exception"
    if report.exception_message:
        what += f": {report.exception_message[:120]}"
    desc = (f"drafted by vllm-repro triage from {Path(src).name}: {what} "
            f"({report.stage}, {report.exit_kind})")
    vsrc = report.version_source
    out = [f"# Drafted by `vllm-repro triage --scenario` from {src}.",
           "# `# guess:` marks values the log does not state; `# derived:` values computed from it.",
           f"name: {_q(name or _scenario_name(src))}",
           f"description: {_q(desc)}",
           "vllm:",
           f"  reproduces_on: [{_q(version)}]"
           + (f"  # named in the log, line {vsrc['log_line']}" if vsrc and version ==
              report.vllm_version else "  # given with --vllm"),
           f"level: {level}  # {level_why}",
           "config:"]
    order = ["block_size", "num_gpu_blocks", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens",
             "max_model_len", "enable_chunked_prefill", "enable_prefix_caching", "policy",
             "num_speculative_tokens", "async_scheduling"]
    for key in order:
        if key in c:
            out.append(f"  {key}: {_q(c[key].value)}{c[key].comment()}")
    src_line = f" (dump_input.py SchedulerOutput, line {dump.output_line})" if reqs and dump else ""
    out.append(f"requests:  # guess: arrival order and times are not in the log; all arrive "
               f"before step 1{src_line}")
    if common and any("prefix" in r for r, _ in req_rows):
        out.append(f"  # derived: num_common_prefix_blocks=[{common}]: the running requests "
                   f"shared their first {common} blocks -> prefix 'common'")
    if n_wait:
        out.append(f"  # guess: the {min(n_wait, MAX_WAITING)} waiting-N requests stand for the "
                   f"{n_wait} waiting requests of the stats; their lengths are not in the log")
    for row, why in req_rows:
        flow = ", ".join(f"{k}: {_q(v)}" for k, v in row.items())
        out.append(f"  - {{{flow}}}" + (f"  # {why}" if why else ""))
    if so and so.finished_req_ids:
        out.append(f"# finished in the crashing step (not replayed): {len(so.finished_req_ids)}"
                   " request(s)")
    out.append(f"limits: {{max_steps: {max_steps}, stall_steps: 50}}  # guess: room for every "
               "request to finish")
    out.extend(expect_lines)
    for n in notes:
        out.append(f"# note: {n}")
    text = "\n".join(out) + "\n"

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:  # a bug in the drafting, not in the log
        raise InputError(f"{src}: the drafted scenario is not valid YAML ({exc})") from None
    scenario = parse_scenario(data, f"scenario drafted from {src}")
    return text, scenario
