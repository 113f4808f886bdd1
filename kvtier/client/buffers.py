"""The caller's buffers of a copying ``put`` or ``get``, checked before anything is sent.

Each block is copied with one memcpy between an arena slot and a flat byte view of the
caller's buffer. Only a C-contiguous buffer has such a view: of any other (Fortran order, a
transposed view, a column slice) numpy would hand out a temporary copy, so a get would fill
the copy, leave the caller's buffer untouched and still report the blocks loaded. Such a
buffer is refused with ``BufferSizeError``, like one of the wrong size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.errors import BufferSizeError
from kvtier.keys import BlockKey, Namespace


def as_bytes(buf: Any) -> np.ndarray:
    """A flat uint8 view of a buffer ``check_buffers`` passed (C-contiguous: a view, never
    a copy); checked once per request there, not again per block on the copy path."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def check_buffers(ns: Namespace, keys: Sequence[BlockKey], buffers: Sequence[Any], *,
                  writable: bool = False) -> None:
    """BufferSizeError unless there is one C-contiguous buffer of the layout's block size
    per key (a strided buffer would be copied to or from a temporary, not itself), of bytes
    (not Python objects), and writable when a get fills it (``writable``): each of those
    failed only after the daemon had granted a lease, with a bare TypeError or ValueError."""
    if len(buffers) != len(keys):
        raise BufferSizeError(f"{len(keys)} keys but {len(buffers)} buffers")
    nbytes = ns.layout.block_bytes
    for i, b in enumerate(buffers):
        try:
            view = memoryview(b)
        except TypeError:
            raise BufferSizeError(f"buffer {i} is a {type(b).__name__}, not a buffer (bytes, "
                                  "a numpy array, a memoryview)") from None
        with view:
            if "O" in view.format:
                raise BufferSizeError(f"buffer {i} holds Python objects, not bytes")
            if writable and view.readonly:
                raise BufferSizeError(f"buffer {i} is read-only: a get writes into it")
            if view.nbytes != nbytes:
                raise BufferSizeError(f"buffer {i} has {view.nbytes} bytes; the layout's "
                                      f"block is {nbytes} bytes")
            if not view.c_contiguous:
                raise BufferSizeError(_not_contiguous(i, view))


def _not_contiguous(i: int, view: memoryview) -> str:
    return (f"buffer {i} is not C-contiguous (shape {view.shape}, strides {view.strides}): "
            "blocks are copied through a flat view of each buffer, which only a C-contiguous "
            "one has; pass np.ascontiguousarray(buf) to a put, and get into a C-contiguous "
            "buffer")
