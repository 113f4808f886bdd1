"""Slot allocation of the nvme tier: one file per size class, fixed slots, hard capacity.

On-disk layout. One file per size class, ``<root>/slots-<slot_bytes>.dat``. Slot ``i`` of a
class lives at ``i * (PAGE + slot_bytes)``: a 4 KiB header page followed by the payload
padded to ``slot_bytes``. Files grow as slots are handed out (a per-class high-water mark)
and shrink when their top slots are free and room is needed. When a class must grow and
the room is in free slots in the middle of files, those slots' ranges are punched out
(``kvtier.tiers.nvme.holes``): their space goes back to the file system where it lies,
so the store evicts only what the new slot's size needs.

``SlotTable`` is bookkeeping plus the files (``files``: a bounded number of descriptors
open, the others reopened when used): it never reads or writes a frame (that is the tier's,
through its FrameIO backend). Capacity counts each slot's full footprint (header page +
padded payload); the total size of the slot files never exceeds it either. A class whose
file a trim cuts to nothing is dropped: its descriptor closed, its file removed (a new
block of its size opens a new one). Touched only from the event loop thread.
"""

from __future__ import annotations

import heapq
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from kvtier.errors import KVTierError
from kvtier.tiers.aligned import PAGE, round_up
from kvtier.tiers.base import TierCounters
from kvtier.tiers.nvme.files import MAX_OPEN_FILES, SlotFile, SlotFiles
from kvtier.tiers.nvme.frameio import FrameIO
from kvtier.tiers.nvme.holes import HolesUnsupported, punch_run

__all__ = ["FILE_RE", "NvmeSlot", "SizeClass", "SlotState", "SlotTable", "slot_bytes_for"]

log = logging.getLogger(__name__)

FILE_RE = re.compile(r"^slots-([1-9]\d*)\.dat$")   # one name per class: no leading zeros


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


def slot_bytes_for(payload_len: int) -> int:
    """The size class of a payload: its length rounded up to PAGE (at least one page)."""
    if payload_len < 0:
        raise ValueError(f"payload length must be >= 0, got {payload_len}")
    return max(PAGE, round_up(payload_len))


@dataclass(slots=True)
class SizeClass:
    """One slot file. Invariant: each index < high_water is in exactly one of ``free`` and
    ``busy``; indices >= high_water are not in the file. ``free`` is a min-heap so the lowest
    slots are reused first, which keeps the file's tail free and trimmable."""

    slot_bytes: int
    path: Path
    file: SlotFile   # its descriptor: ``SlotTable.files`` pins it for each use
    high_water: int = 0
    free: list[int] = field(default_factory=list)
    busy: dict[int, SlotState] = field(default_factory=dict)
    holes: set[int] = field(default_factory=set)   # free slots punched out: no disk
    punching: set[int] = field(default_factory=set)   # off the free list, being punched
    erase_after: set[int] = field(default_factory=set)  # of those: erase if the punch fails

    @property
    def stride(self) -> int:
        return PAGE + self.slot_bytes


