"""The store's read side (``kvtier.store.reads``, ``coordinator``), pinned where a mutation
review found no test noticing a check broken: a lookup counts Redis hits as hits and
promotes the blocks it found there (not the chain's head); it marks the blocks it found
used in the tier that holds them, the chain's head last; a prefetched block counts as
used once; a get counts the bytes it serves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from kvtier.index import SlotState
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.base import TierCounters
from kvtier.tiers.nvme import NvmeTier
from tests.support.redis_port_fake import FakeRedis
from tests.support.store import (
    BLOCK,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    FakeClock,
    chain,
    get,
    nvme_corrupt_payload,
    payload,
    put,
)

TPB = LAYOUT.tokens_per_block


class CountingRedis(FakeRedis):
    """``FakeRedis`` with the tier counters a lookup bumps."""

    def __init__(self) -> None:
        super().__init__()
        self.counters = TierCounters()
        self.probe_stall: asyncio.Event | None = None   # probes wait for it when set

    async def exists_prefix(self, keys: Sequence[bytes], *,
                            namespace: bytes | None = None) -> int:
        if self.probe_stall is not None:
            await self.probe_stall.wait()
        return await super().exists_prefix(keys, namespace=namespace)


@pytest.fixture
async def redis_store(arena: Arena, nvme: NvmeTier,
                      clock: FakeClock) -> AsyncIterator[tuple[TieredStore, CountingRedis]]:
    redis = CountingRedis()
    s = TieredStore(arena, nvme=nvme, redis=redis,  # type: ignore[arg-type]
                    prefetch_wait="wait", clock=clock)
    assert s.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    yield s, redis
    await s.drain(clock() + 5)


async def test_a_lookup_counts_redis_hits_and_promotes_the_blocks_found_there(
        redis_store: tuple[TieredStore, CountingRedis], client: ArenaMapping) -> None:
    """Head in the arena, the next two in Redis, the fourth nowhere: 3 hits (cpu, redis,
    redis) in the request counters too, Redis counts 2 hits and 1 miss, and the prefetch
    brings exactly the two Redis blocks into the arena, each with its own bytes (mutants:
    the request counters given the local hits only; the promotion handed the chain's
    leading keys instead of those past the local prefix)."""
    store, redis = redis_store
    keys = chain(4)
    await put(store, client, keys[:1])
    redis.frames = {k: payload(k) for k in keys[1:3]}
    hits_before = store.requests.hit_blocks
    res = await store.lookup(DIGEST, FP, keys)
    assert res.hits == 3 and res.tiers == ["cpu", "redis", "redis"]
    assert store.requests.hit_blocks - hits_before == 3
    assert store.requests.hit_tokens == 3 * TPB
    c = redis.counters
    assert (c.hit_blocks, c.miss_blocks, c.hit_tokens, c.miss_tokens) == (2, 1, 2 * TPB, TPB)
    await store.promoter.settle(10)
    assert [store.index[k].in_cpu for k in keys[:3]] == [True, True, True]
    assert [store.index[k].depth for k in keys[:3]] == [0, 1, 2]
    assert store.prefetch.issued == 2
    redis.frames.clear()
    assert await get(store, client, keys) == [payload(k) for k in keys[:3]]


async def test_a_lookup_marks_nvme_blocks_used_in_the_nvme_policy(
        store: TieredStore, client: ArenaMapping) -> None:
    """A lookup that finds a block on nvme only marks it used there: of two such blocks
    the one looked up is no longer nvme's next victim (mutant: nvme's recency left as the
    writes made it, and the block a client is about to read was evicted first)."""
    a, b = chain(1, start=1), chain(1, start=2)
    await put(store, client, a, durable=True)
    await put(store, client, b, durable=True)
    for k in (*a, *b):
        await store.demoter.evict_cpu(k)
    assert store.nvme_policy.victim() == a[0]
    assert (await store.lookup(DIGEST, FP, a, prefetch=False)).tiers == ["nvme"]
    assert store.nvme_policy.victim() == b[0]
    # without ``prefetch`` nothing is promoted (mutant: promoted anyway)
    assert store.index[a[0]].cpu_state is SlotState.NONE and store.prefetch.issued == 0


async def test_a_prefetch_stops_at_the_first_block_it_cannot_promote(
        store: TieredStore, client: ArenaMapping) -> None:
    """A lookup's prefetch walks the chain and stops at a block it cannot bring up (its
    nvme write in flight): the blocks past it are unreachable until it is, so they stay on
    nvme (mutant: the walk skipped it and promoted the tail, evicting for blocks no get
    can reach). A get does the same."""
    keys = chain(3)
    await put(store, client, keys, durable=True)
    for k in keys:
        await store.demoter.evict_cpu(k)
    store.index[keys[1]].nvme_busy = True
    try:
        assert (await store.lookup(DIGEST, FP, keys)).hits == 3
        await store.promoter.settle(10)
        states = [store.index[k].cpu_state for k in keys]
        assert states == [SlotState.READY, SlotState.NONE, SlotState.NONE]
        assert store.prefetch.issued == 1
        # a get stops there too (mutant: the get kept walking and loaded the tail)
        assert await get(store, client, keys) == [payload(keys[0])]
        states = [store.index[k].cpu_state for k in keys]
        assert states == [SlotState.READY, SlotState.NONE, SlotState.NONE]
        assert all(store.index[k].readers == 0 for k in keys)
    finally:
        store.index[keys[1]].nvme_busy = False


async def test_a_lookup_leaves_the_chain_head_most_recent_in_cpu(
        store: TieredStore, client: ArenaMapping) -> None:
    """The blocks a lookup finds in the arena are touched tail first, so the head is the
    last to be evicted (evicting it first makes the whole chain unreachable; mutant: touched
    head first)."""
    keys = chain(3)
    await put(store, client, keys)
    policy = store.cpu.policy
    for k in keys:   # head first: the head is now the least recent
        policy.touch(k, now=0.0)
    assert policy.victim() == keys[0]
    assert (await store.lookup(DIGEST, FP, keys, prefetch=False)).hits == 3
    assert policy.victim() == keys[2]


async def test_a_prefetched_block_counts_as_used_before_use_once(
        store: TieredStore, client: ArenaMapping) -> None:
    """A block a lookup brought up from nvme counts one prefetch ``hit_before_use`` at its
    first get and none at the next (mutants: the flag never cleared, counting every get;
    never counted)."""
    keys = chain(1, start=3)
    await put(store, client, keys, durable=True)
    await store.demoter.evict_cpu(keys[0])
    assert (await store.lookup(DIGEST, FP, keys)).tiers == ["nvme"]
    await store.promoter.settle(10)
    assert store.index[keys[0]].in_cpu and store.index[keys[0]].prefetched
    assert await get(store, client, keys) == [payload(keys[0])]
    assert store.prefetch.hit_before_use == 1
    assert await get(store, client, keys) == [payload(keys[0])]
    assert store.prefetch.hit_before_use == 1


async def test_a_get_counts_the_bytes_it_serves_from_the_arena(
        store: TieredStore, client: ArenaMapping) -> None:
    """Each get lease counts its blocks' bytes read from cpu, and its blocks in the request
    counters (mutant: the cpu tier's ``bytes_read`` never counted on a get)."""
    keys = chain(2)
    await put(store, client, keys)
    read0, gets0, blocks0 = (store.cpu.counters.bytes_read, store.requests.gets,
                             store.requests.get_blocks)
    assert len(await get(store, client, chain(3))) == 2
    assert store.cpu.counters.bytes_read - read0 == 2 * BLOCK
    assert (store.requests.gets - gets0, store.requests.get_blocks - blocks0) == (1, 2)


async def test_a_get_serves_no_redis_block_whose_promotion_did_not_start(
        redis_store: tuple[TieredStore, CountingRedis], client: ArenaMapping) -> None:
    """A get whose chain stops at a block it cannot bring up from nvme (its write in
    flight) asks Redis for the rest; a block Redis holds but the promotion did not load
    (it is indexed already) is where the get stops, unpinned (mutant: every indexed block
    joined the lease, waiting on a load that was never started)."""
    store, redis = redis_store
    keys = chain(2, start=4)
    await put(store, client, keys, durable=True)
    await store.demoter.evict_cpu(keys[1])
    redis.frames = {keys[1]: payload(keys[1])}
    meta = store.index[keys[1]]
    meta.nvme_busy = True
    try:
        assert await get(store, client, keys) == [payload(keys[0])]
        assert store.index[keys[1]] is meta and not meta.in_cpu
        assert meta.readers == 0 and store.index[keys[0]].readers == 0
    finally:
        meta.nvme_busy = False


async def test_a_get_counts_only_the_blocks_it_serves(
        store: TieredStore, client: ArenaMapping, nvme: NvmeTier) -> None:
    """A get whose second block fails its load from nvme (a corrupt frame) serves and
    counts one block (mutant: ``get_blocks`` counted every block it tried)."""
    keys = chain(2, start=5)
    await put(store, client, keys, durable=True)
    for k in keys:
        await store.demoter.evict_cpu(k)
    nvme_corrupt_payload(nvme, store, keys[1])
    blocks0 = store.requests.get_blocks
    assert await get(store, client, keys) == [payload(keys[0])]
    assert store.requests.get_blocks - blocks0 == 1


async def test_a_redis_probe_past_its_budget_is_a_counted_miss(
        redis_store: tuple[TieredStore, CountingRedis]) -> None:
    """A Redis probe that does not answer within ``redis_lookup_budget_s`` is a miss,
    counted in ``redis_budget_misses`` (mutant: not counted: an operator sees a falling
    hit rate and no cause)."""
    store, redis = redis_store
    keys = chain(2, start=6)
    redis.frames = {k: payload(k) for k in keys}
    store.reader.redis_lookup_budget_s = 0.01
    redis.probe_stall = asyncio.Event()
    try:
        assert (await store.lookup(DIGEST, FP, keys)).hits == 0
    finally:
        redis.probe_stall.set()
    assert store.requests.redis_budget_misses == 1
    assert (redis.counters.hit_blocks, redis.counters.miss_blocks) == (0, 1)


async def test_a_get_does_not_read_a_redis_tier_that_is_down(
        redis_store: tuple[TieredStore, CountingRedis], client: ArenaMapping) -> None:
    """With the Redis tier down a get serves the local prefix only: it neither probes nor
    promotes from Redis (mutant: a tier merely configured was asked, each get paying a
    probe to a dead server)."""
    store, redis = redis_store
    keys = chain(2, start=7)
    await put(store, client, keys[:1])
    redis.frames = {keys[1]: payload(keys[1])}
    redis.up = False
    assert await get(store, client, keys) == [payload(keys[0])]
    assert keys[1] not in store.index and store.prefetch.issued == 0
