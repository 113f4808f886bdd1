"""The ``hindsight`` policy's parts: OPTgen's labels and the value ordering (issue 13)."""

from __future__ import annotations

from collections.abc import Callable

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
