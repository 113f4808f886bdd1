"""One daemon per nvme directory: an exclusive ``flock`` on ``<root>/kvtier.lock``.

Two daemons on one directory would each hand out the same slots and overwrite each other's
frames (every read then fails its checksum, and each serves what the other stored under
its own capacity). The lock is taken before the start-up scan and held on the descriptor
until the tier closes (the kernel drops it when the process dies, so a crash leaves no stale
lock). The file holds the holder's pid, for the message a second daemon prints.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.trust import hold_flock, open_owned_file

__all__ = ["LOCK_NAME", "lock_nvme_dir"]

LOCK_NAME = "kvtier.lock"


def lock_nvme_dir(root: Path) -> int:
    """Take the lock of ``root`` and return its descriptor (close it to release the lock).

    The lock file is opened without following a symlink and must be ours alone
    (``kvtier.trust.open_owned_file``). StartupError, naming the directory and the holder's
    pid when it recorded one, when another process holds the lock.
    """
    path = root / LOCK_NAME
    fd = open_owned_file(path, os.O_RDWR | os.O_CREAT, "nvme lock file", "--nvme-path")
    hold_flock(fd, lambda: f"nvme directory {root} is in use by another kvtier daemon "
                           f"({_holder(fd)} holds the lock {path}); stop it, or pass another "
                           "--nvme-path to this one")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:   # the pid only helps the message: a full disk must not stop the start
        pass
    return fd


def _holder(fd: int) -> str:
    """``pid N`` as the lock file records it, or a description when it does not."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "a process that recorded no pid"
