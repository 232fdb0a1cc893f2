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

A crash whose frames run through vLLM's V0 engine (:func:`v0_crash`) is drafted at
``level: v0-engine``: the engine's start-up banner stands in for the dumped config, the
``# GPU blocks / # CPU blocks`` line gives both pools, chunked prefill comes from the crash path
where the log does not state it, and a log with no stats gets one guessed request.
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
from .dump import DumpedRequest, parse_pairs, read_config, read_scheduler_output
from .scan import LogScanner

MAX_WAITING = 256  # waiting requests synthesised from the stats, at most
MAX_GPU_BLOCKS = 200_000
_STANDARD_BLOCK_SIZES = (16, 32, 64, 128, 8, 256, 1, 2, 4, 512, 1024)
_BATCH_DEFAULTS = (2048, 8192, 16384)
GUESSED_MAX_TOKENS = 16
#: decode steps a dumped request keeps past the crashed step (its max_tokens is cut to that)
REPLAY_TAIL_TOKENS = 64


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


#: modules of vLLM's V0 engine (``vllm/engine/llm_engine.py`` and what it drives); a crash path
#: through one of them, and through no ``vllm/v1/`` module, is a V0 crash (``level: v0-engine``)
V0_ENGINE_PREFIXES = ("vllm/core/", "vllm/engine/llm_engine.py", "vllm/engine/async_llm_engine.py",
                      "vllm/engine/multiprocessing/", "vllm/engine/output_processor/",
                      "vllm/worker/worker.py", "vllm/executor/gpu_executor.py",
                      "vllm/executor/uniproc_executor.py")
#: V0 code that ``level: v0-engine`` runs as the release ships it (where an innermost frame in
#: it is a crash the replay can show): the scheduler and block managers, the engine, its output
#: processors, and the worker's start-up check of the pool (``raise_if_cache_size_invalid``)
_V0_IN_REACH = ("vllm/core/", "vllm/engine/llm_engine.py", "vllm/engine/output_processor/")
_V0_START_UP = ("vllm/engine/llm_engine.py:_initialize_kv_caches",
                "vllm/worker/worker.py:raise_if_cache_size_invalid",
                "vllm/worker/worker.py:initialize_cache",
                "vllm/worker/worker.py:_assert_memory_footprint_increased_during_profiling")


def v0_crash(report: TriageReport) -> str | None:
    """The first V0 engine frame of the crash path (``module:function``) when the crash went
    through vLLM's V0 engine and through no ``vllm/v1/`` code, else ``None``: read from the
    log's frames, never from its version number."""
    path = report.crash_path or []
    if any(p.startswith("vllm/v1/") for p in path):
        return None
    return next((p for p in path if p.startswith(V0_ENGINE_PREFIXES)), None)


def _packaged_positions() -> int:
    """``max_position_embeddings`` of the lab's default packaged model (``models/opt``), the
    model ``level: v0-engine`` builds vLLM's ``ModelConfig`` from."""
    cfg = Path(__file__).resolve().parent.parent / "models" / "opt" / "config.json"
    return int(json.loads(cfg.read_text())["max_position_embeddings"])


def _choose_level(report: TriageReport, version: str, notes: list[str]) -> tuple[str, str, str | None]:
    """``(level, why, expected phase or None)`` for the replay: ``v0-engine`` when the crash
    path runs through the V0 engine (:func:`v0_crash`); ``engine-core`` when it goes through
    EngineCore code the scheduler level never runs (start-up's KV sizing, the batch queue, ...)
    and the release's capabilities record (cached when it last ran here,
    :mod:`vllm_repro.engine.capabilities`) does not rule it out."""
    from ..engine.capabilities import load
    from ..settings import cache_dir

    v0 = v0_crash(report)
    if v0 is not None:
        _v0_tree_note(version, notes)
        phase = "engine-build" if any(p in _V0_START_UP for p in report.crash_path) else None
        return "v0-engine", f"the crash went through vLLM's V0 engine ({v0})", phase
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


def _v0_tree_note(version: str, notes: list[str]) -> None:
    """A note when ``version``'s tree is cached and has no V0 engine (the draft would be
    refused there): probed by file, as the V0 level does."""
    from ..engine.v0 import has_v0_engine
    from ..sources.sdist import tree_dir

    vllm_dir = tree_dir(version) / "vllm"
    if vllm_dir.is_dir() and not has_v0_engine(vllm_dir):
        notes.append(f"vLLM {version}'s tree has no V0 engine (vllm/engine/llm_engine.py with "
                     "vllm/core/scheduler.py): run the draft with --vllm on a release that has one")


