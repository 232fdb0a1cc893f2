"""One pass over a crash log: collect the evidence a vLLM debugger reads.

:class:`LogScanner` is fed normalised lines one at a time (bounded memory) and collects:

- Python exceptions with their traceback frames, kept apart per stream (process prefix +
  logger call site, see :mod:`.normalize`) so interleaved tracebacks of several processes do not
  mix; chained exceptions (``The above exception was the direct cause...`` /
  ``During handling of the above exception...``) are linked to their cause. Headerless
  tracebacks (a log cut mid-traceback), unindented ones and IPython/Colab tracebacks are read too.
- fatal signals: faulthandler (``Fatal Python error: Segmentation fault`` with its
  ``Current thread ... (most recent call first)`` stack), absl/Ray ``*** SIGSEGV received``,
  ``terminate called after throwing`` (SIGABRT), shell reports (``Segmentation fault (core
  dumped)``, ``Killed``), exit codes (-9/-11/-6, 137/139/134), the kernel OOM killer; and vLLM's
  own ``Got fatal signal from worker processes`` notice, after which a bare ``Killed`` is vLLM
  killing its own process group, not a SIGKILL from outside. Each is read only in the shape a
  dying process prints it (see ``_LEAD``), never from prose that mentions a signal.
- CUDA error lines outside tracebacks, the vLLM version strings, scheduler stats lines
  (V1 ``loggers.py`` and V0 ``metrics.py``), ``# GPU blocks`` / KV cache size lines, preemption
  warnings, the server arguments, the ``dump_input.py`` dump (config string, SchedulerOutput,
  SchedulerStats), and the engine's lifecycle (config -> engine-build -> runtime) as logged.

Memory is bounded whatever the log size: at most :data:`MAX_EXCEPTIONS` exceptions (the first
and the latest), :data:`MAX_FRAMES` frames a traceback, the latest dump and stats lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version

from .frames import Frame, plugin_module, vllm_module
from .normalize import normalize

MAX_EXCEPTIONS = 160
MAX_FRAMES = 320
MAX_SIGNALS = 64
MAX_STREAMS = 4096
MAX_DUMP_CHARS = 32 * 1024 * 1024


@dataclass(eq=False)
class ExcRecord:
    """A Python exception seen in the log.

    ``type`` as printed (``vllm.v1.engine.exceptions.EngineDeadError``), ``message`` its first
    line (``""`` when bare), ``frames`` outermost first, ``lineno`` the exception line's line
    number, ``proc``/``site``/``level`` where it was printed, ``standalone`` when no traceback
    came with it, ``cause`` the exception it was raised from (``link='cause'``) or while
    handling (``link='context'``), ``lifecycle`` the engine stage the log had reached.
    """

    type: str
    message: str
    frames: list[Frame]
    lineno: int
    proc: str
    site: str | None
    level: str | None
    standalone: bool = False
    #: printed for a side thread (``Exception in thread ...``) or an ignored exception
    #: (``Exception ignored in: ...``), not by the flow that crashed
    side_thread: bool = False
    cause: "ExcRecord | None" = None
    link: str | None = None
    lifecycle: str | None = None
    frames_dropped: int = 0
    tb_lineno: int | None = None
    ipython: bool = False
    #: printed by ``logging.Handler.handleError`` ("--- Logging error ---"): a log record that
    #: failed to format, caught by the logging module; the process went on
    logging_error: bool = False

    @property
    def base(self) -> str:
        """The class name without module or Ray's ``(Inner)`` suffix."""
        return self.type.split("(")[0].rsplit(".", 1)[-1].rsplit(":", 1)[-1]


@dataclass(eq=False)
class SignalEvent:
    """A fatal signal (or exit status) seen in the log: ``name`` (``SIGSEGV``), ``source``
    (faulthandler, fatal-signal, c++-abort, shell, exit-code, oom-killer), the line, the
    process prefix, and for faulthandler the dying thread's frames (outermost first)."""

    name: str
    source: str
    lineno: int
    proc: str
    text: str
    frames: list[Frame] = field(default_factory=list)
    lifecycle: str | None = None


@dataclass(eq=False)
class TruncatedTraceback:
    """A traceback cut off before its exception line (an excerpt, a log cut at its end): where
    it starts, the frames it shows (outermost first), the process and engine stage."""

    lineno: int
    frames: list[Frame]
    proc: str
    lifecycle: str | None
    side_thread: bool = False


@dataclass
class Dump:
    """What ``vllm/logging_utils/dump_input.py`` (``_dump_engine_exception``) logged when the
    engine crashed: the ``VllmConfig`` string, the ``SchedulerOutput`` and ``SchedulerStats``
    as text (parsed later), with their line numbers."""

    lineno: int
    version: str | None = None
    config: str | None = None
    config_line: int | None = None
    scheduler_output: str | None = None
    output_line: int | None = None
    stats: str | None = None
    stats_line: int | None = None
    #: the log ended inside the SchedulerOutput (its brackets still open: cut off mid-dump)
    output_open: bool = False


_SIGNUMS = {1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE",
            9: "SIGKILL", 11: "SIGSEGV", 13: "SIGPIPE", 15: "SIGTERM"}
