"""Frame and codec edges the main suites leave open (mutation review, round 4): crafted
frames and payloads that a hostile Redis peer could write are refused, never decoded."""

from __future__ import annotations

import struct

import lz4.block
import numpy as np
import pytest
import xxhash
import zstandard

from kvtier import codec as codecs
from kvtier.errors import FrameError
from kvtier.frame import (
    _STRUCT,
    FLAG_CHAIN,
    FLAG_PARENT,
    FORMAT_VERSION,
    MAGIC,
    Codec,
    FrameHeader,
    make_header,
    parent_tag,
    payload_checksum,
    stripe_bounds,
)

NS = bytes(range(16))
KEY = bytes(range(100, 116))
FP = 0x0123_4567_89AB_CDEF


def crafted_header(*, version: int = FORMAT_VERSION, plen: int = 4, rlen: int = 4,
                   seq: int = 0, flags: int = 0, parent: int = 0) -> bytes:
    """A header whose self-check is valid, with any field values (what a peer can write)."""
    body = _STRUCT.pack(MAGIC, version, 0, flags, NS, KEY, FP, plen, rlen, 0, seq, parent)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, 0xFFFF])
def test_a_frame_of_any_other_version_is_refused(version: int) -> None:
    """Only FORMAT_VERSION is read: an older (or crafted version-0) header would be parsed
    with this version's field meanings, so a `>` check alone lets such frames through."""
    assert version != FORMAT_VERSION
    with pytest.raises(FrameError, match="version"):
        FrameHeader.unpack(crafted_header(version=version))


def test_unpack_keeps_seq_flags_and_parent() -> None:
    """seq names a striped write's stripes and flags/parent place the block in its chain:
    a reader that drops one reads other stripes or drops live chains at a restart."""
    raw = crafted_header(seq=0xABCD_0123_4567_89EF, flags=0b1011, parent=0x1122_3344_5566_7788)
    header = FrameHeader.unpack(raw)
    assert (header.seq, header.flags, header.parent) == (
        0xABCD_0123_4567_89EF, 0b1011, 0x1122_3344_5566_7788)
    assert header.pack() == raw


def test_the_parent_tag_on_disk_is_the_first_8_bytes_of_the_parent_key() -> None:
    """The format says so: frames written by an earlier daemon (or another writer) are
    matched to their chain by these bytes at a restart; another byte order drops them."""
    parent = bytes(range(200, 216))
    header = make_header(NS, KEY, FP, b"abcd", chain=(parent,))
    assert header.flags == FLAG_CHAIN | FLAG_PARENT and header.chain_parent == parent_tag(parent)
    packed = header.pack()
    offset = _STRUCT.size - 8   # parent tag: the last u64 before the header's own check
    assert packed[offset:offset + 8] == parent[:8]


def test_a_chain_head_has_no_parent_and_an_unplaced_frame_none_either() -> None:
    """A head (FLAG_CHAIN without FLAG_PARENT) reads as parentless: read as having parent
    tag 0, a restart would look for a parent no chain holds and drop the whole chain."""
    head = make_header(NS, KEY, FP, b"abcd", chain=(None,))
    assert head.flags == FLAG_CHAIN and head.chain_parent is None
    assert FrameHeader.unpack(head.pack()).chain_parent is None
    unplaced = make_header(NS, KEY, FP, b"abcd")
    assert unplaced.flags == 0 and unplaced.chain_parent is None


def test_make_header_takes_a_checksum_hashed_elsewhere() -> None:
    """Callers hash big payloads off the event loop and pass the result: rehashing here
    would put that work (GIL held for small blocks) back on the loop."""
    header = make_header(NS, KEY, FP, b"abcd", checksum=0x5EED)
    assert header.checksum == 0x5EED
    assert make_header(NS, KEY, FP, b"abcd").checksum == payload_checksum(b"abcd")


def test_an_empty_payload_still_has_its_head_stripe() -> None:
    """Stripe 0 is the head's own value (after the header), so every payload has it:
    readers index it unconditionally (redis_stripes reads dests[0])."""
    assert stripe_bounds(0) == [(0, 0)]
    assert stripe_bounds(1) == [(0, 1)]


# --- codecs: crafted shuffled payloads ----------------------------------------------------

