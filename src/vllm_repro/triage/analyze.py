"""From collected evidence to a verdict: root cause, innermost vLLM frame, stage, exit kind,
release, scheduler state (:class:`TriageReport`).

The rules (``/work/shared/crashlogs/README.md`` conventions):

- **Root cause**, not the wrappers it sets off. Each chain of exceptions (``raise ... from``,
  ``During handling ...``) is walked from its last exception towards its cause while the
  current one is a wrapper (EngineDeadError and kin, a message pointing at "the stack trace
  above", or one that embeds another exception's message), a consequence (EOFError,
  BrokenPipeError, CancelledError, ...), or raised outside vLLM around a vLLM failure. Among the
  chains' representatives, real errors beat standalone lines beat consequences beat wrappers;
  an exception after which the engine was seen serving again (stats lines, HTTP 200) was not
  fatal; ties go to the earliest (later ones are usually its fallout in other processes).
- **Exit kind**: ``cuda_error`` when the root cause is a CUDA error (or, with no Python root
  cause, a CUDA error line); ``signal:SIGx`` when a process died of a signal before the root
  cause was printed, or the root cause only reports a dead process (Ray's ActorDiedError);
  else ``python_exception``. A bare ``Killed`` after vLLM's "fatal signal from worker
  processes" notice is vLLM's own group kill and does not count.
- **Innermost vLLM frame**: in the root cause's traceback; for signal deaths, in the dying
  process's faulthandler stack.
- **Stage**: ImportError (or an error raised while importing vLLM modules) -> ``import``; a
  device-detection error -> ``engine-build``; an error raised in config code (``vllm/config``,
  ``engine/arg_utils.py``) outside the request loop -> ``config``; else the outermost stage
  marker among the vLLM frames (``run_busy_loop``, ``step``, ``execute_model`` -> runtime;
  ``__init__``, ``load_model``, ``_initialize_kv_caches``, ``capture_model`` -> engine-build);
  else the lifecycle the log had reached.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .dump import read_stats
from .frames import Frame, innermost_plugin, innermost_vllm
from .scan import CUDA_RE, ExcRecord, LogScanner, SignalEvent

WRAPPER_TYPES = {"EngineDeadError", "AsyncEngineDeadError", "EngineGenerateError",
                 "RayTaskError", "MQEngineDeadError"}
_WRAPPER_MSG = re.compile(
    r"see (?:the )?stack trace|check the stack trace|for the root cause|see root cause|"
    r"engine core initialization failed|engine process failed to start|background loop (?:has )?"
    r"errored|task finished unexpectedly|worker failed with error|engine loop is not running",
    re.I)
SECONDARY_TYPES = {"EOFError", "BrokenPipeError", "ConnectionResetError",
                   "ConnectionRefusedError", "ConnectionAbortedError", "CancelledError",
                   "KeyboardInterrupt", "SystemExit", "GeneratorExit", "ClosedResourceError",
                   "EndOfStream"}
DEATH_NOTICE_TYPES = {"ActorDiedError", "RayActorError", "ActorUnavailableError",
                      "WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError"}
_WEAK_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP", "SIGPIPE"}
_TORCH_OOM = re.compile(r"(?:^|\.)(?:cuda\.)?OutOfMemoryError$")
_DEVICE = re.compile(r"no supported device|failed to infer device|no CUDA GPUs are available|"
                     r"found no NVIDIA driver|no CUDA-capable device|device string must not be",
                     re.I)
_CONFIG_MODULE = re.compile(r"^vllm/(?:config\.py|config/|engine/arg_utils\.py|"
                            r"entrypoints/openai/cli_args\.py|transformers_utils/config\.py|"
                            r"utils/argparse_utils\.py)")
_CONFIG_TYPES = {"ValidationError", "ArgumentError", "ArgumentTypeError"}
RUNTIME_FUNCS = frozenset({
    "run_busy_loop", "_process_engine_step", "step", "step_async", "step_with_batch_queue",
    "engine_step", "run_engine_loop", "output_handler", "generate", "chat", "encode", "embed",
    "score", "beam_search", "_run_engine", "_validate_and_add_requests", "_add_request",
    "add_request", "add_request_async", "abort_requests", "execute_model",
    "execute_model_async", "schedule", "_schedule", "update_from_output",
    "create_chat_completion", "create_completion", "create_embedding", "_process_input_queue",
    "process_input_sockets", "process_output_sockets", "sample_tokens",
    "start_worker_execution_loop", "_process_model_outputs", "_handle_client_request",
    "process_outputs", "_process_engine_outputs", "run_output_handler",
    # the model runner's per-step work and the KV connector's per-step hooks
    "_prepare_inputs", "_update_states", "_calc_spec_decode_metadata", "_bookkeeping_sync",
    "propose_draft_token_ids", "_sample", "start_load_kv", "wait_for_layer_load",
    "save_kv_layer", "wait_for_save", "get_finished", "build_connector_meta",
    "update_state_after_alloc", "get_num_new_matched_tokens", "request_finished"})
ENGINE_BUILD_FUNCS = frozenset({
    "__init__", "_initialize_kv_caches", "initialize_cache", "initialize_from_config",
    "initialize_kv_cache", "determine_available_memory", "determine_num_available_blocks",
    "profile_run", "_dummy_run", "_dummy_sampler_run", "capture_model",
    "compile_or_warm_up_model", "load_model", "init_device", "init_worker", "_init_executor",
    "_init_workers_ray", "get_kv_cache_config", "get_kv_cache_spec", "load_weights",
    "wait_for_startup", "wait_for_engine_startup", "make_client", "make_async_mp_client",
    "from_engine_args", "from_vllm_config", "create_engine_config", "create_engine_configs",
    "build_async_engine_client", "build_async_engine_client_from_engine_args",
    "_initialize_model", "get_model", "create_weights", "init_distributed_environment",
    "initialize_model_parallel", "ensure_model_parallel_initialized", "_warmup",
    "warming_up_model", "init_device_env", "check_enough_kv_cache_memory",
    "_check_enough_kv_cache_memory", "get_kv_cache_configs", "estimate_max_model_len",
    "unify_kv_cache_configs", "unify_hybrid_kv_cache_specs", "generate_scheduler_kv_cache_config",
    "_get_kv_cache_config_uniform_type", "_get_kv_cache_config_uniform_page_size",
    "get_max_concurrency_for_kv_cache_config", "initialize_attn_backend",
    "may_reinitialize_input_batch", "_init_device_properties", "register_kv_caches"})
# modules whose code only runs on the serving path (the scheduler, the KV cache books, sampling,
# structured output, output processing): a stack of only these frames is a runtime crash
_RUNTIME_MODULE = re.compile(
    r"^vllm/(?:v1/core/(?:sched/|kv_cache_manager|block_pool|single_type_kv_cache_manager|"
    r"kv_cache_coordinator|kv_cache_utils|encoder_cache_manager)|core/(?:scheduler|block_manager|"
    r"block/|evictor)|v1/structured_output/|v1/sample/|v1/spec_decode/|v1/request\.py|"
    r"v1/engine/(?:output_processor|detokenizer|logprobs)|model_executor/layers/sampler|"
    r"model_executor/guided_decoding/|sequence\.py)")


@dataclass
class TriageReport:
    """What a crash log says. The first eight fields are those of
    ``/work/shared/crashlogs/README.md``; the rest is supporting evidence.

    ``last_vllm_frame``: ``{"module": "vllm/...py", "function": str, "line": int|None}``;
    ``stage``: import | config | engine-build | runtime (None when nothing tells);
    ``exit_kind``: python_exception | cuda_error | signal:SIGKILL | signal:SIGSEGV | ...;
    ``scheduler_state``: running/waiting requests, KV cache usage in percent, ... or None.
    """

    source: str
    exception_type: str | None
    exception_message: str | None
    last_vllm_frame: dict | None
    stage: str | None
    exit_kind: str | None
    vllm_version: str | None
    scheduler_state: dict | None
    root_cause: dict | None = None
    signal: dict | None = None
    plugin_frame: dict | None = None
    crash_path: list[str] = field(default_factory=list)
    cause_chain: list[dict] = field(default_factory=list)
    wrapper_exceptions: list[dict] = field(default_factory=list)
    last_printed_exception: dict | None = None
    version_source: dict | None = None
    stage_reason: str = ""
    notes: list[str] = field(default_factory=list)
    dump: dict | None = None
    lines: int = 0
    #: the crash's traceback is cut off before its exception line (an excerpt, a log cut at its
    #: end), or only vLLM's crash dump is there: ``exception_type`` is None and the frame and
    #: stage come from the frames it shows (from the dump: runtime)
    truncated: bool = False
    #: how the log is cut off before its crash, one line (None when it is not): said first by
    #: the report and by a drafted scenario, whose expectation it leaves open
    cut_off: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON-able data (keys in the order above)."""
        return dict(self.__dict__)


