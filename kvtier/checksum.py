"""The frame payload checksum (xxh3-64), and background hashing that leaves the loop be.

``checksum`` is the ``xxhash`` package's xxh3-64: since xxhash 4.0 it releases the GIL while
it hashes more than ``PACKAGE_RELEASES_ABOVE`` bytes, so the Redis tier's threads hash large
blocks in parallel with sends, receives and the event loop, and since 4.1 it picks AVX2 or
AVX-512 at run time (35 GB/s here against 19 GB/s for a distribution's libxxhash).

A block of 64 KiB or less is hashed with the GIL held. One such block costs the loop
microseconds, but a worker thread hashing a thousand of them in a row (the arena journal
hashing a long prompt's committed puts) keeps the GIL for the interpreter's whole switch
interval: while 64 MiB of such blocks were hashed, pings of the event loop waited 3.4-4.2
ms (median) instead of 0.05 ms (benchmarks/bench_hashing.py). ``checksums_in_background``
therefore hashes small blocks with the reference xxHash library (``libxxhash``, as shipped
by Linux distributions) through ctypes, which releases the GIL for each call, and larger
ones with the package. The library's result is checked at import against the package's on
sample inputs; without the library, or on any disagreement, the package hashes them all.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.errors import ChecksumError
from kvtier.frame import Codec, FrameHeader, payload_checksum

# xxhash >= 4.0 hashes with the GIL released above this many bytes (its XXHASH_GIL_MINSIZE)
PACKAGE_RELEASES_ABOVE = 64 << 10


def _load() -> Callable[[int, int], int] | None:
    """libxxhash's XXH3_64bits(address, size), or None when absent or disagreeing."""
    # The sonames are tried directly: ``ctypes.util.find_library`` runs ``ldconfig -p`` in
    # a subprocess, which an import must not do.
    fn = None
    for name in ("libxxhash.so.0", "libxxhash.so"):
        try:
            fn = ctypes.CDLL(name).XXH3_64bits
            break
        except (OSError, AttributeError):
            continue
    if fn is None:
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    rng = np.random.default_rng(0)
    for size in (0, 1, 17, 240, 4096, PACKAGE_RELEASES_ABOVE + 3):
        sample = rng.integers(0, 256, size, np.uint8)
        if fn(sample.ctypes.data, size) != payload_checksum(sample.tobytes()):
            return None
    return fn


_XXH3 = _load()


def native() -> bool:
    """Whether background hashing of small blocks runs without the GIL."""
    return _XXH3 is not None


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``payload``, the same number as ``kvtier.frame.payload_checksum``."""
    return payload_checksum(memoryview(payload))


def checksums_in_background(payloads: Sequence[Any]) -> list[int]:
    """``checksum`` of each of ``payloads`` (contiguous numpy arrays or buffers), none of
    them hashed with the GIL held when libxxhash is there: for a worker thread whose hashing
    must not hold up the event loop."""
    fn = _XXH3
    out = []
    for payload in payloads:
        arr = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)
        if fn is None or arr.nbytes > PACKAGE_RELEASES_ABOVE:
            out.append(payload_checksum(payload))
        else:
            out.append(int(fn(arr.ctypes.data, arr.nbytes)))
    return out


def header_for(namespace: bytes, key: bytes, layout_fp: int, payload: bytes | memoryview,
               *, raw_len: int | None = None, codec: Codec = Codec.NONE,
               seq: int = 0, flags: int = 0) -> FrameHeader:
    """``kvtier.frame.make_header`` with the checksum computed here (same header)."""
    size = memoryview(payload).nbytes
    return FrameHeader(namespace, key, layout_fp, size, size if raw_len is None else raw_len,
                       checksum(payload), codec, seq, flags)


def verify(header: FrameHeader, payload: bytes | memoryview) -> None:
    """``FrameHeader.verify`` with the checksum computed here: raises ChecksumError."""
    size = memoryview(payload).nbytes
    if size != header.payload_len:
        raise ChecksumError(f"payload length {size} differs from header {header.payload_len}")
    if checksum(payload) != header.checksum:
        raise ChecksumError("payload checksum mismatch")
