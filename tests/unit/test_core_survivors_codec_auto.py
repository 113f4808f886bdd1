"""AutoCodec and codec availability edges the main suites leave open (mutation review,
round 4): a codec is kept only for the configured gain, the first blocks wait for a first
sample, and a missing zstandard is reported as such."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier import codec as codecs
from kvtier.errors import ConfigError
from kvtier.frame import Codec


def slightly_compressible(n: int = 1 << 17) -> bytes:
    """Noise with a 5% run of zeros: every codec saves a little, none saves 10%."""
    zeros = n // 20
    return np.random.default_rng(11).bytes(n - zeros) + bytes(zeros)


def test_a_sample_keeps_a_codec_only_for_min_gain() -> None:
    """A codec that saves 5% when 10% is asked for costs CPU on every block for less than
    the operator accepted: the sample must choose NONE and store the block raw."""
    data = slightly_compressible()
    best = min(len(codecs.encode(c, data)) for c in codecs.AutoCodec().candidates)
    assert best < len(data)                      # some codec does save a little
    assert best > 0.9 * len(data)                # but less than min_gain
    auto = codecs.AutoCodec(min_gain=0.10)
    codec, body = auto.encode(data)
    assert codec is Codec.NONE and body == data and auto.current is Codec.NONE


def test_blocks_before_the_first_sample_finished_are_sampled_too() -> None:
    """Encodes that start while the first sample is still running (another thread took
    block 0) sample as well: taking the not-yet-chosen NONE would store the first blocks
    of a compressible workload raw."""
    auto = codecs.AutoCodec(sample_every=16)
    auto.blocks = 1            # block 0 is another thread's sample, still in flight
    kv = (np.random.default_rng(3).standard_normal(1 << 15).astype(np.float32).view(np.uint32)
          >> 16).astype(np.uint16).tobytes()   # bf16: its exponent plane compresses
    codec, body = auto.encode(kv)
    assert codec is not Codec.NONE and len(body) < len(kv)
    assert auto.samples == 1


def test_without_zstandard_shuffle_zstd_is_unavailable_and_refused_at_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each codec is available only with its own library: with lz4 but no zstandard a
    configured shuffle-zstd must fail at start, not on every write."""
    monkeypatch.setattr(codecs, "_zstd", None)
    assert not codecs.available(Codec.SHUFFLE_ZSTD)
    assert codecs.available(Codec.SHUFFLE_LZ4) == (codecs._lz4 is not None)
    with pytest.raises(ConfigError, match="zstandard"):
        codecs.from_config("shuffle-zstd")
    assert Codec.SHUFFLE_ZSTD not in codecs.AutoCodec().candidates


@pytest.mark.parametrize("codec", [c for c in (Codec.SHUFFLE_LZ4, Codec.SHUFFLE_ZSTD)
                                   if codecs.available(c)])
@pytest.mark.parametrize("elem_bytes", [0, 9, 16])
def test_an_element_width_no_reader_takes_is_refused_at_encode(codec: Codec,
                                                               elem_bytes: int) -> None:
    """Readers refuse widths outside 1..8: a writer that took one would store blocks no
    daemon can ever read back (each read a miss, the write wasted)."""
    with pytest.raises(ValueError, match="elem_bytes"):
        codecs.encode(codec, bytes(64), elem_bytes)
