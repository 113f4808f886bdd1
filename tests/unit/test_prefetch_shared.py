"""The ``timeout`` prefetch wait is one rule with one grace (``TIMEOUT_BASE_S``) in the
daemon's promoter and in ``kvtier replay``'s simulator (issue 12: they used to differ)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvtier.index import BlockIndex
from kvtier.policy.base import make_eviction_policy
from kvtier.policy.costmodel import BlockCosts
from kvtier.policy.prefetch import TIMEOUT_BASE_S, PrefetchWait
from kvtier.replay.simulator import SimConfig, TierSpec, simulate
from kvtier.replay.trace import Request, Trace, TraceFormat
from kvtier.store import TieredStore
from kvtier.store.blocks import Blocks
from kvtier.store.cpu import CpuResidency
from kvtier.store.promoter import Promoter
from kvtier.store.stats import PrefetchCounters
from kvtier.store.transfers import Transfers
from kvtier.tiers.arena import Arena
from tests.support.arena import temp_arena

BLOCK = 4096
BLOCK_TOKENS = 4
BYTES_PER_TOKEN = 131072
LANDS_EVERY_S = TIMEOUT_BASE_S / 5   # each nvme block of the replay lands this long after


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(4 * BLOCK, BLOCK) as a:
        yield a


def test_the_store_defaults_to_the_policy_grace(arena: Arena) -> None:
    assert TieredStore(arena).promoter.base_s == TIMEOUT_BASE_S


async def test_promoter_timeout_waits_through_the_grace(arena: Arena) -> None:
    """No per-block part: only the grace keeps the get waiting for a block landing early
    in it (without the grace it would return at once, like ``best_effort``)."""
    cpu = CpuResidency(arena, BlockIndex(), make_eviction_policy("lru"))
    counters = PrefetchCounters()
    promoter = Promoter(Blocks(cpu.index, cpu, None, None), cpu, None, Transfers(arena),
                        counters, lambda: 0.0, PrefetchWait.TIMEOUT, per_block_s=0.0)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bool] = loop.create_future()
    loop.call_later(TIMEOUT_BASE_S / 5, fut.set_result, True)
    await promoter.wait([fut])
    assert fut.done() and counters.late == 1


def test_simulator_timeout_waits_through_the_same_grace() -> None:
    """Three blocks demoted to a slow tier land 1/5, 2/5 and 3/5 of the grace after the
    lookup; the per-block part is ~0 (a tiny modelled block), so only the grace saves them."""
    keys = (1, 2, 3, 4)
    reqs = tuple(Request(arrival_s=float(i), input_tokens=len(keys) * BLOCK_TOKENS,
                         output_tokens=1, blocks=keys) for i in range(2))
    trace = Trace(reqs, BLOCK_TOKENS, TraceFormat.MOONCAKE)
    slow_bw = BLOCK_TOKENS * BYTES_PER_TOKEN / LANDS_EVERY_S
    config = SimConfig(tiers=(TierSpec("cpu", 1, 25e9), TierSpec("nvme", 100, slow_bw)),
                       costs=BlockCosts(block_tokens=BLOCK_TOKENS, block_bytes=1),
                       bytes_per_token=BYTES_PER_TOKEN, prefetch=PrefetchWait.TIMEOUT)
    res = simulate(trace, "lru", config)
    assert res.tiers[1].hit_blocks >= 1   # the second request did reload from the slow tier
    assert res.late_blocks == 0
