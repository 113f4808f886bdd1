"""The checksums equal the frame checksum, natively or not; background hashing of small
blocks leaves the GIL to other threads."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import numpy as np
import pytest

from kvtier import checksum as rc
from kvtier.errors import ChecksumError
from kvtier.frame import Codec, make_header, payload_checksum


@pytest.mark.parametrize("size", [0, 1, 95, 4096, rc.PACKAGE_RELEASES_ABOVE,
                                  rc.PACKAGE_RELEASES_ABOVE + 1, 3 * 2**20 + 7])
def test_checksum_equals_frame_checksum(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8)
    want = payload_checksum(data.tobytes())
    assert rc.checksum(data.tobytes()) == want                 # bytes (read-only)
    assert rc.checksum(memoryview(bytearray(data.tobytes()))) == want  # writable slot
    assert rc.checksum(data.data) == want                      # numpy-backed view
    assert rc.checksums_in_background([data, data.tobytes(), data.data]) == [want] * 3


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


class _FakeLibxxhash:
    """Stands for ``ctypes.CDLL(name)``: an XXH3_64bits that hashes as the package does up
    to ``right_up_to`` bytes and gives another number above (a broken build's SIMD path)."""

    def __init__(self, right_up_to: int) -> None:
        def xxh3(address: int, size: int) -> int:
            right = payload_checksum(ctypes.string_at(address, size))
            return right if size <= right_up_to else right ^ 1

        self.XXH3_64bits = xxh3   # (restype and argtypes are set on it: a plain attribute)

    def __call__(self, name: str) -> _FakeLibxxhash:
        return self


def test_a_libxxhash_that_disagrees_with_the_package_is_not_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's XXH3 is checked on sample inputs before it is used: one that gives
    another hash than the package for some size (here only above 4 KiB) would make
    background-hashed checksums disagree with the frames', so every block it hashed would
    read as corrupt (or a corrupt one as sound). It is not used; one that agrees is."""
    monkeypatch.setattr(rc.ctypes, "CDLL", _FakeLibxxhash(right_up_to=1 << 40))
    assert rc._load() is not None
    monkeypatch.setattr(rc.ctypes, "CDLL", _FakeLibxxhash(right_up_to=4096))
    assert rc._load() is None


def test_fallback_without_the_native_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rc, "_XXH3", None)
    data = bytes(range(256)) * 1024
    assert not rc.native() and rc.checksum(data) == payload_checksum(data)
    assert rc.checksums_in_background([data, data[:100]]) == [payload_checksum(data),
                                                              payload_checksum(data[:100])]


@pytest.mark.skipif(not rc.native(), reason="libxxhash is not installed")
def test_background_hashing_of_small_blocks_lets_other_threads_run() -> None:
    """With a switch interval longer than the whole job, a thread that held the GIL from
    block to block would keep this one from waking until it was done; the library's calls
    release it for each block, so this thread wakes many times while the blocks are
    hashed (4096 x 64 KiB, one cache-warm buffer: ~10 ms of hashing)."""
    block = np.random.default_rng(3).integers(0, 256, rc.PACKAGE_RELEASES_ABOVE, np.uint8)
    blocks = [block] * 4096
    want = payload_checksum(block.data)
    got: list[list[int]] = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        worker = threading.Thread(target=lambda: got.append(rc.checksums_in_background(blocks)))
        worker.start()
        wakeups = 0
        while worker.is_alive():
            time.sleep(0.0001)   # releases the GIL; waking needs it back
            wakeups += 1
        worker.join()
    finally:
        sys.setswitchinterval(old)
    assert got == [[want] * 4096]
    assert wakeups >= 5, wakeups
