"""The block frame: how a block looks wherever it leaves process memory.

A frame is a fixed 96-byte header followed by the (possibly encoded) payload::

    magic "KVTF" | version u16 | codec u8 | flags u8 | namespace 16B | key 16B
    | layout fingerprint u64 | payload_len u64 | raw_len u64 | payload xxh3-64 u64
    | seq u64 | parent tag u64 | header xxh3-64 u64

Chain position (flags, same format version): with ``FLAG_CHAIN`` set the writer recorded
where the block sits in its prefix chain: ``FLAG_PARENT`` says it has a parent and the parent
tag is the first 8 bytes of the parent's key (``parent_tag``). A restarted daemon uses it to
drop frames no chain head leads to. Frames written before (flags 0, the field was reserved
and zero) read as "position unknown", and readers that ignore the flags read new frames.

Striped (``FLAG_STRIPED``, same format version; only the Redis tier writes them): the payload
of a block of 8 MiB or more is stored as 4 MiB stripes, the first after the header under the block's
Redis key, stripe i (i >= 1) under that key + ``:i`` (``kvtier.tiers.redis_stripes``): Redis
serves values of 32 MiB and more several times slower than smaller ones. The header and its
payload checksum cover the whole payload as before. Readers that do not know the flag see a
value shorter than ``payload_len`` and take it for a corrupt frame (a miss). With
``FLAG_STRIPE_TAG`` (what kvtier writes since) ``seq`` holds a random tag drawn for that one
write and stripe i lives under the key + ``:<tag as 16 hex digits>:i``: each write's stripes
have names of their own, so a reader that cleans up after one version (a stripe evicted
under its head) can never delete the stripes of a rewrite of the same block in progress.

The header checks itself, so a torn or overwritten header is detected before any
payload is trusted; the payload checksum covers the stored (encoded) bytes, so
corruption is caught before decoding. A frame failing any check is a miss, never data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import xxhash

from kvtier.errors import ChecksumError, FrameError

MAGIC = b"KVTF"
FORMAT_VERSION = 1
_STRUCT = struct.Struct("<4sHBB16s16sQQQQQQ")
_HEADER_CHECK = struct.Struct("<Q")
HEADER_SIZE = _STRUCT.size + _HEADER_CHECK.size  # 96 bytes
MAX_PAYLOAD = 1 << 36  # 64 GiB: anything larger is a corrupt length, not a block
FLAG_CHAIN = 1         # parent_tag/FLAG_PARENT are meaningful
FLAG_PARENT = 2        # the block has a parent in its chain
FLAG_STRIPED = 4       # the payload continues in stripes under other keys (Redis)
FLAG_STRIPE_TAG = 8    # a striped frame's stripes are named after its seq (a per-write tag)
STRIPE_BYTES = 4 << 20          # a striped payload's stripes (the last may be shorter)
STRIPED_MIN_BYTES = 8 << 20     # blocks of at least this many raw bytes are striped


def parent_tag(key: bytes) -> int:
    """The 8-byte tag a frame keeps of its parent's key (keys are uniform hash outputs)."""
    return int.from_bytes(key[:8], "little")


class Codec(IntEnum):
    """Payload encodings. The ids are part of the on-disk and on-wire format."""

    NONE = 0
    LZ4 = 1
    SHUFFLE_LZ4 = 2
    SHUFFLE_ZSTD = 3


