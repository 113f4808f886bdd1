"""Reload bandwidth per tier, measured by the daemon from its own recent transfers.

A connector decides per block whether loading it beats recomputing it (issue 11, "never
slower than recompute"); for that it needs how fast a block found in a tier reaches the
engine. The daemon knows two legs of that path from what it does anyway:

- *tier -> cpu*: promotions it performs (nvme reads, redis gets), timed around the copy;
- *cpu -> client*: gets it serves, timed from the lease's grant to its release (the client
  copies from the shared arena in between, so this is the client's effective read rate,
  an upper bound on its copy time and hence a lower bound on the bandwidth).

Each leg is an exponentially weighted moving average of bytes/s over transfers of at least
``MIN_SAMPLE_BYTES`` (tiny transfers measure latency, not bandwidth). The reload bandwidth
of a tier composes its legs as rates in series (``1 / (1/a + 1/b)``). Tiers never measured
are absent from :meth:`reload_bandwidth`: a connector then assumes the tier is fast.
Pure bookkeeping, no I/O, safe to call on the event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

CLIENT = "client"
"""Destination name of the serve leg (arena -> the engine's memory)."""
MIN_SAMPLE_BYTES = 4096
MAX_OPEN_GETS = 4096
"""Open get timings kept at most (a client that never releases cannot grow this)."""


@dataclass(slots=True)
class Ewma:
    """Exponentially weighted moving average of a rate (bytes/s)."""

    alpha: float
    value: float = 0.0
    samples: int = 0

    def add(self, rate: float) -> None:
        self.value = rate if self.samples == 0 else (
            self.alpha * rate + (1.0 - self.alpha) * self.value)
        self.samples += 1


@dataclass(slots=True)
class _OpenGet:
    started: float
    nbytes: int
    tier: str


class BandwidthTracker:
    """EWMA bytes/s per (src, dst) leg, and the reload bandwidth per tier built from them.

    ``alpha`` weighs the newest sample (0.2: about the last ten transfers matter).
    """

    def __init__(self, alpha: float = 0.2,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.clock = clock
        self._legs: dict[tuple[str, str], Ewma] = {}
        self._open: dict[int, _OpenGet] = {}

    def observe(self, src: str, dst: str, nbytes: int, seconds: float) -> None:
        """One finished transfer of ``nbytes`` from ``src`` to ``dst`` in ``seconds``."""
        if nbytes < MIN_SAMPLE_BYTES or not 0.0 < seconds < math.inf:   # NaN fails too
            return
        leg = self._legs.get((src, dst))
        if leg is None:
            leg = self._legs[(src, dst)] = Ewma(self.alpha)
        leg.add(nbytes / seconds)

    def get_started(self, lease_id: int, nbytes: int, tier: str = "cpu") -> None:
        """A get lease was granted: the client starts reading ``nbytes`` from ``tier``."""
        if len(self._open) >= MAX_OPEN_GETS:
            self._open.pop(next(iter(self._open)))
        self._open[lease_id] = _OpenGet(self.clock(), nbytes, tier)

    def get_finished(self, lease_id: int, copy_s: float | None = None) -> None:
        """The client released the lease: its copy is done. ``copy_s``: the copy's own
        duration when the client measured it (the hold time also counts round trips and
        whatever else the client did meanwhile); never more than the hold time."""
        opened = self._open.pop(lease_id, None)
        if opened is not None:
            held = self.clock() - opened.started
            seconds = min(held, copy_s) if copy_s is not None and copy_s > 0 else held
            self.observe(opened.tier, CLIENT, opened.nbytes, seconds)

    def get_abandoned(self, lease_id: int) -> None:
        """The lease expired or its connection closed: no measurement."""
        self._open.pop(lease_id, None)

    def leg(self, src: str, dst: str) -> float | None:
        """Measured bytes/s of one leg, or None before any sample."""
        e = self._legs.get((src, dst))
        return e.value if e is not None and e.samples else None

    def reload_bandwidth(self) -> dict[str, float]:
        """Bytes/s at which a block found in each tier reaches a client: ``cpu`` and
        ``hbm`` are the serve leg alone, ``nvme``/``redis`` their promotion in series with
        the cpu serve leg (the promotion alone until a get was measured)."""
        out: dict[str, float] = {}
        serve = self.leg("cpu", CLIENT)
        for tier in ("cpu", "hbm"):
            rate = self.leg(tier, CLIENT)
            if rate:
                out[tier] = rate
        for tier in ("nvme", "redis"):
            rate = _series(self.leg(tier, "cpu"), serve)
            if rate:
                out[tier] = rate
        return out

    def stats(self) -> dict[str, float]:
        """Every measured leg as ``"src->dst": bytes/s`` (for ``kvtier stats``)."""
        return {f"{s}->{d}": round(e.value, 1) for (s, d), e in sorted(self._legs.items())
                if e.samples}


def _series(promote: float | None, serve: float | None) -> float | None:
    if not promote:
        return None
    return 1.0 / (1.0 / promote + 1.0 / serve) if serve else promote
