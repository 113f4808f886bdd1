"""Build the daemon's policies from its config: one eviction policy per tier, admission,
the shared workload observer and the prefix forest.

The same policy classes run in ``kvtier replay``; this module only decides their
parameters for a live node (capacities, next-tier bandwidths, the model's prefill cost).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvtier.policy.adaptive import AdaptivePolicy, ShadowObserver
from kvtier.policy.admission import TierAdmission, WriteBudget
from kvtier.policy.base import EvictionPolicy, make_eviction_policy
from kvtier.policy.costmodel import BlockCosts, PrefillModel
from kvtier.policy.hindsight import HindsightStats
from kvtier.policy.prefix import PrefixForest
from kvtier.policy.shadow import TierShadows
from kvtier.policy.stats import WorkloadStats
from kvtier.tiers.base import TierName

TYPICAL_BLOCK_BYTES = 8 * 2**20
"""Sizing unit for the observer's horizon, fixed before any layout is known (a 256-token
block of an 8B model in bf16 is 32 MiB; small test models are far smaller). Only sizing:
a block's own cost uses its real bytes."""
DEFAULT_BLOCK_TOKENS = 256
"""Tokens per block the cost model assumes for a block whose namespace's layout is not
known (the store passes each block's ``block_tokens`` from its namespace's layout on insert,
so a vLLM namespace of 16 or 32 tokens per block is priced at its real token positions)."""

H2D_BPS = 2.0e10          # reload bandwidth of the tier below hbm (cpu arena -> device)
NVME_READ_BPS = 2.0e9     # reload bandwidth of the tier below cpu (re-measured by bench)
REDIS_READ_BPS = 0.8e9    # reload bandwidth of the tier below nvme


def _call_soon(fn: Callable[[], None]) -> None:
    """Run ``fn`` on the event loop after the current callback (after the reply is sent);
    inline when no loop runs (a store used from synchronous code)."""
    try:
        asyncio.get_running_loop().call_soon(fn)
    except RuntimeError:
        fn()


def _call_later(delay: float, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the event loop ``delay`` seconds from now; inline when none runs."""
    try:
        asyncio.get_running_loop().call_later(delay, fn)
    except RuntimeError:
        fn()


def build_policies(cfg: Any) -> dict[str, Any]:
    """Keyword arguments for ``TieredStore``: eviction, policy_factory, admission,
    observer and forest."""
    name = cfg.policy.eviction
    stats: WorkloadStats | None = None
    costs: BlockCosts | None = None
    if name in ("cost", "adaptive", "hindsight"):
        top_blocks = max(1024, cfg.cpu.bytes // TYPICAL_BLOCK_BYTES)
        all_blocks = top_blocks + (cfg.nvme.bytes // TYPICAL_BLOCK_BYTES
                                   if cfg.nvme.enabled else 0)
        # Reuse counts within a window of ~16x everything the node can hold (as in replay):
        # one cache size of references is too short to tell reused blocks from dead ones.
        window = max(1 << 16, 16 * all_blocks)
        # adaptive starts in (and hindsight is) the OPTgen-trained mode: its labels need the
        # cpu tier's size in blocks, told later (the first put's block size, or the first
        # eviction's population)
        stats = (HindsightStats(horizon=window, history=window) if name != "cost"
                 else WorkloadStats(horizon=window, history=window))
        costs = BlockCosts(block_tokens=DEFAULT_BLOCK_TOKENS, block_bytes=TYPICAL_BLOCK_BYTES,
                           prefill=PrefillModel(params=cfg.policy.model_params))
    below_cpu = NVME_READ_BPS if cfg.nvme.enabled else (
        REDIS_READ_BPS if cfg.redis.enabled else None)
    below_nvme = REDIS_READ_BPS if cfg.redis.enabled else None

    shadows: dict[str, TierShadows] = {}

    def factory(policy: str, tier: TierName) -> EvictionPolicy:
        if policy == "adaptive":
            def make(mode: str) -> EvictionPolicy:
                return factory(mode, tier)

            # the nvme tier is modelled below the cpu tier (one cache of both sizes); the
            # hbm pool is inclusive in cpu, so cpu and hbm are each modelled alone
            above = shadows.get(TierName.CPU.value) if tier is TierName.NVME else None
            rate = cfg.policy.shadow_sample_rate or None
            sh = shadows[tier.value] = TierShadows(make, above=above, rate=rate)
            cap = {TierName.HBM: cfg.hbm.bytes, TierName.CPU: cfg.cpu.bytes}.get(
                tier, cfg.nvme.bytes if cfg.nvme.enabled else 0)
            sizes = (stats.set_capacity if isinstance(stats, HindsightStats)
                     and tier is TierName.CPU else None)
            return AdaptivePolicy(make, sh, capacity_bytes=cap, on_capacity=sizes)
        if policy not in ("cost", "hindsight"):
            return make_eviction_policy(policy)
        bw = {TierName.HBM: H2D_BPS, TierName.CPU: below_cpu}.get(tier, below_nvme)
        if policy == "hindsight":
            return make_eviction_policy(
                "hindsight", stats=stats, costs=costs, reload_bandwidth=bw,
                size_stats=name == "hindsight" and tier is TierName.CPU)
        return make_eviction_policy("cost", stats=stats, costs=costs, reload_bandwidth=bw)

    admission = None
    if cfg.nvme.write_budget_bytes_per_s > 0:
        admission = TierAdmission(
            {"nvme": WriteBudget.per_second(cfg.nvme.write_budget_bytes_per_s)})
    # the shadows are fed by the observer; the store builds the tiers' policies (and so
    # fills ``shadows``) when it is constructed, before its first lookup
    observer = (ShadowObserver(shadows, inner=stats, defer=_call_soon,
                               defer_after=_call_later)
                if name == "adaptive" else stats)
    return {"eviction": name, "policy_factory": factory, "admission": admission,
            "observer": observer, "forest": PrefixForest()}
