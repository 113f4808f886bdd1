"""Codecs: exact round trips (any length, any element width), decoding into a caller's
buffer, corrupt payloads as FrameError, and AutoCodec keeping a codec only while it pays."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import codec as codecs
from kvtier.errors import ConfigError, FrameError
from kvtier.frame import Codec

USABLE = [c for c in Codec if codecs.available(c)]


def kv_like(n_elems: int, dtype: str = "fp16", seed: int = 0) -> bytes:
    """Normal-distributed values as fp16 or bf16 bytes (bf16 = top half of fp32)."""
    f = np.random.default_rng(seed).standard_normal(n_elems).astype(np.float32)
    if dtype == "fp16":
        return f.astype(np.float16).tobytes()
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=5000), elem_bytes=st.integers(1, 8),
       codec=st.sampled_from(USABLE))
def test_round_trip_any_bytes(data: bytes, elem_bytes: int, codec: Codec) -> None:
    enc = codecs.encode(codec, memoryview(data), elem_bytes)
    assert codecs.decode(codec, enc, len(data)) == data
    out = bytearray(len(data) + 7)  # larger than needed: only the front is written
    view = codecs.decode(codec, enc, len(data), memoryview(out))
    assert bytes(view) == data and bytes(out[len(data):]) == bytes(7)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 20000), dtype=st.sampled_from(["fp16", "bf16"]),
       seed=st.integers(0, 1000))
def test_round_trip_kv_data(n: int, dtype: str, seed: int) -> None:
    data = kv_like(n, dtype, seed)
    for codec in USABLE:
        out = bytearray(len(data))
        codecs.decode(codec, codecs.encode(codec, data), len(data), memoryview(out))
        assert out == data, codec


def test_decode_into_typed_view() -> None:
    data = kv_like(1000)
    out = np.zeros(1000, dtype=np.float16)
    for codec in USABLE:
        out[:] = 0
        codecs.decode(codec, codecs.encode(codec, data), len(data), out.data)
        assert out.tobytes() == data


def test_shuffle_groups_bytes_into_planes() -> None:
    planes, tail = codecs.split_planes(bytes([1, 2, 1, 2, 1, 2, 9]), 2)
    assert [p.tobytes() for p in planes] == [b"\x01\x01\x01", b"\x02\x02\x02"]
    assert tail == b"\x09"


@pytest.mark.parametrize("codec", [c for c in USABLE if c is not Codec.NONE])
def test_corrupt_payload_is_frame_error(codec: Codec) -> None:
    data = kv_like(4096)
    enc = bytearray(codecs.encode(codec, data))
    with pytest.raises(FrameError):
        codecs.decode(codec, bytes(enc[: len(enc) // 2]), len(data))
    with pytest.raises(FrameError):
        codecs.decode(codec, bytes(len(enc)), len(data))
    with pytest.raises(FrameError):
        codecs.decode(codec, codecs.encode(codec, data), len(data) + 2)


def test_none_length_mismatch_and_small_buffer() -> None:
    with pytest.raises(FrameError):
        codecs.decode(Codec.NONE, b"abc", 4)
    with pytest.raises(ValueError):
        codecs.decode(Codec.NONE, b"abcd", 4, memoryview(bytearray(3)))


@pytest.mark.skipif(not codecs.available(Codec.SHUFFLE_ZSTD), reason="zstandard not installed")
@pytest.mark.parametrize(("dtype", "low"), [("fp16", 1.12), ("bf16", 1.35)])
def test_shuffle_zstd_gains_on_kv(dtype: str, low: float) -> None:
    data = kv_like(1 << 17, dtype)
    ratio = len(data) / len(codecs.encode(Codec.SHUFFLE_ZSTD, data))
    assert ratio > low
    assert len(data) / len(codecs.encode(Codec.LZ4, data)) < 1.02  # plain lz4: no gain


def test_auto_keeps_a_codec_only_while_it_gains() -> None:
    auto = codecs.AutoCodec(sample_every=4)
    kv = kv_like(1 << 16, "bf16")
    chosen = {auto.encode(kv)[0] for _ in range(8)}
    assert Codec.NONE not in chosen and auto.current is not Codec.NONE
    noise = np.random.default_rng(1).bytes(1 << 17)
    results = [auto.encode(noise) for _ in range(8)]
    assert auto.current is Codec.NONE  # dropped once the gain went away
    for c, body in results:
        assert len(body) <= len(noise)  # never stores an expanded block
        assert codecs.decode(c, body, len(noise)) == noise
    assert auto.samples == 4 and auto.ratio > 1.0


def test_auto_on_incompressible_data_stays_none() -> None:
    auto = codecs.AutoCodec(sample_every=16)
    noise = np.random.default_rng(2).bytes(1 << 16)
    assert all(auto.encode(noise)[0] is Codec.NONE for _ in range(20))
    assert auto.ratio == 1.0


def test_config_names() -> None:
    assert codecs.from_config("none") is Codec.NONE
    assert codecs.from_config("shuffle-lz4") is Codec.SHUFFLE_LZ4
    assert codecs.from_config("auto") is None
    with pytest.raises(ConfigError):
        codecs.from_config("gzip")


def test_auto_drops_between_samples_when_gain_fades() -> None:
    auto = codecs.AutoCodec(sample_every=1000)
    assert auto.encode(kv_like(1 << 16, "bf16"))[0] is not Codec.NONE
    noise = np.random.default_rng(3).bytes(1 << 17)
    for _ in range(10):
        auto.encode(noise)
    assert auto.current is Codec.NONE and auto.samples == 1


# --- hostile payloads: never decoded into more than their block -------------------------

@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=5000), elem_bytes=st.integers(1, 8),
       codec=st.sampled_from(USABLE))
def test_max_encoded_len_bounds_what_kvtier_writes(data: bytes, elem_bytes: int,
                                                    codec: Codec) -> None:
    """Readers refuse a frame whose payload is longer than ``max_encoded_len``: kvtier's
    own payloads, of any bytes, never are (noise included, where lz4 expands)."""
    enc = codecs.encode(codec, memoryview(data), elem_bytes)
    assert len(enc) <= codecs.max_encoded_len(codec, len(data))


def zstd_plane_payload(blob: bytes, count: int) -> bytes:
    """A SHUFFLE_ZSTD payload of 2-byte elements: plane 0 the zstd ``blob`` (``count``
    bytes once decoded), plane 1 stored raw."""
    return (bytes([2]) + struct.pack("<BI", 1, len(blob)) + struct.pack("<BI", 0, count)
            + blob + bytes(count))


@pytest.mark.skipif(not codecs.available(Codec.SHUFFLE_ZSTD), reason="zstandard not installed")
def test_kvtier_zstd_planes_declare_no_size_and_a_small_window() -> None:
    """What the reader's checks admit: kvtier's writer declares no content size (-1) and
    a window within ``ZSTD_MAX_WINDOW``."""
    data = kv_like(1 << 22, "bf16")   # 8 MiB: planes of 4 MiB
    enc = codecs.encode(Codec.SHUFFLE_ZSTD, data)
    sizes = [struct.unpack_from("<BI", enc, 1 + 5 * j) for j in range(2)]
    pos = 11
    for mode, size in sizes:
        if mode == 1:
            params = zstandard.get_frame_parameters(enc[pos:pos + size])
            assert zstandard.frame_content_size(enc[pos:pos + size]) == -1
            assert params.window_size <= codecs.ZSTD_MAX_WINDOW
        pos += size
    assert any(mode == 1 for mode, _ in sizes)
    assert codecs.decode(Codec.SHUFFLE_ZSTD, enc, len(data)) == data


@pytest.mark.skipif(not codecs.available(Codec.SHUFFLE_ZSTD), reason="zstandard not installed")
def test_a_zstd_plane_declaring_another_size_is_refused_before_it_is_decoded() -> None:
    """A zip bomb: a 1 KiB zstd plane that declares 32 MiB (python-zstandard allocates a
    declared size whatever max_output_size says). Refused with no allocation of it."""
    count = 32 << 10
    bomb = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(bytes(32 << 20))
    payload = zstd_plane_payload(bomb, count)
    out = memoryview(bytearray(2 * count))
    tracemalloc.start()
    try:
        with pytest.raises(FrameError, match="declares"):
            codecs.decode(Codec.SHUFFLE_ZSTD, payload, 2 * count, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    # the same plane declaring its true size decodes
    plane = np.random.default_rng(4).integers(0, 4, count, dtype=np.uint8).tobytes()
    honest = zstandard.ZstdCompressor(write_content_size=True).compress(plane)
    got = codecs.decode(Codec.SHUFFLE_ZSTD, zstd_plane_payload(honest, count), 2 * count)
    assert got[0::2] == plane and got[1::2] == bytes(count)


@pytest.mark.skipif(not codecs.available(Codec.SHUFFLE_ZSTD), reason="zstandard not installed")
def test_a_zstd_plane_asking_for_a_window_beyond_the_bound_is_refused() -> None:
    count = 4096
    params = zstandard.ZstdCompressionParameters.from_level(
        1, window_log=27, write_content_size=False)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    blob = stream.compress(bytes(count)) + stream.flush()   # no size known: window 2**27
    assert zstandard.get_frame_parameters(blob).window_size > codecs.ZSTD_MAX_WINDOW
    with pytest.raises(FrameError):
        codecs.decode(Codec.SHUFFLE_ZSTD, zstd_plane_payload(blob, count), 2 * count)
