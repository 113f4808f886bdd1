"""The deferred lookup replay of ShadowObserver: sliced, lowest priority, bounded."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import kvtier.policy.adaptive as adaptive
from kvtier.policy.adaptive import ShadowObserver
from kvtier.policy.base import SlicedStoreObserver, make_eviction_policy
from kvtier.policy.hindsight import HindsightStats
from kvtier.policy.shadow import TierShadows

Callback = Callable[[], None]


class Loop:
    """Records what the observer schedules: ``soon`` (call_soon) and ``later`` (call_later)."""

    def __init__(self) -> None:
        self.soon: list[Callback] = []
        self.later: list[tuple[float, Callback]] = []

    def call_soon(self, fn: Callback) -> None:
        self.soon.append(fn)

    def call_later(self, delay: float, fn: Callback) -> None:
        self.later.append((delay, fn))

    def run_one(self) -> bool:
        """Run the oldest scheduled callback; False when none is left."""
        if self.soon:
            self.soon.pop(0)()
            return True
        if self.later:
            self.later.pop(0)[1]()
            return True
        return False


def _stats() -> HindsightStats:
    return HindsightStats(capacity_blocks=64, horizon=10_000, history=10_000)


def _chains() -> list[tuple[list[int], int]]:
    shared = list(range(100))
    return [(shared, 0), (shared[:40] + list(range(1000, 1050)), 40), (shared, 100),
            (list(range(2000, 2003)), 0), (shared[:77], 77)]


def _state(stats: HindsightStats) -> tuple[object, ...]:
    keys = [k for chain, _ in _chains() for k in chain]
    return (stats.tick, tuple(stats.uses(k) for k in keys),
            tuple(stats.reuse_estimate(k) for k in keys))


def _shadows() -> TierShadows:
    return TierShadows(make_eviction_policy, capacity_blocks=32, modes=("lru", "lfu"),
                       rate=1.0)


class Pair:
    """An inline observer and a deferred one (its slices run by ``loop``), each with its
    own stats and shadows, fed the same lookups by the tests that compare them."""

    def __init__(self) -> None:
        self.loop = Loop()
        self.inline_stats, self.inline_sh = _stats(), _shadows()
        self.inline = ShadowObserver({"cpu": self.inline_sh}, inner=self.inline_stats,
                                     block_tokens=16)
        self.sliced_stats, self.sliced_sh = _stats(), _shadows()
        self.sliced = ShadowObserver({"cpu": self.sliced_sh}, inner=self.sliced_stats,
                                     block_tokens=16, defer=self.loop.call_soon,
                                     defer_after=self.loop.call_later)
        for keys, hits in _chains():
            self.inline.on_lookup(keys, hits, now=0.0)
            self.sliced.on_lookup(keys, hits, now=0.0)


def test_a_sliced_replay_learns_exactly_what_an_inline_one_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adaptive, "DRAIN_SLICE_S", 0.0)  # one piece per slice
    p = Pair()
    loop, inline, inline_stats, inline_sh = p.loop, p.inline, p.inline_stats, p.inline_sh
    sliced, sliced_stats, sliced_sh = p.sliced, p.sliced_stats, p.sliced_sh
    assert sliced_stats.tick == 0  # nothing learned on the request path
    slices = 0
    while loop.run_one():
        slices += 1
    total = sum(len(k) for k, _ in _chains())
    assert slices >= total // adaptive.DRAIN_PIECE  # in pieces, not chain by chain
    assert _state(sliced_stats) == _state(inline_stats)
    assert sliced_sh.references == inline_sh.references == total
    assert sliced.snapshot() == inline.snapshot()


def test_slices_wait_a_gap_while_the_queue_is_short_and_run_back_to_back_when_long(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adaptive, "DRAIN_SLICE_S", 0.0)
    monkeypatch.setattr(adaptive, "BUSY_QUEUED_KEYS", 50)
    loop = Loop()
    obs = ShadowObserver({}, inner=_stats(), defer=loop.call_soon,
                         defer_after=loop.call_later)
    obs.on_lookup(list(range(20)), 0, now=0.0)
    assert loop.soon == [] and [d for d, _ in loop.later] == [adaptive.DRAIN_GAP_S]
    obs.on_lookup(list(range(100, 140)), 0, now=0.0)  # 60 queued: busy
    assert len(loop.later) == 1  # one slice is scheduled at a time
    loop.run_one()
    assert len(loop.soon) == 1 and loop.later == []  # still > 50 queued: no gap
    while loop.run_one():
        pass
    assert obs.inner.tick == 60


def test_a_backlog_beyond_the_bound_drops_the_oldest_chains(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adaptive, "MAX_QUEUED_KEYS", 100)
    loop = Loop()
    stats = _stats()
    obs = ShadowObserver({}, inner=stats, defer=loop.call_soon, defer_after=loop.call_later)
    for i in range(5):
        obs.on_lookup(list(range(i * 1000, i * 1000 + 40)), 0, now=0.0)
    assert obs.dropped_lookups == 3  # 200 keys queued, at most 100 kept: the newest two
    obs.drain()
    assert stats.tick == 80
    assert stats.uses(4000) == 1 and stats.uses(0) == 0


def test_a_store_and_a_snapshot_still_count_every_queued_lookup_first() -> None:
    loop = Loop()
    stats = _stats()
    obs = ShadowObserver({"cpu": _shadows()}, inner=stats, defer=loop.call_soon,
                         defer_after=loop.call_later)
    obs.on_lookup(list(range(30)), 0, now=0.0)
    obs.on_stored(list(range(30)), output_tokens=5, now=0.0)
    assert stats.tick == 30
    obs.on_lookup(list(range(30)), 30, now=0.0)
    assert obs.snapshot()["cpu"]["sampled_references"] == 60
    while loop.run_one():  # the scheduled slices find nothing left
        pass
    assert stats.tick == 60


def test_a_store_report_in_pieces_learns_exactly_what_one_report_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's sliced report (kvtier.store.writes): the lookups queued before it
    replayed a slice at a time up to their mark, then the chain in ranges. Same state as
    one ``on_stored``; the lookups queued after the mark stay queued."""
    monkeypatch.setattr(adaptive, "DRAIN_SLICE_S", 0.0)  # one piece per slice
    p = Pair()
    whole, whole_stats, whole_sh = p.inline, p.inline_stats, p.inline_sh
    sliced, sliced_stats, sliced_sh = p.sliced, p.sliced_stats, p.sliced_sh
    assert isinstance(sliced, SlicedStoreObserver)
    stored = list(range(60)) + list(range(3000, 3100))
    whole.on_stored(stored, output_tokens=40, now=0.0)
    mark = sliced.queued_through()
    sliced.on_lookup(list(range(5000, 5010)), 0, now=0.0)   # after the mark
    turns = 0
    while not sliced.replay_until(mark):
        turns += 1
    assert turns >= sum(len(k) for k, _ in _chains()) // adaptive.DRAIN_PIECE - 1
    for lo in range(0, len(stored), 64):
        sliced.on_stored_range(stored, output_tokens=40, now=0.0, start=lo, stop=lo + 64)
    assert _state(sliced_stats) == _state(whole_stats)
    assert [sliced_stats.reuse_estimate(k) for k in stored] == \
        [whole_stats.reuse_estimate(k) for k in stored]
    assert sliced_stats.uses(5000) == 0   # queued after the mark: not replayed yet
    whole.on_lookup(list(range(5000, 5010)), 0, now=0.0)
    sliced.drain()
    assert _state(sliced_stats) == _state(whole_stats)
    assert sliced_sh.references == whole_sh.references
