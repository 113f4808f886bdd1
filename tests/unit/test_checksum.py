"""The GIL-free checksum equals the frame checksum, natively or not."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier import checksum as rc
from kvtier.errors import ChecksumError
from kvtier.frame import Codec, make_header, payload_checksum


@pytest.mark.parametrize("size", [0, 1, 95, 4096, rc.NATIVE_MIN_BYTES - 1,
                                  rc.NATIVE_MIN_BYTES, 3 * 2**20 + 7])
def test_checksum_equals_frame_checksum(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8)
    want = payload_checksum(data.tobytes())
    assert rc.checksum(data.tobytes()) == want                 # bytes (read-only)
    assert rc.checksum(memoryview(bytearray(data.tobytes()))) == want  # writable slot
    assert rc.checksum(memoryview(data)) == want               # numpy-backed view


def test_header_and_verify_match_frame_module() -> None:
    payload = np.random.default_rng(1).integers(0, 256, 200_000, np.uint8).tobytes()
    ns, key = bytes(range(16)), bytes(16)
    ours = rc.header_for(ns, key, 7, payload, raw_len=300_000, codec=Codec.LZ4, seq=3)
    assert ours == make_header(ns, key, 7, payload, raw_len=300_000, codec=Codec.LZ4, seq=3)
    rc.verify(ours, payload)
    bad = bytearray(payload)
    bad[123_456] ^= 1
    with pytest.raises(ChecksumError):
        rc.verify(ours, bytes(bad))
    with pytest.raises(ChecksumError):
        rc.verify(ours, payload[:-1])


def test_fallback_without_the_native_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rc, "_XXH3", None)
    data = bytes(range(256)) * 1024
    assert not rc.native() and rc.checksum(data) == payload_checksum(data)
