"""Block frames: exact round trips; any corruption, truncation or mix-up is detected."""

from __future__ import annotations

import itertools
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ChecksumError, FrameError
from kvtier.frame import (
    _STRUCT,
    FLAG_STRIPED,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_PAYLOAD,
    STRIPE_BYTES,
    Codec,
    FrameHeader,
    decode_frame,
    encode_frame,
    make_header,
    payload_checksum,
    stripe_bounds,
)

NS = bytes(range(16))
KEY = bytes(range(100, 116))
FP = 0xDEAD_BEEF_0123_4567
PAYLOAD = bytes(range(256)) * 4


def frame(payload: bytes = PAYLOAD, **kwargs: object) -> bytes:
    return encode_frame(make_header(NS, KEY, FP, payload, **kwargs), payload)  # type: ignore[arg-type]


def flip(buf: bytes, bit: int) -> bytes:
    out = bytearray(buf)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def raw_header(*, version: int = FORMAT_VERSION, codec: int = 0, plen: int = 4,
               rlen: int = 4, magic: bytes = MAGIC) -> bytes:
    """A header with a *valid* self-check but arbitrary field values."""
    body = _STRUCT.pack(magic, version, codec, 0, NS, KEY, FP, plen, rlen, 0, 0, 0)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def test_header_is_96_bytes() -> None:
    assert HEADER_SIZE == 96
    assert len(make_header(NS, KEY, FP, PAYLOAD).pack()) == HEADER_SIZE


def test_round_trip() -> None:
    header, payload = decode_frame(frame(), NS, KEY, FP)
    assert bytes(payload) == PAYLOAD
    assert header == make_header(NS, KEY, FP, PAYLOAD)
    assert (header.payload_len, header.raw_len, header.codec) == (1024, 1024, Codec.NONE)
    assert header.checksum == payload_checksum(PAYLOAD)


def test_round_trip_of_an_empty_payload() -> None:
    header, payload = decode_frame(frame(b""), NS, KEY, FP)
    assert bytes(payload) == b""
    assert header.payload_len == 0


def test_decode_ignores_padding_after_the_payload() -> None:
    _, payload = decode_frame(frame() + bytes(4096), NS, KEY, FP)
    assert bytes(payload) == PAYLOAD


def test_none_skips_identity_checks() -> None:
    header, _ = decode_frame(frame())
    assert (header.namespace, header.key, header.layout_fp) == (NS, KEY, FP)


@settings(max_examples=100, deadline=None)
@given(ns=st.binary(min_size=16, max_size=16), key=st.binary(min_size=16, max_size=16),
       fp=st.integers(0, 2**64 - 1), plen=st.integers(0, MAX_PAYLOAD),
       rlen=st.integers(0, MAX_PAYLOAD), csum=st.integers(0, 2**64 - 1),
       codec=st.sampled_from(list(Codec)), seq=st.integers(0, 2**64 - 1))
def test_pack_and_unpack_are_inverses(ns: bytes, key: bytes, fp: int, plen: int, rlen: int,
                                      csum: int, codec: Codec, seq: int) -> None:
    header = FrameHeader(ns, key, fp, plen, rlen, csum, codec, seq)
    assert FrameHeader.unpack(header.pack()) == header


def test_encoded_header_keeps_codec_raw_len_and_seq() -> None:
    header, _ = decode_frame(frame(raw_len=4096, codec=Codec.SHUFFLE_ZSTD, seq=77))
    assert (header.raw_len, header.codec, header.seq) == (4096, Codec.SHUFFLE_ZSTD, 77)


def test_every_single_bit_flip_of_the_header_is_detected() -> None:
    good = frame(seq=123456789)
    for bit in range(HEADER_SIZE * 8):
        with pytest.raises(FrameError):
            decode_frame(flip(good, bit), NS, KEY, FP)
        # even without identity checks the header's own checksum catches it
        with pytest.raises(FrameError):
            FrameHeader.unpack(flip(good, bit)[:HEADER_SIZE])


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(min_size=1, max_size=2048), data=st.data())
def test_every_single_bit_flip_of_the_payload_is_detected(payload: bytes,
                                                          data: st.DataObject) -> None:
    good = frame(payload)
    bit = data.draw(st.integers(HEADER_SIZE * 8, len(good) * 8 - 1), label="bit")
    with pytest.raises(ChecksumError):
        decode_frame(flip(good, bit), NS, KEY, FP)


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=512), data=st.data())
def test_every_single_bit_flip_anywhere_is_detected(payload: bytes, data: st.DataObject) -> None:
    good = frame(payload)
    bit = data.draw(st.integers(0, len(good) * 8 - 1), label="bit")
    with pytest.raises(FrameError):
        decode_frame(flip(good, bit), NS, KEY, FP)


