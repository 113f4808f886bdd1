"""Measuring what a step allocates (for tests that a hostile input costs no big buffer)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def peak_bytes() -> Iterator[list[int]]:
    """The peak of Python allocations (every thread) inside the block, in ``[0]``."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    got = [0]
    try:
        yield got
    finally:
        got[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
