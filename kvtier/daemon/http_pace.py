"""Bounds on the event-loop time of the HTTP server's synchronous renders (found by review).

``GET /metrics`` (``generate_latest``: 3-5 ms) and ``GET /v1/stats`` (the stats dict and its
JSON) run on the daemon's event loop in one piece: 128 connections asking for /metrics
back to back held the loop so that an engine's put+get on the control socket took 1.4 s
(p50) instead of 2 ms, and 64 asking for /v1/stats 93 ms. Two bounds:

- ``RenderCache`` (/metrics): at most ``fresh`` renders per ``max_age_s``; beyond them the
  last body is served again (at most ``max_age_s`` old). Prometheus scrapes every 10-60 s
  and an operator's few scrapes a second are always fresh; a flood costs only its writes.
- ``Pacer`` (/v1/stats, /v1/lookups/recent: fresh by contract, not cached): one render at a
  time, and after one that took ``d`` seconds the next starts ``d * (1 / share - 1)`` later
  (at most ``max_gap_s``), so these renders take at most ``share`` of the loop; at most
  ``max_waiting`` requests wait, beyond them an ``Overloaded`` (a 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvtier.errors import Overloaded

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class RenderCache:
    """The last rendered body, served again once ``fresh`` renders were made within
    ``max_age_s`` (so never older than that); ``clock`` is injectable for tests."""

    max_age_s: float = 1.0
    fresh: int = 4
    clock: Callable[[], float] = time.monotonic
    renders: int = 0              # bodies rendered
    served_cached: int = 0        # requests answered with the last body
    _body: bytes | None = None
    _at: float = 0.0              # when ``_body`` was rendered
    _recent: deque[float] = field(default_factory=deque)   # times of the last renders

    def get(self, render: Callable[[], bytes]) -> bytes:
        """``render()``'s body, or the last one while ``fresh`` renders are younger than
        ``max_age_s`` (a flood of scrapes costs a few renders a second)."""
        now = self.clock()
        while self._recent and now - self._recent[0] >= self.max_age_s:
            self._recent.popleft()
        if self._body is not None and len(self._recent) >= self.fresh and \
                now - self._at < self.max_age_s:
            self.served_cached += 1
            return self._body
        self._body, self._at = render(), now
        self._recent.append(now)
        self.renders += 1
        return self._body


@dataclass(slots=True, eq=False)
class Pacer:
    """One synchronous render at a time, each followed by a pause that keeps the renders'
    share of the event loop at ``share``; a bounded queue (``Overloaded`` beyond it)."""

    share: float = 0.2
    max_waiting: int = 8
    max_gap_s: float = 0.5
    refused: int = 0              # requests answered Overloaded (the queue was full)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _next: float = 0.0            # time.monotonic() the next render may start
    _queued: int = 0              # requests waiting for their turn or rendering

    async def run(self, render: Callable[[], T]) -> T:
        """``render()``, in its turn: after the previous render's pause is over."""
        if self._queued >= self.max_waiting:
            self.refused += 1
            raise Overloaded(f"{self.max_waiting} requests of this kind wait already: "
                             "retry in 1 s")
        self._queued += 1
        try:
            async with self._lock:
                delay = self._next - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                t0 = time.monotonic()
                try:
                    return render()
                finally:
                    took = time.monotonic() - t0
                    self._next = t0 + took + min(self.max_gap_s,
                                                 took * (1 / self.share - 1))
        finally:
            self._queued -= 1
