"""Whether the nvme tier uses O_DIRECT: a probe of the file system under its root.

``nvme.direct = auto`` uses O_DIRECT where an aligned write and read back work (tmpfs and
some network file systems refuse it) and buffered I/O elsewhere; ``on`` makes a refusal a
ConfigError that says what to change; ``off`` never probes. A full disk gives no verdict
(``choose_direct``).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
from pathlib import Path

from kvtier.errors import ConfigError, StartupError
from kvtier.tiers.aligned import PAGE, aligned_buffer

__all__ = ["DIRECT_MODES", "choose_direct", "probe_direct"]

log = logging.getLogger(__name__)

DIRECT_MODES = ("auto", "on", "off")
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)   # the probe cannot tell: no verdict


def probe_direct(root: Path) -> str | None:
    """None when O_DIRECT works under ``root`` (aligned write + read back), else why not.

    Raises OSError (ENOSPC, EDQUOT) when the file system is too full to tell. The probe file
    gets a fresh random name and is created with O_EXCL | O_NOFOLLOW: never a file or
    symlink someone else put there.
    """
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = root / f".odirect-probe-{os.getpid()}-{secrets.token_hex(8)}"
    buf = aligned_buffer(PAGE)
    buf[:8] = b"kvtier\0\1"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT
                     | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno in FULL_ERRNOS:
            raise
        return f"open with O_DIRECT failed: {exc.strerror}"
    try:
        back = aligned_buffer(PAGE)
        if os.pwritev(fd, [buf], 0) != PAGE or os.preadv(fd, [back], 0) != PAGE:
            return "short aligned O_DIRECT transfer"
        return None if bytes(back) == bytes(buf) else "O_DIRECT read back different bytes"
    except OSError as exc:
        if exc.errno in FULL_ERRNOS:
            raise
        return f"aligned O_DIRECT I/O failed: {exc.strerror}"
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def choose_direct(root: Path, mode: str) -> bool:
    """Whether to open slot files with O_DIRECT under ``root`` for ``nvme.direct = mode``.

    A file system too full for the probe gives no answer: ``auto`` keeps O_DIRECT (buffered
    I/O for the whole run would be the wrong guess on the disks it is meant for; the tier
    degrades until space is back either way), ``on`` refuses to start saying the disk is full.
    """
    if mode == "off":
        return False
    try:
        why = probe_direct(root)
    except OSError as exc:
        if mode == "on":
            raise StartupError(
                f"nvme.direct=on but O_DIRECT cannot be checked under {root}: its file system "
                f"is full ({exc.strerror}); free space under {root}, or set nvme.direct=auto "
                "to start without the check") from exc
        log.warning("nvme tier %s: the file system is full (%s), O_DIRECT not checked; "
                    "using it", root, exc.strerror)
        return True
    if why is None:
        return True
    if mode == "on":
        raise ConfigError(
            f"nvme.direct=on but O_DIRECT does not work under {root} ({why}); set "
            "nvme.direct=auto (falls back to buffered I/O) or point nvme.path at a "
            "disk-backed file system")
    log.info("nvme tier %s: O_DIRECT unavailable (%s); using buffered I/O", root, why)
    return False
