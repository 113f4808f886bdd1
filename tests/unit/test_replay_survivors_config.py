"""How a replay builds its tiers' policies (mutation review of kvtier/replay/config.py):
cost and hindsight reload from the tier below with the replay's own costs, adaptive's
shadows learn the sizes above each tier, an order given as text is the Order, and a tier
spec refuses what no tier can be."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.costmodel import BlockCosts
from kvtier.policy.hindsight import HindsightStats
from kvtier.policy.stats import WorkloadStats
from kvtier.replay import config as replay_config
from kvtier.replay.simulator import Order, SimConfig, TierSpec, make_policy, simulate
from kvtier.replay.trace import Request, Trace, TraceFormat

TIERS = (TierSpec("cpu", 4, 25e9), TierSpec("nvme", 16, 3e9), TierSpec("redis", 64, 1e9))


@pytest.mark.parametrize("name", ["cost", "hindsight"])
def test_cost_policies_reload_from_the_tier_below_with_the_replays_costs(
        monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Each tier's cost estimate reloads at the bandwidth of the next tier down (none
    below the last), priced with the replay's BlockCosts, not the default model."""
    seen: list[dict[str, Any]] = []
    real = replay_config.make_eviction_policy

    def spy(policy: str, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(policy, **kwargs)

    monkeypatch.setattr(replay_config, "make_eviction_policy", spy)
    costs = BlockCosts(block_tokens=16, block_bytes=16 * 1000)
    config = SimConfig(tiers=TIERS, costs=costs)
    for i in range(3):
        make_policy(name, i, config, None)
    assert [k["reload_bandwidth"] for k in seen] == [3e9, 1e9, None]
    assert all(k["costs"] is costs for k in seen)


def test_adaptive_shadows_know_the_capacity_above_each_tier() -> None:
    config = SimConfig(tiers=TIERS)
    shadows = []
    for i in range(3):
        pol = make_policy("adaptive", i, config, None)
        assert isinstance(pol, AdaptivePolicy)
        shadows.append(pol.shadows)
    assert [s.above_blocks for s in shadows] == [0, 4, 20]
    assert [s.capacity_blocks for s in shadows] == [4, 16, 64]


def test_an_order_given_as_text_is_the_order() -> None:
    """SimConfig(order="store") replays in the store's order (an unconverted string was
    no Order.STORE, and the replay fell back to head first)."""
    trace = Trace(tuple(Request(float(i), 12, 1, (1, 2, 3)) for i in range(2)), 4,
                  TraceFormat.MOONCAKE)
    for text, order in (("store", Order.STORE), ("reference", Order.REFERENCE)):
        config = SimConfig(tiers=(TierSpec("cpu", 2, 25e9),), order=text)  # type: ignore[arg-type]
        assert config.order is order
        want = simulate(trace, "lru", SimConfig(tiers=config.tiers, order=order))
        got = simulate(trace, "lru", config)
        assert (got.order, got.hit_blocks) == (order.value, want.hit_blocks)


def test_a_tier_spec_refuses_a_negative_size_or_a_bandwidth_that_is_not_positive() -> None:
    assert TierSpec("cpu", 0, 1.0).capacity_blocks == 0   # an empty tier is allowed
    with pytest.raises(ValueError, match="capacity_blocks must not be negative"):
        TierSpec("cpu", -1, 1.0)
    for bw in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="read_bw must be positive"):
            TierSpec("cpu", 1, bw)


@pytest.mark.parametrize("policy", ["hindsight", "adaptive"])
def test_hindsight_and_adaptive_replays_feed_the_reuse_classes(
        monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """Both read HindsightStats (adaptive starts in hindsight): each request must reach
    them, or their classes stay untrained and the replay says nothing about them."""
    calls: list[int] = []
    real = WorkloadStats.on_request

    def spy(self: WorkloadStats, *args: Any, **kwargs: Any) -> None:
        if isinstance(self, HindsightStats):
            calls.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(WorkloadStats, "on_request", spy)
    trace = Trace(tuple(Request(float(i), 8, 1, (i % 3, 10 + i)) for i in range(5)), 4,
                  TraceFormat.MOONCAKE)
    assert simulate(trace, policy, SimConfig(tiers=TIERS[:1])).requests == len(calls) == 5
