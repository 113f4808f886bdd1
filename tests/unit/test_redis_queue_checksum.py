"""A borrowed Redis write tells its owner the payload checksum its frame was built with (so
the arena journal does not hash the block again), and only for an uncompressed frame."""

from __future__ import annotations

import numpy as np

from kvtier.frame import Codec, payload_checksum
from kvtier.tiers.redis_queue import PendingWrite, frame_pending


def _write(told: list[object]) -> tuple[PendingWrite, bytes]:
    data = np.random.default_rng(0).standard_normal(4096).astype(np.float16).tobytes()
    item = PendingWrite.borrow(b"kvtier:k", bytes(16), b"k" * 16, 7, 0, memoryview(data),
                               release=lambda: told.append("released"),
                               on_checksum=told.append)
    return item, data


def test_an_uncompressed_frame_hands_over_its_checksum_before_release() -> None:
    told: list[object] = []
    item, data = _write(told)
    frame_pending(item, Codec.NONE)
    item.done()
    item.done()   # once only
    assert told == [payload_checksum(data), "released"]


def test_a_compressed_or_unframed_write_hands_over_none() -> None:
    for codec in (Codec.LZ4, None):
        told: list[object] = []
        item, _ = _write(told)
        if codec is not None:
            frame_pending(item, codec)
            assert item.codec is Codec.LZ4
        item.done()   # dropped before it was framed, or its frame covers lz4 bytes
        assert told == [None, "released"]