SHUFFLED = [c for c in (Codec.SHUFFLE_LZ4, Codec.SHUFFLE_ZSTD) if codecs.available(c)]
PLANE = struct.Struct("<BI")


def shuffled(planes: list[tuple[int, bytes]], tail: bytes = b"") -> bytes:
    """A shuffled payload by hand: element width, (mode, length) per plane, blobs, tail."""
    heads = b"".join(PLANE.pack(mode, len(blob)) for mode, blob in planes)
    return bytes((len(planes),)) + heads + b"".join(b for _, b in planes) + tail


@pytest.mark.parametrize("codec", SHUFFLED)
def test_a_plane_that_does_not_compress_is_stored_raw(codec: Codec) -> None:
    """A plane stays compressed only when that saves _MIN_PLANE_GAIN: kept when merely
    no larger (or a little larger), noise planes push a payload past max_encoded_len and
    every reader refuses kvtier's own block."""
    data = np.random.default_rng(7).bytes(1 << 16)
    enc = codecs.encode(codec, data, 2)
    assert len(enc) == 1 + 2 * PLANE.size + len(data)     # both planes raw, no tail
    assert [PLANE.unpack_from(enc, 1 + j * PLANE.size)[0] for j in range(2)] == [0, 0]
    assert len(enc) <= codecs.max_encoded_len(codec, len(data))


def one_byte_blob(codec: Codec) -> bytes:
    """A compressed plane that decodes to the single byte 7 (declaring no size)."""
    if codec is Codec.SHUFFLE_LZ4:
        return bytes(lz4.block.compress(b"\x07", store_size=False))
    return bytes(zstandard.ZstdCompressor(write_content_size=False).compress(b"\x07"))


@pytest.mark.parametrize("codec", SHUFFLED)
def test_a_plane_shorter_than_its_elements_is_refused(codec: Codec) -> None:
    """A one-byte plane where four are due would broadcast over the whole column (numpy
    assignment): four bytes the writer never stored, handed out as the block."""
    raw_short = shuffled([(0, b"\x01" * 4), (0, b"\x07")])
    with pytest.raises(FrameError):
        codecs.decode(codec, raw_short, 8)
    packed = one_byte_blob(codec)
    packed_short = shuffled([(0, b"\x01" * 4), (1, packed)])
    with pytest.raises(FrameError):
        codecs.decode(codec, packed_short, 8, memoryview(bytearray(8)))


@pytest.mark.parametrize("codec", SHUFFLED)
@pytest.mark.parametrize("mode", [2, 255])
def test_a_plane_of_an_unknown_mode_is_refused(codec: Codec, mode: int) -> None:
    """Modes are 0 (raw) and 1 (compressed); any other is a malformed payload, not a
    compressed plane to try."""
    ok = codecs.encode(codec, bytes(4096), 1)
    assert PLANE.unpack_from(ok, 1)[0] == 1        # a compressible plane: mode 1
    bad = bytearray(ok)
    bad[1] = mode
    assert codecs.decode(codec, ok, 4096) == bytes(4096)
    with pytest.raises(FrameError, match="malformed"):
        codecs.decode(codec, bytes(bad), 4096)


@pytest.mark.parametrize("codec", SHUFFLED)
def test_a_payload_with_bytes_after_its_tail_is_refused(codec: Codec) -> None:
    """The payload is exactly element width, table, planes and tail: one byte more is a
    corrupt or crafted frame (numpy would broadcast it into an empty tail silently)."""
    data = bytes(range(256)) * 4
    enc = codecs.encode(codec, data, 2)
    assert codecs.decode(codec, enc, len(data)) == data
    with pytest.raises(FrameError, match="tail"):
        codecs.decode(codec, enc + b"\x00", len(data))


def test_a_none_payload_longer_than_its_block_is_refused() -> None:
    """A NONE payload is the block: one byte more must not come back as a block of
    raw_len + 1 bytes (nor be cut silently into the caller's buffer)."""
    with pytest.raises(FrameError):
        codecs.decode(Codec.NONE, b"abcde", 4)
    with pytest.raises(FrameError):
        codecs.decode(Codec.NONE, b"abcde", 4, memoryview(bytearray(8)))
    assert codecs.decode(Codec.NONE, b"abcd", 4) == b"abcd"
    assert codecs.max_encoded_len(Codec.NONE, 4) == 4   # readers refuse longer at the header