# ---- classification ---------------------------------------------------------------------------
#: lines between a newest-first log's exception line and the first of its frames
REVERSED_GAP = 8

def _embeds_other(rec: ExcRecord, others: list[ExcRecord]) -> bool:
    msg = rec.message
    if len(msg) < 20:
        return False
    for o in others:
        m = o.message
        if o is not rec and len(m) >= 16 and m != msg and m in msg:
            return True
    return False


def is_wrapper(rec: ExcRecord, all_recs: list[ExcRecord]) -> bool:
    """An exception that only reports another one (EngineDeadError, "see the stack trace
    above", or one quoting another exception's message)."""
    return (rec.base in WRAPPER_TYPES or bool(_WRAPPER_MSG.search(rec.message))
            or _embeds_other(rec, all_recs))


def is_cuda(rec: ExcRecord) -> bool:
    """A CUDA/NCCL/cuBLAS error or a CUDA out-of-memory raised as a Python exception."""
    return bool(CUDA_RE.search(rec.message)) or (
        bool(_TORCH_OOM.search(rec.type.split("(")[0])) and rec.type.startswith("torch"))


def is_death_notice(rec: ExcRecord) -> bool:
    """An exception that only reports that another process died (Ray's ActorDiedError)."""
    return rec.base in DEATH_NOTICE_TYPES or "died unexpectedly" in rec.message


