"""A node without an nvme tier (``nvme.bytes = 0``, the P/D recipe's daemons) demotes its
cpu victims to Redis, its next tier down: they were dropped, so ``kv_both`` engines on such
nodes shared nothing through Redis unless ``redis.write_through`` was on (found by an
operator's walkthrough). Real redis-server, real arena."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from kvtier.store import TieredStore, transfers
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.redis import RedisTier
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import cfg_for, running
from tests.support.store import (
    ARENA_BLOCKS,
    BLOCK,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    chain,
    get,
    payload,
    put,
)


@pytest.fixture(params=[False, True], ids=["write-behind", "write-through"])
async def tier(request: pytest.FixtureRequest,
               redis_server: RedisServer) -> AsyncIterator[RedisTier]:
    async with running(cfg_for(redis_server.url, write_through=request.param)) as t:
        yield t


@pytest.fixture
async def store(arena: Arena, tier: RedisTier) -> AsyncIterator[TieredStore]:
    s = TieredStore(arena, redis=tier, eviction="lru", prefetch_wait="wait",
                    redis_write_through=tier.cfg.write_through)
    assert s.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    yield s
    await s.drain(s.clock() + 5)


@pytest.mark.parametrize("off_loop", [False, True], ids=["copied-on-loop", "copied-in-thread"])
async def test_cpu_victims_of_a_node_without_nvme_go_to_redis(
        store: TieredStore, tier: RedisTier, arena: Arena, client: ArenaMapping,
        off_loop: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prompts of four blocks through a four-block arena: the first two are evicted
    to make room. Each evicted block is in Redis once (a copy: its slot was free at once,
    the arena is never over its size), a lookup finds the whole of the first prompt (cpu
    or Redis) and the get returns every byte exactly. With ``write_through`` every commit
    is in Redis already and eviction adds no second write. A large block (``off_loop``,
    forced here) is copied on a worker thread."""
    if off_loop:
        monkeypatch.setattr(transfers, "HASH_OFF_LOOP_BYTES", 0)
    prompts = [chain(ARENA_BLOCKS, start=i) for i in range(3)]
    for keys in prompts:
        offsets = await put(store, client, keys)
        assert all(off is not None for off in offsets)
        assert arena.used_bytes <= ARENA_BLOCKS * BLOCK
        # (written through, a slot stays pinned until its SET is over: zero-copy puts)
        assert await tier.flush(timeout=10)
    assert await tier.flush(timeout=10)
    evicted = [k for keys in prompts[:2] for k in keys if k not in store.index]
    assert len(evicted) == 2 * ARENA_BLOCKS
    assert await tier.exists_prefix(evicted, namespace=DIGEST) == len(evicted)
    moved = store.transfers.moved.by_pair
    expect = 3 * ARENA_BLOCKS if tier.cfg.write_through else 2 * ARENA_BLOCKS
    assert moved.get(("cpu", "redis"), 0) == expect * BLOCK, moved

    found = await store.lookup(DIGEST, FP, prompts[0])
    assert found.hits == ARENA_BLOCKS
    assert set(found.tiers) == {"redis"}
    assert await get(store, client, prompts[0]) == [payload(k) for k in prompts[0]]


async def test_a_victim_being_copied_is_in_use_until_its_copy_is_queued(
        store: TieredStore, tier: RedisTier, arena: Arena, client: ArenaMapping,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A large victim is copied on a worker thread with its slot pinned, so nothing can
    reuse the slot under the copy: a delete meanwhile skips it, as it skips a block under
    a read lease. Once queued it leaves the arena, Redis serves its exact bytes, and a
    delete then takes it from Redis too."""
    if tier.cfg.write_through:
        pytest.skip("written through: eviction sends nothing")
    monkeypatch.setattr(transfers, "HASH_OFF_LOOP_BYTES", 0)
    copying, go = threading.Event(), threading.Event()
    real_copy = transfers._copy

    def slow_copy(dst: memoryview, src: memoryview) -> None:
        copying.set()
        assert go.wait(10)
        real_copy(dst, src)

    monkeypatch.setattr(transfers, "_copy", slow_copy)
    first, second = chain(ARENA_BLOCKS, start=0), chain(1, start=1)
    await put(store, client, first)
    task = asyncio.create_task(put(store, client, second))   # evicts one of ``first``
    while not copying.is_set():
        await asyncio.sleep(0.005)
    victim = next(k for k in first if store.index[k].readers)   # pinned while copied
    assert await store.delete(DIGEST, FP, [victim]) == 0        # in use: skipped
    go.set()
    await task
    assert await tier.flush(timeout=10)
    assert victim not in store.index
    assert await tier.exists_prefix([victim], namespace=DIGEST) == 1
    found = await store.lookup(DIGEST, FP, [victim])
    assert found.hits == 1 and found.tiers == ["redis"]
    assert await get(store, client, [victim]) == [payload(victim)]
    assert await store.delete(DIGEST, FP, [victim]) == 1
    assert await tier.exists_prefix([victim], namespace=DIGEST) == 0