_FATAL_NAMES = {"Segmentation fault": "SIGSEGV", "Segfault": "SIGSEGV", "Aborted": "SIGABRT",
                "Bus error": "SIGBUS",
                "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL",
                "Killed": "SIGKILL"}

# ---- traceback grammar ---------------------------------------------------------------------
_TB_HEADER = "Traceback (most recent call last)"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+),? in (?P<func>.+?)\s*$')
_FRAME_NOLINE = re.compile(r'^\s*File "(?P<file>[^"]*)", in (?P<func>.+?)\s*$')
# an abbreviated frame as people retype or trim it: "vllm/v1/core/sched/scheduler.py, in
# schedule", "scheduler.py:432 in schedule", 'File vllm/x.py, line 3, in f' (no quotes)
_FRAME_ABBR = re.compile(r'^\s*(?:File\s+)?"?(?P<file>[\w./\\~:-]*\w\.py)"?'
                         r'(?:(?:,\s*line\s+|:)(?P<line>\d+))?,?\s+in\s+(?P<func>[\w<>.]+)\s*$')
# a traceback Python prints for a thread or a __del__ that is not the main flow's crash
_SIDE = re.compile(r"^(?:Exception in thread |Exception ignored in: |Exception ignored on |"
                   r"Task exception was never retrieved)")
_IPY_HEADER = re.compile(r"^([A-Za-z_][\w.]*)\s{2,}Traceback \(most recent call last\)")
_IPY_FRAME = re.compile(
    r"^(?:\[(?P<a>[^\]]+)\]\([^)]*\)|(?P<b>\S+\.py|<[^>]+>)) in (?P<f><[^>]*>|[\w.]+)(?:\(|\s*$)"
    r"|^File (?P<c>\S.*?):(?P<l>\d+)(?:, in (?P<g>[\w<>.]+))?")
_CARET = re.compile(r"^\s*[\^~]+[\s\^~]*$")
_EXC_LINE = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\([\w.]+\))?)(?:: ?(.*))?$")
_EXC_SUFFIXES = ("Error", "Exception", "Exit", "Interrupt", "Failure", "Fault", "Warning",
                 "Timeout", "Died", "Abort", "Aborted", "Failed", "Exceeded")
_EXC_NAMES = {"StopIteration", "StopAsyncIteration", "KeyboardInterrupt", "SystemExit",
              "GeneratorExit", "CancelledError", "Exception", "BaseException"}
_NOT_STANDALONE = {"Error", "Failure", "Fault", "Timeout", "Abort", "Aborted", "Died"}
_FAULT_HEADER = re.compile(
    r"^(Current thread|Stack|Thread) ?(?:0x[0-9a-fA-F]+)?(?: \[[^\]]*\])? "
    r"\(most recent call first\):")

# ---- signals and CUDA -----------------------------------------------------------------------
# Signal evidence is read only in the shapes a dying process prints, never from a bare mention
# of a signal: a whole line (faulthandler, the shell), a machine-made tail (absl's "received at
# time=", torch's "received by PID"), a key=value exit code, or a short clause at the start of a
# line that ends at the signal or code ("Process 1234 got signal: 11", "Worker proc X exited with
# exit code -9"). Prose about signals ("a SIGSEGV in a worker", "exit codes -9/-11") is not one.
# A line's lead: "[host:pid:tid] ", glog's "[time E pid] logging.cc:484: ", "SomeError: "
_LEAD = r"^(?:\[[^\]]{1,160}\]:?\s*){0,4}(?:[\w.<>-]{1,120}(?::\d+)?:\s*)?"
_CLAUSE = _LEAD + r"(?:[^\s!?`]*[^\s.!?`]\s+){0,6}?"  # + up to six words, none ending a sentence
_END = r"(?=\s*(?:$|[.,;:()\[\]]))"
_FATAL_PY = re.compile(_LEAD + r"(?:Fatal Python error: (Segmentation fault|Aborted|Bus error|"
                       r"Floating point exception|Illegal instruction)"
                       r"|!!+ (Segfault|Aborted|Bus error) encountered(?: !+)?)\s*$")
_SIG_SHAPES = (
    re.compile(r"\*\*\* (SIG[A-Z]+) (?:\(@0x[0-9a-fA-F]+\) )?received (?:at time=|by PID )"),
    re.compile(r"\bSignal \d+ \((SIG[A-Z]+)\) received by PID \d"),  # torch elastic
    re.compile(r"<Signals\.(SIG[A-Z]+): \d+>"),  # subprocess: died with <Signals.SIGSEGV: 11>
    re.compile(_CLAUSE + r"(?:received|caught|got|killed by|died with|died of|terminated by) "
               r"(?:fatal )?signal:? ?(?:Signals\.)?(SIG[A-Z]+|\d{1,2})" + _END, re.I),
)
_NAMES = (r"(Segmentation fault|Aborted|Bus error|Floating point exception|Illegal instruction"
          r"|Killed)")
_SHELL = re.compile(r"^(?:[\w/.-]+: line \d+: +\d+ +" + _NAMES + r"(?:\s+\(core dumped\))?"
                    r"(?:\s+\S.*)?|" + _NAMES + r"(?: \(core dumped\))?)\s*$")
_TERMINATE = re.compile(_LEAD + r"terminate called (?:after throwing an instance of|without an "
                        r"active exception|recursively)")
