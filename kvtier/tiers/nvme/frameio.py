"""The ``FrameIO`` interface (how the nvme tier moves one frame) and its POSIX backend.

A frame is a 4 KiB header page (``FrameHeader.pack()`` zero padded) followed by the payload
padded to its slot. The tier hands every frame read and write to its FrameIO object through
``submit_read``/``submit_write``, which start the transfer on the tier's thread pool and
return a future; each backend decides how to cut the transfer (the POSIX backend splits large
reads into concurrent pieces, ``kvtier.tiers.nvme.split``; kvikio splits inside its own
library). ``read_frame``/``write_frame`` are the same transfers run inline in the calling
thread. The tier's slot scan at ``open()``, erases and trims never go through a backend.
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from kvtier.frame import HEADER_SIZE, FrameHeader
from kvtier.tiers.aligned import PAGE, is_aligned
from kvtier.tiers.nvme.buffers import bounces, scratch
from kvtier.tiers.nvme.split import ReadJob

__all__ = ["FrameIO", "PooledFrameIO", "PosixFrameIO", "write_frame_sync"]

ReadResult = tuple[FrameHeader, int]   # the checked header, bytes read from the file


class FrameIO(Protocol):
    """How an NvmeTier moves one frame between memory and a slot file.

    ``attach``/``detach`` bracket the life of each slot file descriptor the tier opens.
    ``submit_*`` start a transfer on ``pool`` and return its future; ``*_frame`` run one in
    the calling thread. OS failures raise OSError, bad frames FrameError, small buffers
    BufferSizeError. ``min_piece``/``max_pieces`` of ``submit_read`` say how finely the read
    may be split now (the tier lowers ``max_pieces`` to 1 while other frames are in flight);
    backends that split on their own ignore them. A submitted transfer's future settles only
    after no thread uses the caller's buffers any more.
    """

    name: str      # "posix" | "kvikio": ``io_backend`` in stats
    reason: str    # why this backend was chosen: ``io_backend_reason`` in stats

    def label(self, direct: bool) -> str: ...

    def stats_extra(self) -> dict[str, Any]: ...

    def attach(self, path: Path, fd: int) -> None: ...

    def detach(self, fd: int) -> None: ...

    def close(self) -> None: ...

    def write_frame(self, fd: int, offset: int, packed: bytes, payload: memoryview,
                    payload_len: int, slot_bytes: int, direct: bool, sync: bool) -> int: ...

    def read_frame(self, fd: int, offset: int, out: memoryview, slot_bytes: int, direct: bool,
                   namespace: bytes | None, key: bytes | None, layout_fp: int | None,
                   ) -> ReadResult: ...

    def submit_write(self, pool: ThreadPoolExecutor, fd: int, offset: int, packed: bytes,
                     payload: memoryview, payload_len: int, slot_bytes: int, direct: bool,
                     sync: bool) -> Future[int]: ...

    def submit_read(self, pool: ThreadPoolExecutor, fd: int, offset: int, out: memoryview,
                    slot_bytes: int, direct: bool, namespace: bytes | None, key: bytes | None,
                    layout_fp: int | None, *, min_piece: int, max_pieces: int,
                    ) -> Future[ReadResult]: ...


class PooledFrameIO(ABC):
    """``submit_*`` as one pool task running ``write_frame``/``read_frame`` (for backends
    that move a frame in one call). Subclasses provide those two methods."""

    @abstractmethod
    def write_frame(self, fd: int, offset: int, packed: bytes, payload: memoryview,
                    payload_len: int, slot_bytes: int, direct: bool, sync: bool) -> int:
        """Write one frame in this thread; return the bytes written."""

    @abstractmethod
    def read_frame(self, fd: int, offset: int, out: memoryview, slot_bytes: int, direct: bool,
                   namespace: bytes | None, key: bytes | None, layout_fp: int | None,
                   ) -> ReadResult:
        """Read and verify one frame in this thread."""

    def submit_write(self, pool: ThreadPoolExecutor, fd: int, offset: int, packed: bytes,
                     payload: memoryview, payload_len: int, slot_bytes: int, direct: bool,
                     sync: bool) -> Future[int]:
        """Write one frame as one pool task."""
        return pool.submit(self.write_frame, fd, offset, packed, payload, payload_len,
                           slot_bytes, direct, sync)

    def submit_read(self, pool: ThreadPoolExecutor, fd: int, offset: int, out: memoryview,
                    slot_bytes: int, direct: bool, namespace: bytes | None, key: bytes | None,
                    layout_fp: int | None, *, min_piece: int, max_pieces: int,
                    ) -> Future[ReadResult]:
        """Read one frame as one pool task (the split hints are ignored)."""
        return pool.submit(self.read_frame, fd, offset, out, slot_bytes, direct, namespace,
                           key, layout_fp)


class PosixFrameIO(PooledFrameIO):
    """The default FrameIO: ``pwritev``/``preadv`` on the tier's own descriptors; a read may
    be split into concurrent pieces (``kvtier.tiers.nvme.split``)."""

    name = "posix"

    def __init__(self, reason: str = "default") -> None:
        self.reason = reason

    def label(self, direct: bool) -> str:
        return "posix+odirect" if direct else "posix"

    def stats_extra(self) -> dict[str, Any]:
        return {}

    def attach(self, path: Path, fd: int) -> None:
        """Nothing to do: the tier's own descriptor is used."""

    def detach(self, fd: int) -> None:
        """Nothing to do: the tier closes its descriptor."""

    def close(self) -> None:
        """Nothing to release."""

    def write_frame(self, fd: int, offset: int, packed: bytes, payload: memoryview,
                    payload_len: int, slot_bytes: int, direct: bool, sync: bool) -> int:
        return write_frame_sync(fd, offset, packed, payload, payload_len, slot_bytes, direct,
                                sync)

    def read_frame(self, fd: int, offset: int, out: memoryview, slot_bytes: int, direct: bool,
                   namespace: bytes | None, key: bytes | None, layout_fp: int | None,
                   ) -> ReadResult:
        """Read one frame with one ``preadv(header page, payload)`` in this thread."""
        job = ReadJob(fd, offset, out, slot_bytes, direct, namespace, key, layout_fp)
        result: ReadResult = job.run_inline()
        return result

    def submit_read(self, pool: ThreadPoolExecutor, fd: int, offset: int, out: memoryview,
                    slot_bytes: int, direct: bool, namespace: bytes | None, key: bytes | None,
                    layout_fp: int | None, *, min_piece: int, max_pieces: int,
                    ) -> Future[ReadResult]:
        """Read one frame as up to ``max_pieces`` concurrent pieces of at least
        ``min_piece`` bytes (one piece when ``min_piece`` is 0)."""
        return ReadJob(fd, offset, out, slot_bytes, direct, namespace, key, layout_fp,
                       min_piece=min_piece, max_pieces=max_pieces).start(pool)