_V1_DEFAULT = re.compile(r'os\.getenv\(\s*"VLLM_USE_V1"\s*,\s*"([01])"\s*\)')


def _v1_default(version: str) -> tuple[bool | None, str]:
    """Whether ``version`` runs the V1 engine by default, read from its own ``vllm/envs.py``
    when its tree is in the cache (no download): ``VLLM_USE_V1``'s default there, or V1 only
    when the release has no such switch (V0 removed) but does have ``vllm/v1``. ``(None, why)``
    when the tree is not at hand."""
    from ..sources.sdist import tree_dir

    envs = tree_dir(version) / "vllm" / "envs.py"
    try:
        text = envs.read_text(errors="replace")
    except OSError:
        return None, f"vLLM {version}'s tree is not in the cache (vllm-repro prepare {version} reads it)"
    m = _V1_DEFAULT.search(text)
    if m:
        return m.group(1) == "1", f"VLLM_USE_V1 defaults to {m.group(1)} in vLLM {version}'s vllm/envs.py"
    if (envs.parent / "v1").is_dir():
        return True, f"vLLM {version} has only the V1 engine (no VLLM_USE_V1 in its vllm/envs.py)"
    return False, f"vLLM {version} has no vllm/v1 package"


def draft_release(report: TriageReport, version: str | None = None) -> str | None:
    """The release a draft is for: ``version`` (``--vllm``) or the one the log names."""
    return version or report.vllm_version


def draft_scenario(report: TriageReport, sc: LogScanner, *, version: str | None = None,
                   name: str | None = None) -> tuple[str, Scenario]:
    """The scenario YAML text (with ``# guess`` / ``# derived`` comments) and its validated
    :class:`Scenario`, for the release ``version`` (default: the one the log names,
    :func:`draft_release`). The release is under ``vllm.reproduces_on`` only when the draft
    ``expect``s the log's crash (it is in the code the lab drives): a draft without an
    expectation names the release in a comment, to be run with ``--vllm`` (exit 0 when the
    replay runs clean), never one that demands a crash the replay cannot show.

    Raises :class:`InputError` when the log names no release and none is given, or shows
    neither a dumped SchedulerOutput nor scheduler stats to build requests from.
    """
    return _Draft(report, sc, version, name).build()