_EXIT_KEY = r"(?:exit[ _]?code|exitcode|exit[ _]status|return[ _]?code|returncode)"
_EXIT_SHAPES = (
    re.compile(r"\b" + _EXIT_KEY + r"\s*[=:]\s*\(?(-?\d{1,3})\b", re.I),  # exitcode=-11
    re.compile(r"non-zero exit status (-?\d{1,3})\b"),  # subprocess.CalledProcessError
    re.compile(r"Failed core proc\(s\): \{[^}]*?:\s*(-\d{1,3})\b"),  # vLLM V1 engine startup
    re.compile(_CLAUSE + r"(?:(?:exited|terminated|died|finished|failed|stopped|crashed|completed)"
               r" with (?:an? )?(?:(?:exit|return) )?(?:code|status)|exited with|" + _EXIT_KEY
               + r")[ =:]*\(?(-?\d{1,3})" + _END, re.I),
)
_OOM_KILL = re.compile(r"Out of memory: Kill(?:ed)? process \d|\boom-kill:|invoked oom-killer:|"
                       r"oom_reaper: reaped process \d|Memory cgroup out of memory: Kill|"
                       r"\b[Rr]eason[\"']?\s*[:=]\s*[\"']?OOMKilled\b|\"OOMKilled\": ?true|"
                       r"was killed due to (?:memory pressure|the node running low on memory)")
_SELF_KILL = re.compile(r"got fatal signal from worker processes, shutting down", re.I)
_DIED = re.compile(r"\b(?:Engine core proc|Worker proc|Worker process|Engine process|"
                   r"EngineCore)\b[^.]{0,60}? died unexpectedly|worker died or was killed", re.I)
CUDA_RE = re.compile(
    r"CUDA error:|CUDA out of memory|cuda runtime error|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|"
    r"cuDNN error:|NCCL error|ncclUnhandledCudaError|an illegal memory access|device-side assert"
    r" triggered|misaligned address|unspecified launch failure|HIP error:|no CUDA-capable device"
    r"|CUDA driver version is insufficient|cudaError[A-Z]\w+|CUDA kernel errors might be")

# ---- versions -------------------------------------------------------------------------------
_V = r"v?(\d+\.\d+(?:\.\d+)*(?:\.?(?:post|dev|rc|a|b)\d+)*(?:\+[\w.]+)?)"
_VERSION_TIERS = [
    re.compile(r"LLM engine \(" + _V + r"\)"),
    re.compile(r"\bvLLM (?:OpenAI |batch processing )?(?:API )?(?:server )?[Vv]ersion\s*[:=]?\s*" + _V
               + r"|\bvllm[ _-]version['\"]?\s*[:=]\s*['\"]?" + _V + r"|Welcome to vLLM!? " + _V
               + r"|\u2588\s+version\s+" + _V),
    re.compile(r"\bvllm\s*==\s*" + _V + r"|vllm-openai:" + _V + r"|\bvllm-" + _V
               + r"(?=\.dist-info|\.tar|-cp3|-py3|\+)|^vllm\s{2,}" + _V + r"\s*$"),
    # how people write it in a report or a package list: "Observed with vLLM 0.28.0",
    # "vLLM `0.28.0rc2`", "- vllm 0.19.1", conda's "vllm  0.9.1  pypi_0  pypi", "vllm: 0.9.1"
    re.compile(r"(?i:\bvllm)(?:\s+version)?\s*[:=]?\s*`?" + _V + r"`?(?![\w.-])"),
]
#: pip show's "Name: vllm" then "Version: X" (the version is read on the line after)
_PIP_SHOW_NAME = re.compile(r"^Name:\s*vllm\s*$", re.I)
_PIP_SHOW_VERSION = re.compile(r"^Version:\s*" + _V + r"\s*$")

# ---- scheduler state, config, lifecycle ------------------------------------------------------
_STATS_REQS = re.compile(r"\b(Running|Waiting|Swapped|Pending): (\d+) reqs")
_STATS_KV = re.compile(r"\b(GPU |CPU )?KV cache usage: ([\d.]+)%")
_STATS_PREFIX = re.compile(r"Prefix cache hit rate: (?:GPU: )?([\d.]+)%")
_GPU_BLOCKS = re.compile(r"# (?:GPU|gpu|cuda|CUDA|npu|NPU|xpu|XPU|CPU) blocks: (\d+)"
                         r"(?:, # CPU blocks: (\d+))?")
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_CHUNKED = re.compile(r"max_num_batched_tokens=(\d+)")
_PREEMPT = re.compile(r"preempt", re.I)
_LIFECYCLE = [
    (re.compile(r"Application startup complete|Uvicorn running on|Starting vLLM API server"
                r"|seconds to start vllm engine|Received request|Added request|Avg prompt "
                r"throughput|\"(?:POST|GET) /v1/|Processed prompts|Adding requests"), "runtime"),
    (re.compile(r"Initializing an? (?:V1 )?LLM engine|Starting to load model|Loading model "
                r"weights|Loading weights took|Model loading took|Loading safetensors|# \w+ "
                r"blocks: \d|KV cache size:|Maximum concurrency|Capturing (?:the model|CUDA "
                r"graph|cudagraph)|Graph capturing finished|torch\.compile takes|Memory "
                r"profiling takes|init engine \(profile|Compiling a graph|Available KV cache "
                r"memory|Using .* backend"), "engine-build"),
    (re.compile(r"args: Namespace\(|non-default args:|Automatically detected platform|This "
                r"model supports multiple tasks|Resolved architecture|Using max model len"
                r"|Chunked prefill is enabled"), "config"),
]
_STAGE_ORDER = {"config": 0, "engine-build": 1, "runtime": 2}
_QUOTED = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"")