def _has_vllm(frames: list[Frame]) -> bool:
    return any(f.module for f in frames)


def _representative(final: ExcRecord, all_recs: list[ExcRecord]) -> ExcRecord:
    """Walk a chain from its last exception towards the cause that matters."""
    rep = final
    seen = set()
    while rep.cause is not None and id(rep) not in seen:
        seen.add(id(rep))
        c = rep.cause
        outside_vllm = not _has_vllm(rep.frames) and (
            _has_vllm(c.frames) or c.standalone or rep.link == "context")
        if (is_wrapper(rep, all_recs) or rep.base in SECONDARY_TYPES or outside_vllm
                or (rep.link == "context" and rep.base == c.base)):
            rep = c
        else:
            break
    return rep


def _priority(rec: ExcRecord, all_recs: list[ExcRecord], last_healthy: int | None) -> int:
    if is_wrapper(rec, all_recs):
        return 0
    if rec.base in SECONDARY_TYPES or rec.level in ("DEBUG", "INFO", "WARNING", "WARN") \
            or rec.logging_error:
        return 1
    if last_healthy is not None and last_healthy > rec.lineno:
        return 1  # the engine served again afterwards: not what killed it
    if rec.side_thread:
        return 2  # a side thread's (or an ignored) exception: the crash is elsewhere if anywhere
    if rec.standalone:
        return 3
    return 4


def choose_root(sc: LogScanner) -> tuple[ExcRecord | None, list[ExcRecord]]:
    """The root-cause exception and the chain finals it was chosen from."""
    recs = sc.exceptions
    causes = {id(r.cause) for r in recs if r.cause is not None}
    finals = [r for r in recs if id(r) not in causes]
    best: tuple[int, int] | None = None
    root = None
    for f in finals:
        rep = _representative(f, recs)
        key = (_priority(rep, recs, sc.last_healthy), -rep.lineno)
        if best is None or key > best:
            best, root = key, rep
    return root, finals


