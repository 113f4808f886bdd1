"""Loop lag, GC guard, HTTP pacing and in-flight reservations at their edges (found by a
mutation review: each check below let a plausible bug through before)."""

from __future__ import annotations

import asyncio
import gc
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.daemon import http_pace
from kvtier.daemon.gc_guard import GcGuard
from kvtier.daemon.http_pace import Pacer, RenderCache
from kvtier.daemon.inflight import InFlight, Reserved
from kvtier.daemon.loop_lag import LoopLag
from kvtier.errors import Overloaded


class _Handle:
    def __init__(self, when: float) -> None:
        self._when = when

    def when(self) -> float:
        return self._when


class _Loop:
    """The part of a loop ``LoopLag._tick`` uses, at a chosen time."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.scheduled: list[float] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any, *args: Any) -> _Handle:
        self.scheduled.append(when)
        return _Handle(when)


def test_a_tick_fired_early_reads_zero_and_the_next_is_due_a_period_after_it() -> None:
    """A timer run a hair before its time (the loop's clock resolution) is no negative lag
    (it lowered the histogram's sum); after a stall the next tick is due a period after
    this one ran, not at once (a catch-up tick counted the same stall twice)."""
    seen: list[float] = []
    lag = LoopLag(seen.append, period_s=0.05)
    loop = _Loop(now=9.9995)
    lag._handle = _Handle(10.0)  # type: ignore[assignment]
    lag._tick(loop)  # type: ignore[arg-type]
    assert seen == [0.0] and lag.worst_s == 0.0
    loop.now = 11.0                                     # the loop was held for a second
    lag._tick(loop)  # type: ignore[arg-type]
    assert seen[-1] == pytest.approx(11.0 - (9.9995 + 0.05))
    assert loop.scheduled == [pytest.approx(9.9995 + 0.05), pytest.approx(11.05)]


async def test_stop_cancels_the_pending_tick() -> None:
    """A stopped measurement leaves no timer behind (it ran into its own assert, logged
    as an error by the loop, at every stop)."""
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    lag = LoopLag(lambda _s: None, period_s=0.005)
    lag.start()
    handle = lag._handle
    assert handle is not None
    lag.stop()
    assert handle.cancelled()
    await asyncio.sleep(0.02)
    assert errors == [] and lag.ticks == 0


def test_each_full_collection_is_counted_and_reported() -> None:
    """``full_collections`` counts every full collection (a counter for ``rate()``) and
    ``last_full_s`` is its pause, not its wait for a quiet moment."""
    g = GcGuard(full_s=0)
    g.start()
    try:
        g.stats.last_full_waited_s = 123.0
        g.full()
        g.full()
        d = g.as_dict()
        assert d["full_collections"] == 2
        assert 0 < d["last_full_s"] < 60 and d["last_full_waited_s"] == 123.0
    finally:
        g.stop()


async def test_stop_cancels_the_periodic_full_collection() -> None:
    """After ``stop`` nothing collects on its own: the task that runs one every
    ``full_s`` is cancelled with it."""
    g = GcGuard(full_s=0.01)
    g.start()
    task = g._task
    assert task is not None
    g.stop()
    await asyncio.sleep(0.05)
    assert task.cancelled() and g.stats.full_collections == 0
    assert gc.get_freeze_count() == 0


def test_a_render_ages_out_of_the_window_at_exactly_max_age() -> None:
    """At most ``fresh`` renders per ``max_age_s``: the oldest one leaves the window as it
    turns ``max_age_s`` old, and a scrape then is rendered afresh."""
    now = [100.0]
    cache = RenderCache(max_age_s=1.0, fresh=4, clock=lambda: now[0])
    n = [0]

    def render() -> bytes:
        n[0] += 1
        return b"%d" % n[0]

    cache.get(render)
    now[0] = 100.5
    assert [cache.get(render) for _ in range(4)] == [b"2", b"3", b"4", b"4"]
    now[0] = 101.0                     # the render at 100.0 is 1.0 s old: out
    assert cache.get(render) == b"5"


def test_the_pause_after_a_render_keeps_renders_to_their_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a render of ``d`` seconds the next may start ``d * (1/share - 1)`` after it
    ended: a quarter of the loop at share 0.25 (``_next`` read on a fake clock)."""
    clock = [10.0]
    monkeypatch.setattr(http_pace, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    def render() -> str:
        clock[0] += 0.02
        return "ok"

    pacer = Pacer(share=0.25, max_gap_s=1.0)
    assert asyncio.run(pacer.run(render)) == "ok"
    assert pacer._next == pytest.approx(10.0 + 0.02 + 0.06)
    assert pacer.refused == 0


def test_refusals_beyond_the_queue_are_counted() -> None:
    async def main() -> None:
        pacer = Pacer(share=0.5, max_waiting=1)
        out = await asyncio.gather(*(pacer.run(lambda: time.sleep(0.001)) for _ in range(4)),
                                   return_exceptions=True)
        assert pacer.refused == sum(isinstance(r, Overloaded) for r in out) == 2

    asyncio.run(main())


def test_what_of_returns_cannot_change_a_running_reservation() -> None:
    """``of`` hands out a copy: a caller that adjusted it (to check a prepare) would change
    what the process holds for every later prepare."""
    f = InFlight()
    with f.reserve(5, put_bytes=10, get_bytes=20):
        seen = f.of(5)
        seen.put_bytes, seen.get_bytes, seen.leases = 0, 0, 0
        assert f.of(5) == Reserved(put_bytes=10, get_bytes=20, leases=1)
    assert f.of(5) == Reserved()