class SlotTable:
    """The slot files under ``root`` and which slots are free, reserved or stored.

    ``used`` is the footprint of RESERVED + STORED slots, ``disk`` that of every slot below
    the high-water marks but the punched ones (what the files occupy), ``stored`` the
    number of STORED slots.
    """

    def __init__(self, root: Path, capacity: int, io: FrameIO, counters: TierCounters, *,
                 max_open: int = MAX_OPEN_FILES) -> None:
        self.root = root
        self.capacity = capacity
        self.files = SlotFiles(io, max_open)
        self.classes: dict[int, SizeClass] = {}
        self.used = 0
        self.disk = 0
        self.stored = 0
        self.punched_slots = 0  # slots punched out so far (room made without evicting)
        self.punching_bytes = 0  # disk of the slots being punched now (given back soon)
        self._holes_ok = True   # until the file system says it cannot punch
        self.counters = counters

    @property
    def direct(self) -> bool:
        """Files are opened with O_DIRECT (set by the tier before any open)."""
        return self.files.direct

    @direct.setter
    def direct(self, value: bool) -> None:
        self.files.direct = value

    # ------------------------------------------------------------------ files
    def open_class(self, slot_bytes: int) -> SizeClass:
        """Open (creating if needed) the file of a size class and attach it to the backend.
        The file must be ours alone, not a symlink (``kvtier.trust.open_owned_file``):
        StartupError otherwise, before a byte of it is read, written or truncated (and an
        OSError at a reopen, ``files``)."""
        path = self.root / f"slots-{slot_bytes}.dat"
        cls = SizeClass(slot_bytes, path, self.files.open(path))
        self.classes[slot_bytes] = cls
        return cls

    def drop(self, cls: SizeClass) -> None:
        """Forget a class whose file holds no slot (``high_water`` 0): its descriptor is
        closed once no I/O uses it, its file removed."""
        assert cls.high_water == 0 and not cls.busy and not cls.punching
        del self.classes[cls.slot_bytes]
        self.files.retire(cls.file)

    def close(self) -> None:
        """Detach and close every slot file."""
        self.files.close_all()
        self.classes.clear()

    def adopt(self, cls: SizeClass, stored: list[int]) -> None:
        """Take a scanned file: ``stored`` the indices whose frames are valid, the file cut
        right after the last of them (so the free list, every other index below it, grows
        with what is stored, not with the file's size)."""
        high_water = max(stored, default=-1) + 1
        try:
            with self.files.held(cls.file) as fd:
                if os.fstat(fd).st_size > high_water * cls.stride:
                    os.ftruncate(fd, high_water * cls.stride)
        except OSError as exc:   # the slots past high_water are never read: only space is lost
            self.counters.errors += 1
            log.warning("nvme tier: cannot cut the empty tail of %s: %s", cls.path,
                        exc.strerror)
        cls.high_water = high_water
        self.disk += cls.high_water * cls.stride
        keep = set(stored)
        for index in stored:
            cls.busy[index] = SlotState.STORED
        cls.free = [i for i in range(cls.high_water) if i not in keep]
        heapq.heapify(cls.free)
        self.stored += len(keep)
        self.used += len(keep) * cls.stride

    # ------------------------------------------------------------------ slots
    def alloc(self, slot_bytes: int, settled: Callable[[NvmeSlot], bool]) -> NvmeSlot | None:
        """A reserved slot of ``slot_bytes``, or None when its footprint would take ``used``
        or the files past capacity (an attempt: the store punches free slots out or evicts
        and retries, and counts an allocation failure only when nothing makes room).
        ``settled(slot)`` says whether a slot has no disk operation queued (only those may
        be trimmed away). No disk I/O but a tail cut: punching runs in the tier's pool."""
        footprint = PAGE + slot_bytes
        if self.used + footprint > self.capacity:
            return None
        cls = self.classes.get(slot_bytes) or self.open_class(slot_bytes)
        if cls.free:
            index = heapq.heappop(cls.free)
            if index in cls.holes:                # reused: it takes disk again
                if not self._disk_room(footprint, settled):
                    heapq.heappush(cls.free, index)
                    # a free slot that kept its disk needs none (the lowest is a hole
                    # after a partial punch: refusing cost an eviction or a punch); holes
                    # are all free, so none is left when they are as many as the free slots
                    if len(cls.free) <= len(cls.holes):
                        return None
                    whole = next(i for i in cls.free if i not in cls.holes)
                    cls.free.remove(whole)
                    heapq.heapify(cls.free)
                    index = whole
                else:
                    cls.holes.discard(index)
                    self.disk += footprint
        else:
            if not self._disk_room(footprint, settled):
                return None
            index = cls.high_water
            cls.high_water += 1
            self.disk += footprint
        cls.busy[index] = SlotState.RESERVED
        self.used += footprint
        return NvmeSlot(slot_bytes, index)

    def disk_short(self, slot_bytes: int) -> int:
        """Bytes of disk to give back before a ``slot_bytes`` slot fits (punches in flight,
        ``punching_bytes``, may already be giving them): 0 when it fits, or when ``used``
        does not (only an eviction helps then), or without holes."""
        footprint = PAGE + slot_bytes
        if not self._holes_ok or self.used + footprint > self.capacity:
            return 0
        return max(0, self.disk + footprint - self.capacity)

    def fit_disk(self, settled: Callable[[NvmeSlot], bool]) -> bool:
        """Bring the files within capacity (free tails cut, free slots punched out, here:
        the start-up scan, before any client); False when they cannot be (no holes). The
        scan counts every free slot below a file's tail as disk, holes included: this
        punches what is really free (a hole punched again stays a hole)."""
        if self._disk_room(0, settled):
            return True
        plan = self.take_for_punch(self.disk - self.capacity, settled)
        left = self.punched(plan, [self._punch_now(cls, run) for cls, run in plan])
        assert not left   # (no erase can be asked for during the scan)
        return self.disk <= self.capacity

    def _punch_now(self, cls: SizeClass, run: list[int]) -> OSError | None:
        try:
            with self.files.held(cls.file) as fd:
                return punch_run(fd, cls.stride, run)
        except OSError as exc:   # (it could not be reopened)
            return exc

    def _disk_room(self, footprint: int, settled: Callable[[NvmeSlot], bool]) -> bool:
        """Whether the files can take ``footprint`` more bytes, their free tails cut first
        (never a slot with a disk operation still queued)."""
        if self.disk + footprint <= self.capacity:
            return True
        for cls in list(self.classes.values()):   # (a class cut to nothing is dropped)
            self.trim(cls, settled)
        return self.disk + footprint <= self.capacity

    def take_for_punch(self, need: int, settled: Callable[[NvmeSlot], bool],
                       ) -> list[tuple[SizeClass, list[int]]]:
        """Free slots worth ``need`` bytes of disk (or all there are), as runs of adjacent
        slots, the longest first and the last cut to what is needed (one call each). They
        leave the free lists until ``punched`` gives them back, so nothing is handed out
        while the punch runs, and count in ``punching_bytes`` (``disk_short``)."""
        if not self._holes_ok or need <= 0:
            return []
        runs: list[tuple[SizeClass, list[int]]] = []
        for cls in self.classes.values():
            todo = sorted(i for i in cls.free if i not in cls.holes
                          and settled(NvmeSlot(cls.slot_bytes, i)))
            for i in todo:
                if runs and runs[-1][0] is cls and runs[-1][1][-1] == i - 1:
                    runs[-1][1].append(i)
                else:
                    runs.append((cls, [i]))
        runs.sort(key=lambda r: len(r[1]) * r[0].stride, reverse=True)
        plan: list[tuple[SizeClass, list[int]]] = []
        for cls, run in runs:
            if need <= 0:
                break
            run = run[: -(-need // cls.stride)]
            plan.append((cls, run))
            need -= len(run) * cls.stride
        for cls in {id(c): c for c, _ in plan}.values():
            taken = {i for c, run in plan if c is cls for i in run}
            cls.free = [i for i in cls.free if i not in taken]
            heapq.heapify(cls.free)
            cls.punching |= taken
            self.punching_bytes += len(taken) * cls.stride
        return plan

    def punched(self, plan: list[tuple[SizeClass, list[int]]],
                outcomes: list[OSError | None]) -> list[tuple[SizeClass, NvmeSlot]]:
        """The punches of ``take_for_punch`` are over (``outcomes``: None or the error,
        per run): the slots go back to their free lists, holes where it succeeded. Returns
        the slots of failed runs whose frames a delete asked to erase meanwhile (the punch
        was to remove them): the caller erases them now."""
        erase: list[tuple[SizeClass, NvmeSlot]] = []
        for (cls, run), err in zip(plan, outcomes, strict=True):
            if err is None:
                cls.holes.update(run)
                self.disk -= len(run) * cls.stride
                self.punched_slots += len(run)
            elif isinstance(err, HolesUnsupported):
                if self._holes_ok:
                    log.warning("nvme tier: %s cannot punch holes (%s): a new size class "
                                "may evict more than it needs", cls.path, err.strerror)
                self._holes_ok = False
            else:
                self.counters.errors += 1
                log.warning("nvme tier: cannot free slots of %s: %s", cls.path, err.strerror)
            for i in run:
                cls.punching.discard(i)
                if i in cls.erase_after:
                    cls.erase_after.discard(i)
                    if err is not None:
                        erase.append((cls, NvmeSlot(cls.slot_bytes, i)))
                heapq.heappush(cls.free, i)
            self.punching_bytes -= len(run) * cls.stride
        return erase

    def check(self, slot: NvmeSlot, *allowed: SlotState) -> SizeClass:
        """The class of ``slot`` when the slot is in one of the ``allowed`` states, else
        KVTierError (a slot that was never handed out, already freed, ...)."""
        cls = self.classes.get(slot.slot_bytes)
        state = SlotState.FREE
        if cls is not None and 0 <= slot.index < cls.high_water:
            state = cls.busy.get(slot.index, SlotState.FREE)
        if state not in allowed or cls is None:
            raise KVTierError(f"nvme slot {slot} is {state.value}; expected "
                              f"{' or '.join(s.value for s in allowed)}")
        return cls

    def mark_stored(self, slot: NvmeSlot) -> None:
        """RESERVED -> STORED once its write returned (no-op if it was freed meanwhile)."""
        cls = self.classes[slot.slot_bytes]
        if cls.busy.get(slot.index) is SlotState.RESERVED:
            cls.busy[slot.index] = SlotState.STORED
            self.stored += 1

    def release(self, slot: NvmeSlot) -> None:
        """Busy -> free list (no I/O)."""
        cls = self.classes[slot.slot_bytes]
        if cls.busy.pop(slot.index) is SlotState.STORED:
            self.stored -= 1
        heapq.heappush(cls.free, slot.index)
        self.used -= cls.stride

    def trim(self, cls: SizeClass, settled: Callable[[NvmeSlot], bool]) -> None:
        """Cut free slots off the file's tail (none with a disk operation still queued); a
        file cut to nothing is dropped (``drop``)."""
        free = set(cls.free)
        top = cls.high_water
        while top > 0 and top - 1 in free and settled(NvmeSlot(cls.slot_bytes, top - 1)):
            top -= 1
        if top == cls.high_water:
            return
        try:
            with self.files.held(cls.file) as fd:
                os.ftruncate(fd, top * cls.stride)
        except OSError as exc:
            self.counters.errors += 1
            log.warning("nvme tier: cannot shrink %s: %s", cls.path, exc.strerror)
            return
        cls.free = [i for i in cls.free if i < top]
        heapq.heapify(cls.free)
        cut_holes = {i for i in cls.holes if i >= top}
        cls.holes -= cut_holes
        self.disk -= (cls.high_water - top - len(cut_holes)) * cls.stride
        cls.high_water = top
        if top == 0:
            self.drop(cls)
