"""Trace readers: Mooncake JSONL and Alibaba Bailian JSONL (plain, or gzip/bzip2/xz
compressed) into one request record.

Both formats carry per-request ``hash_ids``: prefix-chained block ids, so equal ids at the
same position mean a shared prefix. They differ in time unit and block size:

- Mooncake (FAST'25): ``timestamp`` in ms, ``input_length``, ``output_length``,
  ``hash_ids``; block size given by the caller (512 tokens for the published traces).
- Alibaba Bailian (qwen-bailian-usagetraces-anon): ``chat_id``, ``parent_chat_id``,
  ``timestamp`` in seconds, ``input_length``, ``output_length``, ``turn``, ``hash_ids``;
  block size 16 tokens.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TextIO

from kvtier import jsonin
from kvtier.errors import KVTierError


class TraceError(KVTierError):
    """A trace file could not be read (format, field or value)."""

    code = "trace"


class TraceFormat(str, Enum):
    """Supported trace formats; ``AUTO`` picks by the fields of the first record."""

    AUTO = "auto"
    MOONCAKE = "mooncake"
    BAILIAN = "bailian"


MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace, normalised: seconds, tokens and block ids."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    chat_id: int | None = None
    parent_chat_id: int | None = None
    turn: int | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    """A whole trace: its requests in arrival order and its block size."""

    requests: tuple[Request, ...]
    block_tokens: int
    format: TraceFormat

    @property
    def n_references(self) -> int:
        """Block references over all requests (one per block id per request)."""
        return sum(len(r.blocks) for r in self.requests)

    @property
    def n_unique_blocks(self) -> int:
        """Distinct block ids in the trace (what an infinite cache would hold)."""
        seen: set[int] = set()
        for r in self.requests:
            seen.update(r.blocks)
        return len(seen)


def _detect(record: dict[str, object]) -> TraceFormat:
    if "chat_id" in record or "parent_chat_id" in record or "turn" in record:
        return TraceFormat.BAILIAN
    return TraceFormat.MOONCAKE


MAX_TOKENS = 1 << 31
"""Longest input or output length a record may give, in tokens."""


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(record: dict[str, object], name: str, where: str) -> int:
    value = record.get(name, 0)
    # NaN fails the range test; an infinity or a huge number is over MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 <= value <= MAX_TOKENS:
        raise TraceError(f"{where}: field {name!r} must be a number of tokens from 0 to "
                         f"{MAX_TOKENS:,}, got {_brief(value)}")
    return int(value)


def _block_ids(record: dict[str, object], where: str) -> tuple[int, ...]:
    hashes = record.get("hash_ids")
    # bool is an int subclass, and a float id (1.5) would be truncated into another block's
    if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integer block ids")
    return tuple(hashes)


def _parse(record: dict[str, object], fmt: TraceFormat, where: str) -> Request:
    inp = _count(record, "input_length", where)
    out = _count(record, "output_length", where)
    blocks = _block_ids(record, where)
    try:
        # a JSON value: float() raises TypeError/ValueError for the wrong ones, caught below
        ts = float(record["timestamp"])  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise TraceError(
            f"{where}: not a {fmt.value} trace record ({exc!r}); each line needs "
            "'timestamp', 'input_length', 'output_length' and 'hash_ids'"
        ) from None
    if not math.isfinite(ts):
        raise TraceError(f"{where}: field 'timestamp' must be a finite number, got "
                         f"{_brief(record['timestamp'])}")
    if fmt is TraceFormat.MOONCAKE:
        return Request(arrival_s=ts / 1000.0, input_tokens=inp, output_tokens=out, blocks=blocks)

    def opt_int(name: str) -> int | None:
        value = record.get(name)
        if value is not None and type(value) is not int:
            raise TraceError(f"{where}: field {name!r} must be an integer, got "
                             f"{_brief(value)}")
        return value

    parent = opt_int("parent_chat_id")
    return Request(
        arrival_s=ts, input_tokens=inp, output_tokens=out, blocks=blocks,
        chat_id=opt_int("chat_id"),
        parent_chat_id=None if parent is None or parent < 0 else parent,
        turn=opt_int("turn"),
    )


def _loads(line: str, where: str) -> object:
    """One JSON value; TraceError for what json refuses, each named."""
    try:
        return jsonin.loads(line)
    except ValueError as exc:
        raise TraceError(f"{where}: not a trace record: {exc}") from None


def parse_lines(
    lines: Iterable[str], *, fmt: TraceFormat = TraceFormat.AUTO, source: str = "<trace>"
) -> Iterator[Request]:
    """Parse JSONL lines into requests (blank lines skipped), in file order."""
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        record = _loads(line, where)
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected a JSON object per line")
        if fmt is TraceFormat.AUTO:
            fmt = _detect(record)
        yield _parse(record, fmt, where)


_COMPRESSED = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _open_text(path: Path) -> TextIO:
    """The trace as text lines, decompressed when it is gzip, bzip2 or xz (by its magic
    bytes, whatever its name): published traces are often shipped compressed."""
    with path.open("rb") as raw:
        head = raw.read(6)
    if head.startswith(_ZSTD_MAGIC):
        raise TraceError(f"trace {path} is zstd-compressed: decompress it first "
                         "(zstd -d), or recompress it with gzip, bzip2 or xz")
    for magic, opener in _COMPRESSED:
        if head.startswith(magic):
            return opener(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def load_trace(
    path: str | Path, *, fmt: TraceFormat = TraceFormat.AUTO, block_tokens: int | None = None
) -> Trace:
    """Read a whole trace file, sorted by arrival time (stable, so turns keep their order).

    ``block_tokens`` defaults to the format's published block size (Mooncake 512,
    Bailian 16).
    """
    path = Path(path)
    try:
        with _open_text(path) as fh:
            first = ""
            for first in fh:
                if first.strip():
                    break
            fh.seek(0)
            if fmt is TraceFormat.AUTO and first.strip():
                try:
                    fmt = _detect(json.loads(first))
                except (ValueError, RecursionError, AttributeError, TypeError):
                    fmt = TraceFormat.MOONCAKE  # parse_lines names what is wrong
            requests = list(parse_lines(fh, fmt=fmt, source=str(path)))
    except UnicodeDecodeError:
        raise TraceError(f"trace {path} is not UTF-8 JSONL text (a compressed trace must be "
                         "gzip, bzip2 or xz)") from None
    except (OSError, EOFError, lzma.LZMAError) as exc:  # gzip.BadGzipFile is an OSError
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}"
                         if isinstance(exc, OSError) else
                         f"cannot read trace {path}: {exc}") from None
    if not requests:
        raise TraceError(f"trace {path} holds no requests")
    if fmt is TraceFormat.AUTO:
        fmt = TraceFormat.MOONCAKE
    requests.sort(key=lambda r: r.arrival_s)
    if block_tokens is None:
        block_tokens = (
            BAILIAN_BLOCK_TOKENS if fmt is TraceFormat.BAILIAN else MOONCAKE_BLOCK_TOKENS
        )
    if block_tokens <= 0:
        raise TraceError(f"block size must be positive, got {block_tokens}")
    return Trace(requests=tuple(requests), block_tokens=block_tokens, format=fmt)
