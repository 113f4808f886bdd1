"""Aligned scratch memory the nvme tier's I/O threads share: header pages and bounce buffers.

A frame's header page is packed into (or read from) a per-thread aligned page, so O_DIRECT
can move it; a payload that is not aligned or shorter than its slot goes through a bounce
buffer taken from one shared pool (a frame's pieces run on several threads, so a per-thread
bounce buffer would not do). Every backend (POSIX, kvikio) and the split reads use these.
"""

from __future__ import annotations

import threading

from kvtier.tiers.aligned import PAGE, aligned_buffer

__all__ = ["ZERO_PAGE", "BouncePool", "ScratchPages", "bounces", "scratch"]

ZERO_PAGE = aligned_buffer(PAGE)   # never written: the erase pattern


class ScratchPages(threading.local):
    """Per-I/O-thread aligned header pages: ``wpage`` for writes, ``rpage`` for reads."""

    def __init__(self) -> None:
        self.wpage = aligned_buffer(PAGE)   # only its first HEADER_SIZE bytes are ever written
        self.rpage = aligned_buffer(PAGE)


class BouncePool:
    """Aligned bounce buffers shared by all I/O threads. Keeps at most ``keep`` free ones."""

    def __init__(self, keep: int = 8) -> None:
        self._free: list[memoryview] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """A buffer of at least ``nbytes`` bytes (slice it); hand it back with ``give``."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= nbytes:
                    return self._free.pop(i)
        return aligned_buffer(nbytes)

    def give(self, buf: memoryview) -> None:
        """Return a buffer from ``take`` (dropped when enough are kept already)."""
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


scratch = ScratchPages()
bounces = BouncePool()
