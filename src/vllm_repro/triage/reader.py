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


def _bad_bytes(name: str, block: bytes, exc: UnicodeDecodeError, first_line: int,
               at_eof: bool) -> InputError:
    line = first_line + block.count(b"\n", 0, exc.start)
    col = exc.start - (block.rfind(b"\n", 0, exc.start) + 1) + 1
    if at_eof and exc.reason == "unexpected end of data":
        return InputError(f"{name}: line {line}: the file ends inside a UTF-8 character "
                          "(truncated download or copy?); re-fetch the complete log")
    return InputError(f"{name}: line {line}: not UTF-8 text (byte 0x{block[exc.start]:02x} at "
                      f"column {col}); convert the log to UTF-8 first, e.g. iconv -f latin1 "
                      "-t utf-8")


def _decode_cut(raw: bytes) -> str:
    """A line cut at MAX_LINE bytes may end inside a character: drop that partial character."""
    for trim in range(4):
        try:
            return raw[:len(raw) - trim].decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(raw) - 4:
                raise
    return raw.decode("utf-8")


def iter_lines(source: str | Path) -> Iterator[tuple[int, str]]:
    """Yield ``(lineno, text)`` for each line of ``source`` (a path, or ``-`` for stdin).

    ``lineno`` counts from 1; ``text`` has no line terminator. The input is read in 1 MiB
    blocks and decoded a block at a time; memory stays near one block plus one line (at most
    :data:`MAX_LINE` bytes; the rest of a longer line is skipped, never held). Raises
    :class:`InputError` for a missing, empty, binary, compressed or non-UTF-8 input; the
    message names the file and the line.
    """
    fh, name, close = _open(source)
    max_line = MAX_LINE
    try:
        lineno = 0
        carry = b""
        skipping = False  # inside the tail of an over-long line
        first = True
        while True:
            chunk = fh.read(_CHUNK)
            if first:
                first = False
                if not chunk:
                    raise InputError(f"{name}: the log is empty; give the text vLLM printed "
                                     "when it crashed")
                if chunk.startswith((b"\xff\xfe", b"\xfe\xff")):
                    raise InputError(f"{name}: UTF-16 text (PowerShell's > writes it), not "
                                     "UTF-8; convert it first: iconv -f utf-16 -t utf-8")
                for magic, what in _MAGIC.items():
                    if chunk.startswith(magic):
                        raise InputError(f"{name}: this is {what}, not a text log; "
                                         "decompress or extract the log first")
                if chunk.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                    chunk = chunk[3:]
            if not chunk:
                break
            nul = chunk.find(b"\x00")
            if nul >= 0:
                line = lineno + 1 + carry.count(b"\n") + chunk.count(b"\n", 0, nul)
                raise InputError(f"{name}: line {line}: binary data (NUL bytes), not a text "
                                 "log; give the plain-text log vLLM printed")
            if skipping:
                nl = chunk.find(b"\n")
                if nl < 0:
                    continue
                chunk = chunk[nl + 1:]
                skipping = False
            data = carry + chunk if carry else chunk
            last_nl = data.rfind(b"\n")
            if last_nl < 0:
                carry = data
                if len(carry) >= max_line:
                    lineno += 1
                    try:
                        yield lineno, _decode_cut(carry[:max_line]).rstrip("\r")
                    except UnicodeDecodeError as exc:
                        raise _bad_bytes(name, carry, exc, lineno, False) from None
                    carry = b""
                    skipping = True
                continue
            block, carry = data[:last_nl], data[last_nl + 1:]
            try:
                text = block.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _bad_bytes(name, block, exc, lineno + 1, False) from None
            for line in text.split("\n"):
                lineno += 1
                if len(line) > max_line:
                    line = line[:max_line]
                yield lineno, line.rstrip("\r")
        if carry:
            try:
                text = carry.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _bad_bytes(name, carry, exc, lineno + 1, True) from None
            lineno += 1
            yield lineno, text[:max_line].rstrip("\r")
    finally:
        if close:
            fh.close()
