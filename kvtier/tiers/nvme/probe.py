"""Whether the nvme tier uses O_DIRECT: a probe of the file system under its root.

``nvme.direct = auto`` uses O_DIRECT where an aligned write and read back work (tmpfs and
some network file systems refuse it) and buffered I/O elsewhere; ``on`` makes a refusal a
ConfigError that says what to change; ``off`` never probes.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.tiers.aligned import PAGE, aligned_buffer

__all__ = ["DIRECT_MODES", "choose_direct", "probe_direct"]

log = logging.getLogger(__name__)

DIRECT_MODES = ("auto", "on", "off")


def probe_direct(root: Path) -> str | None:
    """None when O_DIRECT works under ``root`` (aligned write + read back), else why not."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = root / f".odirect-probe-{os.getpid()}-{threading.get_ident()}"
    buf = aligned_buffer(PAGE)
    buf[:8] = b"kvtier\0\1"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        return f"open with O_DIRECT failed: {exc.strerror}"
    try:
        back = aligned_buffer(PAGE)
        if os.pwritev(fd, [buf], 0) != PAGE or os.preadv(fd, [back], 0) != PAGE:
            return "short aligned O_DIRECT transfer"
        return None if bytes(back) == bytes(buf) else "O_DIRECT read back different bytes"
    except OSError as exc:
        return f"aligned O_DIRECT I/O failed: {exc.strerror}"
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def choose_direct(root: Path, mode: str) -> bool:
    """Whether to open slot files with O_DIRECT under ``root`` for ``nvme.direct = mode``."""
    if mode == "off":
        return False
    why = probe_direct(root)
    if why is None:
        return True
    if mode == "on":
        raise ConfigError(
            f"nvme.direct=on but O_DIRECT does not work under {root} ({why}); set "
            "nvme.direct=auto (falls back to buffered I/O) or point nvme.path at a "
            "disk-backed file system")
    log.info("nvme tier %s: O_DIRECT unavailable (%s); using buffered I/O", root, why)
    return False
