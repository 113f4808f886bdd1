"""Split reads: one frame read as up to ``MAX_PIECES`` concurrent page-aligned pieces.

A frame read while no other frame I/O is in flight is cut into pieces of at least
``SPLIT_BYTES`` (the header page rides with the first piece) issued concurrently on the
tier's pool, as kvikio does. The payload checksum is one streaming xxh3-64 over the pieces
in order, hashed as pieces land, so checking overlaps the remaining reads. Every frame is
still verified in full before the read returns. Writes are not split (concurrent pieces
measured slower: allocating O_DIRECT writes serialize on the inode lock).

``ReadJob`` is the POSIX backend's read (``PosixFrameIO.submit_read`` starts one on the pool,
``read_frame`` runs one inline); the tier reaches it only through the ``FrameIO`` interface.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from kvtier.errors import BufferSizeError, ChecksumError, FrameError
from kvtier.frame import HEADER_SIZE, FrameHeader
from kvtier.tiers.aligned import PAGE, is_aligned, round_up
from kvtier.tiers.nvme.buffers import bounces, scratch

__all__ = ["MAX_PIECES", "SPLIT_BYTES", "FrameJob", "ReadJob", "plan_pieces"]

SPLIT_BYTES = 512 * 1024            # frames of 2x this or more are read as concurrent pieces
MAX_PIECES = 8                      # pieces per frame read


def plan_pieces(length: int, min_piece: int, max_pieces: int) -> tuple[int, int]:
    """(pieces, piece bytes) for ``length`` bytes of payload: at most ``max_pieces`` pieces of
    at least ``min_piece`` bytes, each a multiple of PAGE but the last; (1, length) when the
    frame is too small to split or splitting is off (``min_piece`` 0)."""
    if min_piece <= 0 or max_pieces <= 1 or length < 2 * min_piece:
        return 1, length
    pieces = min(max_pieces, length // min_piece)
    size = round_up(-(-length // pieces))
    return -(-length // size), size


class FrameJob(ABC):
    """One frame's disk transfer cut into ``pieces`` page-aligned pieces.

    Piece ``j`` covers payload bytes ``[j * piece, (j + 1) * piece)`` (the last one is shorter)
    at file offset ``offset + PAGE + j * piece``; piece 0 also carries the header page (one
    ``preadv`` of page + first piece). ``start(pool)`` submits one task per piece; ``run_inline()``
    runs them one after another in the calling thread. Pieces never wait for each other, so a
    saturated pool cannot deadlock. The thread that ends the last piece settles ``future``
    (already RUNNING, so ``cancel()`` cannot detach it from the threads still using the
    buffers): the first error of any piece wins, and the caller sees the outcome only after
    every piece is done with its buffers.
    """

    __slots__ = ("_error", "_left", "_lock", "bounce", "fd", "future", "length", "offset",
                 "piece", "pieces")

    def __init__(self, fd: int, offset: int, length: int, min_piece: int,
                 max_pieces: int) -> None:
        self.fd = fd
        self.offset = offset
        self.length = length
        self.pieces, self.piece = plan_pieces(length, min_piece, max_pieces)
        self.bounce: memoryview | None = None
        self.future: Future[Any] = Future()
        self.future.set_running_or_notify_cancel()
        self._lock = threading.Lock()
        self._left = self.pieces
        self._error: BaseException | None = None

    def start(self, pool: ThreadPoolExecutor) -> Future[Any]:
        """Submit every piece to ``pool``; the future settles when all have ended."""
        for j in range(self.pieces):
            try:
                pool.submit(self._run, j)
            except BaseException as exc:   # pool shut down: the pieces never queued fail
                for k in range(j, self.pieces):
                    self._ended(k, exc)
                break
        return self.future

    def run_inline(self) -> Any:
        """Run every piece in this thread, in order; return the result or raise."""
        for j in range(self.pieces):
            self._run(j)
        return self.future.result()

    def span(self, j: int) -> tuple[int, int]:
        """Payload byte range ``[start, end)`` of piece ``j``."""
        start = j * self.piece
        return start, min(start + self.piece, self.length)

    def _run(self, j: int) -> None:
        try:
            self._piece(j)
        except BaseException as exc:
            self._ended(j, exc)
        else:
            self._ended(j, None)

    def _ended(self, j: int, exc: BaseException | None) -> None:
        with self._lock:
            if exc is not None and self._error is None:
                self._error = exc
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        result = None
        try:
            if self._error is None:
                result = self._finish()
        except BaseException as exc:
            self._error = exc
        if self.bounce is not None:
            bounces.give(self.bounce)
            self.bounce = None
        if self._error is not None:
            self.future.set_exception(self._error)
            self._error = None   # the future holds it now (no cycle through the job)
        else:
            self.future.set_result(result)

    @abstractmethod
    def _piece(self, j: int) -> None:
        """Transfer piece ``j`` (runs in a pool thread)."""

    @abstractmethod
    def _finish(self) -> Any:
        """Check the whole frame once every piece is done; the future's result."""