def is_exception_name(name: str) -> bool:
    """Whether ``name`` (``torch.OutOfMemoryError``, ``ray.exceptions.RayTaskError(ValueError)``)
    looks like a Python exception class."""
    base = name.split("(")[0].rsplit(".", 1)[-1]
    return base[:1].isupper() and (base.endswith(_EXC_SUFFIXES) or base in _EXC_NAMES)


def _class_like(name: str) -> bool:
    """``module.Class`` or ``CamelCase`` (two capitals): an exception class with an unusual
    name (``torch._dynamo.exc.Unsupported``, ``BackendCompilerFailed``), not a word."""
    base = name.split("(")[0].rsplit(".", 1)[-1]
    return base[:1].isupper() and ("." in name or sum(c.isupper() for c in base) >= 2)


def _sig_name(token: str) -> str | None:
    if token.isdigit():
        return _SIGNUMS.get(int(token))
    token = token.upper()
    return token if token.startswith("SIG") else None


def _exit_code_signal(code: int) -> str | None:
    if code < 0:
        return _SIGNUMS.get(-code)
    if 128 < code < 160:
        return _SIGNUMS.get(code - 128)
    return None


def bracket_depth(text: str, depth: int = 0) -> int:
    """``depth`` plus the opening minus closing brackets of ``text``, quoted strings ignored."""
    t = _QUOTED.sub("", text)
    return depth + (t.count("(") + t.count("[") + t.count("{")
                    - t.count(")") - t.count("]") - t.count("}"))


class _Stream:
    """Traceback state of one stream (process prefix + logger site)."""

    __slots__ = ("mode", "frames", "dropped", "frame_indent", "expect_source", "ipython",
                 "ipython_type", "pending_link", "last_exc", "tb_lineno", "fault", "dump_open",
                 "side", "side_pending", "proc")

    IDLE, TB, EXC, FAULT, FAULT_OTHER = range(5)

    def __init__(self, proc: str = "") -> None:
        self.proc = proc
        self.mode = self.IDLE
        self.frames: list[Frame] = []
        self.dropped = 0
        self.frame_indent = 0
        self.expect_source = False
        self.ipython = False
        self.ipython_type: str | None = None
        self.pending_link: str | None = None
        self.side = False  # the traceback being read is a side thread's
        self.side_pending = False  # "Exception in thread ...:" seen, its traceback comes next
        self.last_exc: ExcRecord | None = None
        self.tb_lineno: int | None = None
        self.fault: SignalEvent | None = None
        self.dump_open: int | None = None  # bracket depth of an unfinished SchedulerOutput

    def start_tb(self, lineno: int, ipython: bool = False, ipython_type: str | None = None):
        self.mode = self.TB
        self.frames = []
        self.dropped = 0
        self.expect_source = False
        self.ipython = ipython
        self.ipython_type = ipython_type
        self.tb_lineno = lineno

    def add_frame(self, frame: Frame, indent: int) -> None:
        if len(self.frames) >= MAX_FRAMES:
            del self.frames[64]  # keep the outermost 64 and the innermost frames
            self.dropped += 1
        self.frames.append(frame)
        self.frame_indent = indent
        self.expect_source = True


