"""A real, small file system for full-disk tests: a tmpfs of a few MiB mounted under a temp dir.

Mounted with the mount(2) system call through ctypes (no ``mount`` process), so unit tests
may use it. Needs root (CAP_SYS_ADMIN); ``small_tmpfs`` skips the test with the reason when
the mount is refused.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

MNT_DETACH = 2


def _libc() -> ctypes.CDLL:
    """The C library this process already runs (``find_library`` would start ldconfig)."""
    return ctypes.CDLL(None, use_errno=True)


@contextmanager
def small_tmpfs(where: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a tmpfs of ``size_bytes`` at ``where`` (created) for the block; unmount after."""
    where.mkdir(parents=True, exist_ok=True)
    libc = _libc()
    opts = f"size={size_bytes},mode=0700".encode()
    if libc.mount(b"tmpfs", str(where).encode(), b"tmpfs", 0, opts) != 0:
        err = ctypes.get_errno()
        pytest.skip(f"cannot mount a {size_bytes}-byte tmpfs at {where}: "
                    f"{os.strerror(err)} (needs root / CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        if libc.umount2(str(where).encode(), MNT_DETACH) != 0:   # lazy: open files may linger
            err = ctypes.get_errno()
            raise OSError(err, f"umount {where}: {os.strerror(err)}")


def fill(path: Path, nbytes: int) -> None:
    """Write a ballast file of ``nbytes`` real bytes (so it takes space on tmpfs)."""
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