class ReadJob(FrameJob):
    """Read one frame into ``out`` and verify it: the header must unpack and match, the
    payload fit ``out`` and its checksum.

    Piece 0 reads and checks the header. The payload checksum is one streaming xxh3-64 over
    the pieces in order: whichever thread ends the next piece in line hashes it (and any later
    pieces already read), so hashing piece ``j`` overlaps reading the pieces after it; xxhash
    drops the GIL while it hashes. Hashing stops at the first error.
    """

    __slots__ = ("_draining", "_next", "_ready", "got", "hasher", "header", "key", "layout_fp",
                 "namespace", "out", "slot_bytes", "target")

    def __init__(self, fd: int, offset: int, out: memoryview, slot_bytes: int, direct: bool,
                 namespace: bytes | None, key: bytes | None, layout_fp: int | None, *,
                 min_piece: int = 0, max_pieces: int = 1) -> None:
        bounce = None
        if direct and (len(out) < slot_bytes or not is_aligned(out)):
            bounce = bounces.take(slot_bytes)
            target = bounce[:slot_bytes]
        else:
            target = out[:slot_bytes]
        super().__init__(fd, offset, len(target), min_piece, max_pieces)
        self.bounce = bounce
        self.target = target
        self.out = out
        self.slot_bytes = slot_bytes
        self.namespace = namespace
        self.key = key
        self.layout_fp = layout_fp
        self.header: FrameHeader | None = None
        self.hasher = xxhash.xxh3_64()
        self.got = [0] * self.pieces
        self._ready = [False] * self.pieces
        self._next = 0
        self._draining = False

    def _piece(self, j: int) -> None:
        start, end = self.span(j)
        if j == 0:
            page = scratch.rpage
            got = os.preadv(self.fd, [page, self.target[start:end]], self.offset)
            self.got[0] = got
            self._check_header(page, got)
        else:
            self.got[j] = os.preadv(self.fd, [self.target[start:end]],
                                    self.offset + PAGE + start)
        with self._lock:
            self._ready[j] = True
            if self._draining or self._next != j or self._error is not None:
                return
            self._draining = True
        while True:   # this thread hashes the pieces in line, in order
            i = self._next
            self._consume(i)
            with self._lock:
                self._next = i + 1
                if (self._next == self.pieces or not self._ready[self._next]
                        or self._error is not None):
                    self._draining = False
                    return

    def _check_header(self, page: memoryview, got: int) -> None:
        if got < HEADER_SIZE:
            raise FrameError(f"slot truncated ({got} bytes on disk)")
        header = FrameHeader.unpack(page)
        header.check(self.namespace, self.key, self.layout_fp)
        plen = header.payload_len
        if plen > self.slot_bytes:
            raise FrameError(f"frame of {plen} bytes does not fit its {self.slot_bytes}-byte "
                             "slot")
        if plen > len(self.out):
            raise BufferSizeError(f"output buffer of {len(self.out)} bytes is smaller than the "
                                  f"{plen}-byte frame")
        self.header = header

    def _consume(self, i: int) -> None:
        """Check that piece ``i`` holds its share of the payload, copy it out of the bounce
        buffer if one is used, and hash it."""
        assert self.header is not None
        plen = self.header.payload_len
        start, end = self.span(i)
        stop = min(end, plen)
        if stop <= start:
            return
        have = self.got[i] - (PAGE if i == 0 else 0)
        if have < stop - start:
            raise FrameError(f"frame payload truncated ({start + max(have, 0)} of {plen} "
                             "bytes on disk)")
        if self.bounce is not None:
            self.out[start:stop] = self.target[start:stop]
        self.hasher.update(self.out[start:stop])

    def _finish(self) -> tuple[FrameHeader, int]:
        header = self.header
        if header is None or self._next != self.pieces:
            raise FrameError("frame read ended before every piece was checked")
        if self.hasher.intdigest() != header.checksum:
            raise ChecksumError("payload checksum mismatch")
        return header, sum(self.got)
