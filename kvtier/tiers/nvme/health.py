"""Write health of the nvme tier: a full or failing disk degrades the tier, it is not hammered.

A frame write that fails with ENOSPC, EDQUOT, EIO or EROFS moves the tier from UP to
DEGRADED: ``up`` turns false (``kvtier_tier_up{tier="nvme"} 0``), every later write is
refused at once without touching the disk, and reads of the frames already stored go on.
A background task probes after a backoff (``kvtier.backoff``: capped exponential with
jitter): it allocates and syncs a probe file as large as the write that failed (at most
``PROBE_MAX_BYTES``) next to the slot files; when that works the tier is UP again. Each
transition is counted and logged once; refused writes and probes are only counted. The
backoff starts over once a real write succeeds after a restore, so a disk that fills again
right away is probed less and less often.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier.backoff import Backoff, BackoffPolicy
from kvtier.tiers.aligned import PAGE
from kvtier.tiers.nvme.buffers import ZERO_PAGE

__all__ = ["DEFAULT_BACKOFF", "DEGRADING_ERRNOS", "HealthCounters", "NvmeHealth",
           "WriteHealth", "probe_space_sync"]

log = logging.getLogger(__name__)

DEGRADING_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
DEFAULT_BACKOFF = BackoffPolicy(base_s=0.5, cap_s=30.0)   # nvme.backoff_min_s / _max_s
PROBE_MAX_BYTES = 64 * 2**20
PROBE_NAME = ".space-probe"


class NvmeHealth(str, Enum):
    """Whether the tier takes writes: UP, or DEGRADED (refusing them until a probe works)."""

    UP = "up"
    DEGRADED = "degraded"


@dataclass(slots=True)
class HealthCounters:
    """Monotonic counts shown in the tier's stats (``health`` section fields)."""

    degradations: int = 0     # UP -> DEGRADED transitions
    restorations: int = 0     # DEGRADED -> UP transitions
    refused_writes: int = 0   # writes refused while degraded (never reached the disk)
    space_probes: int = 0     # probe writes tried while degraded


def probe_space_sync(root: Path, nbytes: int) -> None:
    """Allocate ``nbytes`` in a probe file under ``root``, write and sync its first page,
    then remove it; raises OSError when the disk still cannot take it. Runs in a pool
    thread."""
    path = root / PROBE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, PAGE))
        os.pwrite(fd, ZERO_PAGE, 0)
        os.fdatasync(fd)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


class WriteHealth:
    """The UP/DEGRADED state of one tier's writes and the probe that restores it.

    Driven from the event loop thread (no locks). ``pool`` (the tier's I/O threads) must be
    set before the first write; ``close()`` stops a pending probe.
    """

    def __init__(self, root: Path, policy: BackoffPolicy = DEFAULT_BACKOFF) -> None:
        self.root = root
        self.state = NvmeHealth.UP
        self.reason = ""
        self.counters = HealthCounters()
        self.pool: ThreadPoolExecutor | None = None
        self.policy = policy
        self._backoff = Backoff(policy)
        self._probe_bytes = PAGE
        self._since = 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def accepting(self) -> bool:
        """True while writes may go to the disk."""
        return self.state is NvmeHealth.UP

    def stats(self) -> dict[str, Any]:
        """The health fields of the tier's stats; empty until the tier first degrades (a
        healthy tier's section keeps its usual keys, and ``up`` already says it is up)."""
        if not self.counters.degradations:
            return {}
        return {"health": self.state.value, "degraded_reason": self.reason,
                **asdict(self.counters)}

    def refuse(self) -> str:
        """Count a write refused while degraded; the reason to put in its error."""
        self.counters.refused_writes += 1
        return self.reason

    def write_ok(self) -> None:
        """A real write reached the disk: the next degradation starts the backoff over."""
        if self.state is NvmeHealth.UP:
            self._backoff.reset()

    def write_failed(self, exc: OSError, nbytes: int) -> bool:
        """Note a failed frame write of ``nbytes``; True when the error degrades the tier
        (it is counted and logged only when the tier was UP). Call from the event loop."""
        if exc.errno not in DEGRADING_ERRNOS:
            return False
        if self.state is NvmeHealth.DEGRADED:
            return True
        self.state = NvmeHealth.DEGRADED
        self.reason = f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror or exc}"
        self.counters.degradations += 1
        self._probe_bytes = min(max(nbytes, PAGE), PROBE_MAX_BYTES)
        self._since = time.monotonic()
        log.warning("nvme tier %s degraded (%s): refusing writes, reads go on; probing for "
                    "space with backoff", self.root, self.reason)
        self._task = asyncio.get_running_loop().create_task(
            self._probe_until_up(), name="kvtier-nvme-space-probe")
        return True

    def close(self) -> None:
        """Stop probing (the tier is closing)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _probe_until_up(self) -> None:
        while True:
            await asyncio.sleep(self._backoff.next_delay())
            if self.pool is None:
                return
            self.counters.space_probes += 1
            try:
                await asyncio.wrap_future(
                    self.pool.submit(probe_space_sync, self.root, self._probe_bytes))
            except RuntimeError:   # the pool shut down: the tier is closing
                return
            except OSError as exc:
                log.debug("nvme tier %s: space probe failed: %s", self.root, exc)
                continue
            self.state = NvmeHealth.UP
            self.counters.restorations += 1
            log.info("nvme tier %s restored after %.1f s (was: %s)", self.root,
                     time.monotonic() - self._since, self.reason)
            self.reason = ""
            self._task = None
            return
