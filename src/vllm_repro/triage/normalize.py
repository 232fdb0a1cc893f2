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

A per-line prefix of a shape the module does not know (a log viewer's ``2025-08-20 10:00:31.123
| `` or ``12\t2025-...Z\t``) is learned from the log itself by :func:`learn_prefix` and passed
to :func:`normalize` as ``prefix``.
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
    r"\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\s+\[?([\w./\\-]+:\d+)(?:\]|\[\])\s?")  # "485[]": mangled
_LEVEL_COLON = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):(?:[\w.]+:)?\s+")


# spaces a browser or chat tool puts in a pasted log (non-breaking, figure, narrow, ideographic)
# and invisible characters (zero-width space/joiners, a byte order mark mid-file)
_ODD_SPACE = str.maketrans({"\u00a0": " ", "\u2007": " ", "\u202f": " ", "\u3000": " ",
                            "\u2009": " ", "\u200b": None, "\u200c": None, "\u200d": None,
                            "\u2060": None, "\ufeff": None})
_ODD_CHARS = frozenset("\u00a0\u2007\u202f\u3000\u2009\u200b\u200c\u200d\u2060\ufeff")

# where the content of a line begins, for learning a prefix: a process prefix, vLLM's logger
# header, a traceback's header, frame or a Python logging line
_ANCHOR = re.compile(
    r"\((?:[^()]{0,80}[\s,])?(?:pid|rank|ip)=[^()]{0,80}\)"
    r"|\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) +(?:\d{4}-)?\d{2}-\d{2} \d{2}:\d{2}:\d{2}"
    r"|\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[ \w]"
    r"|Traceback \(most recent call last\)|File \"[^\"]+\", line \d+|\[rank\d+\]:")
_TOKEN = re.compile(r"\d+|[A-Za-z]+|[ \t]+|.", re.S)
#: lines looked at to learn a prefix, the share of them that must carry it
LEARN_LINES = 400
_LEARN_SHARE = 0.6
_MAX_PREFIX = 120


def clean(line: str) -> str:
    """``line`` without colour codes and with odd spaces made plain (what a prefix is learned
    from, and what :func:`normalize` reads)."""
    s = line
    if "\x1b" in s:
        s = _ANSI.sub("", s)
    if not s.isascii() and not _ODD_CHARS.isdisjoint(s):
        s = s.translate(_ODD_SPACE)
    return s


def _shape(prefix: str) -> tuple:
    """A prefix as tokens, digits and letters generalised: ``(kind, text)`` pairs."""
    out = []
    for t in _TOKEN.findall(prefix):
        if t[0].isdigit():
            out.append(("d", t))
        elif t[0].isalpha():
            out.append(("a", t))
        elif t[0] in " \t":
            out.append(("s", t))
        else:
            out.append(("p", t))
    return tuple(out)


def learn_prefix(lines: list[str]) -> re.Pattern | None:
    """The per-line prefix most lines of ``lines`` (raw, the head of a log) carry before their
    content, as a regex, or None.

    A line's prefix is what comes before where its content begins (a process prefix, vLLM's
    logger header, a traceback line; see ``_ANCHOR``). Prefixes are compared by shape: digit
    runs stand for any number (timestamps, line numbers), a letter run is kept literally when
    every line has the same one (a host, a stream name) and stands for any word otherwise,
    punctuation is kept. The shape must end in a separator (space, tab, ``|``, ``]``, ``:``,
    ``>``) and be carried by at least 60% of the lines that show content, and at least 3.
    Prefixes the module already strips (kubectl, compose, journald ...) are learned too; it is
    harmless, normalize strips either.
    """
    shapes: dict[tuple, list[tuple]] = {}
    anchored = 0
    for raw in lines:
        s = clean(raw)
        m = _ANCHOR.search(s, 0, _MAX_PREFIX + 80)
        if not m:
            continue
        anchored += 1
        pre = s[:m.start()]
        if not pre.strip() or len(pre) > _MAX_PREFIX or pre.rstrip(" \t")[-1:] not in "|]:>\t" \
                and not pre.endswith((" ", "\t")):
            continue
        sh = _shape(pre.rstrip(" \t"))
        key = tuple((k, "" if k in "ads" else t) for k, t in sh)
        shapes.setdefault(key, []).append(sh)
    if anchored < 3 or not shapes:
        return None
    key, seen = max(shapes.items(), key=lambda kv: len(kv[1]))
    if len(seen) < max(3, _LEARN_SHARE * anchored):
        return None
    parts = [r"^[ \t]*"]
    for i, (kind, _) in enumerate(key):
        texts = {sh[i][1] for sh in seen}
        if kind == "d":
            parts.append(r"\d+")
        elif kind == "s":
            parts.append(r"[ \t]+")
        elif kind == "a":
            parts.append(re.escape(next(iter(texts))) if len(texts) == 1 else r"[A-Za-z]+")
        else:
            parts.append(re.escape(key[i][1]))
    if parts[1:2] == [r"[ \t]+"]:
        del parts[1]
    parts.append(r"[ \t]?")
    return re.compile("".join(parts))


def normalize(line: str, prefix: re.Pattern | None = None) -> tuple[str, str | None, str | None, str]:
    """Split one raw log line into ``(proc, level, site, text)`` (see the module docstring);
    ``prefix`` is a learned per-line prefix (:func:`learn_prefix`) to strip first."""
    s = clean(line)
    if prefix is not None:
        m = prefix.match(s)
        if m:
            s = s[m.end():]
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
    if s[:1] == " " and s.lstrip(" ")[:1] in "DIWEC":  # a header indented by the paste
        m = _HEADER.match(s.lstrip(" "))
        if m:
            s = s.lstrip(" ")
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
