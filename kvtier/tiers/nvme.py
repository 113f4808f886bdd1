"""NVMe tier: fixed-size slot files on a local disk, 4 KiB-aligned frames, POSIX I/O.

On-disk layout. One file per size class, ``<root>/slots-<slot_bytes>.dat``. Slot ``i`` of a
class lives at ``i * (PAGE + slot_bytes)``: a 4 KiB header page (``FrameHeader.pack()`` zero
padded) followed by the payload padded to ``slot_bytes``. Files grow as slots are handed out
(a per-class high-water mark) and shrink when their top slots are free and room is needed.

Crash safety. A frame is written with one ``pwritev(header page, payload)``; header and payload
are both checksummed, so a torn write (or a reused slot whose old header survived) fails
verification instead of returning wrong bytes. ``open()`` trusts only headers that unpack and
fit their slot; payloads are verified on every read. A block is visible to the store only after
``write()`` returned. Evicted slots keep their frame (it is still correct data and may come back
after a restart); an explicit delete erases the header page so it cannot.

I/O backend. Frame reads and writes go through a ``FrameIO`` object: ``PosixFrameIO`` (the
default, the functions below) or ``kvtier.tiers.nvme_backend.KvikioFileIO`` (kvikio's CuFile on
GPU hosts). The on-disk format is the same for both; the slot scan at ``open()``, erases and
trims always use the tier's own descriptors. ``backend`` and ``stats_extra()`` say which one
runs and why.

Split reads. With the POSIX backend, a frame read while no other frame I/O is in flight is cut
into up to ``MAX_PIECES`` page-aligned pieces of at least ``split_bytes`` (``SPLIT_BYTES``)
issued concurrently on the pool (header page with the first piece), as kvikio does; the payload
checksum is one streaming xxh3-64 over the pieces in order, hashed as pieces land, so checking
overlaps the remaining reads. Every frame is still verified in full before ``read_into``
returns. Writes stay one ``pwritev`` per frame (concurrent pieces measured slower: allocating
O_DIRECT writes serialize on the inode lock).

Threading. Every disk access runs in a thread pool (never on the event loop). Counters and the
slot bookkeeping are touched only from the caller's thread (the daemon's event loop), so they
need no locks. A slot's disk operations are ordered: an erase or write waits for the previous
operation queued on the same slot, and a cancelled read or write still holds its buffers until
its thread is done with them (cancellation is re-raised afterwards, never swallowed).
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import logging
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, TypeVar

import xxhash

from kvtier.errors import BufferSizeError, ChecksumError, ConfigError, FrameError, KVTierError
from kvtier.frame import HEADER_SIZE, FrameHeader
from kvtier.tiers._aligned import PAGE, aligned_buffer, byte_view, is_aligned
from kvtier.tiers.base import EvictionReason, TierCounters, TierName

__all__ = ["PAGE", "FrameIO", "NvmeIOError", "NvmeSlot", "NvmeTier", "PosixFrameIO",
           "SlotState", "TierState"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_FILE_RE = re.compile(r"^slots-(\d+)\.dat$")
_SEQ_SCAN_MAX_STRIDE = 256 * 1024   # up to this slot stride, scan whole files sequentially
_SCAN_CHUNK = 8 * 2**20             # bytes per sequential scan read
SPLIT_BYTES = 512 * 1024            # frames of 2x this or more are read as concurrent pieces
MAX_PIECES = 8                      # pieces per frame read
_ZERO_PAGE = aligned_buffer(PAGE)    # never written: the erase pattern
_EMPTY_HEADER = bytes(HEADER_SIZE)


class NvmeIOError(KVTierError):
    """A read or write on the nvme tier's files failed at the OS level (EIO, ENOSPC, ...)."""

    code = "nvme_io"


