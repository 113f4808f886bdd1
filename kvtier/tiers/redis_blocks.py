"""Moving framed blocks over one RESP connection (runs in the Redis tier's worker threads).

Reads: a GET's first HEADER_SIZE bytes are read and checked (magic, namespace, key, layout
fingerprint, header checksum, a payload length its codec can produce) before anything
else; an uncompressed payload is then received straight into the caller's buffer and its
checksum verified there. Compressed payloads go to a scratch buffer (at most
``codec.max_encoded_len`` of the block) and are decoded into the caller's. A payload that
fails its checksum or does not decode is scrubbed (the block zeroed) so that nothing
unverified or half decoded stays in a caller's buffer.

Writes: each block is framed where it lies (one checksum for NONE) and sent as two buffers,
header and payload, with no copy in Python.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvtier import codec as codecs
from kvtier.checksum import verify
from kvtier.errors import FrameError
from kvtier.frame import (
    FLAG_STRIPED,
    HEADER_SIZE,
    STRIPE_BYTES,
    STRIPED_MIN_BYTES,
    Codec,
    FrameHeader,
)
from kvtier.tiers.redis_mux import LARGE_VALUE_BYTES, GetJob, read_jobs
from kvtier.tiers.redis_pool import NodePool
from kvtier.tiers.redis_queue import PendingWrite, frame_pending
from kvtier.tiers.redis_resp import ErrorReply, NodeAddr, command
from kvtier.tiers.redis_wire import Conn


class ReadStatus(str, Enum):
    """What one GET produced for one block."""

    OK = "ok"               # the caller's buffer holds the verified block
    MISSING = "missing"     # no such key (or no live server for its slot)
    CORRUPT = "corrupt"     # a frame failed a check: delete it
    FOREIGN = "foreign"     # a sound frame of another namespace: a miss, left alone
    STRAY = "stray"         # a sound frame of another key: a reply out of step (the
                            # connection is dropped) or a value planted there: a miss
    NOFIT = "nofit"         # a sound frame of another size than the caller's buffer
    ERROR = "error"         # an error reply or a failed connection


@dataclass(slots=True)
class BlockRead:
    status: ReadStatus
    wire: int = 0                      # bytes of the value on the wire
    why: str = ""
    error: ErrorReply | None = None
    checksum: int | None = None        # OK, uncompressed: the verified xxh3-64 of the block


MISSING = BlockRead(ReadStatus.MISSING)


class _Placer:
    """Decides, per value, where its payload goes once its header was read and checked."""

    __slots__ = ("headers", "keys", "layout_fp", "namespace", "outs", "reads", "scratch",
                 "stray")

    def __init__(self, keys: Sequence[bytes], outs: Sequence[memoryview], namespace: bytes,
                 layout_fp: int) -> None:
        self.keys = keys
        self.outs = outs
        self.namespace = namespace
        self.layout_fp = layout_fp
        self.reads: list[BlockRead | None] = [None] * len(keys)
        self.headers: list[FrameHeader | None] = [None] * len(keys)
        self.scratch: list[memoryview | None] = [None] * len(keys)
        self.stray = False   # a value held another key's frame: the connection is out of step

    def __call__(self, i: int, head: bytes, n: int) -> memoryview | None:
        out = self.outs[i]
        verdict = judge_header(head, self.keys[i], out.nbytes, self.namespace,
                               self.layout_fp, n)
        if isinstance(verdict, BlockRead):
            self.reads[i] = verdict
            self.stray = self.stray or verdict.status is ReadStatus.STRAY
            return None
        header = self.headers[i] = verdict
        if header.flags & FLAG_STRIPED:   # the rest is in other keys: read as stripes
            self.reads[i] = BlockRead(ReadStatus.MISSING, n, "striped frame read by GET")
            return None
        if uncompressed(header):
            return out[:header.raw_len]
        buf = memoryview(bytearray(header.payload_len))
        self.scratch[i] = buf
        return buf


def judge_header(head: bytes, key: bytes, out_bytes: int, namespace: bytes, layout_fp: int,
                 n: int | None = None) -> FrameHeader | BlockRead:
    """A read's verdict from a frame's first HEADER_SIZE bytes: the header when its payload
    may go into an ``out_bytes`` buffer, else the BlockRead that ends the read (CORRUPT,
    FOREIGN: a sound frame of another namespace, STRAY: a sound frame of another key,
    NOFIT: a frame of another size than the buffer, see ``RedisReads._settle_read``).
    ``n``: the value's length on the wire when known (a GET), checked against the header.
    A frame of this namespace, key and layout that can never be one kvtier wrote (a
    striped flag on a block too small to be striped) is CORRUPT."""
    try:
        header = FrameHeader.unpack(head)
    except FrameError as exc:
        return BlockRead(ReadStatus.CORRUPT, n or 0, str(exc))
    wire = HEADER_SIZE + header.payload_len if n is None else n
    if header.namespace != namespace:  # someone else's block: keep it
        return BlockRead(ReadStatus.FOREIGN, wire, "frame holds another namespace")
    if header.key != key:   # another key's reply (out of step), or a value copied here
        return BlockRead(ReadStatus.STRAY, wire, "frame holds another key")
    try:
        header.check(namespace, key, layout_fp)
        if (why := never_valid(header, None)) is not None:
            raise FrameError(why)
        here = (min(header.payload_len, STRIPE_BYTES) if header.flags & FLAG_STRIPED
                else header.payload_len)   # a striped frame's key holds stripe 0
        if n is not None and here != n - HEADER_SIZE:
            raise FrameError(f"frame says {here} payload bytes, value "
                             f"holds {n - HEADER_SIZE}")
        if not lengths_sound(header):   # before any buffer of payload_len is made
            raise FrameError(f"a {header.codec.name} payload of {header.payload_len} bytes "
                             f"cannot encode {header.raw_len}")
    except FrameError as exc:
        return BlockRead(ReadStatus.CORRUPT, wire, str(exc))
    if header.raw_len != out_bytes:  # the caller's buffer, not the frame, is wrong
        return BlockRead(ReadStatus.NOFIT, wire, (
            f"block of {header.raw_len} bytes does not match the {out_bytes}-byte buffer"))
    return header


def never_valid(header: FrameHeader, block_bytes: int | None) -> str | None:
    """Why a sound header of the reader's namespace can never be a frame kvtier wrote for
    a block of ``block_bytes`` (its namespace's layout's; None: unknown), or None: a
    striped flag on a block smaller than ``STRIPED_MIN_BYTES`` (kvtier stripes those of
    that size or more, nothing else), a ``raw_len`` other than the block size. (A large
    block stored whole is valid: earlier kvtier versions wrote them so.)"""
    if header.flags & FLAG_STRIPED and header.raw_len < STRIPED_MIN_BYTES:
        return (f"striped flag on a block of {header.raw_len} bytes (only blocks of "
                f"{STRIPED_MIN_BYTES} bytes or more are striped)")
    if block_bytes is not None and header.raw_len != block_bytes:
        return (f"block of {header.raw_len} bytes where its namespace's blocks have "
                f"{block_bytes}")
    return None


def lengths_sound(header: FrameHeader) -> bool:
    """Whether the header's ``payload_len`` is one its codec can produce from its
    ``raw_len`` (equal when uncompressed): a reader allocates, receives and a delete
    expands stripes by ``payload_len``, so a corrupt or planted header must not set it."""
    if header.codec is Codec.NONE:
        return header.payload_len == header.raw_len
    return header.payload_len <= codecs.max_encoded_len(header.codec, header.raw_len)


@functools.lru_cache(maxsize=64)
def most_wire(block_bytes: int) -> int:
    """The longest value a GET of a block of ``block_bytes`` can use: its header and the
    longest payload any codec writes for it (a striped frame's key holds less). A longer
    value is refused unread, its connection closed (found by review: a planted value of
    500 MiB behind a sound header was drained on every read until the deadline); one of
    the right size is never affected."""
    return HEADER_SIZE + max(codecs.max_encoded_len(c, block_bytes) for c in Codec)


def header_range(rkey: bytes) -> bytes:
    """The command reading the frame header at ``rkey`` (b"" when the key is missing)."""
    return command(b"GETRANGE", rkey, b"0", b"%d" % (HEADER_SIZE - 1))


def uncompressed(header: FrameHeader) -> bool:
    """Whether the frame's payload is the block itself (lands in the caller's buffer)."""
    return header.codec is Codec.NONE and header.payload_len == header.raw_len


def read_blocks(conn: Conn, rkeys: Sequence[bytes], keys: Sequence[bytes],
                outs: Sequence[memoryview], namespace: bytes, layout_fp: int
                ) -> list[BlockRead]:
    """GET every key (one pipeline) and land each verified block in its ``outs`` buffer."""
    place = _Placer(keys, _bytes_views(outs), namespace, layout_fp)
    replies = conn.get_many(rkeys, HEADER_SIZE, place,
                            most_wire(max(o.nbytes for o in place.outs)))
    if place.stray:   # the pool drops it: its next exchange could read this one's replies
        conn.stray_frame = True
    return [_read_of(place, i, reply) for i, reply in enumerate(replies)]


def read_blocks_muxed(batches: Sequence[tuple[NodeAddr, list[int]]], rkeys: Sequence[bytes],
                      keys: Sequence[bytes], outs: Sequence[memoryview], namespace: bytes,
                      layout_fp: int, *, pool_of: Callable[[NodeAddr], NodePool], width: int
                      ) -> tuple[list[BlockRead], list[tuple[NodeAddr, BaseException]]]:
    """``read_blocks`` for many pipelines (``batches``: a server and the indexes of the keys
    it holds, in key order) read by this one thread, ``width`` at a time
    (kvtier.tiers.redis_mux). Each block is verified as it lands; no pipeline starts past
    a block that was not OK. Returns a BlockRead per key (MISSING where none was read,
    ERROR where its connection failed, nothing read after that in its pipeline) and the
    (server, error) of each failed pipeline."""
    place = _Placer(keys, _bytes_views(outs), namespace, layout_fp)
    reads: list[BlockRead] = [MISSING] * len(keys)
    bad = len(keys)   # the first index known not OK

    def job(node: NodeAddr, idx: list[int]) -> GetJob:
        def placed(i: int, head: bytes, n: int) -> memoryview | None:
            dest = place(idx[i], head, n)
            read = place.reads[idx[i]]
            if read is not None and read.status is ReadStatus.STRAY:
                this.out_of_step = True   # its connection is dropped, never reused
            return dest

        def done(i: int, reply: int | ErrorReply | BaseException | None) -> None:
            nonlocal bad
            read = reads[idx[i]] = _read_of(place, idx[i], reply)
            if read.status is not ReadStatus.OK:
                bad = min(bad, idx[i])

        large = min(place.outs[i].nbytes for i in idx) >= LARGE_VALUE_BYTES
        this = GetJob(node, [rkeys[i] for i in idx], HEADER_SIZE, placed, done, idx[0],
                      large=large, most=most_wire(max(place.outs[i].nbytes for i in idx)))
        return this

    jobs = [job(node, idx) for node, idx in batches]
    read_jobs(jobs, pool_of, width, lambda j: j.first < bad)
    return reads, [(j.node, j.error) for j in jobs if j.error is not None]


def _bytes_views(outs: Sequence[memoryview]) -> list[memoryview]:
    return [o if o.format == "B" and o.ndim == 1 else o.cast("B") for o in outs]


def _read_of(place: _Placer, i: int, reply: int | ErrorReply | BaseException | None
             ) -> BlockRead:
    """The BlockRead of key ``i`` from its GET reply (the payload already placed), or from
    the exception that failed its connection before the reply was in."""
    if reply is None:
        return MISSING
    if isinstance(reply, ErrorReply):
        return BlockRead(ReadStatus.ERROR, error=reply, why=str(reply))
    if isinstance(reply, BaseException):
        return BlockRead(ReadStatus.ERROR, why=f"{type(reply).__name__}: {reply}"[:300])
    read = place.reads[i]
    return read if read is not None else _finish(place, i, reply)


def _finish(place: _Placer, i: int, wire: int) -> BlockRead:
    header = place.headers[i]
    out = place.outs[i]
    if header is None:  # shorter than a header: unpack saw too few bytes
        return BlockRead(ReadStatus.CORRUPT, wire, "value shorter than a frame header")
    scratch = place.scratch[i]
    payload = out[:header.raw_len] if scratch is None else scratch
    try:
        verify(header, payload)
        if scratch is not None:
            codecs.decode(header.codec, scratch, header.raw_len, out)
    except FrameError as exc:   # never leave unverified or partly decoded bytes
        out[:header.raw_len] = bytes(header.raw_len)
        return BlockRead(ReadStatus.CORRUPT, wire, str(exc))
    # uncompressed: the checksum just verified is the block's own (the journal reuses it)
    return BlockRead(ReadStatus.OK, wire, checksum=header.checksum if scratch is None else None)


# One SET of a batch: its Redis key, the block it is for, and what it sends (None: the
# block's whole frame, framed on the way out).
WireSet = tuple[bytes, PendingWrite, tuple[bytes | memoryview, ...] | None]


def write_blocks(conn: Conn, sets: Sequence[WireSet], codec: Codec | codecs.AutoCodec,
                 ttl_s: int | None) -> list[Any]:
    """SET every entry in one pipeline; a whole frame is framed (with its block's element
    width) just before it is sent, so its checksum overlaps the server reading the ones
    before; one reply each."""
    def parts_of(i: int) -> tuple[bytes | memoryview, ...]:
        _, item, parts = sets[i]
        if parts is not None:
            return parts
        if not item.parts:
            frame_pending(item, codec)
        return item.parts

    return conn.set_many([s[0] for s in sets], parts_of, ttl_s)
