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

import lzma
import math
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from kvtier import jsonin
from kvtier.replay.tracefile import (
    STDIN,
    TraceError,
    open_text,
    text_lines,
    what_trace,
)


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
    # a bool, a string or 1024.7 is no count of tokens (int() would read them as 1, or cut
    # them); NaN and infinities are no whole number, and a huge one is over MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or (isinstance(value, float) and not value.is_integer()) \
            or not 0 <= value <= MAX_TOKENS:
        raise TraceError(f"{where}: field {name!r} must be a whole number of tokens from 0 "
                         f"to {MAX_TOKENS:,}, got {_brief(value)}")
    return int(value)


def _block_ids(record: dict[str, object], where: str) -> tuple[int, ...]:
    hashes = record.get("hash_ids")
    # bool is an int subclass, and a float id (1.5) would be truncated into another block's
    if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integer block ids")
    return tuple(hashes)


def _timestamp(record: dict[str, object], fmt: TraceFormat, where: str) -> float:
    if "timestamp" not in record:
        raise TraceError(f"{where}: not a {fmt.value} trace record (no 'timestamp'); each "
                         "line needs 'timestamp', 'input_length', 'output_length' and "
                         "'hash_ids'")
    value = record["timestamp"]
    # true would read as 1 and "12" as 12: only a JSON number is a time
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(f"{where}: field 'timestamp' must be a number, got {_brief(value)}")
    try:
        ts = float(value)
    except OverflowError:
        ts = math.inf
    if not math.isfinite(ts):
        raise TraceError(f"{where}: field 'timestamp' must be a finite number, got "
                         f"{_brief(value)}")
    return ts


def _parse(record: dict[str, object], fmt: TraceFormat, where: str) -> Request:
    inp = _count(record, "input_length", where)
    out = _count(record, "output_length", where)
    blocks = _block_ids(record, where)
    ts = _timestamp(record, fmt, where)
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


def _block_size(fmt: TraceFormat) -> int:
    return BAILIAN_BLOCK_TOKENS if fmt is TraceFormat.BAILIAN else MOONCAKE_BLOCK_TOKENS


_TS = re.compile(r'"timestamp"\s*:\s*(-?[0-9][0-9.eE+-]*)\s*[,}]')


def _quick_timestamp(line: str) -> float | None:
    """A line's top-level timestamp without parsing the line (None when unsure): the only
    ``"timestamp"`` key of a line must be the record's, since a JSON string cannot hold an
    unescaped quote."""
    if line.count('"timestamp"') != 1:
        return None
    m = _TS.search(line)
    if m is None:
        return None
    try:
        return float(m.group(1))
    except ValueError:
        return None


