"""The adaptive wrapper's mirror of residency, pins and recency across a rebuild, and the
deferred observer's bounded queue (mutation review of kvtier.policy.adaptive)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import kvtier.policy.adaptive as adaptive
from kvtier.policy.adaptive import AdaptivePolicy, ShadowObserver
from kvtier.policy.base import EvictionPolicy, Key, make_eviction_policy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.shadow import TierShadows


class Recording(LRUPolicy):
    """An LRU that records the keyword arguments of every insert."""

    __slots__ = ("inserts",)

    def __init__(self) -> None:
        super().__init__()
        self.inserts: list[tuple[Key, dict[str, Any]]] = []

    def insert(self, key: Key, *, nbytes: int = 0, parent: Key | None = None, depth: int = 0,
               now: float = 0.0, block_tokens: int = 0) -> None:
        self.inserts.append((key, {"nbytes": nbytes, "parent": parent, "depth": depth,
                                   "block_tokens": block_tokens}))
        super().insert(key, nbytes=nbytes, parent=parent, depth=depth, now=now)


def _make(mode: str) -> EvictionPolicy:
    return Recording()


def _policy() -> AdaptivePolicy:
    """Two LRU modes ``a`` (live) and ``b``: a switch is a rebuild that must change nothing."""
    return AdaptivePolicy(_make, TierShadows(_make, capacity_blocks=8, modes=("a", "b")))


def _switch(pol: AdaptivePolicy) -> Key | None:
    """Switch the shadows' choice and let ``victim`` rebuild the live mode."""
    pol.shadows.mode = "b" if pol.mode == "a" else "a"
    v = pol.victim()
    assert pol.mode == pol.shadows.mode
    return v


def test_a_touch_reaches_the_live_mode() -> None:
    """The wrapper forwards every use: without it the live LRU evicts a block just hit."""
    pol = _policy()
    for k in range(3):
        pol.insert(k, nbytes=1)
    pol.touch(0)
    assert pol.victim() == 1


@pytest.mark.parametrize("use", ["touch", "insert"])
def test_a_rebuild_keeps_the_recency_of_a_touch_or_a_reinsert(use: str) -> None:
    """A used block moves to the recent end of the mirror, so the rebuilt mode does not
    evict the block the tier has just hit."""
    pol = _policy()
    for k in range(3):
        pol.insert(k, nbytes=1)
    if use == "touch":
        pol.touch(0)
    else:
        pol.insert(0, nbytes=1)
    assert pol.victim() == 1
    assert _switch(pol) == 1 and list(pol._meta) == [1, 2, 0]


def test_a_rebuild_passes_every_block_s_layout_to_the_new_mode() -> None:
    """nbytes, parent, depth and block_tokens reach the rebuilt mode (cost and hindsight
    price a block by its token position: a block_tokens dropped prices it at 256)."""
    pol = _policy()
    pol.insert(1, nbytes=10, parent=None, depth=0, block_tokens=16)
    pol.insert(2, nbytes=20, parent=1, depth=1, block_tokens=16)
    pol.insert(3, nbytes=30, parent=None, depth=0)
    _switch(pol)
    live = pol._live
    assert isinstance(live, Recording)
    assert live.inserts == [
        (1, {"nbytes": 10, "parent": None, "depth": 0, "block_tokens": 16}),
        (2, {"nbytes": 20, "parent": 1, "depth": 1, "block_tokens": 16}),
        (3, {"nbytes": 30, "parent": None, "depth": 0, "block_tokens": 0}),
    ]


def test_a_pin_survives_a_rebuild_and_an_unpin_too() -> None:
    """A pinned block under a lease is never the victim of the rebuilt mode, and one whose
    lease ended is not pinned forever by a rebuild."""
    pol = _policy()
    for k in range(3):
        pol.insert(k, nbytes=1)
    pol.set_pinned(0, True)
    assert _switch(pol) == 1
    pol.set_pinned(0, False)
    assert _switch(pol) == 0