def choose_signal(sc: LogScanner, root: ExcRecord | None) -> tuple[SignalEvent | None, list[Frame]]:
    """The fatal signal that ended the run (None if none counts) and the dying thread's
    frames (faulthandler), outermost first."""
    sigs = [s for s in sc.signals if s.name not in _WEAK_SIGNALS] or list(sc.signals)
    if root is not None and not is_death_notice(root):
        sigs = [s for s in sigs if s.lineno <= root.lineno]
    if not sigs:
        return None, []
    sig = sigs[0]
    with_frames = [s for s in sc.signals if s.frames and s.name == sig.name]
    same_proc = [s for s in with_frames if s.proc == sig.proc]
    frames = (same_proc or with_frames or [sig])[0].frames
    return sig, frames


def _marker_stage(frames: list[Frame]) -> tuple[str | None, Frame | None]:
    for f in frames:
        if not f.module:
            continue
        if f.function in RUNTIME_FUNCS:
            return "runtime", f
        if f.function in ENGINE_BUILD_FUNCS:
            return "engine-build", f
    return None, None


def decide_stage(root: ExcRecord | None, frames: list[Frame], sig_frames: list[Frame],
                 lifecycle: str | None) -> tuple[str | None, str]:
    """``(stage, reason)``; see the module docstring for the rules."""
    vframes = [f for f in frames if f.module]
    inner = vframes[-1] if vframes else None
    if root is not None:
        if root.base in ("ImportError", "ModuleNotFoundError"):
            return "import", f"{root.base} (failed import)"
        if inner is not None and inner.function == "<module>" \
                and sum(f.function == "<module>" for f in frames) >= 2:
            return "import", f"raised while importing {inner.module}"
        if _DEVICE.search(root.message):
            return "engine-build", "device detection failed"
    marker, mf = _marker_stage(frames)
    if root is not None and marker != "runtime" and (
            (inner is not None and _CONFIG_MODULE.match(inner.module or ""))
            or root.base in _CONFIG_TYPES):
        where = f"{inner.module}:{inner.function}" if inner else root.base
        return "config", f"raised by config validation ({where})"
    if marker:
        return marker, f"{mf.module}:{mf.function} in the root-cause stack"
    if sum(f.function == "<module>" for f in frames) >= 2 and inner is not None:
        return "import", f"raised while modules were being imported ({inner.module})"
    if vframes and all(_RUNTIME_MODULE.match(f.module) for f in vframes):
        return "runtime", (f"only serving-path frames ({inner.module}:{inner.function}): the "
                           "scheduler / KV cache code runs on requests")
    marker, mf = _marker_stage(sig_frames)
    if marker:
        return marker, f"{mf.module}:{mf.function} in the dying thread's stack"
    if lifecycle:
        return lifecycle, "how far the log got before the crash (no stage in the frames)"
    return None, "nothing in the log tells"


def scheduler_state(sc: LogScanner, crash_line: int | None) -> dict | None:
    """Running/waiting requests, KV cache usage (%), prefix cache, block counts and
    preemption warnings as the log shows them at the crash (the dump_input.py stats when
    present, else the last stats line before the crash); None when nothing is visible."""
    state: dict[str, Any] | None = None
    if sc.dump is not None and sc.dump.stats:
        st = read_stats(sc.dump.stats)
        if st:
            state = dict(st)
            state["source"] = f"dump_input.py SchedulerStats dump (line {sc.dump.stats_line})"
    if state is None:
        before = [(n, d) for n, d in sc.stats if crash_line is None or n <= crash_line]
        if before:
            n, d = before[-1]
            state = dict(d)
            state["source"] = f"stats line at log line {n}"
    if state is None and not sc.preemption_warnings:
        return None
    state = state or {}
    if sc.gpu_blocks:
        state["num_gpu_blocks"] = sc.gpu_blocks[0]
        if sc.gpu_blocks[1] is not None:
            state["num_cpu_blocks"] = sc.gpu_blocks[1]
    if sc.kv_cache_tokens:
        state["kv_cache_tokens"] = sc.kv_cache_tokens[0]
    state["preemption_warnings"] = bool(sc.preemption_warnings)
    if sc.preemption_warnings:
        state["preemption_warning_count"] = sc.preemption_warnings
        state["first_preemption_line"] = sc.first_preemption_line
    return state


def _frame_dict(f: Frame | None) -> dict | None:
    return None if f is None else {"module": f.module or f.plugin, "function": f.function,
                                   "line": f.line}