class LogScanner:
    """Collects evidence from log lines fed in order; see the module docstring.

    Usage: ``sc = LogScanner(); for n, line in iter_lines(path): sc.feed(n, line);
    sc.finish()``. Attributes hold the evidence (lists are bounded).
    """

    def __init__(self, prefix: re.Pattern | None = None) -> None:
        #: a per-line prefix learned from the log's head (:func:`.normalize.learn_prefix`)
        self.prefix = prefix
        self.lines = 0
        self.exceptions: list[ExcRecord] = []
        self._in_logging_error = False  # inside a "--- Logging error ---" block
        self.exceptions_dropped = 0
        self.signals: list[SignalEvent] = []
        self.self_kill_lines: list[int] = []
        self.death_lines: list[tuple[int, str, str]] = []  # "... died unexpectedly" (line, proc, text)
        self.cuda_lines: list[tuple[int, str, str]] = []  # (lineno, proc, text)
        # the first version string of each strength tier: tier -> (lineno, version, text)
        self.versions: dict[int, tuple[int, str, str]] = {}
        self._pip_show: int | None = None  # the line of pip show's "Name: vllm"
        self.stats: list[tuple[int, dict]] = []
        self.gpu_blocks: tuple[int, int | None, int] | None = None  # (gpu, cpu, lineno)
        self.kv_cache_tokens: tuple[int, int] | None = None  # (tokens, lineno)
        self.max_num_batched_tokens: int | None = None
        self.preemption_warnings = 0
        self.first_preemption_line: int | None = None
        self.args: tuple[int, str] | None = None
        #: the engine's start-up banner config (``Initializing an LLM engine (vX) with config:
        #: ...``, V0's ``LLMEngine.__init__`` and V1's ``EngineCore``): (lineno, the config text)
        self.engine_config: tuple[int, str] | None = None
        self.dump: Dump | None = None
        self.lifecycle: str | None = None
        self.lifecycle_line: int | None = None
        self.last_healthy: int | None = None
        self.truncated_tracebacks: list[int] = []
        #: the frames of tracebacks cut off before their exception line (the first 16)
        self.truncated_frames: list[TruncatedTraceback] = []
        #: lines whose bytes were not UTF-8 (read as U+FFFD): (count, first line)
        self.not_utf8: tuple[int, int | None] = (0, None)
        self.nul_padding: tuple[int, int | None] = (0, None)
        self._streams: dict[tuple[str, str | None], _Stream] = {}
        self._prev_tb: tuple[int, tuple[str, str | None]] | None = None
        #: (line, stream key) of the last line of a dump still open (a wrapped dump goes on)
        self._dump_prev: tuple[int, tuple[str, str | None]] | None = None

    # ---- helpers ----------------------------------------------------------------------------
    def _stream(self, key: tuple[str, str | None]) -> _Stream:
        s = self._streams.get(key)
        if s is None:
            if len(self._streams) >= MAX_STREAMS:
                for k in [k for k, v in self._streams.items() if v.mode == _Stream.IDLE][:1024]:
                    del self._streams[k]
            s = self._streams[key] = _Stream(key[0])
        return s

    def _record_exc(self, rec: ExcRecord) -> None:
        rec.lifecycle = self.lifecycle
        if len(self.exceptions) >= MAX_EXCEPTIONS:
            del self.exceptions[32]  # keep the first 32 and the latest ones
            self.exceptions_dropped += 1
        self.exceptions.append(rec)

    def _record_signal(self, name: str, source: str, lineno: int, proc: str, text: str) -> SignalEvent:
        ev = SignalEvent(name, source, lineno, proc, text.strip()[:240], lifecycle=self.lifecycle)
        if len(self.signals) >= MAX_SIGNALS:
            del self.signals[MAX_SIGNALS // 2]
        self.signals.append(ev)
        return ev

    def _finish_tb_truncated(self, s: _Stream) -> None:
        if s.mode == _Stream.TB and s.tb_lineno is not None and len(self.truncated_tracebacks) < 64:
            self.truncated_tracebacks.append(s.tb_lineno)
            if s.frames and len(self.truncated_frames) < 16:
                self.truncated_frames.append(TruncatedTraceback(
                    s.tb_lineno, s.frames, s.proc, self.lifecycle, s.side))
        s.mode = _Stream.IDLE
        s.frames = []

    def _exception(self, s: _Stream, m: re.Match, lineno: int, key, level, standalone: bool) -> None:
        typ, msg = m.group(1), (m.group(2) or "").strip()
        rec = ExcRecord(typ, msg, s.frames if not standalone else [], lineno, key[0], key[1],
                        level, standalone=standalone, frames_dropped=s.dropped,
                        tb_lineno=s.tb_lineno if not standalone else None, ipython=s.ipython)
        if self._in_logging_error:
            rec.logging_error = True
        rec.side_thread = s.side
        if s.pending_link and s.last_exc is not None:
            rec.cause, rec.link = s.last_exc, s.pending_link
        s.pending_link = None
        s.last_exc = rec
        s.mode = _Stream.EXC
        s.frames = []
        s.dropped = 0
        self._record_exc(rec)

    # ---- the per-line work --------------------------------------------------------------------
    def feed(self, lineno: int, raw: str) -> None:
        """Read one log line (without its terminator)."""
        self.lines = lineno
        proc, level, site, text = normalize(raw, self.prefix)
        if text.strip() == "--- Logging error ---":
            # logging.Handler.handleError: the chain that follows, up to its closing line, is
            # the record's formatting failure (with the exception being logged as its context)
            self._in_logging_error = True
        elif self._in_logging_error and text.strip().startswith("Use the traceback above"):
            self._in_logging_error = False
        key = (proc, site)
        prev = self._prev_tb
        if prev is not None and site is None and level is None and prev[0] == lineno - 1 \
                and prev[1][0] == proc:
            # a logger that put its header on the first line only: the raw lines that follow
            # continue its traceback
            raw_stream = self._streams.get(key)
            if raw_stream is None or raw_stream.mode != _Stream.TB:
                key = prev[1]
        dprev = self._dump_prev
        wrapped = False
        if dprev is not None and dprev[0] == lineno - 1 and site is None and level is None \
                and (proc == "" or proc == dprev[1][0]) and key != dprev[1]:
            # a dump line wrapped by a paste or a viewer: the rest comes without the prefix,
            # cut anywhere, mid-word even ("total_num_sche" / "duled_tokens=13")
            ds = self._streams.get(dprev[1])
            if ds is not None and ds.dump_open is not None:
                key, wrapped = dprev[1], True
        s = self._streams.get(key)
        if s is not None and s.dump_open is not None:
            self._dump_continues(s, text.strip(), "" if wrapped else " ")
            self._dump_prev = (lineno, key) if s.dump_open is not None else None
            return
        self._traceback_line(lineno, key, level, text)
        s = self._streams.get(key)
        self._prev_tb = (lineno, key) if key[1] is not None and s is not None \
            and s.mode == _Stream.TB else None
        self._evidence_line(lineno, proc, level, key, text)

    def _dump_continues(self, s: _Stream, st: str, joint: str = " ") -> None:
        """A multi-line SchedulerOutput (numpy arrays print over several lines, each its own
        log line: ``joint`` a space) goes on; a wrapped line goes on with ``joint`` empty."""
        d = self.dump
        if d is not None and d.scheduler_output is not None \
                and len(d.scheduler_output) < MAX_DUMP_CHARS:
            d.scheduler_output += joint + st
        s.dump_open = bracket_depth(st, s.dump_open or 0)
        if s.dump_open <= 0:
            s.dump_open = None

    def _traceback_line(self, lineno: int, key, level: str | None, text: str) -> None:
        """One line for the traceback state machine of its process (``key``): a blank line ends
        an exception block; then, in turn, the structural lines (headers, chain links,
        faulthandler), faulthandler's frames, frame lines, the rest of an open traceback, and a
        standalone exception line. Each part returns True when it consumed the line."""
        s = self._streams.get(key)
        st = text.strip()
        if not st:
            if s is not None and s.mode in (_Stream.FAULT, _Stream.FAULT_OTHER, _Stream.EXC):
                s.mode = _Stream.IDLE
            return
        if s is None:
            # only lines that can open something need a stream
            if not ("Traceback" in st or "File" in st or "xception" in st or ".py" in st
                    or "most recent call first" in st
                    or (level is None or level == "ERROR" or level == "CRITICAL")
                    and (":" in st or st.isidentifier()) and _EXC_LINE.match(st)):
                return
            s = self._stream(key)
        if self._structure_line(s, lineno, key, st) or self._fault_frame(s, text, st) \
                or self._frame_line(s, lineno, text, st) \
                or self._in_traceback(s, lineno, key, level, text, st):
            return
        if s.mode == _Stream.IDLE and text[:1] not in " \t" and level in (None, "ERROR", "CRITICAL"):
            m = _EXC_LINE.match(st)
            if m and is_exception_name(m.group(1)) and m.group(1).split("(")[0].rsplit(".", 1)[-1] \
                    not in _NOT_STANDALONE and not m.group(1).endswith("Warning"):
                self._exception(s, m, lineno, key, level, standalone=True)

    def _structure_line(self, s: _Stream, lineno: int, key, st: str) -> bool:
        """A traceback header, a side thread's ``Exception in thread``, a chain link ("During
        handling ...", "The above exception ..."), or faulthandler's header."""
        if _TB_HEADER in st:
            if s.mode == _Stream.TB and s.frames:
                self._finish_tb_truncated(s)
            if s.side_pending:
                s.side_pending = False
            elif s.pending_link is None:
                s.side = False
            m = _IPY_HEADER.match(st)
            s.start_tb(lineno, ipython=bool(m), ipython_type=m.group(1) if m else None)
            return True
        if st[:1] in "ET" and _SIDE.match(st):
            if s.mode == _Stream.TB and s.frames:
                self._finish_tb_truncated(s)
            s.side = s.side_pending = True
            s.mode = _Stream.IDLE
            return True
        if st.startswith("During handling of the above exception"):
            s.pending_link = "context"
            s.mode = _Stream.IDLE
            return True
        if st.startswith("The above exception was the direct cause"):
            s.pending_link = "cause"
            s.mode = _Stream.IDLE
            return True
        m = _FAULT_HEADER.match(st)
        if not m:
            return False
        if s.mode == _Stream.TB and s.frames:
            self._finish_tb_truncated(s)
        if m.group(1) == "Thread":
            s.mode = _Stream.FAULT_OTHER
            return True
        s.mode = _Stream.FAULT
        ev = None
        for prev in reversed(self.signals):  # the fatal-error line just before it
            if prev.proc == key[0] and prev.source == "faulthandler" and not prev.frames \
                    and lineno - prev.lineno < 50:
                ev = prev
                break
        s.fault = ev
        return True

    def _fault_frame(self, s: _Stream, text: str, st: str) -> bool:
        """A frame of faulthandler's stack (most recent first); any other line ends it (and is
        read on, False)."""
        if s.mode not in (_Stream.FAULT, _Stream.FAULT_OTHER):
            return False
        m = _FRAME.match(text)
        if m:
            if s.mode == _Stream.FAULT and s.fault is not None and len(s.fault.frames) < MAX_FRAMES:
                # faulthandler prints most recent first
                s.fault.frames.insert(0, Frame.make(m["file"], int(m["line"]), m["func"]))
            return True
        if st.startswith("<no Python frame>"):
            return True
        s.mode = _Stream.IDLE  # and read the line normally
        return False

    def _frame_line(self, s: _Stream, lineno: int, text: str, st: str) -> bool:
        """A ``File "...", line N, in f`` line (or a retyped ``vllm/...py, in f`` one, inside a
        traceback or naming a vLLM file); outside a traceback it opens one whose header is
        missing."""
        m = _FRAME.match(text) or _FRAME_NOLINE.match(text)
        if m is None and ".py" in st and " in " in st:
            m = _FRAME_ABBR.match(text)
            if m and s.mode != _Stream.TB and not (vllm_module(m["file"]) or plugin_module(m["file"])):
                m = None  # outside a traceback, only a vLLM file makes it a frame, not prose
        if not m:
            return False
        if s.mode != _Stream.TB:
            s.start_tb(lineno)  # a traceback whose header is not in the log
        line = int(m["line"]) if "line" in m.groupdict() and m["line"] else None
        s.add_frame(Frame.make(m["file"], line, m["func"]), len(text) - len(text.lstrip()))
        return True

    def _in_traceback(self, s: _Stream, lineno: int, key, level: str | None, text: str,
                      st: str) -> bool:
        """Inside an open traceback: IPython frames, carets, source lines, the exception line
        that closes it; anything else means the traceback was cut (closed as truncated, False:
        the line is read on)."""
        if s.mode != _Stream.TB:
            return False
        indent = len(text) - len(text.lstrip())
        if s.ipython:
            m = _IPY_FRAME.match(st)
            if m:
                f = m["a"] or m["b"] or m["c"]
                s.add_frame(Frame.make(f, int(m["l"]) if m["l"] else None,
                                       m["f"] or m["g"] or "?"), 0)
                s.expect_source = False
                return True
        if _CARET.match(text):
            return True
        if s.expect_source and indent > s.frame_indent:
            s.expect_source = False
            return True
        m = _EXC_LINE.match(st)
        if m and (not s.ipython or indent == 0) and (
                is_exception_name(m.group(1))
                # after the last frame's source line: any Class or module.Class line
                or (not s.expect_source and s.frames and indent <= s.frame_indent
                    and _class_like(m.group(1)))):
            self._exception(s, m, lineno, key, level, standalone=False)
            return True
        if s.expect_source or s.ipython:
            s.expect_source = False  # an unindented source line (indentation lost)
            return True
        if st.startswith("[Previous line repeated") or st == "...":
            return True
        if s.frames and indent > s.frame_indent:
            return True  # more of a multi-line source excerpt (Python 3.13: "...<2 lines>...")
        self._finish_tb_truncated(s)  # something else: the traceback was cut
        return False

    def _evidence_line(self, lineno: int, proc: str, level: str | None, key, text: str) -> None:
        st = text.strip()
        if not st:
            return
        if level != "INFO" and level != "DEBUG":
            if self._problem_line(lineno, proc, level, key, st):
                return
        # --- version ---------------------------------------------------------------------------
        if 0 not in self.versions and ("ersion" in st or "llm" in st or "LLM" in st):
            if self._pip_show == lineno - 1 and (m := _PIP_SHOW_VERSION.match(st)):
                self.versions.setdefault(2, (lineno, m.group(1), st[:200]))
            elif st[:1] in "Nn" and _PIP_SHOW_NAME.match(st):
                self._pip_show = lineno
            for tier, rx in enumerate(_VERSION_TIERS):
                m = rx.search(st)
                if m:
                    v = next(g for g in m.groups() if g)
                    try:
                        Version(v)
                    except InvalidVersion:
                        continue
                    self.versions.setdefault(tier, (lineno, v, st[:200]))
                    break
        # --- scheduler state and config ----------------------------------------------------------
        if " reqs" in st and (reqs := _STATS_REQS.findall(st)):
            d: dict = {k.lower(): int(v) for k, v in reqs}
            for which, pct in _STATS_KV.findall(st):
                d["cpu_kv_cache_usage_pct" if which == "CPU " else "kv_cache_usage_pct"] = float(pct)
            if (m := _STATS_PREFIX.search(st)):
                d["prefix_cache_hit_rate_pct"] = float(m.group(1))
            self.stats.append((lineno, d))
            if len(self.stats) > 64:
                del self.stats[0]
        if "blocks: " in st and (m := _GPU_BLOCKS.search(st)):
            self.gpu_blocks = (int(m.group(1)), int(m.group(2)) if m.group(2) else None, lineno)
        if "KV cache size" in st and (m := _KV_TOKENS.search(st)):
            self.kv_cache_tokens = (int(m.group(1).replace(",", "")), lineno)
        if "Chunked prefill is enabled" in st and (m := _CHUNKED.search(st)):
            self.max_num_batched_tokens = int(m.group(1))
        if (level == "WARNING" or level == "WARN") and _PREEMPT.search(st):
            self.preemption_warnings += 1
            if self.first_preemption_line is None:
                self.first_preemption_line = lineno
        if self.engine_config is None and "LLM engine (v" in st and "with config:" in st:
            self.engine_config = (lineno, st.split("with config:", 1)[1].strip()[:MAX_DUMP_CHARS])
        if "args: Namespace(" in st or "non-default args:" in st:
            i = st.find("Namespace(") if "Namespace(" in st else st.find("{")
            if i >= 0:
                self.args = (lineno, st[i:i + 1_000_000])
        # --- lifecycle (it only moves forward) ---------------------------------------------------
        if self.lifecycle != "runtime":
            for rx, stage in _LIFECYCLE:
                if rx.search(st):
                    if self.lifecycle is None or _STAGE_ORDER[stage] >= _STAGE_ORDER[self.lifecycle]:
                        self.lifecycle, self.lifecycle_line = stage, lineno
                    break
        if "Avg prompt throughput" in st or ('" 200' in st and "POST " in st):
            self.last_healthy = lineno  # the engine was serving (health/metrics GETs do not count)

    def _problem_line(self, lineno: int, proc: str, level: str | None, key, st: str) -> bool:
        """Dump, signal, exit-code and CUDA evidence (never on INFO/DEBUG lines). True when the
        line was a dump line and needs nothing else."""
        if "Dump" in st or "SchedulerOutput(" in st or "SchedulerStats(" in st \
                or (self.dump is not None and "LLM engine (v" in st and "with config:" in st):
            if self._dump_line(lineno, key, st):
                return True
        if ("SIG" in st or "ignal" in st or "Fatal Python" in st or "terminate called" in st
                or "xit" in st or "eturn" in st or "emory" in st or "OOM" in st or "oom" in st
                or "died with" in st or "terminated with" in st or "proc(s)" in st
                or (level is None and len(st) < 160)):
            self._signal_line(lineno, proc, level, st)
        if "fatal signal" in st and _SELF_KILL.search(st) and len(self.self_kill_lines) < 16:
            self.self_kill_lines.append(lineno)
        if "died" in st and _DIED.search(st) and len(self.death_lines) < 16:
            self.death_lines.append((lineno, proc, st[:240]))
        if ("CUDA" in st or "cuda" in st or "NCCL" in st or "nccl" in st or "HIP" in st
                or "illegal" in st or "device-side" in st or "misaligned" in st
                or "launch failure" in st or "CUBLAS" in st or "CUDNN" in st or "cuDNN" in st) \
                and CUDA_RE.search(st) and len(self.cuda_lines) < 64:
            self.cuda_lines.append((lineno, proc, st[:300]))
        return False

    def _signal_line(self, lineno: int, proc: str, level: str | None, st: str) -> None:
        """Record the fatal signal or signal exit code ``st`` shows, if it is printed in one of
        the shapes above (the first that matches wins)."""
        m = _FATAL_PY.search(st)
        if m:
            self._record_signal(_FATAL_NAMES[m.group(1) or m.group(2)], "faulthandler", lineno,
                                proc, st)
            return
        for rx in _SIG_SHAPES:
            m = rx.search(st)
            if m:
                name = _sig_name(next(g for g in m.groups() if g))
                if name:
                    self._record_signal(name, "fatal-signal", lineno, proc, st)
                return
        if _TERMINATE.search(st):
            self._record_signal("SIGABRT", "c++-abort", lineno, proc, st)
            return
        if _OOM_KILL.search(st):
            self._record_signal("SIGKILL", "oom-killer", lineno, proc, st)
            return
        if level is None and (m := _SHELL.match(st)):
            name = _FATAL_NAMES[m.group(1) or m.group(2)]
            if not (name == "SIGKILL" and st == "Killed" and self.self_kill_lines):
                # (a bare Killed after vLLM's notice is vLLM killing its own process group)
                self._record_signal(name, "shell", lineno, proc, st)
            return
        for rx in _EXIT_SHAPES:
            m = rx.search(st)
            if m:
                name = _exit_code_signal(int(m.group(1)))
                if name:
                    self._record_signal(name, "exit-code", lineno, proc, st)
                return

    def _dump_line(self, lineno: int, key, st: str) -> bool:
        """Read a dump_input.py line; True when it was one."""
        if st.startswith("Dumping input data"):
            self.dump = Dump(lineno)
            if "LLM engine (v" in st and (m := _VERSION_TIERS[0].search(st)):
                # the banner even where the config is not on it ("... (v0.12.0)..." as a
                # reporter shortened it)
                self.dump.version = m.group(1)
                self.versions.setdefault(0, (lineno, m.group(1), st[:200]))
        d = self.dump
        if "LLM engine (v" in st and "with config:" in st and d is not None and d.config is None:
            m = _VERSION_TIERS[0].search(st)
            d.version = m.group(1) if m else None
            d.config = st.split("with config:", 1)[1].strip()[:MAX_DUMP_CHARS]
            d.config_line = lineno
            if m:
                self.versions.setdefault(0, (lineno, m.group(1), st[:200]))
            return True
        i = st.find("SchedulerOutput(")
        if i >= 0 and (i == 0 or st.startswith("Dumping scheduler output")):
            if d is None:
                d = self.dump = Dump(lineno)
            d.scheduler_output = st[i:i + MAX_DUMP_CHARS]
            d.output_line = lineno
            depth = bracket_depth(d.scheduler_output)
            if depth > 0:
                self._stream(key).dump_open = depth
                self._dump_prev = (lineno, key)
            return True
        i = st.find("SchedulerStats(")
        if i >= 0 and (i == 0 or st.startswith("Dumping scheduler stats")):
            if d is None:
                d = self.dump = Dump(lineno)
            d.stats = st[i:i + 1_000_000]
            d.stats_line = lineno
            return True
        return st.startswith("Dumping")

    def finish(self) -> None:
        """End of input: a traceback still open at the end was cut off, as was a dumped
        SchedulerOutput still open."""
        for s in self._streams.values():
            if s.mode == _Stream.TB:
                self._finish_tb_truncated(s)
            if s.dump_open is not None and self.dump is not None and self.dump.scheduler_output:
                self.dump.output_open = True
