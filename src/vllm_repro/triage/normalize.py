"""Strip what surrounds a log line's content: colour codes, log-viewer prefixes, the process
prefix vLLM / Ray / torch put on child-process output, and vLLM's own logger header.

``normalize(line) -> (proc, level, site, text)``:

- ``proc``: the process prefix(es) without brackets, e.g. ``VllmWorker rank=0 pid=226``,
  ``EngineCore_0 pid=12``, ``RayWorkerWrapper pid=2191173, ip=192.0.2.50``, ``rank0``;
  ``""`` for the process that printed without one.
- ``level``: ``INFO`` / ``WARNING`` / ``ERROR`` ... from vLLM's header (``ERROR 06-05 16:27:39
  [core.py:502]``, V0's ``ERROR 12-13 08:58:11 engine.py:165]``) or a ``LEVEL:`` prefix; None
  for raw output (stderr tracebacks, faulthandler, the shell).
- ``site``: the logger call site (``core.py:502``), None without a vLLM header. Lines of one
  multi-line log record share (proc, site), which is how interleaved tracebacks are separated.
- ``text``: the content, with its own indentation kept.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
# colour codes whose ESC byte was lost when the log was pasted: "[36m(RayWorkerWrapper ...)[0m"
_BARE_SGR = re.compile(r"^(?:\[\d{1,3}(?:;\d{1,3})*m)+")

_VIEWER = re.compile(
    r"""^(?:
      \d{4}-\d{2}-\d{2}[T\ ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?   # ISO time:
          (?:\s+(?:stdout|stderr)\s+[FP])?\s+                                  # kubectl -t, CRI
    | \[\d{4}-\d{2}-\d{2}[T\ ][\d:.,]+(?:Z|[+-]\d{2}:?\d{2})?\]\s+             # [ISO time]
    | [A-Z][a-z]{2}\ [\ \d]\d\ \d{2}:\d{2}:\d{2}\ \S+\ [\w.@/-]+(?:\[\d+\])?:\s # journald
    | [\w.-]*[-_]\d+\s+\|\ ?                                                   # compose: vllm-1 |
    | [\w.-]+\s{2,}\|\ ?                                                       # compose padding
    | \[pod/[^\]]+\]\s                                                         # kubectl --prefix
    | \[(?:stdout|stderr)\]\s?
    | \#\#\[\w+\]                                                              # CI annotations
    )""", re.X)

_MONTHS = {"Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"}
_PROC = re.compile(r"^\(([^()]{1,160})\)[ \t]?")
_PROC_OK = re.compile(r"(?:^|[\s,])(?:pid|rank|ip)=|^(?:raylet|gcs_server|autoscaler|monitor|"
                      r"dashboard|log_monitor|runtime_env_agent)\b")
_TORCH_RANK = re.compile(r"^\[(rank\d+)\]:\s?")

_HEADER = re.compile(
    r"^(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+(?:\d{4}-)?\d{2}-\d{2}\s+"
    r"\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\s+\[?([\w./\\-]+:\d+)\]\s?")
_LEVEL_COLON = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):(?:[\w.]+:)?\s+")


def normalize(line: str) -> tuple[str, str | None, str | None, str]:
    """Split one raw log line into ``(proc, level, site, text)`` (see the module docstring)."""
    s = line
    if "\x1b" in s:
        s = _ANSI.sub("", s)
    if "\r" in s:  # progress bars: what the terminal finally showed
        s = s.rstrip("\r").rsplit("\r", 1)[-1]
    if s[:1] == "[":
        m = _BARE_SGR.match(s)
        if m:
            s = s[m.end():]
    c = s[:1]
    if c.isdigit() or c == "[" or c == "#" or "|" in s[:100] or s[:3] in _MONTHS:
        for _ in range(3):
            m = _VIEWER.match(s)
            if not m:
                break
            s = s[m.end():]
    procs = []
    for _ in range(4):
        c = s[:1]
        if c == "(":
            m = _PROC.match(s)
            if not m or not _PROC_OK.search(m.group(1)):
                break
            procs.append(m.group(1))
            s = s[m.end():]
        elif c == "[":
            m = _TORCH_RANK.match(s) or _BARE_SGR.match(s)
            if not m:
                break
            if m.re is _TORCH_RANK:
                procs.append(m.group(1))
            s = s[m.end():]
            if s[:1] == " " and m.re is _BARE_SGR:
                s = s[1:]
        else:
            break
    proc = " / ".join(procs)
    level = site = None
    if s[:1] in "DIWEC":
        m = _HEADER.match(s)
        if m:
            level, site = m.group(1), m.group(2)
            s = s[m.end():]
        else:
            m = _LEVEL_COLON.match(s)
            if m:
                level = m.group(1)
                s = s[m.end():]
    return proc, level, site, s