def payload_checksum(payload: bytes | memoryview) -> int:
    """xxh3-64 of the stored payload bytes (~20 GB/s, far above any tier's bandwidth)."""
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """Decoded frame header; ``pack``/``unpack`` are exact inverses."""

    namespace: bytes
    key: bytes
    layout_fp: int
    payload_len: int
    raw_len: int
    checksum: int
    codec: Codec = Codec.NONE
    seq: int = 0
    flags: int = 0         # FLAG_CHAIN | FLAG_PARENT
    parent: int = 0        # parent_tag(parent key) when flags has FLAG_PARENT

    @property
    def chain_parent(self) -> int | None:
        """The parent's tag; None for a chain head or a frame that did not record it
        (``flags & FLAG_CHAIN`` tells the two apart)."""
        return self.parent if self.flags & FLAG_PARENT else None

    def pack(self) -> bytes:
        body = _STRUCT.pack(MAGIC, FORMAT_VERSION, int(self.codec), self.flags, self.namespace,
                            self.key, self.layout_fp, self.payload_len, self.raw_len,
                            self.checksum, self.seq, self.parent)
        return body + _HEADER_CHECK.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> FrameHeader:
        """Parse and check a header; raises FrameError on any inconsistency."""
        if len(buf) < HEADER_SIZE:
            raise FrameError(f"frame header truncated ({len(buf)} < {HEADER_SIZE} bytes)")
        body = bytes(buf[: _STRUCT.size])
        (check,) = _HEADER_CHECK.unpack_from(buf, _STRUCT.size)
        magic, version, codec, flags, ns, key, layout_fp, plen, rlen, csum, seq, parent = (
            _STRUCT.unpack(body))
        if magic != MAGIC:
            raise FrameError("not a kvtier frame (bad magic)")
        if xxhash.xxh3_64_intdigest(body) != check:
            raise FrameError("frame header checksum mismatch (torn or corrupt header)")
        if version != FORMAT_VERSION:
            raise FrameError(f"unsupported frame version {version}")
        try:
            codec_e = Codec(codec)
        except ValueError:
            raise FrameError(f"unknown codec id {codec}") from None
        if plen > MAX_PAYLOAD or rlen > MAX_PAYLOAD:
            raise FrameError("frame length out of range")
        return cls(ns, key, layout_fp, plen, rlen, csum, codec_e, seq, flags, parent)

    def check(self, namespace: bytes | None, key: bytes | None, layout_fp: int | None) -> None:
        """Raise FrameError unless the header belongs to the expected block."""
        if key is not None and self.key != key:
            raise FrameError("frame holds another key")
        if namespace is not None and self.namespace != namespace:
            raise FrameError("frame holds another namespace")
        if layout_fp is not None and self.layout_fp != layout_fp:
            raise FrameError("frame layout fingerprint differs")

    def verify(self, payload: bytes | memoryview) -> None:
        """Raise ChecksumError unless ``payload`` is exactly what was framed."""
        if len(payload) != self.payload_len:
            raise ChecksumError(
                f"payload length {len(payload)} differs from header {self.payload_len}")
        if payload_checksum(payload) != self.checksum:
            raise ChecksumError("payload checksum mismatch")


def stripe_bounds(payload_len: int) -> list[tuple[int, int]]:
    """[lo, hi) of each stripe of a striped payload: stripe 0 follows the header."""
    return [(lo, min(lo + STRIPE_BYTES, payload_len))
            for lo in range(0, max(payload_len, 1), STRIPE_BYTES)]


def make_header(namespace: bytes, key: bytes, layout_fp: int, payload: bytes | memoryview,
                raw_len: int | None = None, codec: Codec = Codec.NONE,
                seq: int = 0, chain: tuple[bytes | None] | None = None,
                checksum: int | None = None) -> FrameHeader:
    """Header for ``payload`` (already encoded with ``codec``); ``chain`` = ``(parent key or
    None,)`` records the block's chain position (see FLAG_CHAIN); ``checksum``: the
    payload's ``payload_checksum`` when the caller hashed it already (elsewhere)."""
    flags = parent = 0
    if chain is not None:
        flags = FLAG_CHAIN
        if chain[0] is not None:
            flags |= FLAG_PARENT
            parent = parent_tag(chain[0])
    return FrameHeader(namespace, key, layout_fp, len(payload),
                       len(payload) if raw_len is None else raw_len,
                       payload_checksum(payload) if checksum is None else checksum, codec, seq,
                       flags, parent)


def encode_frame(header: FrameHeader, payload: bytes | memoryview) -> bytes:
    """One contiguous frame (header + payload), e.g. a Redis value."""
    return header.pack() + bytes(payload)


def decode_frame(buf: bytes | memoryview, namespace: bytes | None = None,
                 key: bytes | None = None, layout_fp: int | None = None,
                 ) -> tuple[FrameHeader, memoryview]:
    """Check a contiguous frame and return its header and (still encoded) payload."""
    view = memoryview(buf)
    header = FrameHeader.unpack(view)
    header.check(namespace, key, layout_fp)
    payload = view[HEADER_SIZE: HEADER_SIZE + header.payload_len]
    header.verify(payload)
    return header, payload
