"""The shared-memory arena: one /dev/shm file, pre-faulted, carved into slabs.

The daemon creates and owns the file; clients map the same file (its descriptor passed
over the socket at the handshake, or its path; either way checked by ``ArenaMapping``) and
read/write KV straight into slots the daemon leases to them, so KV bytes never cross the
control socket. The arena's size is the cpu tier's hard capacity.

Allocation is ``kvtier.tiers.slab.SlabAllocator`` (shared with the hbm pool): equal slabs,
size classes of 4 KiB-multiple slots cut from units of contiguous slabs, emptied units
returned to the pool, O(1) from a class's free list.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
from pathlib import Path

import numpy as np

from kvtier.errors import ConfigError, UntrustedArena
from kvtier.tiers.slab import PAGE, SlabAllocator
from kvtier.trust import arena_problem

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_ARENA_FIX = ("the daemon creates its arena as a 0600 file of its own user, so the process on "
              "the socket is not a kvtier daemon you can trust: stop it and restart `kvtier "
              "serve`")


class Arena:
    """Owner side of the arena (the daemon). Not thread-safe: driven by the event loop."""

    def __init__(self, capacity_bytes: int, *, shm_dir: Path = Path("/dev/shm"),
                 slab_bytes: int = 64 * 2**20, prefault: bool = True) -> None:
        if capacity_bytes < PAGE:
            raise ConfigError(f"cpu tier of {capacity_bytes} bytes is smaller than one slab")
        self.slots = SlabAllocator(capacity_bytes, slab_bytes)
        self.slab_bytes = self.slots.slab_bytes
        self.size = self.slots.size
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

    def _prefault(self) -> None:
        """Touch every page once so first use runs at memcpy speed, not page-fault speed."""
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, AttributeError, ValueError):
            self.buf.reshape(-1, PAGE)[:, 0] = 0

    # -- allocation (see kvtier.tiers.slab) -----------------------------------------------
    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot able to hold ``nbytes``, or None when the arena is full."""
        return self.slots.alloc(nbytes)

    def free(self, offset: int) -> None:
        """Return a slot; a bad or repeated free raises CapacityError."""
        self.slots.free(offset)

    def could_fit(self, nbytes: int) -> bool:
        """Whether alloc(nbytes) would succeed now without eviction."""
        return self.slots.could_fit(nbytes)

    @property
    def used_bytes(self) -> int:
        return self.slots.used_bytes

    @property
    def allocated_slots(self) -> int:
        return self.slots.allocated_slots

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset: offset + nbytes]

    def close(self) -> None:
        """Unmap and unlink (clients that still map it keep their mapping until they close)."""
        self.buf = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        self.path.unlink(missing_ok=True)


class ArenaMapping:
    """Client side: maps the daemon's arena and hands out views of leased slots.

    Maps only a private regular file of the daemon's user (``kvtier.trust.arena_problem``:
    owned by ``owner_uid``, default our own uid; no group/other bits; at least ``size``
    bytes), else UntrustedArena. ``fd``: the descriptor the daemon passed over the socket
    (taken over: closed here); without one, ``path`` is opened with O_NOFOLLOW. Either way
    the check runs with fstat on the very descriptor that is mapped, so nothing can swap
    the file in between. ``source`` says which way the arena came ("fd" or "path").
    """

    def __init__(self, path: str, size: int, *, fd: int | None = None,
                 owner_uid: int | None = None) -> None:
        self.source = "path" if fd is None else "fd"
        if fd is None:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                raise UntrustedArena(f"refusing to map the arena {path}: it is a symbolic "
                                     f"link; {_ARENA_FIX}") from None
        try:
            owner = os.getuid() if owner_uid is None else owner_uid
            problem = ("is announced with a size of 0 bytes" if size <= 0
                       else arena_problem(os.fstat(fd), size, owner))
            if problem is not None:
                raise UntrustedArena(f"refusing to map the arena {path} ({self.source}): it "
                                     f"{problem}; {_ARENA_FIX}")
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
