"""Reading a file named by a user (a config, a saved scrape) within bounds.

A FIFO would block ``open`` until a writer came, a device such as /dev/zero would read
until memory runs out: only a regular file is read, opened non-blocking, at most a cap.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_CHUNK = 1 << 20


class NotRegularFile(ValueError):
    """The path names a FIFO, a device, a directory or a socket."""


class TooLarge(ValueError):
    """The file holds more than the caller's cap."""


def read_regular(path: str | Path, max_bytes: int, *,
                 devnull_ok: bool = False) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes``; ``devnull_ok``:
    /dev/null reads as empty (a common way to say "nothing"). OSError as ``os.open``
    raises it (a missing file, a permission)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if devnull_ok and stat.S_ISCHR(st.st_mode) and \
                st.st_rdev == os.stat(os.devnull).st_rdev:
            return b""
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
        data = bytearray()
        while len(data) <= max_bytes:
            piece = os.read(fd, min(_CHUNK, max_bytes + 1 - len(data)))
            if not piece:
                break
            data += piece
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise TooLarge(f"{path} is larger than {max_bytes} bytes")
    return bytes(data)
