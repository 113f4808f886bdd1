"""Opening a trace file for ``kvtier.replay.trace``: plain or compressed (by magic bytes),
a file, a pipe or standard input, streamed and never rewound; lines bounded in length, so
a device or a binary file is refused at its first long line instead of read into memory.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO, cast

from kvtier.errors import KVTierError


class TraceError(KVTierError):
    """A trace file could not be read (format, field or value)."""

    code = "trace"



_COMPRESSED = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
STDIN = "-"
"""The trace path that means standard input."""


def what_trace(name: str) -> str:
    return "standard input" if name == STDIN else f"trace {name}"


MAX_LINE_CHARS = 1 << 20
"""Longest line of a trace, in characters: a record is a few KB (a 128k-token prompt in
16-token blocks is 8192 ids); a longer line, or bytes without a newline (/dev/zero, a
binary file), is refused at that line instead of read into memory whole."""


def text_lines(fh: TextIO, source: str) -> Iterator[str]:
    """The lines of ``fh``, each read at most ``MAX_LINE_CHARS`` (and its newline) at a
    time; TraceError naming the line beyond that."""
    lineno = 0
    while line := fh.readline(MAX_LINE_CHARS + 1):
        lineno += 1
        if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
            raise TraceError(f"{source}:{lineno}: line longer than {MAX_LINE_CHARS:,} "
                             "characters: not a JSONL trace (a record is one short line)")
        yield line


def _open_raw(path: Path, name: str) -> io.BufferedReader:
    """The trace's bytes, streamed: a file (a FIFO too: it is read once, never rewound) or
    standard input; TraceError for a named directory, device or socket, which hold no trace
    (/dev/zero would be read until memory runs out). Standard input is taken as it comes
    (/dev/null under cron, a socket under a remote runner): its lines are bounded anyway."""
    raw: io.BufferedReader
    if name == STDIN:
        buf = cast(Any, sys.stdin.buffer)
        try:
            raw = io.BufferedReader(io.FileIO(os.dup(buf.fileno()), "rb"))
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            return io.BufferedReader(buf)   # an in-memory stdin (tests, embedding)
    else:
        raw = path.open("rb")
    try:
        mode = os.fstat(raw.fileno()).st_mode
        if name != STDIN and not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            kind = "a directory" if stat.S_ISDIR(mode) else "a device or a socket"
            raise TraceError(f"{what_trace(name)} is {kind}, not a file: give a JSONL trace file "
                             "(plain or gzip/bzip2/xz), a pipe, or - for standard input")
    except BaseException:
        raw.close()
        raise
    return raw


def open_text(path: Path, name: str) -> TextIO:
    """The trace as text lines, decompressed when it is gzip, bzip2 or xz (by its magic
    bytes, whatever its name): published traces are often shipped compressed. The file is
    opened once and never rewound, so a pipe reads as well as a file; so is standard input
    (``-``). Lines are read through ``text_lines`` (at most ``MAX_LINE_CHARS`` each)."""
    raw = _open_raw(path, name)
    try:
        head = raw.peek(6)[:6]
        if head.startswith(_ZSTD_MAGIC):
            raise TraceError(f"{what_trace(name)} is zstd-compressed: decompress it first "
                             "(zstd -d), or recompress it with gzip, bzip2 or xz")
        for magic, opener in _COMPRESSED:
            if head.startswith(magic):
                return cast(TextIO, opener(raw, "rt", encoding="utf-8"))
        return io.TextIOWrapper(raw, encoding="utf-8")
    except BaseException:
        raw.close()
        raise
