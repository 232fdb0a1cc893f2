"""Read a crash log as a stream of text lines, in bounded memory.

The file (or stdin) is read line by line in binary and decoded as UTF-8; bytes that are not
UTF-8 (a latin-1 ``é`` in a prompt, a multi-byte character cut off at the end of a truncated
copy) become U+FFFD and are counted in :class:`ReadStats`, they never make the log unreadable.
A line longer than :data:`MAX_LINE` bytes is cut there (the rest of it is skipped, never held).
NUL bytes are padding, not binary data: a log copied out of a container, or rotated with
``copytruncate`` while the writer kept its offset, starts with (or holds runs of) NUL bytes
before the text; they are dropped and counted (:class:`ReadStats`). Anything that is not a text
log is an :class:`~vllm_repro.errors.InputError` with a one-line message: an empty file (or only
NUL bytes), a binary file (:func:`looks_binary`: NUL bytes between other bytes, control bytes a
text log does not have), a compressed file, UTF-16 text.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
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


#: control bytes a text log does not hold (tab, newline, vertical tab, form feed, carriage
#: return, escape and NUL are not among them: NUL is padding, ESC starts a terminal colour)
_CONTROL = bytes(b for b in range(32) if b not in (0, 9, 10, 11, 12, 13, 27)) + b"\x7f"
#: a block is binary when more than this share of its bytes (NUL padding left out) are lone NULs
#: or control bytes: a text log has none or next to none (a stray one in a prompt)
_BINARY_SHARE = 0.01
#: bytes judged by :func:`looks_binary`: the head of the text, and around the first NUL of a block
_SAMPLE = 64 * 1024


def looks_binary(block: bytes) -> bool:
    """Whether ``block`` (a slice of the file) is binary data rather than text with NUL padding:
    lone NUL bytes (a NUL with other bytes on both sides: UTF-16, executables, archives) and
    control bytes together are more than :data:`_BINARY_SHARE` of its bytes once the runs of
    NULs (padding) are left out."""
    if not block:
        return False
    lone = len(re.findall(rb"(?<=[^\x00])\x00(?=[^\x00])", block))
    text = block.replace(b"\x00", b"")
    if not text:
        return False
    odd = lone + len(text) - len(text.translate(None, _CONTROL))
    return odd > _BINARY_SHARE * len(text)


def _first_odd(block: bytes) -> int:
    """The offset of the first byte that makes ``block`` binary (a lone NUL or a control
    byte); 0 when there is none."""
    m = re.search(rb"(?<=[^\x00])\x00(?=[^\x00])|[" + re.escape(_CONTROL) + rb"]", block)
    return m.start() if m else 0


def _binary(name: str, line: int) -> InputError:
    return InputError(f"{name}: line {line}: binary data (NUL bytes between other bytes, control "
                      "bytes), not a text log; give the plain-text log vLLM printed")


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


@dataclass
class ReadStats:
    """What reading the log had to repair: lines with bytes that are not UTF-8 (shown as
    U+FFFD), the first such line; NUL bytes of padding dropped (``nul_bytes``) and the line
    after the first of them (``first_nul_line``: 1 for padding before the text)."""

    bad_lines: int = 0
    first_bad_line: int | None = None
    nul_bytes: int = 0
    first_nul_line: int | None = None

    def bad(self, first_line: int, text: str) -> None:
        n = 0
        for i, line in enumerate(text.split("\n")):
            if "\ufffd" in line:
                n += 1
                if self.first_bad_line is None:
                    self.first_bad_line = first_line + i
        self.bad_lines += n


def _decode(raw: bytes, first_line: int, stats: ReadStats | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        if stats is not None:
            stats.bad(first_line, text)
        return text


def _decode_cut(raw: bytes, lineno: int, stats: ReadStats | None) -> str:
    """A line cut at MAX_LINE bytes may end inside a character: drop that partial character."""
    for trim in range(4):
        try:
            return raw[:len(raw) - trim].decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(raw) - 4:
                break
    return _decode(raw, lineno, stats)


def iter_lines(source: str | Path, stats: ReadStats | None = None) -> Iterator[tuple[int, str]]:
    """Yield ``(lineno, text)`` for each line of ``source`` (a path, or ``-`` for stdin).

    ``lineno`` counts from 1; ``text`` has no line terminator. The input is read in 1 MiB
    blocks and decoded a block at a time; memory stays near one block plus one line (at most
    :data:`MAX_LINE` bytes; the rest of a longer line is skipped, never held). Bytes that are
    not UTF-8 are replaced (U+FFFD) and counted in ``stats``, as are the NUL bytes of padding,
    which are dropped (before the text, between lines, anywhere). Raises :class:`InputError` for
    a missing, empty (or all NUL), binary (:func:`looks_binary`), compressed or UTF-16 input; the
    message names the file.
    """
    fh, name, close = _open(source)
    max_line = MAX_LINE
    try:
        lineno = 0
        carry = b""
        skipping = False  # inside the tail of an over-long line
        first = True
        padding = 0  # NUL bytes before the text
        while True:
            chunk = fh.read(_CHUNK)
            if first and chunk and not chunk.lstrip(b"\x00"):  # still the padding before the text
                padding += len(chunk)
                continue
            if first:
                first = False
                if padding or chunk[:1] == b"\x00":
                    stripped = chunk.lstrip(b"\x00")
                    padding += len(chunk) - len(stripped)
                    chunk = stripped
                    if stats is not None:
                        stats.nul_bytes += padding
                        stats.first_nul_line = 1
                if not chunk:
                    raise InputError(f"{name}: the log is empty" + (
                        f" (only {padding} NUL bytes of padding)" if padding else "")
                        + "; give the text vLLM printed when it crashed")
                if chunk.startswith((b"\xff\xfe", b"\xfe\xff")):
                    raise InputError(f"{name}: UTF-16 text (PowerShell's > writes it), not "
                                     "UTF-8; convert it first: iconv -f utf-16 -t utf-8")
                for magic, what in _MAGIC.items():
                    if chunk.startswith(magic):
                        raise InputError(f"{name}: this is {what}, not a text log; "
                                         "decompress or extract the log first")
                if chunk.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                    chunk = chunk[3:]
                if looks_binary(chunk[:_SAMPLE]):
                    raise _binary(name, 1 + chunk.count(b"\n", 0, _first_odd(chunk[:_SAMPLE])))
            if not chunk:
                break
            nul = chunk.find(b"\x00")
            if nul >= 0:
                line = lineno + 1 + carry.count(b"\n") + chunk.count(b"\n", 0, nul)
                if looks_binary(chunk[max(0, nul - _SAMPLE // 2):nul + _SAMPLE // 2]):
                    raise _binary(name, line)
                kept = chunk.replace(b"\x00", b"")
                if stats is not None:
                    stats.nul_bytes += len(chunk) - len(kept)
                    if stats.first_nul_line is None:
                        stats.first_nul_line = line
                chunk = kept
                if not chunk:
                    continue
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
                    yield lineno, _decode_cut(carry[:max_line], lineno, stats).rstrip("\r")
                    carry = b""
                    skipping = True
                continue
            block, carry = data[:last_nl], data[last_nl + 1:]
            text = _decode(block, lineno + 1, stats)
            for line in text.split("\n"):
                lineno += 1
                if len(line) > max_line:
                    line = line[:max_line]
                yield lineno, line.rstrip("\r")
        if carry:
            text = _decode(carry, lineno + 1, stats)
            lineno += 1
            yield lineno, text[:max_line].rstrip("\r")
    finally:
        if close:
            fh.close()