def test_a_removed_block_does_not_come_back_pinned() -> None:
    """A block removed while pinned and stored again is not pinned after a rebuild."""
    pol = _policy()
    pol.insert(0, nbytes=1)
    pol.set_pinned(0, True)
    pol.remove(0)
    assert 0 not in pol and len(pol) == 0
    pol.insert(0, nbytes=1)
    assert _switch(pol) == 0


def test_pinning_an_absent_block_does_nothing() -> None:
    """A pin of a block not (or no longer) resident is ignored, now and after a rebuild."""
    pol = _policy()
    pol.set_pinned(7, True)
    pol.insert(7, nbytes=1)
    assert pol.victim() == 7
    assert _switch(pol) == 7


def test_sizing_keeps_the_tiers_above_given_at_construction() -> None:
    """A tier modelled below others (``above_blocks``) keeps that size when the wrapper
    learns its own: the shadows model the cumulative cache."""
    sh = TierShadows(_make, modes=("a", "b"), above_blocks=1000)
    pol = AdaptivePolicy(_make, sh, capacity_bytes=4096)
    pol.insert(1, nbytes=64)
    assert sh.capacity_blocks == 64 and sh.above_blocks == 1000


def test_sizing_takes_the_tier_above_from_its_shadows() -> None:
    """The nvme tier's shadows read the cpu tier's learned size (``above``)."""
    cpu = TierShadows(_make, modes=("a",), capacity_blocks=300)
    nvme = TierShadows(_make, modes=("a",), above=cpu)
    pol = AdaptivePolicy(_make, nvme)
    for k in range(5):
        pol.insert(k, nbytes=1)
    pol.victim()
    assert nvme.capacity_blocks == 5 and nvme.above_blocks == 300


def test_the_registered_factory_passes_the_capacity_in_bytes() -> None:
    pol = make_eviction_policy("adaptive", capacity_bytes=1 << 20)
    assert isinstance(pol, AdaptivePolicy)
    pol.insert(b"k" * 16, nbytes=1 << 14)
    assert pol.shadows.capacity_blocks == 64


def test_a_victim_follows_the_shadows_choice() -> None:
    """``victim`` rebuilds the live mode as soon as the shadows chose another."""
    pol = _policy()
    pol.insert(1, nbytes=1)
    first = pol._live
    _switch(pol)
    assert pol._live is not first and pol.mode == "b"


# ------------------------------------------------------------------ ShadowObserver

Callback = Callable[[], None]


def _observer(shadows: dict[str, TierShadows] | None = None,
              inner: Any = None) -> tuple[ShadowObserver, list[Callback], list[Callback]]:
    soon: list[Callback] = []
    later: list[Callback] = []
    obs = ShadowObserver(shadows or {}, inner=inner, defer=soon.append,
                         defer_after=lambda _d, fn: later.append(fn))
    return obs, soon, later


def test_one_slice_is_scheduled_at_a_time() -> None:
    """Lookups queued while a slice is pending schedule no other one (a slice per lookup
    would run the replay back to back on a busy loop)."""
    obs, soon, later = _observer()
    for i in range(5):
        obs.on_lookup([i], 0, now=0.0)
    assert len(soon) + len(later) == 1