class _Draft:
    """One drafting: the log's sources, then a phase per part of the scenario (config, requests,
    lengths, batch, KV cache size, spec decode / async, expectation), then the YAML text."""

    def __init__(self, report: TriageReport, sc: LogScanner, version: str | None, name: str | None):
        self.report, self.sc, self.name = report, sc, name
        self.src = report.source
        self.version = self._check_version(draft_release(report, version))
        dump = self.dump = sc.dump
        self.so = read_scheduler_output(dump.scheduler_output) if dump and dump.scheduler_output else None
        self.state = report.scheduler_state or {}
        self.notes: list[str] = []
        self.level, self.level_why, self.phase = _choose_level(report, self.version, self.notes)
        self.v0 = self.level == "v0-engine"
        self.at_start_up = self.level in ("engine-core", "v0-engine") and self.phase == "engine-build"
        self.dumped_cfg = read_config(dump.config) if dump and dump.config else {}
        # V0 logs have no dump_input.py: the start-up banner's config is the engine's config
        banner = sc.engine_config if self.v0 and not self.dumped_cfg else None
        self.banner_raw = parse_pairs(banner[1]) if banner else {}
        self.banner_cfg = read_config(banner[1]) if banner else {}
        self.banner_line = f"engine config, line {banner[0]}" if banner else ""
        self.args_cfg = read_config(sc.args[1]) if sc.args else {}
        self.cfg_line = f"dump_input.py config, line {dump.config_line}" if self.dumped_cfg else ""
        self.args_line = f"server arguments, line {sc.args[0]}" if sc.args else ""
        self.reqs: list[DumpedRequest] = self.so.requests if self.so else []
        self.c: dict[str, _Val] = {}
        self.req_rows: list[tuple[dict, str]] = []
        self.used: set[str] = set()
        self.common = self.so.num_common_prefix_blocks[0] if self.so and \
            self.so.num_common_prefix_blocks else 0
        self.n_wait = 0

    def build(self) -> tuple[str, Scenario]:
        self._require_requests()
        self._block_size()
        self._switches()
        self._parallel()
        self._requests()
        self._lengths()
        self._batch()
        self._kv_cache_size()
        self._spec_and_async()
        return self._validated(self._text(self._expectation()))

    # --- sources --------------------------------------------------------------------------------
    def _check_version(self, version: str | None) -> str:
        if not version:
            raise InputError(f"{self.src}: the log names no vLLM release; pass --vllm VERSION to "
                             "draft a scenario for one")
        try:
            Version(version)
        except InvalidVersion:
            raise InputError(f"{self.src}: {version!r} is not a vLLM release version; pass --vllm "
                             "VERSION") from None
        return version

    def _require_requests(self) -> None:
        so, state = self.so, self.state
        if (so is None or not so.requests) and not state.get("running") and not state.get("waiting") \
                and not state.get("pending") and not self.at_start_up and not self.v0:
            if self.report.dump is not None and self.report.cut_off:
                raise InputError(f"{self.src}: the log is cut off before any request of vLLM's crash "
                                 f"dump (log line {self.report.dump['log_line']}) could be read: "
                                 "nothing to build the scenario's requests from; triage the whole "
                                 "log")
            raise InputError(f"{self.src}: no dump_input.py SchedulerOutput and no scheduler stats "
                             "with requests in the log: nothing to build the scenario's requests from")

    def known(self, key: str, conv) -> _Val | None:
        """``key``'s value where the log states it: the server arguments first, then the dumped
        config."""
        if key in self.args_cfg and conv(self.args_cfg[key]) is not None:
            return _Val(conv(self.args_cfg[key]), "log", self.args_line)
        if key in self.dumped_cfg and conv(self.dumped_cfg[key]) is not None:
            return _Val(conv(self.dumped_cfg[key]), "log", self.cfg_line)
        for cfg in (self.banner_cfg, self.banner_raw):
            if key in cfg and conv(cfg[key]) is not None:
                return _Val(conv(cfg[key]), "log", self.banner_line)
        return None

    # --- config -----------------------------------------------------------------------------------
    def _block_size(self) -> None:
        bs = self.known("block_size", _posint)
        if bs is None:
            inferred = _infer_block_size(self.reqs)
            bs = _Val(inferred[0], "derived", inferred[1]) if inferred else \
                _Val(16, "guess", "vLLM's default block size on CUDA")
        self.c["block_size"] = bs
        self.B = bs.value

    def _switches(self) -> None:
        if self.v0:
            return self._v0_switches()
        c, version = self.c, self.version
        v1_default, why = _v1_default(version)
        if v1_default is False:
            self.notes.append(f"vLLM {version} does not run the V1 engine the lab drives by "
                              f"default ({why}): replay the draft with --vllm on a V1 release")
        elif v1_default is None:
            self.notes.append(f"assumed the V1 engine's defaults: {why}")
            v1_default = True
        default_why = f"vLLM {version}'s default" + (" (V1 engine)" if v1_default else "")
        c["enable_chunked_prefill"] = self.known("enable_chunked_prefill", _bool) or _Val(
            v1_default, "guess", default_why)
        c["enable_prefix_caching"] = self.known("enable_prefix_caching", _bool) or _Val(
            v1_default, "guess", default_why)
        pol = self.args_cfg.get("scheduling_policy")
        c["policy"] = _Val(pol, "log", self.args_line) if pol in ("fcfs", "priority") else \
            _Val("fcfs", "guess", "vLLM's default scheduling policy")

    def _parallel(self) -> None:
        """``tensor_parallel_size`` / ``pipeline_parallel_size`` / ``data_parallel_size`` as the
        log's engine config states them (above 1 only), so that the replay's ``ParallelConfig``
        and the emulated platform's device count are the deployment's; left out, with a note,
        where the ranks are more than the lab emulates (``engine/topology.py``). Not at
        ``level: v0-engine`` (the lab's V0 worker runs one rank)."""
        from ..engine.topology import MAX_WORLD_SIZE

        if self.v0:
            return
        found = {}
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            v = self.known(key, _posint)
            if v is not None and v.value > 1:
                found[key] = v
        dp = found.get("data_parallel_size")
        if dp is not None and self.level == "engine-core":
            self._data_parallel(found, dp)
        if not found:
            return
        ranks = 1
        for v in found.values():
            ranks *= v.value
        if ranks > MAX_WORLD_SIZE:
            sizes = ", ".join(f"{k} {v.value}" for k, v in found.items())
            self.notes.append(f"the log's engine ran {ranks} ranks ({sizes}), more than the "
                              f"{MAX_WORLD_SIZE} the lab emulates: the draft runs one")
            return
        self.c.update(found)
        tp_pp = found.get("tensor_parallel_size", _Val(1, "", "")).value * found.get(
            "pipeline_parallel_size", _Val(1, "", "")).value
        if tp_pp > 1:
            # vLLM's own choice for a world that fits one node; said, since older releases
            # count the node's GPUs through torch.cuda (cuda_device_count_stateless), which a
            # CPU build answers 0, before they choose it
            self.c["distributed_executor_backend"] = _Val(
                "mp", "derived", f"vLLM's default executor for {tp_pp} ranks on one node")

    def _data_parallel(self, found: dict, dp: _Val) -> None:
        """``data_parallel_size`` > 1 at level engine-core: the release's own DP shape (an
        engine core process per DP rank, ``DPEngineCoreProc`` with its coordinator, started by
        the asyncio ``DPLBAsyncMPClient``: ``multiprocess_mode`` and ``asyncio_mode``; the
        packaged MoE config ``mixtral-moe``, since vLLM builds a ``DPEngineCoreProc`` only for
        an MoE model), unless the release's cached capabilities record says it has none; then
        (in place) the size is dropped and the draft replays one DP rank's engine core, with a
        note."""
        from ..engine.capabilities import load
        from ..settings import cache_dir

        caps = load(cache_dir(), self.version)
        if caps is not None and not caps.dp_engine_core_proc:
            found.pop("data_parallel_size")
            self.notes.append(f"the log's engine ran data_parallel_size {dp.value}, but "
                              f"{caps.refusal('data parallel engine cores')}: the draft replays "
                              "one DP rank's engine core")
            return
        c = self.c
        c["multiprocess_mode"] = _Val(True, "derived", f"data_parallel_size {dp.value}: an "
                                      "engine core process per DP rank")
        c["asyncio_mode"] = _Val(True, "derived", "vLLM's DP client is the asyncio one "
                                 "(DPLBAsyncMPClient)")
        c["model"] = _Val("mixtral-moe", "derived", "vLLM builds a DPEngineCoreProc per DP rank "
                          "only for an MoE model: the lab's packaged config-only MoE")
        if caps is None:
            self.notes.append(f"the log's engine ran data_parallel_size {dp.value}: the draft "
                              f"runs it; vLLM {self.version} has not run here yet, so whether it "
                              "has DP engine cores is checked by the run")

    def _v0_switches(self) -> None:
        """V0's switches: chunked prefill as the log states it, else as the crash path shows it
        (``Scheduler._schedule_chunked_prefill`` or ``_schedule_default``); the V0
        ``EngineArgs`` fields the engine banner shows (``use_v2_block_manager``,
        ``num_scheduler_steps``, multi-step included: ``level: v0-engine`` runs it)."""
        c, path = self.c, " ".join(self.report.crash_path)
        chunked = self.known("enable_chunked_prefill", _bool)
        if chunked is None and "scheduler.py:_schedule_chunked_prefill" in path:
            chunked = _Val(True, "derived", "the crash went through Scheduler._schedule_chunked_prefill")
        elif chunked is None and "scheduler.py:_schedule_default" in path:
            chunked = _Val(False, "derived", "the crash went through Scheduler._schedule_default")
        c["enable_chunked_prefill"] = chunked or _Val(False, "guess", "V0 EngineArgs' default")
        c["enable_prefix_caching"] = self.known("enable_prefix_caching", _bool) or _Val(
            False, "guess", "V0 EngineArgs' default")
        pol = self.args_cfg.get("scheduling_policy")
        c["policy"] = _Val(pol, "log", self.args_line) if pol in ("fcfs", "priority") else \
            _Val("fcfs", "guess", "vLLM's default scheduling policy")
        v2 = self.known("use_v2_block_manager", _bool)
        if v2 is not None:
            c["use_v2_block_manager"] = v2
        steps = self.known("num_scheduler_steps", _posint)
        if steps is not None:  # multi-step runs at v0-engine (engine/v0.py: execute_multi_step)
            c["num_scheduler_steps"] = steps

    # --- requests ---------------------------------------------------------------------------------
    def _requests(self) -> None:
        for r in self.reqs:
            self.req_rows.append(self._dumped_row(r))
        state, rows = self.state, self.req_rows
        self.n_wait = n_wait = int(state.get("waiting") or state.get("pending") or 0)
        if not rows and self.at_start_up and not state.get("running"):
            rows.append(({"id": "first", "at_step": 1, "prompt_len": 16,
                          "max_tokens": GUESSED_MAX_TOKENS},
                         "guess: the engine died at start-up, before any request; one request "
                         "stands for the first"))
        if not rows and self.v0 and not state.get("running") and not n_wait:
            rows.append(({"id": "guessed-1", "at_step": 1, "prompt_len": 1024,
                          "max_tokens": GUESSED_MAX_TOKENS},
                         "guess: the log shows no requests (V0 dumps none, and no stats line); "
                         "one request stands for the load"))
        if not rows:
            for i in range(int(state.get("running") or 0)):
                rows.append(({"id": f"running-{i + 1}", "at_step": 1, "prompt_len": 1024,
                              "max_tokens": GUESSED_MAX_TOKENS},
                             "guess: a running request from the stats; lengths not in the log"))
        if n_wait:
            known_lens = [row["prompt_len"] for row, _ in rows] or [1024]
            wlen = int(statistics.median(known_lens))
            for i in range(min(n_wait, MAX_WAITING)):
                rid = _safe_id(f"waiting-{i + 1}", self.used)
                rows.append(({"id": rid, "at_step": 1, "prompt_len": wlen,
                              "max_tokens": GUESSED_MAX_TOKENS}, ""))
            if n_wait > MAX_WAITING:
                self.notes.append(f"the stats showed {n_wait} waiting requests; the first "
                                  f"{MAX_WAITING} are drafted")

    def _dumped_row(self, r: DumpedRequest) -> tuple[dict, str]:
        """A request of the dumped SchedulerOutput and why its lengths are what they are."""
        rid = _safe_id(r.id, self.used)
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
            reach = (r.num_output_tokens or 0) + REPLAY_TAIL_TOKENS
            if mt > reach:  # a dumped max_tokens=32000 would replay 32000 decode steps
                why.append(f"derived max_tokens: the dump's {mt} cut to {reach} (its "
                           f"{r.num_output_tokens or 0} output tokens + {REPLAY_TAIL_TOKENS}): "
                           "steps past the crashed one never ran")
                mt = reach
        else:
            mt = GUESSED_MAX_TOKENS
            why.append("guess max_tokens")
        if r.resumed:
            why.append("resumed from preemption in the crashing step")
        return {"id": rid, "at_step": 1, "prompt_len": plen, "max_tokens": mt}, "; ".join(why)

    # --- lengths and batch ------------------------------------------------------------------------
    def _lengths(self) -> None:
        c, rows = self.c, self.req_rows
        need = max(row["prompt_len"] + row["max_tokens"] for row, _ in rows)
        mml = self.known("max_model_len", _posint)
        if mml is None:
            mml = _Val(max(2048, 1 << (need - 1).bit_length()), "guess",
                       "not in the log; the smallest power of two that fits every request")
        if self.v0 and mml.value > (limit := _packaged_positions()):
            self.notes.append(f"the log's max_model_len {mml.value} is over the lab's packaged "
                              f"model's {limit} positions, which vLLM's ModelConfig holds it to")
            mml = _Val(limit, "derived", f"the log's {mml.value} capped at the packaged model's "
                                         "max_position_embeddings")
        c["max_model_len"] = mml
        for row, _ in rows:
            if row["prompt_len"] + row["max_tokens"] > mml.value:
                row["max_tokens"] = max(1, mml.value - row["prompt_len"])
                if row["prompt_len"] + row["max_tokens"] > mml.value:
                    row["prompt_len"] = mml.value - 1
                    row["max_tokens"] = 1
        if self.common and c["enable_prefix_caching"].value:
            plen_common = self.common * self.B
            for row, _ in rows[:len(self.reqs)]:
                if row["prompt_len"] >= plen_common:
                    row["prefix"], row["prefix_len"] = "common", plen_common

    def _batch(self) -> None:
        c = self.c
        c["max_num_seqs"] = self.known("max_num_seqs", _posint) or _Val(
            max(256, len(self.req_rows)), "guess", "vLLM's default (256), or enough for every request")
        total = self.so.total_num_scheduled_tokens if self.so else None
        mnbt = self.known("max_num_batched_tokens", _posint)
        if mnbt is None and self.sc.max_num_batched_tokens:
            mnbt = _Val(self.sc.max_num_batched_tokens, "log", "'Chunked prefill is enabled' line")
        if mnbt is None:
            if total:
                pick = next((d for d in _BATCH_DEFAULTS if d >= total), None) or \
                    1024 * math.ceil(total / 1024)
                mnbt = _Val(pick, "guess", f"the smallest vLLM default >= the {total} tokens the "
                                           "crashing step scheduled")
            elif self.v0 and c["enable_chunked_prefill"].value:
                mnbt = _Val(512, "guess", "V0's default with chunked prefill (0.6's EngineArgs)")
            else:
                mnbt = _Val(8192, "guess", "vLLM's default for the OpenAI server on large GPUs")
        if not c["enable_chunked_prefill"].value and mnbt.value < c["max_model_len"].value:
            mnbt = _Val(c["max_model_len"].value, "derived",
                        "without chunked prefill vLLM needs >= max_model_len")
        c["max_num_batched_tokens"] = mnbt

    # --- KV cache size ----------------------------------------------------------------------------
    def _kv_cache_size(self) -> None:
        c, sc, B = self.c, self.sc, self.B
        blocks_per_req = [math.ceil((row["prompt_len"] + row["max_tokens"]) / B)
                          for row, _ in self.req_rows]
        floor_blocks = max(blocks_per_req) + 1
        if sc.gpu_blocks:
            nb = _Val(sc.gpu_blocks[0], "log", f"'# GPU blocks' line {sc.gpu_blocks[2]}")
            if self.v0 and sc.gpu_blocks[1] is not None:
                c["num_cpu_blocks"] = _Val(sc.gpu_blocks[1], "log",
                                           f"'# CPU blocks' line {sc.gpu_blocks[2]}")
        elif sc.kv_cache_tokens:
            kind = "derived" if c["block_size"].kind != "guess" else "guess"
            nb = _Val(max(2, sc.kv_cache_tokens[0] // B), kind,
                      f"GPU KV cache size {sc.kv_cache_tokens[0]} tokens (line "
                      f"{sc.kv_cache_tokens[1]}) / block_size")
        else:
            nb = self._kv_from_usage(floor_blocks)
        if nb.value > MAX_GPU_BLOCKS:
            nb = _Val(MAX_GPU_BLOCKS, "guess", f"{nb.value} capped to keep the replay fast")
        if nb.value < floor_blocks:
            nb = _Val(floor_blocks, "derived", "raised so that the longest request fits")
        c["num_gpu_blocks"] = nb
        if self.v0:
            if self.at_start_up and "no available memory for the cache blocks" in (
                    self.report.exception_message or "").lower():
                c["num_gpu_blocks"] = _Val(0, "derived", "the log: no memory was left for the "
                                           "KV cache blocks (the fake worker reports 0)")
            return
        if self.at_start_up and "no available memory for the cache blocks" in (
                self.report.exception_message or "").lower():
            c["kv_cache_memory_bytes"] = _Val(0, "derived", "the log: no memory was left for the "
                                              "KV cache after profiling")

    def _kv_from_usage(self, floor_blocks: int) -> _Val:
        """The pool from the blocks the dumped requests hold and the stats' KV cache usage."""
        B, reqs = self.B, self.reqs
        used_blocks = sum(math.ceil((r.num_computed_tokens + (r.num_scheduled or 0)) / B)
                          for r in reqs)
        used_blocks -= max(0, len(reqs) - 1) * self.common
        pct = self.state.get("kv_cache_usage_pct")
        if used_blocks > 0 and isinstance(pct, (int, float)) and pct >= 1.0:
            return _Val(math.ceil(used_blocks * 100 / pct) + 1, "guess",
                        f"{used_blocks} blocks held by the dumped requests at {pct}% KV cache usage")
        return _Val(max(2 * floor_blocks, 64), "guess", "the KV cache size is not in the log")

    # --- speculative decoding / async scheduling --------------------------------------------------
    def _spec_and_async(self) -> None:
        c = self.c
        if self.v0:  # V0's speculative decoding and async output processing are not lab fields
            nspec = self.known("num_speculative_tokens", _posint)
            if nspec:
                self.notes.append(f"the log ran speculative decoding ({nspec.value} tokens); "
                                  "level v0-engine does not drive it, so the draft leaves it out")
            return
        nspec = self.known("num_speculative_tokens", _posint)
        if nspec is None and self.so is not None and self.so.num_spec_tokens > 0:
            # no config in the log, but the dumped step scheduled draft tokens
            nspec = _Val(self.so.num_spec_tokens, "derived",
                         f"the dumped step scheduled {self.so.num_spec_tokens} spec tokens per "
                         "request (scheduled_spec_decode_tokens)")
        if nspec:
            c["num_speculative_tokens"] = nspec
            method = self.args_cfg.get("speculative_method") or self.dumped_cfg.get("speculative_method")
            if method and method != "ngram":
                self.notes.append(f"the log's speculative method is {method!r}; the lab drafts "
                                  "ngram-style tokens")
        if self.so is not None and self.so.structured_output:
            self.notes.append("the dumped step held structured-output requests; their grammars "
                              "are not in the dump, so the draft gives none: add "
                              "`structured_outputs:` to a request (level engine-core) to replay "
                              "them")
        if self.known("async_scheduling", _bool) and self.known("async_scheduling", _bool).value:
            c["async_scheduling"] = self.known("async_scheduling", _bool)
        # level: what of vLLM the replay runs (chosen in __init__)
        if self.level == "engine-core" and "step_with_batch_queue" in " ".join(self.report.crash_path) \
                and "async_scheduling" not in c:
            c["async_scheduling"] = _Val(True, "guess", "the crash went through "
                                         "EngineCore.step_with_batch_queue (async scheduling, or a "
                                         "pipeline-parallel batch queue)")

    # --- expectation ------------------------------------------------------------------------------
    def _expectation(self) -> list[str]:
        report, level = self.report, self.level
        frame = report.last_vllm_frame
        module = (frame or {}).get("module", "")
        in_reach = module.startswith("vllm/v1/core/") or (
            level == "engine-core" and module in ENGINE_CORE_MODULES) or (
            level == "v0-engine" and (module.startswith(_V0_IN_REACH) or (
                self.phase == "engine-build" and module == "vllm/worker/worker.py")))
        if report.exception_type and frame and in_reach:
            exc = report.exception_type.split("(")[0].rsplit(".", 1)[-1]
            lines = [f"expect:  # the log's crash is in the vLLM code the lab drives at level {level}",
                     "  outcome: crash",
                     f"  exception: {_q(exc)}",
                     f"  where: {_q(frame['module'] + ':' + frame['function'])}"]
            if self.phase:
                lines.append(f"  phase: {self.phase}")
            return lines
        where = f"{frame['module']}:{frame['function']}" if frame else "no vLLM frame"
        if report.cut_off and not report.exception_type:
            shows = f"its last vLLM frame: {where}" if frame else "no vLLM frame in it"
            return ["# no expect: the log is cut off before its crash, so the crash is not in it",
                    f"# ({shows}) and nothing says whether the lab's code could show it; the",
                    "# replay shows whether vLLM's scheduler side stays sound under this load",
                    "# (clean: exit 0; anything else: exit 1)"]
        what = report.exception_type or report.exit_kind or "the crash"
        return [f"# no expect: the log's crash ({what} in {where}) is outside the scheduler/KV",
                "# code the lab drives, so the replay cannot show it; it shows whether vLLM's",
                "# scheduler side stays sound under this load (clean: exit 0; anything else: exit 1)"]

    # --- the text ---------------------------------------------------------------------------------
    def _text(self, expect_lines: list[str]) -> str:
        report, rows, c, src, version = self.report, self.req_rows, self.c, self.src, self.version
        max_steps = min(100_000, max(500, 4 * (
            sum(r["prompt_len"] for r, _ in rows) // max(1, c["max_num_batched_tokens"].value)
            + max(r["max_tokens"] for r, _ in rows) + len(rows))))
        what = report.exception_type or (
            "the log is cut off before its crash (not in the log)" if report.cut_off
            else "no Python exception")
        if report.exception_message:
            what += f": {report.exception_message[:120]}"
        known = [x for x in (report.stage and f"stage {report.stage}", report.exit_kind) if x]
        desc = (f"drafted by vllm-repro triage from {Path(src).name}: {what}"
                + (f" ({', '.join(known)})" if known else ""))
        vsrc = report.version_source
        named = f"named in the log, line {vsrc['log_line']}" if vsrc and version == \
            report.vllm_version else "given with --vllm"
        expects = any(line.startswith("expect:") for line in expect_lines)
        name = self.name or _scenario_name(src)
        out = [f"# Drafted by `vllm-repro triage --scenario` from {src}."]
        if report.cut_off:  # first: the draft is only as good as the lines before the cut
            out += _comment("CUT OFF: ", report.cut_off)
        cut_dump = self.so.cut_warning(self.dump.output_line, self.state.get("running"),
                                       self.state.get("source")) if self.so else None
        if cut_dump:
            out += _comment("WARNING: ", cut_dump)
        out += ["# `# guess:` marks values the log does not state; `# derived:` values computed "
                "from it.",
                f"name: {_q(name)}",
                f"description: {_q(desc)}"]
        if expects:
            out += ["vllm:", f"  reproduces_on: [{_q(version)}]  # {named}"]
        else:  # reproduces_on would demand a crash the lab cannot show: the replay would fail
            out += [f"# vLLM {version} ({named}) is not under vllm.reproduces_on: the draft has no",
                    "# expect (below), so that release would demand a crash the replay cannot show;",
                    f"# run it there with: vllm-repro run <this file> --vllm {version}"]
        out += [f"level: {self.level}  # {self.level_why}",
                "config:"]
        for key in _CONFIG_ORDER:
            if key in c:
                out.append(f"  {key}: {_q(c[key].value)}{c[key].comment()}")
        src_line = f" (dump_input.py SchedulerOutput, line {self.dump.output_line})" \
            if self.reqs and self.dump else ""
        out.append(f"requests:  # guess: arrival order and times are not in the log; all arrive "
                   f"before step 1{src_line}")
        if self.common and any("prefix" in r for r, _ in rows):
            out.append(f"  # derived: num_common_prefix_blocks=[{self.common}]: the running requests "
                       f"shared their first {self.common} blocks -> prefix 'common'")
        if self.n_wait:
            out.append(f"  # guess: the {min(self.n_wait, MAX_WAITING)} waiting-N requests stand for "
                       f"the {self.n_wait} waiting requests of the stats; their lengths are not in the log")
        for row, why in rows:
            flow = ", ".join(f"{k}: {_q(v)}" for k, v in row.items())
            out.append(f"  - {{{flow}}}" + (f"  # {why}" if why else ""))
        if self.so and self.so.finished_req_ids:
            out.append(f"# finished in the crashing step (not replayed): "
                       f"{len(self.so.finished_req_ids)} request(s)")
        out.append(f"limits: {{max_steps: {max_steps}, stall_steps: 50}}  # guess: room for every "
                   "request to finish")
        out.extend(expect_lines)
        for n in self.notes:
            out.append(f"# note: {n}")
        return "\n".join(out) + "\n"

    def _validated(self, text: str) -> tuple[str, Scenario]:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:  # a bug in the drafting, not in the log
            raise InputError(f"{self.src}: the drafted scenario is not valid YAML ({exc})") from None
        return text, parse_scenario(data, f"scenario drafted from {self.src}")


def _comment(head: str, text: str, width: int = 96) -> list[str]:
    """``head`` + ``text`` as YAML comment lines of at most ``width`` characters, the lines after
    the first indented under the text."""
    import textwrap

    return ["# " + line for line in textwrap.wrap(
        head + text, width - 2, subsequent_indent=" " * len(head))]


#: the order of the draft's config keys
_CONFIG_ORDER = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "kv_cache_memory_bytes",
                 "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "enable_chunked_prefill", "enable_prefix_caching", "policy",
                 "use_v2_block_manager", "num_scheduler_steps", "num_speculative_tokens",
                 "async_scheduling", "tensor_parallel_size", "pipeline_parallel_size",
                 "data_parallel_size", "distributed_executor_backend", "multiprocess_mode",
                 "asyncio_mode", "model")
