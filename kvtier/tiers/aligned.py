"""Pages, page-aligned buffers and byte views: the one PAGE and round_up of kvtier.tiers.

O_DIRECT needs the memory address, the file offset and the length of every transfer to be
multiples of the logical block size. 4096 covers every disk and file system we target, so
the nvme tier aligns everything to ``PAGE``. Buffers come from numpy (a core dependency)
over-allocated by one page and sliced to the first aligned address, so they are released
like any Python object (no mmap lifetime rules) and large ones are lazily zeroed by calloc.
"""

from __future__ import annotations

import numpy as np

PAGE = 4096


def round_up(n: int, to: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``to`` (a page by default): slot and I/O sizes."""
    return (n + to - 1) // to * to


def aligned_buffer(nbytes: int, alignment: int = PAGE) -> memoryview:
    """A zeroed, writable, ``alignment``-aligned byte buffer of exactly ``nbytes`` bytes."""
    if nbytes < 0:
        raise ValueError(f"buffer size must be >= 0, got {nbytes}")
    raw = np.zeros(nbytes + alignment, dtype=np.uint8)
    start = (-address_of(raw.data)) % alignment
    return raw[start: start + nbytes].data  # the slice keeps ``raw`` alive


def byte_view(buf: object) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (numpy arrays, mmap, bytes)."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)  # type: ignore[arg-type]  # numpy's 3.11 stubs lack __buffer__
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def address_of(view: memoryview) -> int:
    """The address of the first byte of ``view`` (works for read-only views too)."""
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def is_aligned(view: memoryview, alignment: int = PAGE) -> bool:
    """True when ``view`` starts on an ``alignment`` boundary (its length is not checked)."""
    return address_of(view) % alignment == 0
