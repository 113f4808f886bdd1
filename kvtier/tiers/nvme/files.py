"""The slot files' descriptors: a bounded number open, the others reopened when used.

The tier keeps one file per size class (``slots``), and a daemon shares its open-file limit
with its client connections (``kvtier.daemon.descriptors`` budgets 256 descriptors for
everything else). A file's descriptor used to stay open for the daemon's life, so a client
storing blocks of thousands of sizes made it hold thousands. Now:

- at most ``limit`` (``MAX_OPEN_FILES``) descriptors are open: before one more is opened,
  the least recently used that no I/O uses is closed (with kvikio, its CuFile too);
- a closed file is reopened on its next use through the checks of its first open
  (``kvtier.trust.open_owned_file``: no symlink followed, a regular file of ours alone,
  one link, before a byte is read or written) and must still be the same file (device
  and inode): a file replaced or removed meanwhile is an OSError, never read or written;
- a descriptor handed to an I/O thread is pinned until that operation's future is done:
  it is never closed while a read, write, punch or erase on it is queued or running (its
  number, reused by the next open, would take the operation to another file). Pins are
  taken on the thread that drives the tier (the event loop; the start-up scan before it),
  where descriptors are also closed; an operation's end unpins from its own thread. While
  more classes than ``limit`` have I/O in flight, that many stay open;
- ``retire`` closes the descriptor of a class the tier dropped (its file cut to nothing)
  once no I/O uses it, and removes the file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvtier.errors import StartupError
from kvtier.lograte import LogRate
from kvtier.tiers.nvme.frameio import FrameIO
from kvtier.trust import open_owned_file

__all__ = ["MAX_OPEN_FILES", "SlotFile", "SlotFiles"]

log = logging.getLogger("kvtier.tiers.nvme.tier")
_warn = LogRate(log)

MAX_OPEN_FILES = 32
"""Slot file descriptors kept open (classes with I/O in flight excepted). A deployment
stores a few block sizes (one per model and layout); kvikio adds its own per open file."""

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class SlotFile:
    """One slot file: where it is, which file it was at its first open, its descriptor."""

    path: Path
    ident: tuple[int, int]     # (st_dev, st_ino) at the first open: a reopen must match
    fd: int = -1               # -1 while closed
    users: int = 0             # operations pinning ``fd`` (under ``SlotFiles._lock``)
    retired: bool = False      # its class is gone: never reopened


class SlotFiles:
    """The open slot file descriptors, least recently used first, at most ``limit``."""

    def __init__(self, io: FrameIO, limit: int = MAX_OPEN_FILES) -> None:
        if limit < 1:
            raise ValueError(f"at least one slot file must stay open, got {limit}")
        self.limit = limit
        self.direct = False          # open with O_DIRECT (set before the first open)
        self.reopens = 0             # closed descriptors opened again
        self.closes = 0              # descriptors closed to stay within ``limit``
        self._io = io
        self._open: OrderedDict[SlotFile, None] = OrderedDict()
        self._retiring: list[SlotFile] = []   # retired, closed once their I/O ends
        self._lock = threading.Lock()         # guards ``users`` (I/O threads unpin)

    @property
    def open_count(self) -> int:
        """Descriptors open now (retired ones still in use included)."""
        return len(self._open) + len(self._retiring)

    def open(self, path: Path) -> SlotFile:
        """Open (creating it if needed) a class's file for the first time. StartupError when
        it is not ours alone (``open_owned_file``), OSError when it cannot be opened."""
        self._shed(room=1)
        fd = self._open_fd(path, os.O_CREAT)
        try:
            st = os.fstat(fd)
            f = SlotFile(path, (st.st_dev, st.st_ino))
            self._io.attach(path, fd)
        except BaseException:
            os.close(fd)
            raise
        f.fd = fd
        self._open[f] = None
        return f

    def pin(self, f: SlotFile) -> int:
        """``f``'s descriptor, reopened when it was closed, kept open until ``unpin``.
        OSError when it cannot be reopened (removed, replaced, not ours alone, EMFILE)."""
        if f.fd < 0:
            self._reopen(f)
        with self._lock:
            f.users += 1
        if f in self._open:
            self._open.move_to_end(f)
        self._shed()
        return f.fd

    def unpin(self, f: SlotFile) -> None:
        """An operation on ``f``'s descriptor ended (any thread)."""
        with self._lock:
            f.users -= 1

    def start(self, f: SlotFile, begin: Callable[[int], Future[T]]) -> Future[T]:
        """``begin(fd)`` (which hands ``fd`` to an I/O thread and returns the operation's
        future) with ``f`` pinned until that future is done."""
        fd = self.pin(f)
        return self.unpin_when_done([f], lambda: begin(fd))

    def unpin_when_done(self, files: list[SlotFile], begin: Callable[[], Future[T]],
                        ) -> Future[T]:
        """``begin()`` for an operation using the pinned ``files``: they are unpinned when
        its future is done (at once when ``begin`` raises). The unpin is the future's first
        callback, so whoever waits for the future sees the descriptors unpinned."""
        try:
            fut = begin()
        except BaseException:
            for f in files:
                self.unpin(f)
            raise

        def done(_: Future[T]) -> None:
            for f in files:
                self.unpin(f)

        fut.add_done_callback(done)
        return fut

    @contextlib.contextmanager
    def held(self, f: SlotFile) -> Iterator[int]:
        """``f``'s descriptor, pinned for a ``with`` block run on this thread."""
        fd = self.pin(f)
        try:
            yield fd
        finally:
            self.unpin(f)

    def retire(self, f: SlotFile) -> None:
        """``f``'s class is gone: close its descriptor (once no I/O uses it) and remove the
        file, if it is still the one it was."""
        f.retired = True
        self._open.pop(f, None)
        if f.fd >= 0:
            self._retiring.append(f)
        self._sweep()
        with contextlib.suppress(OSError):
            st = os.stat(f.path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == f.ident:
                f.path.unlink()

    def close_all(self) -> None:
        """Close every descriptor (the tier is closing: its I/O threads are done)."""
        for f in [*self._open, *self._retiring]:
            self._close(f)
        self._open.clear()
        self._retiring.clear()

    # ------------------------------------------------------------------ internals
    def _open_fd(self, path: Path, extra: int) -> int:
        flags = os.O_RDWR | extra | (os.O_DIRECT if self.direct else 0)
        return open_owned_file(path, flags, "nvme slot file", "--nvme-path")

    def _reopen(self, f: SlotFile) -> None:
        if f.retired:
            raise OSError(errno.ENOENT, f"{f.path}: its size class was dropped")
        self._shed(room=1)
        try:
            try:
                fd = self._open_fd(f.path, 0)   # no O_CREAT: the file holds the class's frames
            except FileNotFoundError:
                fd = self._made_anew(f)
        except StartupError as exc:         # planted since: a symlink, not ours alone, ...
            raise OSError(errno.EPERM, str(exc)) from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != f.ident:
                raise OSError(errno.ESTALE, f"{f.path} is not the slot file the tier opened "
                                            "(replaced while it was closed)")
            self._io.attach(f.path, fd)
        except BaseException:
            os.close(fd)
            raise
        f.fd = fd
        self.reopens += 1
        self._open[f] = None

    def _made_anew(self, f: SlotFile) -> int:
        """``f``'s file was removed while its descriptor was closed (the user's clean-up, a
        tmp reaper): make it again, empty, so that its size class can be written again.
        Its frames went with it: a read of one finds no valid frame there (a miss, the
        block dropped), never other bytes. Left gone, every write of that size failed for
        the daemon's life, its slots and disk budget held (found by review)."""
        fd = self._open_fd(f.path, os.O_CREAT | os.O_EXCL)
        st = os.fstat(fd)
        f.ident = (st.st_dev, st.st_ino)
        _warn.warning("vanished", "nvme tier: slot file %s was removed while closed: made "
                      "again, empty; the blocks it held are lost (read as misses)", f.path)
        return fd

    def _shed(self, room: int = 0) -> None:
        """Close idle descriptors, least recently used first, until ``room`` more fit."""
        self._sweep()
        excess = len(self._open) + room - self.limit
        if excess <= 0:
            return
        for f in list(self._open):
            if excess <= 0:
                break
            if self._idle(f):
                del self._open[f]
                self._close(f)
                self.closes += 1
                excess -= 1

    def _sweep(self) -> None:
        """Close the retired descriptors no I/O uses any more."""
        if self._retiring:
            busy = []
            for f in self._retiring:
                if self._idle(f):
                    self._close(f)
                else:
                    busy.append(f)
            self._retiring = busy

    def _idle(self, f: SlotFile) -> bool:
        with self._lock:   # (only this thread pins: idle stays idle until it closes)
            return f.users == 0

    def _close(self, f: SlotFile) -> None:
        fd, f.fd = f.fd, -1
        if fd < 0:
            return
        self._io.detach(fd)
        try:
            os.close(fd)
        except OSError as exc:   # (the descriptor is gone all the same)
            log.warning("nvme tier: closing %s: %s", f.path, exc.strerror)
