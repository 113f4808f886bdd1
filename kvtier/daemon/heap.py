"""Give the memory of large request frames back to the system once they are answered.

A frame of many megabytes (a 10^6-key request is 16 MB, refused after it is read) is held
two or three times over while it is decoded. glibc serves the first such buffer with mmap,
but freeing it raises glibc's mmap threshold to its size, so the next ones come from the
heap and stay there after they are freed: eight refused 10^6-key requests left a daemon
50-65 MiB larger for good (tests/integration/test_bounded_work.py; it passed only while
the daemon compiled its modules from source, whose freed memory the frames reused). After
a frame of at least ``TRIM_AFTER_BYTES``, ``HeapTrim`` asks glibc to return free heap pages
(``malloc_trim``), once per loop turn however many such frames ended in it. Elsewhere
(another libc) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable

__all__ = ["TRIM_AFTER_BYTES", "HeapTrim"]

TRIM_AFTER_BYTES = 4 << 20
"""Frames this large are rare (ordinary requests are a few KiB to tens of KiB); a trim
costs about a millisecond."""


def _glibc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim   # the process's own libc (no ldconfig run)
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrim:
    """``after(nbytes)``: a request frame of ``nbytes`` was answered (its memory freed)."""

    __slots__ = ("_pending", "_trim", "trims")

    def __init__(self) -> None:
        self._trim = _glibc_trim()
        self._pending = False
        self.trims = 0

    def after(self, nbytes: int) -> None:
        if nbytes < TRIM_AFTER_BYTES or self._trim is None or self._pending:
            return
        self._pending = True
        asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._pending = False
        if self._trim is not None:
            self._trim(0)
            self.trims += 1
