"""Triage a crash log end to end: stream it through the scanner, analyse, refuse non-crashes."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError
from .analyze import TriageReport, analyze
from .normalize import LEARN_LINES, learn_prefix
from .reader import ReadStats, iter_lines
from .scan import LogScanner


_HEAD_CHARS = 16 * 1024 * 1024  # at most this much of the head is held to learn the prefix


def scan_log(source: str | Path) -> LogScanner:
    """Read ``source`` (a path or ``-`` for stdin) line by line into a :class:`LogScanner`.
    Raises :class:`InputError` for an unreadable, empty, binary or UTF-16 input; bytes that
    are not UTF-8 are read as U+FFFD (``sc.not_utf8``: how many lines, the first); NUL bytes of
    padding are dropped (``sc.nul_padding``: how many bytes, the line after the first)."""
    stats = ReadStats()
    lines = iter_lines(source, stats)
    head: list[tuple[int, str]] = []
    size = 0
    for item in lines:  # the log's head, to learn a per-line prefix from (bounded)
        head.append(item)
        size += len(item[1])
        if len(head) >= LEARN_LINES or size >= _HEAD_CHARS:
            break
    sc = LogScanner(prefix=learn_prefix([t[:400] for _, t in head]))
    feed = sc.feed
    for lineno, line in head:
        feed(lineno, line)
    del head
    for lineno, line in lines:
        feed(lineno, line)
    sc.finish()
    sc.not_utf8 = (stats.bad_lines, stats.first_bad_line)
    sc.nul_padding = (stats.nul_bytes, stats.first_nul_line)
    return sc


def triage_log(source: str | Path) -> tuple[TriageReport, LogScanner]:
    """The :class:`TriageReport` of a crash log, and the scanner (for the dump).

    Raises :class:`InputError` (one line, naming the file) when the input is not a readable
    text log or shows no crash at all: no exception, fatal signal, CUDA error or vLLM process
    dying. A traceback cut off before its exception line is reported with ``truncated`` and the
    frames it shows; one with no frames at all is refused as a truncated log.
    """
    name = "<stdin>" if str(source) == "-" else str(source)
    sc = scan_log(source)
    report = analyze(sc, name)
    if report.exception_type is None and report.exit_kind is None and not sc.death_lines \
            and not report.truncated:
        if sc.truncated_tracebacks:
            raise InputError(
                f"{name}: line {sc.truncated_tracebacks[0]}: the traceback there is cut off "
                "before its exception line (truncated log?); include the lines that follow it")
        raise InputError(f"{name}: no crash found in {sc.lines} lines (no Python exception, "
                         "fatal signal or CUDA error); give the log of the run that crashed")
    return report, sc


def write_draft(path: Path, text: str) -> None:
    """Write a drafted scenario to ``path`` whole or not at all (a temporary file beside it,
    then renamed). Raises :class:`InputError` when its folder is missing or it cannot be
    written."""
    if path.parent and not path.parent.is_dir():
        raise InputError(f"{path}: its folder {path.parent} does not exist")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise InputError(f"{path}: cannot write the scenario ({exc.strerror or exc})") from None
