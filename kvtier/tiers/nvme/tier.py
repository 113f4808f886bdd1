"""NvmeTier: the store's face of the nvme tier (lifecycle, alloc/free, frame writes and reads).

The parts live in their own modules: slot files and allocation (``slots``), their
descriptors (``files``: a bounded number open), punching and
erasing (``reclaim``), the start-up scan (``recovery``), the frame I/O backends behind
``FrameIO`` (``frameio``, ``split``, ``kvikio_io``), the O_DIRECT probe (``probe``), the
directory lock (``lock``) and the write health (``health``). This class wires them, orders
each slot's disk operations and maps OS errors to typed, counted ones.

Threading. Every disk access runs in a thread pool (never on the event loop). Counters and the
slot bookkeeping are touched only from the caller's thread (the daemon's event loop), so they
need no locks. A slot's disk operations are ordered: an erase or write waits for the previous
operation queued on the same slot, and a cancelled read or write still holds its buffers until
its thread is done with them (cancellation is re-raised afterwards, never swallowed), and a
slot file's descriptor stays open (pinned, ``files``) until every operation handed it is over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier.backoff import BackoffPolicy
from kvtier.errors import BufferSizeError, ConfigError, FrameError, KVTierError
from kvtier.frame import FrameHeader
from kvtier.tiers.aligned import PAGE, byte_view
from kvtier.tiers.base import TierCounters, TierName
from kvtier.tiers.nvme.files import MAX_OPEN_FILES
from kvtier.tiers.nvme.frameio import FrameIO, PosixFrameIO
from kvtier.tiers.nvme.health import DEFAULT_BACKOFF, WriteHealth
from kvtier.tiers.nvme.lock import lock_nvme_dir
from kvtier.tiers.nvme.probe import DIRECT_MODES, choose_direct
from kvtier.tiers.nvme.reclaim import Reclaimer
from kvtier.tiers.nvme.recovery import Recovered, recover
from kvtier.tiers.nvme.slots import NvmeSlot, SizeClass, SlotState, SlotTable, slot_bytes_for
from kvtier.tiers.nvme.split import MAX_PIECES, SPLIT_BYTES

__all__ = ["NvmeDegradedError", "NvmeIOError", "NvmeTier", "TierState"]

log = logging.getLogger(__name__)


class NvmeIOError(KVTierError):
    """A read or write on the nvme tier's files failed at the OS level (EIO, ENOSPC, ...)."""

    code = "nvme_io"


class NvmeDegradedError(NvmeIOError):
    """A write refused without touching the disk: the tier is degraded (full or failing
    disk) until a space probe succeeds. Free space under nvme.path; it recovers by itself."""

    code = "nvme_degraded"