class _Reader:
    """Parses records one line at a time and checks what a line alone cannot show.

    - ``hash_ids`` must be prefix-chained: a block id names a whole prefix, so it follows the
      same id (or opens the request) wherever it appears. A trace that reuses ids another
      way would be replayed wrongly without a word (the prefix forest keeps one parent per
      block), so it is refused, in one pass over a dict id -> predecessor.
    - ``len(hash_ids) == ceil(input_length / block_tokens)``: a block per started
      ``block_tokens`` of prompt. It holds on every line of the published Mooncake trace
      (512) and of the Bailian samples (16); a trace read with the wrong block size breaks
      it at once. A record without ``input_length`` is not checked (replay then counts
      whole blocks).
    """

    def __init__(self, fmt: TraceFormat, block_tokens: int | None, source: str,
                 check_lengths: bool) -> None:
        self.fmt = fmt
        self.block_tokens = block_tokens
        self.source = source
        self.check_lengths = check_lengths
        self._pred: dict[int, int | None] = {}
        self._lines: list[int] = []  # line number of each request parsed (error messages)
        self._blocks: list[tuple[int, ...]] = []

    def parse(self, lineno: int, line: str) -> Request | None:
        """The request on one line (None for a blank one), checked against earlier lines."""
        line = line.strip()
        if not line:
            return None
        where = f"{self.source}:{lineno}"
        record = _loads(line, where)
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected a JSON object per line")
        if self.fmt is TraceFormat.AUTO:
            self.fmt = _detect(record)
        if self.block_tokens is None:
            self.block_tokens = _block_size(self.fmt)
        req = _parse(record, self.fmt, where)
        bt = self.block_tokens
        if self.check_lengths and "input_length" in record \
                and len(req.blocks) != -(-req.input_tokens // bt):
            raise TraceError(
                f"{where}: {len(req.blocks)} block ids for input_length {req.input_tokens} "
                f"contradict {bt}-token blocks (expected {-(-req.input_tokens // bt)}): give "
                "the trace's block size with --block-tokens, or its format with --format")
        self._chain(req.blocks, lineno, where)
        return req

    def _chain(self, blocks: tuple[int, ...], lineno: int, where: str) -> None:
        pred = self._pred
        before: int | None = None
        for h in blocks:
            first = pred.setdefault(h, before)
            if first != before:
                line = next((n for n, b in zip(self._lines, self._blocks, strict=True)
                             if h in b), lineno)
                raise TraceError(
                    f"{where}: block id {h} {_after(before)} here but "
                    f"{_after(first, before)} on line {line}: hash_ids must be prefix-chained "
                    "(equal ids at the same position mean the same prefix)")
            before = h
        self._lines.append(lineno)
        self._blocks.append(blocks)

    def read(self, lines: Iterable[str], limit: int | None = None) -> list[Request]:
        """Every request of ``lines`` in file order; with ``limit``, only those that can be
        among the ``limit`` earliest arrivals: after the first ``limit`` requests, a line
        whose timestamp is not below theirs is skipped unparsed (a sorted trace's tail)."""
        out: list[Request] = []
        it = iter(enumerate(lines, 1))
        for lineno, line in it:
            req = self.parse(lineno, line)
            if req is not None:
                out.append(req)
                if limit is not None and len(out) >= limit:
                    break
        else:
            return out
        bound = max(r.arrival_s for r in out)
        scale = 1000.0 if self.fmt is TraceFormat.MOONCAKE else 1.0  # as _parse converts
        for lineno, line in it:
            ts = _quick_timestamp(line)
            if ts is not None and ts / scale >= bound:
                continue  # it sorts after all of the first ``limit`` requests
            req = self.parse(lineno, line)
            if req is not None:
                out.append(req)
        return out


def _after(pred: int | None, here: int | None = None) -> str:
    """How a block id is placed: after ``pred``, or first (``here``: the other placement,
    so that "follows 3 here but 1 on line 1" says the verb once)."""
    if pred is None:
        return "opens the request"
    return str(pred) if here is not None else f"follows {pred}"


def parse_lines(
    lines: Iterable[str], *, fmt: TraceFormat = TraceFormat.AUTO, source: str = "<trace>",
    block_tokens: int | None = None, check_lengths: bool = True,
) -> Iterator[Request]:
    """Parse JSONL lines into requests (blank lines skipped), in file order, with the
    checks of :class:`_Reader`."""
    reader = _Reader(fmt, block_tokens, source, check_lengths)
    for lineno, line in enumerate(lines, 1):
        req = reader.parse(lineno, line)
        if req is not None:
            yield req


def load_trace(
    path: str | Path, *, fmt: TraceFormat = TraceFormat.AUTO, block_tokens: int | None = None,
    limit: int | None = None, check_lengths: bool | None = None,
) -> Trace:
    """Read a whole trace file (``-``: standard input), sorted by arrival time (stable, so
    turns keep their order).

    ``block_tokens`` defaults to the format's published block size (Mooncake 512,
    Bailian 16). ``limit``: keep only the ``limit`` earliest requests (reading a sorted
    trace stops parsing there). ``check_lengths``: refuse a block size that contradicts
    ``input_length`` (see :class:`_Reader`); by default only for the format's own block
    size, since a caller's ``block_tokens`` may deliberately re-block a trace.
    """
    name = str(path)
    path = Path(path)
    if block_tokens is not None and block_tokens <= 0:
        raise TraceError(f"block size must be positive, got {block_tokens}")
    what = what_trace(name)
    reader = _Reader(fmt, block_tokens, "<stdin>" if name == STDIN else name,
                     block_tokens is None if check_lengths is None else check_lengths)
    try:
        with open_text(path, name) as fh:
            requests = reader.read(text_lines(fh, reader.source), limit)
    except UnicodeDecodeError:
        raise TraceError(f"{what} is not UTF-8 JSONL text (a compressed trace must be "
                         "gzip, bzip2 or xz)") from None
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
        # gzip.BadGzipFile is an OSError; a corrupt deflate stream is a zlib.error
        raise TraceError(f"cannot read {what}: {exc.strerror or exc}"
                         if isinstance(exc, OSError) else
                         f"cannot read {what}: damaged or truncated compressed data "
                         f"({exc})") from None
    if not requests:
        raise TraceError(f"{what} holds no requests")
    requests.sort(key=lambda r: r.arrival_s)
    if limit is not None:
        del requests[limit:]
    fmt = TraceFormat.MOONCAKE if reader.fmt is TraceFormat.AUTO else reader.fmt
    return Trace(requests=tuple(requests), block_tokens=reader.block_tokens or _block_size(fmt),
                 format=fmt)
