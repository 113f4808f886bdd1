"""Keep Python's full garbage collections off the request path.

The block index and the eviction policies hold a few GC-tracked objects per block, so a
full collection walks every block the daemon holds, with the event loop stopped. Filling a
daemon with 400k blocks, collections took a third of its time and stalled puts for up to
0.9 s (docs/operations.md, "Garbage collection"). Those objects never need the collector:
reference counting frees a block's objects when it leaves; cycles come from short-lived
things (tasks, exceptions), which the young collections take.

``GcGuard`` freezes (``gc.freeze``) the survivors of every collection of the middle
generation, so what grows old is never walked again: the oldest generation stays nearly
empty and its collections short. Frozen objects are still freed by reference counting. A
cycle that became garbage after it was frozen is reclaimed by one collection over
everything every ``full_s`` (unfreeze, collect, freeze); its duration and what it found are
kept for the stats. That collection stops the loop (about 1 s at 400k blocks), so it waits
for a quiet moment: ``quiet_s`` without a request (at most another ``full_s``, then it runs
anyway and counts it).

Counting the frozen objects (``gc.get_freeze_count``) walks all of them: 63 ms with the loop
stopped at 400k blocks, once per /v1/stats or /metrics scrape when the stats asked for it.
So they are counted only where everything is walked anyway (at start and after each full
collection); each freeze adds the size of the generations it freezes, which after a
collection hold only its survivors.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvtier.daemon")

__all__ = ["GcGuard", "GcStats"]


@dataclass(slots=True)
class GcStats:
    freezes: int = 0            # collections whose survivors were frozen
    full_collections: int = 0   # collections over everything (frozen objects included)
    last_full_s: float = 0.0    # how long the last one stopped the loop
    last_full_found: int = 0    # unreachable objects it found (cycles frozen meanwhile)
    frozen: int = 0             # objects frozen, counted at start and at each full collection
    frozen_since: int = 0       # objects frozen after that count (some freed since)
    last_full_waited_s: float = 0.0   # how long the last one waited for a quiet moment
    full_not_quiet: int = 0     # full collections run without one (none came in time)


class GcGuard:
    """Freezes what survives each middle-generation collection; one full collection every
    ``full_s`` (0: never), once ``quiet_for()`` (seconds since the last request) reaches
    ``quiet_s`` (0: on the hour). ``stop`` unfreezes everything (the interpreter's own
    collector)."""

    def __init__(self, full_s: float, *, quiet_s: float = 0.0,
                 quiet_for: Callable[[], float] | None = None) -> None:
        self.full_s = full_s
        self.quiet_s = quiet_s
        self.quiet_for = quiet_for
        self.stats = GcStats()
        self._task: asyncio.Task[None] | None = None
        self._on = False

    def start(self) -> None:
        """Freeze from now on (and run the periodic full collection on the running loop)."""
        if not self._on:
            gc.callbacks.append(self._after)
            self._on = True
            gc.collect(1)
            self._freeze()
            self.stats.frozen, self.stats.frozen_since = gc.get_freeze_count(), 0
        if self.full_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="kvtier-gc-full")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._on:
            gc.callbacks.remove(self._after)
            self._on = False
            gc.unfreeze()

    def _after(self, phase: str, info: dict[str, Any]) -> None:
        # called by the collector; a young collection leaves survivors in the middle
        # generation, whose own collection promotes them to the oldest: freeze them there
        if phase == "stop" and info.get("generation", 0) >= 1:
            self._freeze()

    def _freeze(self) -> None:
        # after a collection the young generations are nearly empty and the oldest holds
        # only its survivors (the last freeze emptied it): counting them is its own cost
        self.stats.frozen_since += sum(len(gc.get_objects(g)) for g in range(3))
        gc.freeze()
        self.stats.freezes += 1

    def full(self) -> None:
        """One collection over everything (the loop stops meanwhile), then freeze again."""
        t0 = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()   # the callback (``_after``) freezes the survivors again
        s = self.stats
        s.full_collections += 1
        s.last_full_s = time.perf_counter() - t0
        s.last_full_found = found
        s.frozen, s.frozen_since = gc.get_freeze_count(), 0
        log.info("full garbage collection: %.3f s, %d objects frozen, %d unreachable found",
                 s.last_full_s, s.frozen, found)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.full_s)
            await self._quiet_moment()
            self.full()

    async def _quiet_moment(self) -> None:
        """Wait until ``quiet_s`` passed without a request, or another ``full_s``."""
        if self.quiet_for is None or self.quiet_s <= 0:
            return
        t0 = time.monotonic()
        give_up = t0 + self.full_s
        while (quiet := self.quiet_for()) < self.quiet_s:
            left = give_up - time.monotonic()
            if left <= 0:
                self.stats.full_not_quiet += 1
                break
            await asyncio.sleep(min(self.quiet_s - quiet, left) + 0.001)
        self.stats.last_full_waited_s = time.monotonic() - t0

    def as_dict(self) -> dict[str, float | int]:
        """For /v1/stats (``daemon.gc``): O(1), nothing is counted here."""
        s = self.stats
        return {"frozen": s.frozen, "frozen_since": s.frozen_since, "freezes": s.freezes,
                "full_collections": s.full_collections, "last_full_s": s.last_full_s,
                "last_full_found": s.last_full_found,
                "last_full_waited_s": s.last_full_waited_s, "full_not_quiet": s.full_not_quiet}