def _exc_brief(r: ExcRecord) -> dict:
    inner = innermost_vllm(r.frames)
    where = f"{inner.module}:{inner.function}" if inner else None
    return {"type": r.type, "message": r.message, "where": where, "log_line": r.lineno,
            "process": r.proc or None}


def _crash_path(frames: list[Frame]) -> list[str]:
    out: list[str] = []
    for f in frames:
        if f.module:
            step = f"{f.module}:{f.function}"
            if not out or out[-1] != step:
                out.append(step)
    return out


def _exit_kind(sc: LogScanner, root, sig, cut) -> str | None:
    """python_exception, cuda_error or signal:NAME (a signal printed before the exception, or
    with only a death notice, is how the process died)."""
    if root is not None and is_cuda(root):
        return "cuda_error"
    if sig is not None and (root is None or is_death_notice(root) or sig.lineno <= root.lineno):
        return f"signal:{sig.name}"
    if root is not None:
        return "python_exception"
    if sc.cuda_lines:
        return "cuda_error"
    if cut is not None:
        return "python_exception"  # a Python traceback, whose exception line is lost
    return None


def _version(sc: LogScanner) -> tuple[str | None, dict | None]:
    """The release the log names, from its most trusted source, and where."""
    for tier in sorted(sc.versions):
        lineno, v, text = sc.versions[tier]
        return v, {"log_line": lineno, "text": text}
    return None, None


def _cause_chain(root) -> list[dict]:
    """The root cause's ``__cause__`` / ``__context__`` chain, at most 16 deep."""
    chain: list[dict] = []
    c = root.cause if root is not None else None
    while c is not None and len(chain) < 16:
        chain.append({"type": c.type, "message": c.message,
                      "last_vllm_frame": _frame_dict(innermost_vllm(c.frames)),
                      "link": root.link if c is root.cause else None})
        c = c.cause
    return chain


def _root_cause(root, cut) -> dict | None:
    """Where the root cause is: its exception line, or the cut traceback's first line."""
    if root is not None:
        return {"log_line": root.lineno, "process": root.proc or None, "logger": root.site,
                "traceback_line": root.tb_lineno, "standalone": root.standalone}
    if cut is not None:
        return {"log_line": cut.lineno, "process": cut.proc or None, "logger": None,
                "traceback_line": cut.lineno, "standalone": False, "truncated": True}
    return None


def _notes(sc: LogScanner, root, sig, cut, reversed_tb) -> list[str]:
    """What a reader of the report should know about the log itself: missing processes, cut
    tracebacks, bytes that are not UTF-8, NUL padding dropped, what was not kept."""
    notes: list[str] = []
    if root is not None and is_wrapper(root, sc.exceptions):
        notes.append("only exceptions that report another one are in the log: the root cause "
                     "was printed by another process (EngineCore, a worker) whose output is "
                     "missing here")
    if root is None and sig is None and sc.death_lines:
        n, proc, text = sc.death_lines[0]
        notes.append(f"a vLLM process died without a Python traceback or signal in the log (line "
                     f"{n}: {text[:120]}): look for the OOM killer (dmesg) or a core dump")
    if root is not None and root.standalone and reversed_tb is None:
        notes.append("the root cause is a bare exception line: its traceback is not in the log")
    if sc.self_kill_lines:
        notes.append(f"vLLM's 'fatal signal from worker processes' notice at line "
                     f"{sc.self_kill_lines[0]}: a following bare 'Killed' is vLLM killing its own "
                     "process group, not the OOM killer")
    if cut is not None:
        notes.append(f"the crash's traceback (line {cut.lineno}"
                     + (f", {cut.proc}" if cut.proc else "") + ") is cut off before its exception "
                     "line: the frames it shows are reported; paste the lines that follow it for "
                     "the exception")
    elif sc.truncated_tracebacks:
        notes.append(f"{len(sc.truncated_tracebacks)} traceback(s) cut off before their exception "
                     f"line (first at line {sc.truncated_tracebacks[0]})")
    if sc.not_utf8[0]:
        notes.append(f"{sc.not_utf8[0]} line(s) hold bytes that are not UTF-8, read as U+FFFD "
                     f"(first at line {sc.not_utf8[1]})")
    if sc.nul_padding[0]:
        where = "before the text" if sc.nul_padding[1] == 1 else f"first at line {sc.nul_padding[1]}"
        notes.append(f"{sc.nul_padding[0]} NUL bytes of padding dropped ({where}: a copy from a "
                     "container or a log rotated under its writer)")
    if sc.exceptions_dropped:
        notes.append(f"{sc.exceptions_dropped} exceptions from the middle of the log not kept")
    if root is not None and root.frames_dropped:
        notes.append(f"{root.frames_dropped} frames of a deep traceback not kept")

    return notes