def write_frame_sync(fd: int, offset: int, packed: bytes, payload: memoryview,
                     payload_len: int, slot_bytes: int, direct: bool, sync: bool) -> int:
    """Write one frame with one ``pwritev(header page, payload)``; return the bytes written.

    O_DIRECT goes straight from ``payload`` when it is PAGE-aligned and covers ``slot_bytes``,
    otherwise through an aligned bounce buffer (padding zeroed). Writes are not split into
    pieces: concurrent pieces measured slower (allocating O_DIRECT writes serialize on the
    inode lock) and no faster for overwrites. A short write raises OSError(EIO).
    """
    page = scratch.wpage
    page[:HEADER_SIZE] = packed
    bounce = None
    if len(payload) >= slot_bytes and (not direct or is_aligned(payload)):
        body = payload[:slot_bytes]
    elif not direct:
        body = payload[:payload_len]
    else:
        bounce = bounces.take(slot_bytes)
        body = bounce[:slot_bytes]
        body[:payload_len] = payload[:payload_len]
        body[payload_len:] = bytes(slot_bytes - payload_len)
    try:
        written = os.pwritev(fd, [page, body], offset)
    finally:
        if bounce is not None:
            bounces.give(bounce)
    if written != PAGE + len(body):
        raise OSError(errno.EIO, f"short write ({written} of {PAGE + len(body)} bytes)")
    if sync:
        os.fdatasync(fd)
    return written