class TierState(Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class SlotState(Enum):
    """FREE -> RESERVED (alloc) -> STORED (write returned) -> FREE (free).

    RESERVED -> FREE is also legal (a write failed or was abandoned). Anything else raises.
    """

    FREE = "free"
    RESERVED = "reserved"
    STORED = "stored"


@dataclass(frozen=True, slots=True)
class NvmeSlot:
    """Where a frame lives: size class (padded payload capacity) and slot number in its file."""

    slot_bytes: int   # payload capacity of this size class (multiple of PAGE)
    index: int        # slot number within that class's file

    @property
    def offset(self) -> int:
        return self.index * (PAGE + self.slot_bytes)


@dataclass(slots=True)
class _SizeClass:
    """One slot file. Invariant: each index < high_water is in exactly one of ``free`` and
    ``busy``; indices >= high_water are not in the file. ``free`` is a min-heap so the lowest
    slots are reused first, which keeps the file's tail free and trimmable."""

    slot_bytes: int
    path: Path
    fd: int
    high_water: int = 0
    free: list[int] = field(default_factory=list)
    busy: dict[int, SlotState] = field(default_factory=dict)

    @property
    def stride(self) -> int:
        return PAGE + self.slot_bytes


class _Scratch(threading.local):
    """Per-I/O-thread aligned header pages (bounce buffers are shared: ``_Bounces``)."""

    def __init__(self) -> None:
        self.wpage = aligned_buffer(PAGE)   # only its first HEADER_SIZE bytes are ever written
        self.rpage = aligned_buffer(PAGE)


_scratch = _Scratch()


class FrameIO(Protocol):
    """How an NvmeTier moves one frame between memory and a slot file (runs in its threads).

    ``attach``/``detach`` bracket the life of each slot file descriptor the tier opens;
    ``write_frame``/``read_frame`` have the contracts of ``_write_sync``/``_read_sync`` below
    (OS failures raise OSError, bad frames FrameError, small buffers BufferSizeError).
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
                   ) -> tuple[FrameHeader, int]: ...


class PosixFrameIO:
    """The default FrameIO: one ``pwritev``/``preadv`` per frame on the tier's descriptors."""

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
        return _write_sync(fd, offset, packed, payload, payload_len, slot_bytes, direct, sync)

    def read_frame(self, fd: int, offset: int, out: memoryview, slot_bytes: int, direct: bool,
                   namespace: bytes | None, key: bytes | None, layout_fp: int | None,
                   ) -> tuple[FrameHeader, int]:
        return _read_sync(fd, offset, out, slot_bytes, direct, namespace, key, layout_fp)


def probe_direct(root: Path) -> str | None:
    """None when O_DIRECT works under ``root`` (aligned write + read back), else why not."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = root / f".odirect-probe-{os.getpid()}-{threading.get_ident()}"
    buf = aligned_buffer(PAGE)
    buf[:8] = b"kvtier\0\1"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        return f"open with O_DIRECT failed: {exc.strerror}"
    try:
        back = aligned_buffer(PAGE)
        if os.pwritev(fd, [buf], 0) != PAGE or os.preadv(fd, [back], 0) != PAGE:
            return "short aligned O_DIRECT transfer"
        return None if bytes(back) == bytes(buf) else "O_DIRECT read back different bytes"
    except OSError as exc:
        return f"aligned O_DIRECT I/O failed: {exc.strerror}"
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


class NvmeTier:
    """Slot files under ``root`` with a hard byte capacity; I/O in ``io_threads`` threads.

    Lifecycle: construct, ``open()`` (sync, rebuilds the slot map and returns the stored
    frames), then ``alloc``/``write``/``read_into``/``free`` from one event loop, ``close()``.
    Capacity counts each slot's full footprint (header page + padded payload); the total size
    of the slot files never exceeds it either. ``split_bytes`` is the smallest piece of a split
    read (0: one request per frame; see "Split reads" above).
    """

    name = TierName.NVME

    def __init__(self, root: Path, capacity_bytes: int, *, direct: str = "auto",
                 io_threads: int = 4, io: FrameIO | None = None,
                 split_bytes: int = SPLIT_BYTES) -> None:
        if direct not in ("auto", "on", "off"):
            raise ConfigError(f"nvme.direct must be auto, on or off, got {direct!r}")
        if capacity_bytes < 0 or io_threads < 1:
            raise ConfigError("nvme.bytes must be >= 0 and nvme.io_threads >= 1")
        if split_bytes < 0 or split_bytes % PAGE:
            raise ConfigError(f"nvme split_bytes must be a multiple of {PAGE} (0: never split), "
                              f"got {split_bytes}")
        self.root = Path(root)
        self.counters = TierCounters()
        self._capacity = capacity_bytes
        self._direct_mode = direct
        self._io_threads = io_threads
        self._io: FrameIO = io if io is not None else PosixFrameIO()
        # the POSIX backend's frames go through _FrameJob pieces on the pool; others (kvikio
        # splits frames itself) get one read_frame/write_frame call per frame
        self._split_bytes = split_bytes if type(self._io) is PosixFrameIO else -1
        self._inflight = 0    # frame reads and writes submitted and not yet ended
        self._direct = False
        self._state = TierState.NEW
        self._pool: ThreadPoolExecutor | None = None
        self._classes: dict[int, _SizeClass] = {}
        self._pending: dict[NvmeSlot, Future[object]] = {}  # last disk op queued per slot
        self._used = 0        # footprint of RESERVED + STORED slots
        self._disk = 0        # footprint of every slot below the high-water marks
        self._stored = 0
        self._seq = 0

    # ------------------------------------------------------------------ Tier protocol
    @property
    def backend(self) -> str:
        return self._io.label(self._direct)

    @property
    def io(self) -> FrameIO:
        """The frame I/O backend (POSIX unless the daemon selected kvikio)."""
        return self._io

    def stats_extra(self) -> dict[str, Any]:
        """Backend details merged into this tier's section of /v1/stats."""
        return {"io_backend": self._io.name, "io_backend_reason": self._io.reason,
                "direct": self._direct, **self._io.stats_extra()}

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def disk_bytes(self) -> int:
        """Bytes the slot files span (>= used_bytes: includes free slots below the tails)."""
        return self._disk

    @property
    def blocks(self) -> int:
        return self._stored

    @property
    def up(self) -> bool:
        return self._state is TierState.OPEN

    @property
    def direct(self) -> bool:
        return self._direct

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> list[tuple[NvmeSlot, FrameHeader]]:
        """Rebuild the slot map from the files' header pages; return the stored frames, oldest
        first (by ``header.seq``), so the store can rebuild its index and LRU order.

        Torn or corrupt headers, and frames longer than what their file holds, are counted as
        checksum failures and their slots freed. When a key is stored twice, only the newest
        copy is kept. When the stored frames exceed ``capacity_bytes`` (it was lowered), the
        oldest are dropped (counted as capacity evictions).
        """
        if self._state is not TierState.NEW:
            raise KVTierError(f"nvme tier is {self._state.value}; open() is called once")
        self.root.mkdir(parents=True, exist_ok=True)
        self._direct = self._choose_direct()
        self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kvtier-nvme")
        found: list[tuple[NvmeSlot, FrameHeader]] = []
        for path in sorted(self.root.iterdir()):
            m = _FILE_RE.match(path.name)
            if m is None or int(m.group(1)) <= 0 or int(m.group(1)) % PAGE:
                continue
            found.extend(self._scan(self._open_class(int(m.group(1)))))
        newest: dict[tuple[bytes, bytes], tuple[NvmeSlot, FrameHeader]] = {}
        for slot, header in sorted(found, key=lambda item: item[1].seq):
            self._seq = max(self._seq, header.seq)
            old = newest.get((header.namespace, header.key))
            if old is not None:
                self._release(old[0])   # a stale copy: superseded by a later write
            newest[(header.namespace, header.key)] = (slot, header)
        kept = sorted(newest.values(), key=lambda item: item[1].seq)
        while self._used > self._capacity and kept:
            self._release(kept.pop(0)[0])
            self.counters.evicted(EvictionReason.CAPACITY)
        for cls in self._classes.values():
            self._trim(cls)
        self._state = TierState.OPEN
        log.info("nvme tier %s: %d frames, %d of %d bytes, backend %s", self.root, len(kept),
                 self._used, self._capacity, self.backend)
        return kept

    def close(self) -> None:
        """Finish queued I/O (erases included), shut the pool and close the files."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for cls in self._classes.values():
            self._io.detach(cls.fd)
            os.close(cls.fd)
        self._io.close()
        self._classes.clear()
        self._pending.clear()
        self._state = TierState.CLOSED

    def next_seq(self) -> int:
        """A new frame sequence number: above every seq seen and never below the wall clock in
        microseconds, so it keeps increasing across restarts even if the newest were erased."""
        self._seq = max(self._seq + 1, time.time_ns() // 1000)
        return self._seq

    # ------------------------------------------------------------------ allocation
    @staticmethod
    def slot_bytes_for(payload_len: int) -> int:
        """The size class of a payload: its length rounded up to PAGE (at least one page)."""
        if payload_len < 0:
            raise ValueError(f"payload length must be >= 0, got {payload_len}")
        return max(PAGE, -(-payload_len // PAGE) * PAGE)

    def alloc(self, payload_len: int) -> NvmeSlot | None:
        """A reserved slot for ``payload_len`` bytes, or None (counted as an allocation
        failure) when its footprint would take ``used_bytes`` or the files past capacity; the
        store then evicts and retries."""
        self._require_open()
        slot_bytes = self.slot_bytes_for(payload_len)
        footprint = PAGE + slot_bytes
        if self._used + footprint > self._capacity:
            self.counters.allocation_failures += 1
            return None
        cls = self._classes.get(slot_bytes) or self._open_class(slot_bytes)
        if cls.free:
            index = heapq.heappop(cls.free)
        else:
            if self._disk + footprint > self._capacity:
                for other in self._classes.values():
                    self._trim(other)
            if self._disk + footprint > self._capacity:
                self.counters.allocation_failures += 1   # room is in other classes' middles
                return None
            index = cls.high_water
            cls.high_water += 1
            self._disk += footprint
        cls.busy[index] = SlotState.RESERVED
        self._used += footprint
        return NvmeSlot(slot_bytes, index)

    def free(self, slot: NvmeSlot, *, erase: bool = False) -> None:
        """Return a slot to its free list. ``erase=True`` (an explicit delete) also zeroes its
        header page, queued to the pool and ordered before any later write to the slot, so the
        block does not come back after a restart."""
        self._require_open()
        cls = self._slot_class(slot, SlotState.RESERVED, SlotState.STORED)
        self._release(slot)
        if erase:
            assert self._pool is not None
            prev = self._pending.get(slot)
            self._pending[slot] = self._pool.submit(_erase_sync, cls.fd, slot.offset, prev)

    # ------------------------------------------------------------------ I/O
    async def write(self, slot: NvmeSlot, header: FrameHeader, payload: memoryview, *,
                    sync: bool = False) -> None:
        """Write one frame into a reserved slot (one pwritev of header page + payload).

        ``payload`` holds at least ``header.payload_len`` bytes; it may be the whole padded
        arena slot. O_DIRECT goes straight from it when it is PAGE-aligned and covers
        ``slot.slot_bytes``, otherwise through an aligned bounce buffer. ``sync=True`` adds an
        fdatasync. Raises NvmeIOError (counted in ``errors``) when the OS call fails; the slot
        then stays reserved (free it, or write it again).
        """
        self._require_open()
        cls = self._slot_class(slot, SlotState.RESERVED)
        view = byte_view(payload)
        if header.payload_len > slot.slot_bytes or len(view) < header.payload_len:
            raise BufferSizeError(
                f"frame of {header.payload_len} bytes from a {len(view)}-byte buffer does not "
                f"fit a {slot.slot_bytes}-byte slot; alloc() with the payload length")
        start = _submitter(self._io.write_frame, cls.fd, slot.offset, header.pack(), view,
                           header.payload_len, slot.slot_bytes, self._direct, sync)
        nbytes = await self._run(slot, True, start, "write to", cls)
        if cls.busy.get(slot.index) is SlotState.RESERVED:  # not freed while in flight
            cls.busy[slot.index] = SlotState.STORED
            self._stored += 1
        self._seq = max(self._seq, header.seq)
        self.counters.bytes_written += nbytes

    async def read_into(self, slot: NvmeSlot, out: memoryview, *, namespace: bytes | None,
                        key: bytes | None, layout_fp: int | None) -> FrameHeader:
        """Read a stored frame's payload into ``out`` and return its checked header.

        Bytes are read straight into ``out`` (O_DIRECT when it is aligned and at least
        ``slot.slot_bytes`` long; the padding after ``payload_len`` is overwritten too). The
        header must match ``namespace``/``key``/``layout_fp`` (None skips that check) and the
        payload its checksum; any failure is counted in ``checksum_failures`` and raises
        FrameError/ChecksumError, and the store should drop the slot.
        """
        self._require_open()
        cls = self._slot_class(slot, SlotState.STORED)
        view = byte_view(out)
        if self._split_bytes >= 0:
            start: Callable[[ThreadPoolExecutor], Future[Any]] = _ReadJob(
                cls.fd, slot.offset, view, slot.slot_bytes, self._direct, namespace, key,
                layout_fp, min_piece=self._split_bytes, max_pieces=self._max_pieces()).start
        else:
            start = _submitter(self._io.read_frame, cls.fd, slot.offset, view,
                               slot.slot_bytes, self._direct, namespace, key, layout_fp)
        header, nbytes = await self._run(slot, False, start, "read from", cls)
        self.counters.bytes_read += nbytes
        return header

    def _max_pieces(self) -> int:
        """How many pieces a read may be split into now: ``MAX_PIECES`` while no other frame
        I/O is in flight, else 1 (the pool's threads already overlap whole frames)."""
        return MAX_PIECES if self._inflight == 0 else 1

    async def _run(self, slot: NvmeSlot, ordered: bool,
                   start: Callable[[ThreadPoolExecutor], Future[Any]], what: str,
                   cls: _SizeClass) -> Any:
        """Start an I/O on the pool (``start(pool)`` returns its future) and map its errors to
        counted, typed ones. ``ordered`` ops (writes; erases are queued by free()) start only
        after the slot's previous one ended."""
        assert self._pool is not None
        if ordered:
            prev = self._pending.get(slot)
            if prev is not None and not prev.done():
                await asyncio.wait([asyncio.wrap_future(prev)])
        op = start(self._pool)
        if ordered:
            self._pending[slot] = op
        self._inflight += 1
        try:
            return await asyncio.wrap_future(op)
        except asyncio.CancelledError:
            if not op.done():   # the thread still uses the caller's buffer: let it finish
                await asyncio.wait([asyncio.wrap_future(op)])
            raise
        except FrameError:
            self.counters.checksum_failures += 1
            raise
        except OSError as exc:
            self.counters.errors += 1
            raise NvmeIOError(f"nvme {what} {cls.path} slot {slot.index} failed: "
                              f"{exc.strerror or exc}") from exc
        finally:
            self._inflight -= 1
            if self._pending.get(slot) is op and op.done():
                del self._pending[slot]

    # ------------------------------------------------------------------ internals
    def _require_open(self) -> None:
        if self._state is not TierState.OPEN:
            raise KVTierError(f"nvme tier is {self._state.value}, not open")

    def _choose_direct(self) -> bool:
        if self._direct_mode == "off":
            return False
        why = probe_direct(self.root)
        if why is None:
            return True
        if self._direct_mode == "on":
            raise ConfigError(
                f"nvme.direct=on but O_DIRECT does not work under {self.root} ({why}); set "
                "nvme.direct=auto (falls back to buffered I/O) or point nvme.path at a "
                "disk-backed file system")
        log.info("nvme tier %s: O_DIRECT unavailable (%s); using buffered I/O", self.root, why)
        return False

    def _open_class(self, slot_bytes: int) -> _SizeClass:
        path = self.root / f"slots-{slot_bytes}.dat"
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if self._direct else 0)
        cls = _SizeClass(slot_bytes, path, os.open(path, flags, 0o600))
        try:
            self._io.attach(path, cls.fd)
        except BaseException:
            os.close(cls.fd)
            raise
        self._classes[slot_bytes] = cls
        return cls

    def _slot_class(self, slot: NvmeSlot, *allowed: SlotState) -> _SizeClass:
        cls = self._classes.get(slot.slot_bytes)
        state = SlotState.FREE
        if cls is not None and 0 <= slot.index < cls.high_water:
            state = cls.busy.get(slot.index, SlotState.FREE)
        if state not in allowed or cls is None:
            raise KVTierError(f"nvme slot {slot} is {state.value}; expected "
                              f"{' or '.join(s.value for s in allowed)}")
        return cls

    def _release(self, slot: NvmeSlot) -> None:
        """Bookkeeping half of free(): busy -> free list (no I/O)."""
        cls = self._classes[slot.slot_bytes]
        if cls.busy.pop(slot.index) is SlotState.STORED:
            self._stored -= 1
        heapq.heappush(cls.free, slot.index)
        self._used -= cls.stride

    def _trim(self, cls: _SizeClass) -> None:
        """Cut free slots off the file's tail (none with an erase still queued)."""
        free = set(cls.free)
        top = cls.high_water
        while top > 0 and top - 1 in free:
            pending = self._pending.get(NvmeSlot(cls.slot_bytes, top - 1))
            if pending is not None and not pending.done():
                break
            top -= 1
        if top == cls.high_water:
            return
        try:
            os.ftruncate(cls.fd, top * cls.stride)
        except OSError as exc:
            self.counters.errors += 1
            log.warning("nvme tier: cannot shrink %s: %s", cls.path, exc.strerror)
            return
        cls.free = [i for i in cls.free if i < top]
        heapq.heapify(cls.free)
        self._disk -= (cls.high_water - top) * cls.stride
        cls.high_water = top

    def _scan(self, cls: _SizeClass) -> Iterator[tuple[NvmeSlot, FrameHeader]]:
        """Classify every slot of a file from its header page; yield the valid ones."""
        size = os.fstat(cls.fd).st_size
        cls.high_water = -(-size // cls.stride)
        self._disk += cls.high_water * cls.stride
        for index, raw in self._read_headers(cls, size):
            header = None
            if raw.strip(b"\0"):
                try:
                    header = FrameHeader.unpack(raw)
                    if (header.payload_len > cls.slot_bytes
                            or index * cls.stride + PAGE + header.payload_len > size):
                        raise FrameError("frame longer than its slot or file")
                except FrameError as exc:
                    self.counters.checksum_failures += 1
                    log.warning("nvme tier: dropping %s slot %d: %s", cls.path, index, exc)
                    header = None
            if header is None:
                cls.free.append(index)
            else:
                cls.busy[index] = SlotState.STORED
                self._stored += 1
                self._used += cls.stride
                yield NvmeSlot(cls.slot_bytes, index), header
        heapq.heapify(cls.free)

    def _read_headers(self, cls: _SizeClass, size: int) -> Iterator[tuple[int, bytes]]:
        """Each slot's first HEADER_SIZE bytes (fewer at a torn tail), in index order.

        Small slots: whole-file reads of ``_SCAN_CHUNK`` bytes (few syscalls, sequential).
        Large slots: one header-page read per slot, spread over the pool, so a start does not
        read every payload off the disk.
        """
        assert self._pool is not None
        stride = cls.stride
        if stride > _SEQ_SCAN_MAX_STRIDE:
            offsets = [i * stride for i in range(cls.high_water)]
            pages = self._pool.map(_read_page_sync, [cls.fd] * len(offsets), offsets)
            yield from enumerate(pages)
            return
        per_chunk = max(1, _SCAN_CHUNK // stride)
        buf = aligned_buffer(per_chunk * stride)
        for first in range(0, cls.high_water, per_chunk):
            got = os.preadv(cls.fd, [buf], first * stride)
            for j in range(min(per_chunk, cls.high_water - first)):
                start = j * stride
                yield first + j, bytes(buf[start: min(start + HEADER_SIZE, max(got, start))])


# ---------------------------------------------------------------------- pool-side functions
def _submitter(fn: Callable[..., T], *args: object,
               ) -> Callable[[ThreadPoolExecutor], Future[T]]:
    """A ``start(pool)`` that runs ``fn(*args)`` as one pool task (FrameIO backends)."""
    return lambda pool: pool.submit(fn, *args)


def _split(length: int, min_piece: int, max_pieces: int) -> tuple[int, int]:
    """(pieces, piece bytes) for ``length`` bytes of payload: at most ``max_pieces`` pieces of
    at least ``min_piece`` bytes, each a multiple of PAGE but the last; (1, length) when the
    frame is too small to split or splitting is off (``min_piece`` 0)."""
    if min_piece <= 0 or max_pieces <= 1 or length < 2 * min_piece:
        return 1, length
    pieces = min(max_pieces, length // min_piece)
    size = -(-length // pieces)
    size = -(-size // PAGE) * PAGE
    return -(-length // size), size


class _Bounces:
    """Aligned bounce buffers shared by all I/O threads (a frame's pieces run on several
    threads, so a per-thread buffer would not do). Keeps at most ``keep`` free buffers."""

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


_bounces = _Bounces()


class _FrameJob(ABC):
    """One frame's disk transfer cut into ``pieces`` page-aligned pieces.

    Piece ``j`` covers payload bytes ``[j * piece, (j + 1) * piece)`` (the last one is shorter)
    at file offset ``offset + PAGE + j * piece``; piece 0 also carries the header page (one
    ``preadv``/``pwritev`` of page + first piece). ``start(pool)`` submits one task per piece,
    so a large frame moves as several concurrent requests, like kvikio does; ``run_inline()``
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
        self.pieces, self.piece = _split(length, min_piece, max_pieces)
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
            _bounces.give(self.bounce)
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


class _ReadJob(_FrameJob):
    """Read one frame into ``out`` and verify it (see ``_read_sync``).

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
            bounce = _bounces.take(slot_bytes)
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
            page = _scratch.rpage
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


def _write_sync(fd: int, offset: int, packed: bytes, payload: memoryview, payload_len: int,
                slot_bytes: int, direct: bool, sync: bool) -> int:
    """Write one frame with one ``pwritev(header page, payload)``.

    O_DIRECT goes straight from ``payload`` when it is PAGE-aligned and covers ``slot_bytes``,
    otherwise through an aligned bounce buffer (padding zeroed). Writes are not split into
    pieces: concurrent pieces measured slower (allocating O_DIRECT writes serialize on the
    inode lock) and no faster for overwrites.
    """
    page = _scratch.wpage
    page[:HEADER_SIZE] = packed
    bounce = None
    if len(payload) >= slot_bytes and (not direct or is_aligned(payload)):
        body = payload[:slot_bytes]
    elif not direct:
        body = payload[:payload_len]
    else:
        bounce = _bounces.take(slot_bytes)
        body = bounce[:slot_bytes]
        body[:payload_len] = payload[:payload_len]
        body[payload_len:] = bytes(slot_bytes - payload_len)
    try:
        written = os.pwritev(fd, [page, body], offset)
    finally:
        if bounce is not None:
            _bounces.give(bounce)
    if written != PAGE + len(body):
        raise OSError(errno.EIO, f"short write ({written} of {PAGE + len(body)} bytes)")
    if sync:
        os.fdatasync(fd)
    return written


def _read_sync(fd: int, offset: int, out: memoryview, slot_bytes: int, direct: bool,
               namespace: bytes | None, key: bytes | None, layout_fp: int | None,
               ) -> tuple[FrameHeader, int]:
    """Read one frame with one ``preadv(header page, payload)`` in this thread and verify it:
    the header must unpack and match, the payload fit ``out`` and its checksum."""
    return _ReadJob(fd, offset, out, slot_bytes, direct, namespace, key, layout_fp).run_inline()


def _read_page_sync(fd: int, offset: int) -> bytes:
    page = _scratch.rpage
    got = os.preadv(fd, [page], offset)
    return bytes(page[: min(max(got, 0), HEADER_SIZE)])


def _erase_sync(fd: int, offset: int, prev: Future[object] | None) -> int:
    if prev is not None:
        wait([prev])   # order after the slot's previous op; its caller saw any error
    try:
        return os.pwritev(fd, [_ZERO_PAGE], offset)
    except OSError as exc:
        log.warning("nvme tier: erasing the frame at offset %d failed (%s); it may come back "
                    "after a restart until the slot is reused", offset, exc.strerror)
        raise