def test_a_slice_that_leaves_work_schedules_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a slice the queue's rest is scheduled again: without it the learning stalls
    until the next store report."""
    monkeypatch.setattr(adaptive, "DRAIN_SLICE_S", 0.0)
    sh = TierShadows(make_eviction_policy, capacity_blocks=8, modes=("lru",), rate=1.0)
    obs, soon, later = _observer({"cpu": sh})
    obs.on_lookup(list(range(3)), 0, now=0.0)
    obs.on_lookup(list(range(10, 13)), 0, now=0.0)
    later.pop()()
    assert len(soon) + len(later) == 1 and sh.references == 3
    while soon or later:
        (soon or later).pop()()
    assert sh.references == 6
    obs.on_lookup([20], 0, now=0.0)   # an idle observer schedules again
    assert len(soon) + len(later) == 1


def test_the_shadows_weigh_each_block_by_block_tokens() -> None:
    """The observer passes its block size to the shadows (their hit rates are in tokens)."""
    sh = TierShadows(make_eviction_policy, capacity_blocks=8, modes=("lru",), rate=1.0)
    obs = ShadowObserver({"cpu": sh}, block_tokens=16)
    obs.on_lookup([1, 2], 0, now=0.0)
    assert sh.tokens == 32


def test_a_dropped_backlog_keeps_the_counts_and_the_marks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropped chains leave the queued-key count (else every later lookup drops the
    oldest) and count as done for a store's mark (else its replay never finishes)."""
    monkeypatch.setattr(adaptive, "MAX_QUEUED_KEYS", 100)
    obs, _soon, _later = _observer()
    for i in range(5):
        obs.on_lookup(list(range(i * 1000, i * 1000 + 40)), 0, now=0.0)
    assert obs.dropped_lookups == 3 and obs._queued_keys == 80
    mark = obs.queued_through()
    obs.on_lookup([9], 0, now=0.0)
    assert obs.dropped_lookups == 3
    assert _replay(obs, mark) and len(obs._queue) == 1


def _replay(obs: ShadowObserver, mark: int) -> bool:
    """``replay_until(mark)`` until it says done (at most 1000 slices)."""
    return any(obs.replay_until(mark) for _ in range(1000))


def test_replay_until_stops_at_its_mark() -> None:
    """A store's replay counts the lookups before its mark and reports them done."""
    obs, _soon, _later = _observer()
    obs.on_lookup([1], 0, now=0.0)
    mark = obs.queued_through()
    obs.on_lookup([2], 0, now=0.0)
    assert _replay(obs, mark)
    assert len(obs._queue) == 1


def test_a_whole_chain_inner_gets_a_sliced_store_once() -> None:
    """An ``inner`` without ranges is told of a store report once, at its first slice."""
    seen: list[int] = []

    class Whole:
        def on_lookup(self, keys: list[int], hit_blocks: int, *, now: float) -> None:
            pass

        def on_stored(self, keys: list[int], *, output_tokens: int | None,
                      now: float) -> None:
            seen.append(len(keys))

    obs = ShadowObserver({}, inner=Whole())
    for lo in (0, 4, 8):
        obs.on_stored_range(list(range(12)), output_tokens=1, now=0.0, start=lo, stop=lo + 4)
    assert seen == [12]


def test_a_single_chain_beyond_the_bound_is_still_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound drops the oldest chains, never the newest one (a 32K-token prompt alone
    past the bound is learned, not lost)."""
    monkeypatch.setattr(adaptive, "MAX_QUEUED_KEYS", 100)
    sh = TierShadows(make_eviction_policy, capacity_blocks=8, modes=("lru",), rate=1.0)
    obs, _soon, _later = _observer({"cpu": sh})
    obs.on_lookup(list(range(150)), 0, now=0.0)
    assert obs.dropped_lookups == 0
    obs.drain()
    assert sh.references == 150


def test_a_whole_chain_inner_counts_a_long_deferred_lookup_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices split a chain in pieces only for a ranged ``inner`` (WorkloadStats); any
    other is told of each lookup once, however long the chain."""
    monkeypatch.setattr(adaptive, "DRAIN_SLICE_S", 0.0)
    seen: list[int] = []

    class Whole:
        def on_lookup(self, keys: list[int], hit_blocks: int, *, now: float) -> None:
            seen.append(len(keys))

    obs, soon, later = _observer(inner=Whole())
    obs.on_lookup(list(range(40)), 0, now=0.0)
    while soon or later:
        (soon or later).pop()()
    assert seen == [40]
