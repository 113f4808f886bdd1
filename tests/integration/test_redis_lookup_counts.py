"""The Redis tier's hit and miss counters mean what they mean for cpu and nvme: lookups'
blocks found / not found in the tier, counted once per lookup from its probe (a real
redis-server; docs/operations.md, Monitoring). Before, only ``get_into`` counted them:
lookups that missed in Redis counted nothing, a lookup without prefetch that found blocks
counted no hit, and tokens were never counted."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Iterator

import pytest

from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.base import TierCounters
from kvtier.tiers.redis import RedisTier
from tests.support.arena import temp_arena
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import cfg_for, eventually, running
from tests.support.store import (
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    chain,
    seed_redis,
)

TPB = LAYOUT.tokens_per_block


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(16 * BLOCK, BLOCK) as a:
        yield a


@pytest.fixture
async def tier(redis_server: RedisServer) -> AsyncIterator[RedisTier]:
    async with running(cfg_for(redis_server.url)) as t:
        yield t


def _store(arena: Arena, tier: RedisTier, budget_s: float = 1.0) -> TieredStore:
    store = TieredStore(arena, redis=tier, eviction="lru", prefetch_wait="wait",
                        redis_lookup_budget_s=budget_s)
    assert store.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    return store


def counts(c: TierCounters) -> tuple[int, int, int, int]:
    """(hit blocks, miss blocks, hit tokens, miss tokens)"""
    return c.hit_blocks, c.miss_blocks, c.hit_tokens, c.miss_tokens


def blocks(hits: int, misses: int) -> tuple[int, int, int, int]:
    return hits, misses, hits * TPB, misses * TPB


async def test_lookups_count_what_their_redis_probe_found_once(
        arena: Arena, tier: RedisTier) -> None:
    store = _store(arena, tier)
    c = tier.counters
    keys = chain(6)
    await seed_redis(tier, keys[:4])

    # no prefetch: the probe found 4 of the 6 blocks asked; the 5th is the one miss
    assert (await store.lookup(DIGEST, FP, keys, prefetch=False)).tiers == ["redis"] * 4
    assert counts(c) == blocks(4, 0 + 1)
    assert tier.fetched_blocks == 0                    # nothing was read
    # a chain Redis holds whole: hits, no miss
    assert (await store.lookup(DIGEST, FP, keys[:4], prefetch=False)).hits == 4
    assert counts(c) == blocks(8, 1)
    # a prompt stored nowhere: one miss per lookup (blocks past it reach no tier)
    for _ in range(3):
        assert (await store.lookup(DIGEST, FP, chain(5, start=1), prefetch=False)).hits == 0
    assert counts(c) == blocks(8, 4)

    # a lookup that promotes, and the get that follows: counted once, by the lookup
    assert (await store.lookup(DIGEST, FP, keys[:4])).hits == 4
    await store.promoter.settle(10)
    assert counts(c) == blocks(12, 4) and tier.fetched_blocks == 4
    lease, offsets = await store.prepare_get(CLIENT, DIGEST, FP, keys[:4])
    assert len(offsets) == 4
    await store.release_get(CLIENT, lease)
    assert counts(c) == blocks(12, 4)

    # held whole by the arena now: Redis is never asked
    assert (await store.lookup(DIGEST, FP, keys[:4], prefetch=False)).tiers == ["cpu"] * 4
    assert counts(c) == blocks(12, 4)
    # past the local prefix, Redis is asked for the rest only
    await seed_redis(tier, keys[4:5])
    found = await store.lookup(DIGEST, FP, keys, prefetch=False)
    assert found.tiers == ["cpu"] * 4 + ["redis"]
    assert counts(c) == blocks(13, 5)

    # a get without a lookup reads from Redis (fetched) but counts no lookup hit
    other = chain(2, start=2)
    await seed_redis(tier, other)
    lease, offsets = await store.prepare_get(CLIENT, DIGEST, FP, other)
    assert len(offsets) == 2
    await store.release_get(CLIENT, lease)
    assert counts(c) == blocks(13, 5) and tier.fetched_blocks == 6
    assert tier.stats_extra()["fetched_blocks"] == 6
    await store.drain(store.clock() + 5)


async def test_a_probe_cut_by_the_budget_or_a_down_tier_counts_its_first_block_missed(
        arena: Arena, redis_server: RedisServer, tier: RedisTier) -> None:
    store = _store(arena, tier, budget_s=0.1)
    keys = chain(3)
    await seed_redis(tier, keys)
    proc = redis_server.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)       # replies never come: the budget cuts the probe
    try:
        found = await store.lookup(DIGEST, FP, keys, prefetch=False)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert found.hits == 0 and store.requests.redis_budget_misses == 1
    assert counts(tier.counters) == blocks(0, 1)

    redis_server.kill()
    await eventually(lambda: not tier.up)
    assert (await store.lookup(DIGEST, FP, keys, prefetch=False)).hits == 0
    assert counts(tier.counters) == blocks(0, 2)      # the tier down serves nothing
    await store.drain(store.clock() + 1)
