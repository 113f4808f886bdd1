"""GcGuard: long-lived objects are frozen out of Python's collections, and the periodic
full collection reclaims a cycle that became garbage after it was frozen."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator

import pytest

from kvtier.daemon.gc_guard import GcGuard
from kvtier.index import BlockMeta, SlotState


class Node:
    """A GC-tracked object that can reference itself and be weakly referenced."""

    me: Node | None = None


@pytest.fixture
def guard() -> Iterator[GcGuard]:
    g = GcGuard(full_s=0)
    g.start()
    try:
        yield g
    finally:
        g.stop()
    assert gc.get_freeze_count() == 0   # stop hands everything back to the collector


def test_blocks_that_outlive_a_collection_are_never_walked_again(guard: GcGuard) -> None:
    before = gc.get_freeze_count()          # (the test process's own objects)
    blocks = [BlockMeta(i.to_bytes(16, "big"), bytes(16), 1, 4096, None, i, cpu=i,
                        cpu_state=SlotState.READY) for i in range(50_000)]
    gc.collect(1)            # what a daemon's allocations trigger on their own
    frozen = gc.get_freeze_count()
    assert frozen >= before + len(blocks)
    oldest = gc.get_objects(generation=2)   # what a full collection would walk
    assert len(oldest) < 1_000, len(oldest)
    assert guard.stats.freezes >= 2
    assert guard.stats.frozen_since >= len(blocks)   # what each freeze counted
    blocks.clear()          # reference counting still frees frozen objects
    assert gc.get_freeze_count() <= frozen - 50_000


def test_a_cycle_dropped_after_it_was_frozen_waits_for_the_full_collection(
        guard: GcGuard) -> None:
    node = Node()
    node.me = node
    alive = weakref.ref(node)
    gc.collect(1)            # survives: frozen
    del node
    gc.collect()             # an ordinary full collection skips frozen objects
    assert alive() is not None
    guard.full()
    assert alive() is None
    assert guard.stats.full_collections == 1 and guard.stats.last_full_found >= 1
    assert gc.get_freeze_count() > 0          # the survivors are frozen again
    # counted right after the freeze: since then only a few frozen temporaries (the
    # collector's own info dict, say) were freed by reference counting, and nothing was
    # frozen anew unless a collection ran (which frozen_since then counts)
    counted = guard.stats.frozen + guard.stats.frozen_since
    assert 0 <= counted - gc.get_freeze_count() < 100, (counted, gc.get_freeze_count())


def test_the_stats_never_walk_the_frozen_objects(
        guard: GcGuard, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting them walks every one (63 ms at 400k blocks, per /metrics scrape)."""
    gc.collect(1)
    counted = guard.stats.frozen + guard.stats.frozen_since

    def walk() -> int:
        raise AssertionError("gc.get_freeze_count walked the frozen objects")

    with monkeypatch.context() as m:
        m.setattr(gc, "get_freeze_count", walk)
        stats = guard.as_dict()
    assert stats["frozen"] + stats["frozen_since"] == counted > 0


def test_stop_without_start_and_twice_is_harmless() -> None:
    g = GcGuard(full_s=0)
    g.stop()
    g.start()
    g.stop()
    g.stop()
    assert gc.get_freeze_count() == 0 and g._after not in gc.callbacks


class Requests:
    """Seconds since the last request, as the daemon reports them to the guard."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def quiet_for(self) -> float:
        return time.monotonic() - self.last


async def test_the_full_collection_waits_for_a_quiet_moment() -> None:
    requests = Requests()
    g = GcGuard(full_s=0.4, quiet_s=0.15, quiet_for=requests.quiet_for)
    g.start()
    try:
        busy_until = time.monotonic() + 0.5
        while time.monotonic() < busy_until:      # a request every 10 ms: never quiet
            requests.last = time.monotonic()
            await asyncio.sleep(0.01)
        assert g.stats.full_collections == 0      # due at 0.4 s, still waiting
        give_up = time.monotonic() + 2.0
        while g.stats.full_collections == 0 and time.monotonic() < give_up:
            await asyncio.sleep(0.005)             # quiet now: it runs
        assert g.stats.full_collections == 1 and g.stats.full_not_quiet == 0
        assert g.stats.last_full_waited_s >= 0.2   # from 0.4 s to 0.5 s + quiet_s
    finally:
        g.stop()


async def test_without_a_quiet_moment_it_runs_after_another_period() -> None:
    requests = Requests()
    g = GcGuard(full_s=0.1, quiet_s=10.0, quiet_for=requests.quiet_for)
    g.start()
    try:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            requests.last = time.monotonic()
            await asyncio.sleep(0.02)
        assert g.stats.full_collections >= 1
        assert g.stats.full_not_quiet == g.stats.full_collections
        assert 0.09 <= g.stats.last_full_waited_s < 1.0   # gave up after ~full_s
    finally:
        g.stop()
