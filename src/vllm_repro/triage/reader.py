"""Read a crash log as a stream of text lines, in bounded memory.

The file (or stdin) is read line by line in binary and decoded as strict UTF-8; a line longer
than :data:`MAX_LINE` bytes is cut there (the rest of it is skipped, never held). Anything that
is not a text log is an :class:`~vllm_repro.errors.InputError` with a one-line message: an
empty file, a binary or compressed file, bytes that are not UTF-8 (including a multi-byte
character cut off at the end of a truncated file).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO, Iterator

from ..errors import InputError

#: bytes kept of one line (a dump_input.py SchedulerOutput line can be megabytes long)
MAX_LINE = 8 * 1024 * 1024
_CHUNK = 1 << 20

_MAGIC = {
    b"\x1f\x8b": "gzip-compressed",
    b"PK\x03\x04": "a zip archive",
    b"\x28\xb5\x2f\xfd": "zstd-compressed",
    b"BZh": "bzip2-compressed",
    b"\xfd7zXZ\x00": "xz-compressed",
    b"\x7fELF": "an executable (ELF)",
    b"\x89PNG": "a PNG image",
    b"%PDF": "a PDF",
}


def _open(source: str | Path) -> tuple[BinaryIO, str, bool]:
    if str(source) == "-":
        return sys.stdin.buffer, "<stdin>", False
    p = Path(source)
    if p.is_dir():
        raise InputError(f"{p}: is a folder; give the crash log file (or - for stdin)")
    try:
        return p.open("rb"), str(p), True
    except FileNotFoundError:
        raise InputError(f"{p}: no such file; give the path of a vLLM crash log (or - for stdin)") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read it ({exc.strerror or exc.__class__.__name__})") from None


def _decode(raw: bytes, name: str, lineno: int, cut: bool, at_eof: bool) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if cut and exc.start >= len(raw) - 3:  # the cut split a character: drop its head
            return raw[:exc.start].decode("utf-8", errors="replace")
        if at_eof and exc.reason == "unexpected end of data":
            raise InputError(f"{name}: line {lineno}: the file ends inside a UTF-8 character "
                             "(truncated download or copy?); re-fetch the complete log") from None
        raise InputError(f"{name}: line {lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                         f"column {exc.start + 1}); convert the log to UTF-8 first, e.g. "
                         "iconv -f latin1 -t utf-8") from None


def iter_lines(source: str | Path) -> Iterator[tuple[int, str]]:
    """Yield ``(lineno, text)`` for each line of ``source`` (a path, or ``-`` for stdin).

    ``lineno`` counts from 1; ``text`` has no line terminator. Memory: one line (at most
    :data:`MAX_LINE` bytes) at a time. Raises :class:`InputError` for a missing, empty, binary
    or non-UTF-8 input; the message names the file and the line.
    """
    fh, name, close = _open(source)
    try:
        lineno = 0
        while True:
            raw = fh.readline(MAX_LINE)
            if not raw:
                break
            lineno += 1
            if lineno == 1:
                for magic, what in _MAGIC.items():
                    if raw.startswith(magic):
                        raise InputError(f"{name}: this is {what}, not a text log; "
                                         "decompress or extract the log first")
            cut = False
            if not raw.endswith(b"\n") and len(raw) >= MAX_LINE:
                cut = True
                while True:  # skip the rest of an over-long line without holding it
                    rest = fh.readline(_CHUNK)
                    if not rest or rest.endswith(b"\n"):
                        break
            if b"\x00" in raw:
                raise InputError(f"{name}: line {lineno}: binary data (NUL bytes), not a text "
                                 "log; give the plain-text log vLLM printed")
            at_eof = not raw.endswith(b"\n")
            text = _decode(raw, name, lineno, cut, at_eof)
            yield lineno, text.rstrip("\r\n")
        if lineno == 0:
            raise InputError(f"{name}: the log is empty; give the text vLLM printed when it crashed")
    finally:
        if close:
            fh.close()
