"""The shared-memory arena: one /dev/shm file, pre-faulted, carved into slabs.

The daemon creates and owns the file; clients map the same file (its descriptor passed
over the socket at the handshake, or its path; either way checked by ``ArenaMapping``) and
read/write KV straight into slots the daemon leases to them, so KV bytes never cross the
control socket. The arena's size is the cpu tier's hard capacity.

Warm restart. The daemon names its arena after its data directory
(``stable_arena_name``), holds an exclusive ``flock`` on it while it lives, and keeps a
journal beside it (``kvtier.tiers.arena_journal``) of what every slot holds. A daemon that
starts on the same data directory after a crash finds the file unlocked and adopts it
(``adopt=True``) instead of creating a new one; the store then re-reserves the journal's
slots (``SlabAllocator.reserve_many``). ``remove_stale_arenas`` removes the arenas of
other dead daemons (unlocked files), so /dev/shm does not fill up with them.

Allocation is ``kvtier.tiers.slab.SlabAllocator`` (shared with the hbm pool): equal slabs,
size classes of 4 KiB-multiple slots cut from units of contiguous slabs, emptied units
returned to the pool, O(1) from a class's free list.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

import numpy as np
import xxhash

from kvtier.errors import ConfigError
from kvtier.tiers.arena_journal import ArenaJournal
from kvtier.tiers.journal_format import open_private
from kvtier.tiers.slab import PAGE, SlabAllocator

log = logging.getLogger(__name__)
_STABLE_RE = re.compile(r"^d[0-9a-f]{16}\.arena$")


def stable_arena_name(data_dir: Path) -> str:
    """The arena file name of the daemon serving ``data_dir``: the same across restarts, so
    a daemon started after a crash finds its predecessor's arena."""
    digest = xxhash.xxh3_64_hexdigest(str(Path(data_dir).resolve()).encode())
    return f"kvtier-{os.getuid()}-d{digest}.arena"


def journal_path(arena_path: Path) -> Path:
    """Where the journal of the arena at ``arena_path`` lives (same directory)."""
    return arena_path.with_suffix(".journal")

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


