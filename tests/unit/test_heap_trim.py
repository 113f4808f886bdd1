"""``HeapTrim``: after a request frame of ``TRIM_AFTER_BYTES`` or more is answered, glibc
is asked once per loop turn to give free heap pages back (a 16 MB frame's buffers stayed
with the daemon for good: tests/integration/test_bounded_work.py measures the daemon)."""

from __future__ import annotations

import asyncio

from kvtier.daemon.heap import TRIM_AFTER_BYTES, HeapTrim


async def test_large_frames_trim_once_per_loop_turn_and_small_ones_never() -> None:
    heap = HeapTrim()
    assert heap._trim is not None   # glibc on these machines
    heap.after(64 << 10)            # an ordinary request
    await asyncio.sleep(0)
    assert heap.trims == 0
    for _ in range(3):              # three large frames answered in one turn
        heap.after(TRIM_AFTER_BYTES)
    await asyncio.sleep(0)
    assert heap.trims == 1
    heap.after(16 << 20)            # the next turn's
    await asyncio.sleep(0)
    assert heap.trims == 2
