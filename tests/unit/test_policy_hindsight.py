"""The ``hindsight`` policy's parts: OPTgen's labels and the value ordering (issue 13)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.base import EvictionPolicy, make_eviction_policy
from kvtier.policy.hindsight import HindsightPolicy, HindsightStats
from kvtier.policy.shadow import TierShadows


def test_optgen_labels_a_reuse_a_hit_only_while_the_cache_has_room() -> None:
    s = HindsightStats(capacity_blocks=1, window_capacities=1000)
    assert s.opt_hit(0, 2)  # an empty cache of one block holds it
    assert not s.opt_hit(1, 3)  # overlaps the first interval: no room for a second block
    assert s.opt_hit(3, 5)  # after it: room again
    s2 = HindsightStats(capacity_blocks=2, window_capacities=1000)
    assert s2.opt_hit(0, 4) and s2.opt_hit(1, 3)  # two blocks fit in two slots...
    assert not s2.opt_hit(2, 6)  # ...a third overlapping both does not


def test_optgen_ignores_reuses_beyond_the_window_and_slides_its_vector() -> None:
    s = HindsightStats(capacity_blocks=256, window_capacities=2)  # window: 512 references
    assert not s.opt_hit(0, 513)
    assert s.opt_hit(0, 512)
    for t in range(1000, 200_000, 997):  # far past the vector's length: it slides
        assert s.opt_hit(t - 300, t)
    assert not s.opt_hit(199_000, 199_000 + 600)


def test_stats_learn_that_a_block_reused_behind_a_full_cache_is_no_hit() -> None:
    # a key reused every 3 references is an OPT hit; keys reused 10 references later, while
    # a cache of 2 blocks is taken by the frequent key and another, are not
    s = HindsightStats(capacity_blocks=2, window_capacities=100, horizon=1000, history=1000)
    hot, other = 10**6, 10**6 + 1
    for i in range(200):
        s.on_lookup([hot], 0)
        s.on_lookup([other], 0)
        s.on_lookup([i % 10], 0)
    assert s.reuse_probability(hot) > 0.9
    assert s.reuse_probability(3) < 0.5


def test_hindsight_orders_by_value_with_greedy_dual_aging() -> None:
    s = HindsightStats(capacity_blocks=4, window_capacities=100, horizon=1000, history=1000)
    for _ in range(30):
        s.on_lookup([1], 0)
        s.on_lookup([2], 0)
    s.on_lookup([3], 0)  # seen once
    p = make_eviction_policy("hindsight", stats=s)
    assert isinstance(p, HindsightPolicy)
    for k in (1, 2, 3):
        p.insert(k, nbytes=1024, parent=None, depth=0)
    assert p.victim() == 3  # the block nobody came back to goes first
    assert p.value(1) > p.value(3)


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        HindsightStats(capacity_blocks=-1)
    with pytest.raises(ValueError):
        HindsightStats(capacity_blocks=8, window_capacities=0)
    with pytest.raises(ValueError):
        HindsightStats().set_capacity(0)


def test_before_its_size_is_known_a_reuse_within_the_horizon_is_a_hit() -> None:
    s = HindsightStats(horizon=100)
    assert s.capacity_blocks == 0
    assert s.opt_hit(0, 100) and s.opt_hit(1, 100) and not s.opt_hit(0, 101)
    s.set_capacity(1)
    assert s.capacity_blocks == 1
    assert s.opt_hit(0, 2) and not s.opt_hit(1, 3)  # OPTgen from now on


def test_adaptive_tells_the_tier_size_it_learns_to_its_hook() -> None:
    sizes: list[int] = []

    def make(mode: str) -> EvictionPolicy:
        return make_eviction_policy(mode)

    pol = AdaptivePolicy(make, TierShadows(make, modes=("lru", "lfu")),
                         capacity_bytes=64 * 1024, on_capacity=sizes.append)
    pol.insert(1, nbytes=1024, parent=None, depth=0)
    assert sizes == [64]


def test_a_deferred_observer_counts_lookups_off_the_request_path_and_before_stores() -> None:
    from kvtier.policy.adaptive import ShadowObserver

    stats = HindsightStats(capacity_blocks=4, horizon=1000, history=1000)
    later: list[Callable[[], None]] = []
    obs = ShadowObserver({}, inner=stats, defer=later.append)
    obs.on_lookup([1, 2, 3], 0, now=0.0)
    obs.on_lookup([1, 2], 2, now=0.0)
    assert stats.tick == 0 and len(later) == 1  # queued, one drain scheduled
    obs.on_stored([1, 2], output_tokens=10, now=0.0)  # a store drains first
    assert stats.tick == 5 and stats.uses(1) == 2
    later[0]()  # the scheduled drain finds nothing left
    assert stats.tick == 5


class Batched(HindsightStats):
    """Counts the chains (or pieces) labelled at once."""

    __slots__ = ("batches",)

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.batches = 0

    def _labels(self, keys: object, start: int, stop: int) -> list[bool | None] | None:
        labels = super()._labels(keys, start, stop)  # type: ignore[arg-type]
        self.batches += labels is not None
        return labels


class OneByOne(HindsightStats):
    """Labels every reference as it comes (the path before batching)."""

    __slots__ = ()

    def _labels(self, keys: object, start: int, stop: int) -> None:
        return None


def _optgen_state(stats: HindsightStats) -> tuple[object, ...]:
    recs = tuple((k, r.uses, r.cls, r.last, r.reused, r.gaps, r.tried)
                 for k, r in stats._hist.items())
    return (stats.tick, stats._base, stats._occ.tolist(), recs, tuple(stats._reuse),
            tuple(stats._gap), tuple(stats._access))


@pytest.mark.parametrize("capacity, history, universe", [
    (4096, 1 << 16, 3000),   # room to spare: chains take the batch
    (24, 1 << 16, 200),      # the room runs out: the batch defers to one by one
    (64, 150, 400),          # the history drops records mid-chain
    (16, 1 << 16, 60),       # many slides of the vector, repeats within chains
])
def test_optgen_labels_a_chain_at_once_exactly_as_one_by_one(
        capacity: int, history: int, universe: int) -> None:
    rng = np.random.default_rng(capacity + history)
    batched = Batched(capacity_blocks=capacity, horizon=1 << 16, history=history)
    single = OneByOne(capacity_blocks=capacity, horizon=1 << 16, history=history)
    for i in range(400):
        n = int(rng.integers(1, 48))
        keys = [int(k) for k in rng.integers(0, universe, n)]
        hits = int(rng.integers(0, n + 1))
        if i % 3 == 0:
            out = int(rng.integers(1, 500))
            batched.on_request(keys, hits, output_tokens=out)
            single.on_request(keys, hits, output_tokens=out)
        else:
            cut = int(rng.integers(0, n + 1))   # in two pieces, as the deferred replay does
            batched.on_lookup(keys, hits, start=0, stop=cut)
            batched.on_lookup(keys, hits, start=cut)
            single.on_lookup(keys, hits)
        assert _optgen_state(batched) == _optgen_state(single), i
    if capacity == 4096:
        assert batched.batches > 300   # the batch is the common path, not a corner
