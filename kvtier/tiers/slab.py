"""Slab allocation of fixed-size slots: offsets only, no memory.

Used by the cpu arena (shared memory) and the hbm pool (device memory). A pool is an array
of equal slabs. A size class (slot size rounded up to 4 KiB, so slots can feed O_DIRECT
I/O) takes a *unit* of ``ceil(slot / slab)`` contiguous free slabs and cuts it into equal
slots; a unit whose slots are all free goes back to the free slab pool, so memory moves
between size classes as layouts come and go. Allocation is O(1) from a class's free list;
taking a new unit scans the slab table (rare). Capacity is hard: the pool never hands out
more than ``size`` bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvtier.errors import CapacityError, ConfigError
from kvtier.tiers.aligned import PAGE, round_up

log = logging.getLogger("kvtier.tiers.slab")


def slab_layout(capacity_bytes: int, slab_bytes: int) -> tuple[int, int]:
    """(slab bytes, number of slabs) for a pool of ``capacity_bytes``: as many slabs as whole
    ``slab_bytes`` (rounded up to a page) fit, each grown by an equal share of the rest (a
    whole number of pages), together ``capacity_bytes`` rounded down to pages less at most a
    page per slab.

    Cutting whole ``slab_bytes`` slabs and dropping the rest silently lost up to a slab:
    ``cpu.bytes = 127MiB`` with 64 MiB slabs served 64 MiB, ``1GB`` 6% less than asked, while
    the config still said what was asked. Slabs only grow: smaller ones (rounding the count
    to the nearest) held half as many blocks near ``slab_bytes`` (a block then took two
    slabs; found by review). ConfigError below one page."""
    pages = capacity_bytes // PAGE if capacity_bytes > 0 else 0
    if pages <= 0:
        raise ConfigError(f"a pool of {capacity_bytes} bytes is smaller than one "
                          f"{PAGE}-byte page")
    asked = round_up(max(PAGE, slab_bytes))
    n_slabs = min(pages, max(1, pages * PAGE // asked))
    slab = pages // n_slabs * PAGE
    if slab != asked and pages * PAGE >= asked:
        log.info("a pool of %d bytes (cpu.bytes for the cpu tier) is cut into %d slabs of %d "
                 "bytes instead of slab_bytes %d (cpu.slab_bytes), so that they hold all of "
                 "it", capacity_bytes, n_slabs, slab, asked)
    return slab, n_slabs


def _slot_bytes(nbytes: int) -> int:
    if nbytes < 0:
        raise ValueError(f"slot size must be >= 0, got {nbytes}")
    return round_up(max(nbytes, 1))


@dataclass(slots=True)
class _Unit:
    """A run of contiguous slabs serving one size class."""

    first_slab: int
    n_slabs: int
    offset: int
    slot_bytes: int
    n_slots: int
    free: list[int] = field(default_factory=list)   # slot offsets, popped from the end


class SlabAllocator:
    """Offsets of slots in a buffer of ``capacity_bytes``: the slab scheme of every kvtier pool.

    The buffer is cut into equal slabs (``slab_layout``: ``slab_bytes`` adjusted so that they
    hold all of ``capacity_bytes``). A size class (request rounded up to whole pages) takes a
    unit of ``ceil(slot / slab)`` contiguous free slabs, first fit, and cuts it into slots;
    a unit whose slots are all free returns its slabs. The shared-memory arena and the HBM
    pool both allocate through it. Not thread-safe: the daemon drives it from its event loop.
    """

    def __init__(self, capacity_bytes: int, slab_bytes: int = 64 * 2**20) -> None:
        self.slab_bytes, n_slabs = slab_layout(capacity_bytes, slab_bytes)
        self.size = n_slabs * self.slab_bytes
        self._slab_owner: list[_Unit | None] = [None] * n_slabs
        self._classes: dict[int, list[_Unit]] = {}
        self._allocated: dict[int, int] = {}   # offset -> slot bytes of handed-out slots
        self.used_bytes = 0
        self.allocated_slots = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot able to hold ``nbytes``, or None when none is left."""
        slot_bytes = _slot_bytes(nbytes)
        for unit in self._classes.get(slot_bytes, ()):
            if unit.free:
                return self._take(unit)
        fresh = self._new_unit(slot_bytes)
        return None if fresh is None else self._take(fresh)

    def alloc_many(self, nbytes: int, n: int) -> list[int]:
        """Up to ``n`` slots for ``nbytes`` each (fewer when the pool runs out), the ones
        ``n`` calls of ``alloc`` would give, in that order: a batch pays the bookkeeping once
        per unit, not once per slot."""
        slot_bytes = _slot_bytes(nbytes)
        out: list[int] = []
        units = self._classes.get(slot_bytes, [])
        i = 0
        while len(out) < n:
            if i < len(units):
                unit = units[i]
                i += 1
            else:
                fresh = self._new_unit(slot_bytes)
                if fresh is None:
                    break
                unit = fresh
                units = self._classes[slot_bytes]
                i = len(units)
            take = min(n - len(out), len(unit.free))
            if take:
                got = unit.free[len(unit.free) - take:]
                del unit.free[len(unit.free) - take:]
                got.reverse()   # pop order
                out += got
        self._allocated.update(dict.fromkeys(out, slot_bytes))
        self.used_bytes += slot_bytes * len(out)
        self.allocated_slots += len(out)
        return out

    def free(self, offset: int) -> None:
        """Return a slot; an emptied unit gives its slabs back. Bad offsets raise."""
        slab = offset // self.slab_bytes if offset >= 0 else -1
        unit = self._slab_owner[slab] if 0 <= slab < len(self._slab_owner) else None
        if unit is None or offset not in self._allocated:
            raise CapacityError(f"free of an offset {offset} that is not an allocated slot")
        del self._allocated[offset]
        unit.free.append(offset)
        self.used_bytes -= unit.slot_bytes
        self.allocated_slots -= 1
        if len(unit.free) == unit.n_slots:
            for j in range(unit.first_slab, unit.first_slab + unit.n_slabs):
                self._slab_owner[j] = None
            self._classes[unit.slot_bytes].remove(unit)

    def reserve(self, offset: int, nbytes: int) -> bool:
        """Mark the slot at ``offset`` (size class of ``nbytes``) allocated, as ``alloc`` had
        handed it out; False when it cannot be that slot now (misaligned, beyond the pool,
        taken, or its slabs serve another size class). How an adopted arena's slots come back.
        """
        return self.reserve_many([(offset, nbytes)])[0]

    def reserve_many(self, slots: list[tuple[int, int]]) -> list[bool]:
        """``reserve`` for many ``(offset, nbytes)`` at once: one pass over each touched unit's
        free list instead of one removal per slot."""
        ok: list[bool] = []
        taken: dict[int, set[int]] = {}   # id(unit) -> offsets to take out of its free list
        units: dict[int, _Unit] = {}
        for offset, nbytes in slots:
            unit = self._unit_for(offset, _slot_bytes(nbytes))
            mine = None if unit is None else taken.setdefault(id(unit), set())
            if unit is None or mine is None or offset in mine or offset in self._allocated:
                ok.append(False)
                continue
            units[id(unit)] = unit
            mine.add(offset)
            self._allocated[offset] = unit.slot_bytes
            self.used_bytes += unit.slot_bytes
            self.allocated_slots += 1
            ok.append(True)
        for uid, unit in units.items():
            gone = taken[uid]
            unit.free = [o for o in unit.free if o not in gone]
        return ok

    def _unit_for(self, offset: int, slot_bytes: int) -> _Unit | None:
        """The unit that holds (or, on free slabs, would hold) a ``slot_bytes`` slot at
        ``offset``, created when its slabs are free; None when no such slot can exist."""
        slab = self.slab_bytes
        k = -(-slot_bytes // slab)
        first = offset // slab if offset >= 0 else -1
        if offset < 0 or first + k > len(self._slab_owner):
            return None
        owner = self._slab_owner[first]
        if owner is None:
            if k > 1 and any(o is not None for o in self._slab_owner[first:first + k]):
                return None
            base = first * slab
            if (offset - base) % slot_bytes or offset + slot_bytes > base + k * slab:
                return None
            return self._place_unit(first, k, slot_bytes)
        if owner.slot_bytes != slot_bytes or (offset - owner.offset) % slot_bytes \
                or offset + slot_bytes > owner.offset + owner.n_slots * slot_bytes:
            return None
        return owner

    def could_fit(self, nbytes: int) -> bool:
        """Whether ``alloc(nbytes)`` would succeed now."""
        slot_bytes = _slot_bytes(nbytes)
        if any(u.free for u in self._classes.get(slot_bytes, ())):
            return True
        return self._free_run(-(-slot_bytes // self.slab_bytes)) is not None

    def slot_size(self, offset: int) -> int:
        """The slot bytes of an allocated offset (KeyError when it is not allocated)."""
        return self._allocated[offset]

    def _take(self, unit: _Unit) -> int:
        off = unit.free.pop()
        self._allocated[off] = unit.slot_bytes
        self.used_bytes += unit.slot_bytes
        self.allocated_slots += 1
        return off

    def _free_run(self, k: int) -> int | None:
        run = 0
        for i, owner in enumerate(self._slab_owner):
            run = run + 1 if owner is None else 0
            if run == k:
                return i - k + 1
        return None

    def _new_unit(self, slot_bytes: int) -> _Unit | None:
        k = -(-slot_bytes // self.slab_bytes)
        first = self._free_run(k)
        if first is None:
            return None
        return self._place_unit(first, k, slot_bytes)

    def _place_unit(self, first: int, k: int, slot_bytes: int) -> _Unit:
        offset = first * self.slab_bytes
        n_slots = (k * self.slab_bytes) // slot_bytes
        unit = _Unit(first, k, offset, slot_bytes, n_slots,
                     [offset + j * slot_bytes for j in reversed(range(n_slots))])
        for j in range(first, first + k):
            self._slab_owner[j] = unit
        self._classes.setdefault(slot_bytes, []).append(unit)
        return unit
