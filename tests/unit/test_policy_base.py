"""Registry, LRU and prefetch wait policies on hand-made sequences with known answers."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.policy import (
    EvictionPolicy,
    FakeClock,
    PrefetchWait,
    make_eviction_policy,
    prefetch_deadline,
    wait_for_prefix,
)


def test_registry_builds_known_and_rejects_unknown() -> None:
    pol = make_eviction_policy("lru")
    assert isinstance(pol, EvictionPolicy)
    assert pol.name == "lru"
    with pytest.raises(ConfigError, match="lru"):
        make_eviction_policy("nope")


def test_lru_evicts_oldest_and_touch_refreshes() -> None:
    pol = make_eviction_policy("lru")
    for i, k in enumerate("abc"):
        pol.insert(k, nbytes=1, parent=None, depth=0, now=float(i))
    assert pol.victim() == "a"
    pol.touch("a", now=3.0)
    assert pol.victim() == "b"
    assert pol.victim() == "b"  # victim does not remove
    pol.remove("b")
    assert pol.victim() == "c" and len(pol) == 2
    pol.remove("zzz")  # absent: no-op
    assert len(pol) == 2


def test_lru_skips_pinned_and_returns_none_when_all_pinned() -> None:
    pol = make_eviction_policy("lru")
    for k in "ab":
        pol.insert(k, nbytes=1, parent=None, depth=0, now=0.0)
    pol.set_pinned("a", True)
    assert pol.victim() == "b"
    pol.set_pinned("b", True)
    assert pol.victim() is None
    assert len(pol) == 2 and "a" in pol
    pol.set_pinned("a", False)
    assert pol.victim() == "a"
    pol.remove("b")  # removing a pinned block forgets it
    assert "b" not in pol and len(pol) == 1


def test_fake_clock_moves_forward_only() -> None:
    clock = FakeClock(5.0)
    assert clock() == 5.0
    assert clock.advance(1.5) == 6.5
    with pytest.raises(ValueError):
        clock.advance(-1)
    with pytest.raises(ValueError):
        clock.set(1.0)


def test_prefetch_deadlines() -> None:
    assert prefetch_deadline(PrefetchWait.BEST_EFFORT, 10, 0.01, 100.0) == 100.0
    assert prefetch_deadline(PrefetchWait.WAIT, 10, 0.01, 100.0) is None
    assert prefetch_deadline(PrefetchWait.TIMEOUT, 10, 0.01, 100.0, base_s=0.5) == 100.6


def test_wait_policies_with_fake_clock() -> None:
    clock = FakeClock(10.0)
    # blocks 0,1 resident; 2 lands at +0.02, 3 at +0.05, 4 at +0.5
    ready_at = [9.0, 10.0, 10.02, 10.05, 10.5]
    now = clock()
    best = wait_for_prefix(PrefetchWait.BEST_EFFORT, ready_at, now, per_block_s=0.01)
    assert (best.ready_blocks, best.return_at, best.late_blocks) == (2, 10.0, 3)
    full = wait_for_prefix(PrefetchWait.WAIT, ready_at, now, per_block_s=0.01)
    assert (full.ready_blocks, full.return_at, full.late_blocks) == (5, 10.5, 0)
    # deadline = 10 + 5 * 0.012 = 10.06: blocks up to 10.05 make it, the last is late
    part = wait_for_prefix(PrefetchWait.TIMEOUT, ready_at, now, per_block_s=0.012)
    assert part.ready_blocks == 4 and part.late_blocks == 1
    assert part.return_at == pytest.approx(10.06)
    # the timeout grows with the number of blocks: 0.2 s per block covers everything
    slow = wait_for_prefix(PrefetchWait.TIMEOUT, ready_at, now, per_block_s=0.2)
    assert slow.ready_blocks == 5 and slow.return_at == 10.5


def test_wait_stops_at_first_block_not_ready() -> None:
    # a later block landing early does not help: only a prefix is usable
    out = wait_for_prefix(PrefetchWait.BEST_EFFORT, [0.0, 5.0, 0.0], 1.0, per_block_s=0.0)
    assert out.ready_blocks == 1 and out.late_blocks == 2

