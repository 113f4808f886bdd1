"""GcGuard: long-lived objects are frozen out of Python's collections, and the periodic
full collection reclaims a cycle that became garbage after it was frozen."""

from __future__ import annotations

import gc
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
    assert guard.stats.frozen == gc.get_freeze_count() and guard.stats.frozen_since == 0


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