class Arena:
    """Owner side of the arena (the daemon). Not thread-safe: driven by the event loop."""

    def __init__(self, capacity_bytes: int, *, shm_dir: Path = Path("/dev/shm"),
                 slab_bytes: int = 64 * 2**20, prefault: bool = True, name: str | None = None,
                 adopt: bool = False) -> None:
        """Create the arena file (``name``: a stable name, else a unique one), or with
        ``adopt`` map the existing file of that name with its contents (``adopted`` says
        whether that happened: a missing, foreign or resized file is replaced by a new one).
        """
        if capacity_bytes < PAGE:
            raise ConfigError(f"cpu.bytes of {capacity_bytes} bytes is smaller than one "
                              f"{PAGE}-byte page, the least the cpu tier can hold: give at "
                              f"least {PAGE} (--cpu-bytes, e.g. 2GiB)")
        self.slots = SlabAllocator(capacity_bytes, slab_bytes)
        self.slab_bytes = self.slots.slab_bytes
        self.size = self.slots.size
        self.journal: ArenaJournal | None = None
        self.adopted = False
        if not shm_dir.is_dir():
            what = "is not a directory" if shm_dir.exists() else "does not exist"
            raise ConfigError(f"shared-memory directory {shm_dir} (cpu.shm_dir) {what}: set "
                              "cpu.shm_dir to a tmpfs directory such as /dev/shm")
        fd = -1
        if name is not None:
            self.path = shm_dir / name
            fd = self._open_stable(adopt)
        if fd < 0:
            unique = f"kvtier-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}.arena"
            self.path = shm_dir / unique
            fd = self._create()
        self._fd = fd   # held open: its flock says this daemon is alive
        try:
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            self._discard()
            raise ConfigError(f"cannot map a {self.size}-byte arena in {shm_dir}: {exc}; "
                              "lower cpu.bytes or enlarge /dev/shm") from None
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        if prefault:
            self._prefault()

    def _open_stable(self, adopt: bool) -> int:
        """A locked descriptor of the stable-named file, adopted or new; -1 when the name
        is held by a file that is not ours (then a unique name is used, cold)."""
        try:
            fd = open_private(self.path, os.O_RDWR)
        except FileNotFoundError:
            return self._create()
        except OSError as exc:
            log.warning("arena %s is not a private file of this user (%s): using a unique "
                        "name; warm restart is off", self.path, exc)
            return -1
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(f"arena {self.path} is in use by another kvtier daemon on the "
                              "same data directory; stop it or use another --data-dir") from None
        try:
            same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:   # removed as stale between our open and our lock: start afresh
            os.close(fd)
            return self._create()
        if adopt and os.fstat(fd).st_size == self.size:
            self.adopted = True
            return fd
        if adopt:
            log.info("arena %s has another size than %d bytes: starting cold", self.path,
                     self.size)
        self.path.unlink(missing_ok=True)
        os.close(fd)
        return self._create()

    def _create(self) -> int:
        """A new locked file of ``self.size`` bytes at ``self.path``: made under a temporary
        name and renamed into place, so no other daemon ever sees it unlocked (and stale)."""
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, self.size)
            os.rename(tmp, self.path)
        except OSError as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"cannot create a {self.size}-byte arena {self.path}: {exc}; "
                              "lower cpu.bytes or enlarge /dev/shm") from None
        return fd

    def _discard(self) -> None:
        os.close(self._fd)
        self._fd = -1
        self.path.unlink(missing_ok=True)

    def _prefault(self) -> None:
        """Touch every page once so first use runs at memcpy speed, not page-fault speed
        (an adopted arena is only read: its bytes are blocks)."""
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, AttributeError, ValueError):
            if self.adopted:
                int(self.buf.reshape(-1, PAGE)[:, 0].max())
            else:
                self.buf.reshape(-1, PAGE)[:, 0] = 0

    # -- allocation (see kvtier.tiers.slab) -----------------------------------------------
    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot able to hold ``nbytes``, or None when the arena is full.
        The journal records it before the offset can reach a client."""
        off = self.slots.alloc(nbytes)
        if off is not None and self.journal is not None:
            self.journal.alloc(off, nbytes)
        return off

    def alloc_many(self, nbytes: int, n: int) -> list[int]:
        """Up to ``n`` slots of ``nbytes`` (fewer when the arena is full), journaled at once."""
        offsets = self.slots.alloc_many(nbytes, n)
        if offsets and self.journal is not None:
            self.journal.alloc_many(offsets, nbytes)
        return offsets

    def free(self, offset: int) -> None:
        """Return a slot; a bad or repeated free raises CapacityError."""
        self.slots.free(offset)
        if self.journal is not None:
            self.journal.free(offset)

    def open_for_client(self) -> int:
        """A new descriptor of the arena file for handing to a client (SCM_RIGHTS). Never
        pass the arena's own descriptor: it shares the daemon's flock, and a client holding
        it after a crash would make the restarted daemon think the arena is still in use."""
        fd = open_private(self.path, os.O_RDWR)
        if os.fstat(fd).st_ino != os.fstat(self._fd).st_ino:
            os.close(fd)
            raise ConfigError(f"arena {self.path} was replaced under the daemon")
        return fd

    def reserve_many(self, slots: list[tuple[int, int]]) -> list[bool]:
        """Re-reserve adopted slots ``(offset, nbytes)`` (not journaled: the caller writes the
        adopted state to a fresh journal); see ``SlabAllocator.reserve_many``."""
        return self.slots.reserve_many(slots)

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

    def close(self, *, unlink: bool = True) -> None:
        """Unmap and unlink, journal included (clients that still map it keep their mapping
        until they close). A graceful stop leaves nothing to adopt; ``unlink=False`` (a
        start refused after adopting a crashed daemon's arena) leaves it for the next."""
        self.buf = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        if self.journal is not None:
            self.journal.close(unlink=unlink)
            self.journal = None
        if self._fd >= 0:
            if unlink:
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


def remove_stale_arenas(shm_dir: Path, keep: Path | None = None,
                        need_bytes: int | None = None) -> list[Path]:
    """Unlink arenas of this user whose daemon process is gone (after a SIGKILL).

    Unique names (``kvtier-UID-PID-*.arena``) are stale when PID is gone; stable names
    (``kvtier-UID-dHASH.arena``, see ``stable_arena_name``) when no process holds their
    flock; their journals go with them. ``keep`` (the caller's own stable arena, which it
    is about to adopt) is left alone. A stale stable arena is another data dir's warm
    restart in waiting (its daemon may be restarting right now), so with ``need_bytes``
    they are removed only while ``shm_dir`` has less than that free, oldest first.
    """
    removed = []
    prefix = f"kvtier-{os.getuid()}-"
    stable: list[Path] = []
    for p in shm_dir.glob(prefix + "*.arena"):
        rest = p.name[len(prefix):]
        if _STABLE_RE.match(rest):
            if p != keep and _unlocked(p):
                stable.append(p)
            continue
        try:
            pid = int(rest.split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
            removed.append(p)
        except PermissionError:
            pass
    for p in shm_dir.glob(prefix + "*.tmp"):   # half-made files (NAME.PID.HEX.tmp)
        parts = p.name.split(".")
        if len(parts) >= 4 and parts[-3].isdigit() and not _pid_alive(int(parts[-3])):
            p.unlink(missing_ok=True)
    for p in sorted(stable, key=_mtime):
        if need_bytes is not None and _free_bytes(shm_dir) >= need_bytes:
            break
        p.unlink(missing_ok=True)
        journal_path(p).unlink(missing_ok=True)
        removed.append(p)
    for p in shm_dir.glob(prefix + "*.arena.presence"):   # kvtier.presence, of a gone arena
        with contextlib.suppress(OSError):   # only our own files; anything else stays
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() \
                    and not p.with_suffix("").exists():
                p.unlink()
    return removed


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _free_bytes(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlocked(path: Path) -> bool:
    """Whether ``path`` is a private file of ours that no live daemon holds locked."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False   # a live daemon holds it
    finally:
        os.close(fd)
    return True
