"""The event loop's lag: how late a timer fires is how long the loop served no one.

One event loop serves every client of a daemon. Work that holds it (a long request's
piece, a replay of the workload observer, a full garbage collection) delays every other
client's request by as much, which no per-op latency shows on its own: a ping that waited
for a neighbour's delete looks slow, the delete does not. ``LoopLag`` asks the loop to
wake it every ``period_s`` and records how late the wake-up came, as the histogram
``kvtier_event_loop_lag_seconds`` (the alert ``KVTierEventLoopStalls`` reads it) and as
the worst lag since start in ``/v1/stats`` (``loop.lag_worst_s``).

A timer on uvloop (libuv) has millisecond resolution: an idle loop reads 0-1 ms. The
cost is one callback per period (20 a second).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["PERIOD_S", "LoopLag"]

PERIOD_S = 0.05


@dataclass(slots=True, eq=False)
class LoopLag:
    """Measures the running loop's lag from ``start`` to ``stop``; ``observe(seconds)``
    gets each measurement."""

    observe: Callable[[float], None]
    period_s: float = PERIOD_S
    worst_s: float = 0.0
    ticks: int = 0
    _handle: asyncio.TimerHandle | None = field(default=None, init=False)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._handle = loop.call_at(loop.time() + self.period_s, self._tick, loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        assert self._handle is not None
        lag = max(0.0, now - self._handle.when())
        self.ticks += 1
        self.worst_s = max(self.worst_s, lag)
        self.observe(lag)
        self._handle = loop.call_at(now + self.period_s, self._tick, loop)

    def stats(self) -> dict[str, float | int]:
        return {"lag_worst_s": round(self.worst_s, 6), "lag_ticks": self.ticks}
