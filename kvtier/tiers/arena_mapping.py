"""Client side of the arena: a verified, process-wide shared mapping of the daemon's arena.

Every client checks the descriptor it was given (fstat: a private regular file of the
daemon's verified user, large enough) and then maps it, except that a process maps each
arena file only once: clients whose descriptor is the same file (device and inode, which
cannot be reused while a mapping pins the file) share one mapping, counted by reference.
An engine opens several clients (scheduler, loader, saver, one per TP worker thread);
mapping with MAP_POPULATE once per client cost a full page-table walk of the arena each
(~0.1 s per 2 GiB, measured), in background threads beside the engine's first steps.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ProtocolError, UntrustedArena
from kvtier.trust import arena_problem

ARENA_FIX = ("the daemon creates its arena as a 0600 file of its own user, so the process on "
             "the socket is not a kvtier daemon you can trust: stop it and restart `kvtier "
             "serve`")

FileKey = tuple[int, int, int]   # (st_dev, st_ino, mapped size)


@dataclass(slots=True)
class _Shared:
    mm: mmap.mmap
    buf: np.ndarray
    refs: int = 1


_SHARED: dict[FileKey, _Shared] = {}
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A fresh ``_LOCK`` in a forked child. The parent's may be held by a thread that does
    not exist here (one mapping an arena in ``connect()``: MAP_POPULATE takes ~0.1 s per
    2 GiB), and would never be released: the child's own ``connect()`` hung. The mappings
    published under it stay shared: MAP_SHARED mappings of the daemon's arena file are
    inherited intact, and one in the making was never published."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def shared_mappings() -> int:
    """How many arena files this process has mapped (for tests and stats)."""
    with _LOCK:
        return len(_SHARED)


class ArenaMapping:
    """Client side: maps the daemon's arena and hands out views of leased slots.

    Maps only a private regular file of the daemon's user (``kvtier.trust.arena_problem``:
    owned by ``owner_uid``, default our own uid; no group/other bits; at least ``size``
    bytes), else UntrustedArena. ``fd``: the descriptor the daemon passed over the socket
    (taken over: closed here); without one, ``path`` is opened with O_NOFOLLOW. Either way
    the check runs with fstat on the very descriptor whose file is mapped, so nothing can
    swap the file in between. ``source`` says which way the arena came ("fd" or "path").
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
                                     f"link; {ARENA_FIX}") from None
        try:
            owner = os.getuid() if owner_uid is None else owner_uid
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino)   # which file: a path can be reused
            problem = ("is announced with a size of 0 bytes" if size <= 0
                       else arena_problem(st, size, owner))
            if problem is not None:
                raise UntrustedArena(f"refusing to map the arena {path} ({self.source}): it "
                                     f"{problem}; {ARENA_FIX}")
            self._key: FileKey = (st.st_dev, st.st_ino, size)
            with _LOCK:
                shared = _SHARED.get(self._key)
                if shared is not None:
                    shared.refs += 1
                else:
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                    mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
                    shared = _SHARED[self._key] = _Shared(mm, np.frombuffer(mm, np.uint8))
        finally:
            os.close(fd)
        self._shared: _Shared | None = shared
        self.buf = shared.buf
        self.size = size
        self.keep_mapped = False   # shared by a process's clients (and maybe CUDA-registered)

    def view(self, offset: int, nbytes: int, *, writable: bool) -> np.ndarray:
        """``nbytes`` at ``offset``; ProtocolError unless that lies inside the arena (a
        slice would quietly be shorter, or count from the end)."""
        if type(offset) is not int or offset < 0 or offset + nbytes > self.size:
            raise ProtocolError(f"a slot of {nbytes} bytes at {offset!r:.40} is outside the "
                                f"arena of {self.size} bytes")
        v = self.buf[offset: offset + nbytes]
        if not writable:
            v = v.view()
            v.flags.writeable = False
        return v

    def close(self) -> None:
        """Drop this client's reference, unless ``keep_mapped`` (then its owner drops it by
        clearing the flag); the last reference unmaps (once no view is alive)."""
        if self.keep_mapped or self._shared is None:
            return
        shared, self._shared = self._shared, None
        self.buf = np.empty(0, dtype=np.uint8)
        with _LOCK:
            shared.refs -= 1
            if shared.refs > 0:
                return
            if _SHARED.get(self._key) is shared:
                del _SHARED[self._key]
        shared.buf = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError, ValueError):
            shared.mm.close()