def _open_at_end(sc: LogScanner, root):
    """The traceback of ``root``'s process that the log ends inside (cut before its exception
    line, after ``root`` and after every finished exception), else ``None``."""
    if not sc.truncated_frames:
        return None
    last = sc.truncated_frames[-1]
    latest = max((e.lineno for e in sc.exceptions), default=0)
    if last.lineno > max(root.lineno, latest) and last.proc == root.proc and not last.side_thread:
        return last
    return None


def analyze(sc: LogScanner, source: str) -> TriageReport:
    """Turn a finished :class:`LogScanner` into a :class:`TriageReport` (no I/O)."""
    root, finals = choose_root(sc)
    cut = None
    if root is None or _priority(root, sc.exceptions, sc.last_healthy) <= 1:
        # only a wrapper or a consequence (or nothing) finished: a traceback cut off before its
        # exception line that shows vLLM frames is the better evidence of the crash
        # (printed before it, or by another process: a traceback that the same process
        # prints after its wrapper is the wrapper's fallout)
        cands = [t for t in sc.truncated_frames if _has_vllm(t.frames) and (
            root is None or t.lineno < root.lineno or t.proc != root.proc)]
        cut = next((t for t in cands if not t.side_thread), None) or next(iter(cands), None)
        if cut is not None:
            root = None
    reversed_tb = None
    if root is not None and root.standalone:
        # a log in reverse order (a newest-first viewer, lines pasted bottom-up): the
        # exception line comes first and its frames right after it, with no exception line
        # (up to REVERSED_GAP lines apart: the caret and source lines of the innermost frame,
        # CUDA's notes, come between them in that order), with no other exception in between
        nxt = min((e.lineno for e in sc.exceptions if e.proc == root.proc
                   and e.lineno > root.lineno), default=None)
        reversed_tb = next((t for t in sc.truncated_frames if t.proc == root.proc
                            and 0 < t.lineno - root.lineno <= REVERSED_GAP
                            and (nxt is None or t.lineno < nxt) and _has_vllm(t.frames)), None)
    sig, sig_frames = choose_signal(sc, root)
    notes: list[str] = []
    d = sc.dump
    # vLLM's crash dump (dump_input.py) with no traceback or signal after it: EngineCore writes
    # it only when a step raised, so the log shows a crash whose report is cut off
    dump_only = (root is None and cut is None and sig is None and d is not None
                 and bool(d.config or d.scheduler_output or d.stats))

    exit_kind = _exit_kind(sc, root, sig, cut)

    frames = root.frames if root is not None else (cut.frames if cut is not None else [])
    if reversed_tb is not None:
        # newest line first: the frames read innermost first, so turn them back
        frames = list(reversed(reversed_tb.frames))
        notes.append(f"the frames of the exception at line {root.lineno} follow it (line "
                     f"{reversed_tb.lineno} on): the log reads newest line first")
    if exit_kind and exit_kind.startswith("signal:") and _has_vllm(sig_frames):
        frames = sig_frames
    elif not _has_vllm(frames) and (root is None or is_death_notice(root)) and _has_vllm(sig_frames):
        frames = sig_frames
    inner = innermost_vllm(frames)
    plugin = innermost_plugin(frames)

    lifecycle = root.lifecycle if root is not None else (
        sig.lifecycle if sig else (cut.lifecycle if cut is not None else sc.lifecycle))
    stage, reason = decide_stage(root, frames, sig_frames, lifecycle)
    if dump_only:
        stage, reason = "runtime", (f"vLLM's crash dump at line {d.lineno} (dump_input.py): "
                                    "EngineCore writes it only when a step raised")
        notes.append("the log holds vLLM's crash dump but not the exception after it (cut "
                     "off?): paste the lines that follow the dump for the root cause")
    elif stage is None and d is not None and (crash_at := (
            root.lineno if root is not None else cut.lineno if cut is not None else None)) \
            and d.lineno < crash_at:
        # the frames tell no stage (an RPC wait, a connector hook), but vLLM dumped the crashed
        # step's batch before this crash: EngineCore does that only for a step that raised
        stage, reason = "runtime", (f"vLLM's crash dump at line {d.lineno} (dump_input.py) "
                                    "before the crash: EngineCore writes it only when a step "
                                    "raised")

    version, version_source = _version(sc)

    crash_line = root.lineno if root is not None else (
        sig.lineno if sig else (sc.death_lines[0][0] if sc.death_lines else (
            cut.lineno if cut is not None else None)))
    chain = _cause_chain(root)
    wrappers = [_exc_brief(r) for r in sc.exceptions
                if r is not root and is_wrapper(r, sc.exceptions)][:16]
    last = sc.exceptions[-1] if sc.exceptions else None
    last_printed = _exc_brief(last) if last is not None and last is not root else None

    notes += _notes(sc, root, sig, cut, reversed_tb)
    state = scheduler_state(sc, crash_line)
    dump_cut = _dump_cut_warning(d, state)
    if dump_cut:
        notes.insert(0, f"warning: {dump_cut}")
    cut_off = None
    if dump_only:
        cut_off = (f"the log ends {'inside' if d.output_open else 'after'} vLLM's crash dump "
                   f"(line {d.lineno}), before the exception that made EngineCore write it: the "
                   "crash itself is not in the log")
    elif cut is not None:
        cut_off = (f"the crash's traceback (line {cut.lineno}) is cut off before its exception "
                   "line: the exception is not in the log")
    elif root is not None and (tail := _open_at_end(sc, root)) is not None:
        # a chained exception: the inner one finished, the log ends inside the traceback that
        # was leading to the outer one (e.g. `head -c` through "During handling of ...")
        cut_off = (f"the log ends inside a traceback (line {tail.lineno}) printed after "
                   f"{root.type} (line {root.lineno}): the exception it led to is not in the "
                   f"log, and {root.type} may be its cause rather than the crash")

    dump_info = None
    if sc.dump is not None:
        dump_info = {"log_line": sc.dump.lineno, "config": sc.dump.config is not None,
                     "scheduler_output": sc.dump.scheduler_output is not None,
                     "stats": sc.dump.stats is not None}

    return TriageReport(
        source=source,
        exception_type=root.type if root is not None else None,
        exception_message=root.message if root is not None else None,
        last_vllm_frame=_frame_dict(inner) if inner else None,
        stage=stage,
        exit_kind=exit_kind,
        vllm_version=version,
        scheduler_state=state,
        root_cause=_root_cause(root, cut),
        signal=None if sig is None else {"name": sig.name, "source": sig.source,
                                         "log_line": sig.lineno, "process": sig.proc or None,
                                         "text": sig.text},
        plugin_frame=_frame_dict(plugin) if plugin else None,
        crash_path=_crash_path(frames),
        cause_chain=chain,
        wrapper_exceptions=wrappers,
        last_printed_exception=last_printed,
        version_source=version_source,
        stage_reason=reason,
        notes=notes,
        dump=dump_info,
        lines=sc.lines,
        truncated=cut is not None or dump_only,
        cut_off=cut_off,
    )


def _dump_cut_warning(d, state: dict | None) -> str | None:
    """The warning for a dumped SchedulerOutput the log cuts off mid-line (the requests read
    from it against the count announced: :meth:`~vllm_repro.triage.dump.SchedulerOutputDump.
    cut_warning`), else None. Parsed here only when the scanner saw the dump left open."""
    if d is None or not d.output_open or not d.scheduler_output:
        return None
    from .dump import read_scheduler_output

    so = read_scheduler_output(d.scheduler_output)
    if so is None:
        return None
    state = state or {}
    return so.cut_warning(d.output_line, state.get("running"), state.get("source"))