class TierState(Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class NvmeTier:
    """Slot files under ``root`` with a hard byte capacity; I/O in ``io_threads`` threads.

    Lifecycle: construct, ``open()`` (sync, rebuilds the slot map and returns the stored
    frames), then ``alloc``/``write``/``read_into``/``free`` from one event loop, ``close()``.
    ``split_bytes`` is the smallest piece of a split read (0: one request per frame), a hint
    the backend may ignore. ``backoff`` paces the space probes while degraded.
    ``max_open_files``: slot file descriptors kept open (``kvtier.tiers.nvme.files``).
    """

    name = TierName.NVME

    def __init__(self, root: Path, capacity_bytes: int, *, direct: str = "auto",
                 io_threads: int = 4, io: FrameIO | None = None,
                 split_bytes: int = SPLIT_BYTES,
                 backoff: BackoffPolicy = DEFAULT_BACKOFF,
                 max_open_files: int = MAX_OPEN_FILES) -> None:
        if direct not in DIRECT_MODES:
            raise ConfigError(f"nvme.direct must be auto, on or off, got {direct!r}")
        if capacity_bytes < 0:
            raise ConfigError(f"nvme.bytes must be >= 0, got {capacity_bytes}")
        if io_threads < 1:
            raise ConfigError(f"nvme.io_threads must be >= 1, got {io_threads}")
        if split_bytes < 0 or split_bytes % PAGE:
            raise ConfigError(f"nvme split_bytes must be a multiple of {PAGE} (0: never split), "
                              f"got {split_bytes}")
        if max_open_files < 1:
            raise ConfigError(f"nvme max_open_files must be >= 1, got {max_open_files}")
        self.root = Path(root)
        self.counters = TierCounters()
        self._direct_mode = direct
        self._io_threads = io_threads
        self._io: FrameIO = io if io is not None else PosixFrameIO()
        self._split_bytes = split_bytes
        self._slots = SlotTable(self.root, capacity_bytes, self._io, self.counters,
                                max_open=max_open_files)
        self._health = WriteHealth(self.root, backoff)
        self._inflight = 0    # frame reads and writes submitted and not yet ended
        self._state = TierState.NEW
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[NvmeSlot, Future[Any]] = {}  # last disk op queued per slot
        self._reclaim = Reclaimer(self._slots, self._pending, lambda: self._pool,
                                  self._settled)
        self._seq = 0
        self._lock_fd: int | None = None   # holds the nvme directory's lock while open

    # ------------------------------------------------------------------ Tier protocol
    @property
    def backend(self) -> str:
        return self._io.label(self._slots.direct)

    @property
    def io(self) -> FrameIO:
        """The frame I/O backend (POSIX unless the daemon selected kvikio)."""
        return self._io

    def stats_extra(self) -> dict[str, Any]:
        """Backend and health details merged into this tier's section of /v1/stats."""
        return {"io_backend": self._io.name, "io_backend_reason": self._io.reason,
                "direct": self._slots.direct, "disk_bytes": self._slots.disk,
                "punched_slots": self._slots.punched_slots,
                "open_files": self._slots.files.open_count,
                "file_reopens": self._slots.files.reopens,
                "file_closes": self._slots.files.closes,
                **self._io.stats_extra(), **self._health.stats()}

    @property
    def capacity_bytes(self) -> int:
        return self._slots.capacity

    @property
    def used_bytes(self) -> int:
        return self._slots.used

    @property
    def disk_bytes(self) -> int:
        """Bytes the slot files occupy (>= used_bytes: free slots below the tails that were
        not punched out count)."""
        return self._slots.disk

    @property
    def open_files(self) -> int:
        """Slot file descriptors open now (at most ``max_open_files`` while no more classes
        than that have I/O in flight)."""
        return self._slots.files.open_count

    @property
    def hole_bytes(self) -> int:
        """Bytes of free slots punched out of the files (spanned, not on disk)."""
        return sum(len(c.holes) * c.stride for c in self._slots.classes.values())

    @property
    def blocks(self) -> int:
        return self._slots.stored

    @property
    def up(self) -> bool:
        """Open and taking writes (false while degraded; reads still work then)."""
        return self._state is TierState.OPEN and self._health.accepting

    @property
    def degraded(self) -> bool:
        """Open but refusing writes after a full or failing disk (see ``health``)."""
        return self._state is TierState.OPEN and not self._health.accepting

    def refuse_write(self) -> None:
        """Count a write its caller skipped because the tier is degraded (the same counters
        as a write refused here), so a caller can skip before allocating a slot."""
        self.counters.dropped_writes += 1
        self._health.refuse()

    @property
    def direct(self) -> bool:
        return self._slots.direct

    @property
    def health(self) -> WriteHealth:
        """The write health (state, reason, counters, probe backoff); read it, do not drive
        it."""
        return self._health

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> Recovered:
        """Rebuild the slot map from the files' header pages; return the stored frames, oldest
        first (by ``header.seq``), so the store can rebuild its index and LRU order
        (``kvtier.tiers.nvme.recovery`` says what is kept and what is dropped). Takes the
        directory's lock first (``lock``): StartupError when another daemon holds it, or
        when a slot file is not ours alone."""
        if self._state is not TierState.NEW:
            raise KVTierError(f"nvme tier is {self._state.value}; open() is called once")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_nvme_dir(self.root)   # before any file is probed or scanned
        try:
            self._slots.direct = choose_direct(self.root, self._direct_mode)
            self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kvtier-nvme")
            self._health.pool = self._pool
            kept, max_seq = recover(self._slots, self._pool, self.counters)
        except BaseException:
            self.close()
            raise
        self._seq = max(self._seq, max_seq)
        self._state = TierState.OPEN
        log.info("nvme tier %s: %d frames, %d of %d bytes, backend %s", self.root, len(kept),
                 self.used_bytes, self.capacity_bytes, self.backend)
        return kept

    def close(self) -> None:
        """Stop probing, finish queued I/O (erases included), shut the pool, close files."""
        self._health.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._slots.close()
        self._io.close()
        self._pending.clear()
        if self._lock_fd is not None:   # last: the directory is free for another daemon
            os.close(self._lock_fd)
            self._lock_fd = None
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
        return slot_bytes_for(payload_len)

    def alloc(self, payload_len: int) -> NvmeSlot | None:
        """A reserved slot for ``payload_len`` bytes, or None when its footprint would take
        ``used_bytes`` or the files past capacity; the store then evicts and retries (and
        counts an allocation failure if that cannot make room). Bookkeeping only."""
        self._require_open()
        return self._slots.alloc(slot_bytes_for(payload_len), self._settled)

    def disk_short(self, payload_len: int) -> int:
        """Bytes of free slots to punch out before ``payload_len`` fits (0: it fits, or
        ``used`` does not and only an eviction helps)."""
        self._require_open()
        return self._slots.disk_short(slot_bytes_for(payload_len))

    async def make_room(self, payload_len: int) -> bool:
        """Punch free slots out of the files, in the pool, until ``payload_len`` fits
        their disk (the room a new size class needs lies in other files' middles), and
        wait for the punches in flight; False when none runs, so the store evicts
        (``kvtier.tiers.nvme.reclaim``)."""
        self._require_open()
        return await self._reclaim.make_room(payload_len)

    def free(self, slot: NvmeSlot, *, erase: bool = False) -> None:
        """Return a slot to its free list. ``erase=True`` (an explicit delete) also zeroes its
        header page, queued to the pool and ordered before any later write to the slot, so the
        block does not come back after a restart."""
        self._require_open()
        cls = self._slots.check(slot, SlotState.RESERVED, SlotState.STORED)
        self._slots.release(slot)
        if erase:
            self._reclaim.queue_erase(cls, slot)

    def erase_free(self, slot: NvmeSlot) -> bool:
        """Zero the header page of a free slot whose frame is still on disk (an evicted
        frame whose key was deleted since), ordered like ``free(erase=True)``; False when
        the slot was handed out again or cut off its file (``Reclaimer.erase_free``)."""
        self._require_open()
        return self._reclaim.erase_free(slot)

    async def erased(self) -> None:
        """Wait until every erase queued so far is on disk (a delete answers after it),
        the punches in flight first (``Reclaimer.erased``)."""
        await self._reclaim.erased()

    # ------------------------------------------------------------------ I/O
    async def write(self, slot: NvmeSlot, header: FrameHeader, payload: memoryview, *,
                    sync: bool = False) -> None:
        """Write one frame into a reserved slot (one pwritev of header page + payload).

        ``payload`` holds at least ``header.payload_len`` bytes; it may be the whole padded
        arena slot. O_DIRECT goes straight from it when it is PAGE-aligned and covers
        ``slot.slot_bytes``, otherwise through an aligned bounce buffer. ``sync=True`` adds an
        fdatasync. Raises NvmeIOError (counted in ``errors``) when the OS call fails, and
        NvmeDegradedError at once, without touching the disk, while the tier is degraded
        (counted in ``dropped_writes``); the slot then stays reserved (free it, or write it
        again).
        """
        self._require_open()
        cls = self._slots.check(slot, SlotState.RESERVED)
        view = byte_view(payload)
        if header.payload_len > slot.slot_bytes or len(view) < header.payload_len:
            raise BufferSizeError(
                f"frame of {header.payload_len} bytes from a {len(view)}-byte buffer does not "
                f"fit a {slot.slot_bytes}-byte slot; alloc() with the payload length")
        if not self._health.accepting:
            self.counters.dropped_writes += 1
            raise NvmeDegradedError(f"nvme tier {self.root} is degraded "
                                    f"({self._health.refuse()}); write refused until space "
                                    "is back")
        assert self._pool is not None
        prev = self._pending.get(slot)
        if prev is not None and not prev.done():   # order after the slot's previous disk op
            await asyncio.wait([asyncio.wrap_future(prev)])
        pool, packed, direct = self._pool, header.pack(), self._slots.direct
        op = self._start(slot, cls, lambda fd: self._io.submit_write(
            pool, fd, slot.offset, packed, view, header.payload_len, slot.slot_bytes, direct,
            sync), writing=True)
        self._pending[slot] = op
        nbytes = await self._await(slot, op, cls, writing=True)
        self._health.write_ok()
        self._slots.mark_stored(slot)
        self._seq = max(self._seq, header.seq)
        self.counters.bytes_written += nbytes

    async def read_into(self, slot: NvmeSlot, out: memoryview, *, namespace: bytes | None,
                        key: bytes | None, layout_fp: int | None) -> FrameHeader:
        """Read a stored frame's payload into ``out`` and return its checked header.

        Bytes are read straight into ``out`` (O_DIRECT when it is aligned and at least
        ``slot.slot_bytes`` long; the padding after ``payload_len`` is overwritten too). The
        header must match ``namespace``/``key``/``layout_fp`` (None skips that check) and the
        payload its checksum; any failure is counted in ``checksum_failures`` and raises
        FrameError/ChecksumError, and the store should drop the slot. Reads go on while the
        tier is degraded.
        """
        self._require_open()
        cls = self._slots.check(slot, SlotState.STORED)
        assert self._pool is not None
        # a lone read may be split into pieces; with other frames in flight the pool's
        # threads already overlap whole frames
        pool, target, direct = self._pool, byte_view(out), self._slots.direct
        pieces = MAX_PIECES if self._inflight == 0 else 1
        op = self._start(slot, cls, lambda fd: self._io.submit_read(
            pool, fd, slot.offset, target, slot.slot_bytes, direct, namespace, key, layout_fp,
            min_piece=self._split_bytes, max_pieces=pieces), writing=False)
        header, nbytes = await self._await(slot, op, cls, writing=False)
        self.counters.bytes_read += nbytes
        return header

    def _start(self, slot: NvmeSlot, cls: SizeClass, begin: Callable[[int], Future[Any]], *,
               writing: bool) -> Future[Any]:
        """``begin(fd)`` with the slot file's descriptor pinned until the operation ends
        (reopened if it was closed: a failure is counted and typed like the I/O's own)."""
        try:
            return self._slots.files.start(cls.file, begin)
        except OSError as exc:
            raise self._failed(slot, cls, exc, writing=writing) from exc

    async def _await(self, slot: NvmeSlot, op: Future[Any], cls: SizeClass, *,
                     writing: bool) -> Any:
        """Wait for a started disk op and map its errors to counted, typed ones. A failed
        write with a full-disk errno degrades the tier (``health``)."""
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
            raise self._failed(slot, cls, exc, writing=writing) from exc
        finally:
            self._inflight -= 1
            if self._pending.get(slot) is op and op.done():
                del self._pending[slot]

    # ------------------------------------------------------------------ internals
    def _failed(self, slot: NvmeSlot, cls: SizeClass, exc: OSError, *,
                writing: bool) -> NvmeIOError:
        """Count a failed frame I/O (a write with a full-disk errno degrades the tier)."""
        self.counters.errors += 1
        if writing:
            self._health.write_failed(exc, PAGE + slot.slot_bytes)
        what = "write to" if writing else "read from"
        return NvmeIOError(f"nvme {what} {cls.path} slot {slot.index} failed: "
                           f"{exc.strerror or exc}")

    def _require_open(self) -> None:
        if self._state is not TierState.OPEN:
            raise KVTierError(f"nvme tier is {self._state.value}, not open")

    def _settled(self, slot: NvmeSlot) -> bool:
        """No disk operation is still queued on ``slot`` (so its file range may be cut)."""
        pending = self._pending.get(slot)
        return pending is None or pending.done()
