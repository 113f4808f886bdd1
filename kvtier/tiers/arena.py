"""The shared-memory arena: one /dev/shm file, pre-faulted, carved into slabs.

The daemon creates and owns the file; clients map the same file (path handed over in the
handshake) and read/write KV straight into slots the daemon leases to them, so KV bytes
never cross the control socket. The arena's size is the cpu tier's hard capacity.

Allocation: the arena is an array of equal slabs. A size class (slot size, a multiple of
4 KiB so slots can feed O_DIRECT I/O) takes a *unit* of ``ceil(slot / slab)`` contiguous
free slabs and cuts it into equal slots. A unit whose slots are all free goes back to the
free slab pool, so memory moves between size classes as layouts come and go. Allocation
is O(1) from a class's free list; taking a new unit scans the slab table (rare).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.errors import CapacityError, ConfigError

PAGE = 4096
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def _slot_bytes(nbytes: int) -> int:
    """The size class of ``nbytes``: whole pages, at least one (0 would divide by zero)."""
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
    free: list[int] = field(default_factory=list)  # slot offsets

    @property
    def used(self) -> int:
        return self.n_slots - len(self.free)


class Arena:
    """Owner side of the arena (the daemon). Not thread-safe: driven by the event loop."""

    def __init__(self, capacity_bytes: int, *, shm_dir: Path = Path("/dev/shm"),
                 slab_bytes: int = 64 * 2**20, prefault: bool = True) -> None:
        slab = round_up(max(PAGE, slab_bytes))
        if slab > capacity_bytes:  # a small arena is one slab (rounding up would not fit)
            slab = capacity_bytes // PAGE * PAGE
        n_slabs = capacity_bytes // slab if slab else 0
        if n_slabs <= 0:
            raise ConfigError(f"cpu tier of {capacity_bytes} bytes is smaller than one slab")
        self.slab_bytes = slab
        self.size = n_slabs * slab
        if not shm_dir.is_dir():
            raise ConfigError(f"shared-memory directory {shm_dir} does not exist")
        name = f"kvtier-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}.arena"
        self.path = shm_dir / name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise ConfigError(f"cannot create a {self.size}-byte arena in {shm_dir}: {exc}; "
                              "lower cpu.bytes or enlarge /dev/shm") from None
        os.close(fd)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        if prefault:
            self._prefault()
        self._slab_owner: list[_Unit | None] = [None] * n_slabs
        self._classes: dict[int, list[_Unit]] = {}
        self._allocated: set[int] = set()  # offsets of slots handed out (catches bad frees)
        self.used_bytes = 0
        self.allocated_slots = 0

    def _prefault(self) -> None:
        """Touch every page once so first use runs at memcpy speed, not page-fault speed."""
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, AttributeError, ValueError):
            self.buf.reshape(-1, PAGE)[:, 0] = 0

    # -- allocation ---------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot able to hold ``nbytes``, or None when the arena is full."""
        slot_bytes = _slot_bytes(nbytes)
        for unit in self._classes.get(slot_bytes, ()):
            if unit.free:
                return self._take(unit)
        unit = self._new_unit(slot_bytes)
        if unit is None:
            return None
        return self._take(unit)

    def _take(self, unit: _Unit) -> int:
        off = unit.free.pop()
        self._allocated.add(off)
        self.used_bytes += unit.slot_bytes
        self.allocated_slots += 1
        return off

    def _new_unit(self, slot_bytes: int) -> _Unit | None:
        k = -(-slot_bytes // self.slab_bytes)
        owners = self._slab_owner
        run = 0
        for i, owner in enumerate(owners):
            run = run + 1 if owner is None else 0
            if run == k:
                first = i - k + 1
                offset = first * self.slab_bytes
                n_slots = (k * self.slab_bytes) // slot_bytes
                unit = _Unit(first, k, offset, slot_bytes, n_slots,
                             [offset + j * slot_bytes for j in reversed(range(n_slots))])
                for j in range(first, first + k):
                    owners[j] = unit
                self._classes.setdefault(slot_bytes, []).append(unit)
                return unit
        return None

    def free(self, offset: int) -> None:
        """Return a slot; a unit left empty gives its slabs back to the pool."""
        slab = offset // self.slab_bytes
        unit = self._slab_owner[slab] if 0 <= slab < len(self._slab_owner) else None
        if unit is None or offset not in self._allocated:
            raise CapacityError(f"free of an offset {offset} that is not an allocated slot")
        self._allocated.remove(offset)
        unit.free.append(offset)
        self.used_bytes -= unit.slot_bytes
        self.allocated_slots -= 1
        if len(unit.free) == unit.n_slots:
            for j in range(unit.first_slab, unit.first_slab + unit.n_slabs):
                self._slab_owner[j] = None
            self._classes[unit.slot_bytes].remove(unit)

    def could_fit(self, nbytes: int) -> bool:
        """Whether alloc(nbytes) would succeed now without eviction."""
        slot_bytes = _slot_bytes(nbytes)
        if any(u.free for u in self._classes.get(slot_bytes, ())):
            return True
        k = -(-slot_bytes // self.slab_bytes)
        run = 0
        for owner in self._slab_owner:
            run = run + 1 if owner is None else 0
            if run == k:
                return True
        return False

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset: offset + nbytes]

    def close(self) -> None:
        """Unmap and unlink (clients that still map it keep their mapping until they close)."""
        self.buf = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        self.path.unlink(missing_ok=True)


class ArenaMapping:
    """Client side: maps the daemon's arena file and hands out views of leased slots."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.size = size

    def view(self, offset: int, nbytes: int, *, writable: bool) -> np.ndarray:
        v = self.buf[offset: offset + nbytes]
        if not writable:
            v = v.view()
            v.flags.writeable = False
        return v

    def close(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()


def remove_stale_arenas(shm_dir: Path) -> list[Path]:
    """Unlink arenas of this user whose daemon process is gone (after a SIGKILL)."""
    removed = []
    prefix = f"kvtier-{os.getuid()}-"
    for p in shm_dir.glob(prefix + "*.arena"):
        try:
            pid = int(p.name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
            removed.append(p)
        except PermissionError:
            pass
    return removed
