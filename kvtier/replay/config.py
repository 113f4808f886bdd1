"""What a replay is configured with (tiers, costs, the order a request's blocks reach the
policy) and the eviction policies it builds: :func:`kvtier.replay.simulator.simulate`'s
inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvtier.policy.adaptive import AdaptivePolicy
from kvtier.policy.admission import AdmissionPolicy
from kvtier.policy.base import EvictionPolicy, make_eviction_policy
from kvtier.policy.costmodel import BlockCosts
from kvtier.policy.prefetch import PrefetchWait
from kvtier.policy.shadow import TierShadows
from kvtier.policy.stats import WorkloadStats
from kvtier.replay.belady import BeladyPolicy

__all__ = ["PUT_EVICT_BATCH", "Order", "SimConfig", "TierSpec", "make_policy"]

PUT_EVICT_BATCH = 16
"""Victims a put chooses at a time, before their orphans go: kvtier.store.alloc's
``EVICT_BATCH`` (tests/unit/test_replay_order.py keeps the two equal)."""


class Order(str, Enum):
    """In which order a replayed request's blocks reach the top tier's policy.

    - ``store`` (the default, what kvtier's store does): the blocks in the top tier are
      touched tail first, so the head is the most recent of them (the lookup's
      ``touch_chain``); then the tier evicts to make room for the blocks to write, which
      cannot be victims (a put allocates before its blocks reach the policy; victims
      ``PUT_EVICT_BATCH`` at a time, before their orphans go, as kvtier/store/alloc.py),
      and those are inserted tail first (``ready_many``), so they are more recent than
      the ones touched. A block whose parent went to make room is not written; what a
      request larger than the tier cannot keep is evicted after (its tail first under
      every policy). Nothing is bypassed: Belady cannot refuse a block either.
    - ``reference`` (the reference figures of shared/traces/README.md): head first, each
      block inserted or touched in chain order and the tier evicting after each insert,
      the block just inserted a candidate too (Belady's bypass). A recency policy then
      evicts a chain's root first and orphans the chain (docs/replay-analysis.md, "The
      store's order").
    """

    STORE = "store"
    REFERENCE = "reference"


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One simulated tier: capacity in blocks and bandwidth toward the engine (B/s)."""

    name: str
    capacity_blocks: int
    read_bw: float

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError(f"tier {self.name}: capacity_blocks must not be negative, got "
                             f"{self.capacity_blocks}")
        if not self.read_bw > 0:  # NaN too: a reload would take NaN seconds
            raise ValueError(f"tier {self.name}: read_bw must be positive, got {self.read_bw}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything a replay needs besides the trace and the policy name."""

    tiers: tuple[TierSpec, ...]
    costs: BlockCosts | None = None  # None: default model at the trace's block size
    bytes_per_token: int = 131072
    prefetch: PrefetchWait = PrefetchWait.WAIT
    drop_orphans: bool = True
    admission: Callable[[str], AdmissionPolicy] | None = None  # tier name -> policy
    order: Order = Order.STORE

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", Order(self.order))  # ("store" works too)


def make_policy(
    name: str, tier_index: int, config: SimConfig, stats: WorkloadStats | None
) -> EvictionPolicy:
    """Build the eviction policy of one simulated tier (``belady`` is replay-only)."""
    if name == "belady":
        return BeladyPolicy()
    if name == "adaptive":
        def make(mode: str) -> EvictionPolicy:
            return make_policy(mode, tier_index, config, stats)

        above = sum(t.capacity_blocks for t in config.tiers[:tier_index])
        shadows = TierShadows(make, capacity_blocks=config.tiers[tier_index].capacity_blocks,
                              above_blocks=above)
        return AdaptivePolicy(make, shadows)
    if name in ("cost", "hindsight"):
        below = config.tiers[tier_index + 1].read_bw if tier_index + 1 < len(config.tiers) else None
        return make_eviction_policy(name, stats=stats, costs=config.costs,
                                    reload_bandwidth=below)
    return make_eviction_policy(name)
