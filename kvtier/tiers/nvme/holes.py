"""Punching holes in slot files (``fallocate(FALLOC_FL_PUNCH_HOLE)``), through ctypes:
Python's ``os`` has only ``posix_fallocate``, which cannot free a range.

The nvme tier keeps one file per size class and grows a file at its tail. Free slots in
the middle of other classes' files hold disk space that a new class cannot use: a 4 MiB
block arriving on a tier full of 4 KiB blocks made the store evict thousands of small
blocks (up to its bound of 4096, about three times the room it needed) before one
happened to free a file's tail. Punching the free slots' ranges gives their space back
where they lie, so an allocation evicts only what its size needs.
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["HolesUnsupported", "punch_hole", "punch_run"]

_PUNCH_HOLE = 0x02   # FALLOC_FL_PUNCH_HOLE (linux/falloc.h), only with:
_KEEP_SIZE = 0x01    # FALLOC_FL_KEEP_SIZE: the file's length stays


class HolesUnsupported(OSError):
    """The file system (or the platform) cannot punch holes: the tier does without."""


def _load() -> ctypes._CFuncPtr | None:   # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn


_fallocate = _load()


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the disk blocks of ``[offset, offset + length)`` of ``fd``; the range then
    reads as zeros (so a frame there is gone for good) and the file keeps its length.
    ``HolesUnsupported`` when the file system cannot, OSError on another failure."""
    if _fallocate is None:
        raise HolesUnsupported(errno.ENOSYS, "fallocate is not available here")
    if _fallocate(fd, _PUNCH_HOLE | _KEEP_SIZE, offset, length) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise HolesUnsupported(err, os.strerror(err))
    raise OSError(err, os.strerror(err))


def punch_run(fd: int, stride: int, run: list[int]) -> OSError | None:
    """Punch the adjacent slots ``run`` (of ``stride`` bytes) out of ``fd``; the error, or
    None. (Extents split on ext4 can take ms per call: run it off the event loop.)"""
    try:
        punch_hole(fd, run[0] * stride, len(run) * stride)
    except OSError as exc:
        return exc
    return None