@pytest.mark.parametrize(("ns", "key", "fp", "what"), [
    (NS, bytes(16), FP, "another key"),
    (bytes(16), KEY, FP, "another namespace"),
    (NS, KEY, FP + 1, "layout"),
])
def test_a_frame_of_another_block_is_rejected(ns: bytes, key: bytes, fp: int, what: str) -> None:
    with pytest.raises(FrameError, match=what):
        decode_frame(frame(), ns, key, fp)


@pytest.mark.parametrize("cut", [0, 1, 4, HEADER_SIZE // 2, HEADER_SIZE - 1])
def test_truncated_header_is_rejected(cut: int) -> None:
    with pytest.raises(FrameError, match="truncated"):
        decode_frame(frame()[:cut], NS, KEY, FP)


@pytest.mark.parametrize("missing", [1, 100, len(PAYLOAD)])
def test_truncated_payload_is_rejected(missing: int) -> None:
    with pytest.raises(ChecksumError, match="length"):
        decode_frame(frame()[:-missing], NS, KEY, FP)


def test_wrong_payload_of_the_right_length_is_rejected() -> None:
    header = make_header(NS, KEY, FP, PAYLOAD)
    with pytest.raises(ChecksumError, match="checksum"):
        header.verify(bytes(len(PAYLOAD)))
    header.verify(memoryview(PAYLOAD))  # the same bytes through a view pass


def test_zeroed_header_is_not_a_frame() -> None:
    with pytest.raises(FrameError, match="magic"):
        FrameHeader.unpack(bytes(HEADER_SIZE))


@pytest.mark.parametrize(("kwargs", "what"), [
    ({"version": FORMAT_VERSION + 1}, "version"),
    ({"codec": 200}, "codec"),
    ({"plen": MAX_PAYLOAD + 1}, "length"),
    ({"rlen": 2**64 - 1}, "length"),
    ({"magic": b"KVTX"}, "magic"),
])
def test_self_consistent_but_invalid_headers_are_rejected(kwargs: dict[str, object],
                                                          what: str) -> None:
    with pytest.raises(FrameError, match=what):
        FrameHeader.unpack(raw_header(**kwargs))  # type: ignore[arg-type]


def test_header_check_runs_on_a_memoryview_with_trailing_bytes() -> None:
    buf = memoryview(bytearray(frame()))
    assert FrameHeader.unpack(buf) == FrameHeader.unpack(bytes(buf[:HEADER_SIZE]))


def test_stripe_bounds_cover_a_payload_in_order() -> None:
    for size in (1, STRIPE_BYTES - 1, STRIPE_BYTES, 3 * STRIPE_BYTES + 5):
        bounds = stripe_bounds(size)
        assert bounds[0][0] == 0 and bounds[-1][1] == size
        assert all(hi - lo <= STRIPE_BYTES for lo, hi in bounds)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert len(stripe_bounds(3 * STRIPE_BYTES + 5)) == 4


def test_a_striped_head_read_by_a_get_is_a_miss_not_corruption() -> None:
    """A GET of a striped block's key holds the header and stripe 0 only: that length is
    what the header promises there (not corrupt), and the GET path leaves the block to the
    striped read."""
    from kvtier.tiers.redis_blocks import ReadStatus, _Placer, judge_header

    size = 3 * STRIPE_BYTES
    header = FrameHeader(bytes(16), b"k" * 16, 7, size, size, 0, flags=FLAG_STRIPED)
    wire_head = HEADER_SIZE + STRIPE_BYTES
    verdict = judge_header(header.pack(), b"k" * 16, size, bytes(16), 7, wire_head)
    assert verdict == header
    short = judge_header(header.pack(), b"k" * 16, size, bytes(16), 7, wire_head - 1)
    assert not isinstance(short, FrameHeader) and short.status is ReadStatus.CORRUPT
    whole = judge_header(header.pack(), b"k" * 16, size, bytes(16), 7, HEADER_SIZE + size)
    assert not isinstance(whole, FrameHeader) and whole.status is ReadStatus.CORRUPT
    place = _Placer([b"k" * 16], [memoryview(bytearray(size))], bytes(16), 7)
    assert place(0, header.pack(), wire_head) is None        # nothing read into the block
    read = place.reads[0]
    assert read is not None and read.status is ReadStatus.MISSING
