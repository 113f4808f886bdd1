"""Mutation-review survivors of Redis -> cpu promotion (kvtier/store/promoter.py, with the
Redis read of kvtier/store/transfers.py): decisions no other test noticed broken. Each
docstring names the decision and the mutant that survived without it. Redis is
``FakeRedis`` (tests/support/redis_port_fake.py), an in-process stand-in for what the store
asks of a ``RedisTier`` (no server); races are simulated by patching the store's alloc
(restored after by monkeypatch)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier.index import BlockMeta
from kvtier.policy.prefetch import PrefetchWait
from kvtier.policy.prefix import PrefixForest
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.nvme import NvmeTier
from tests.support.redis_port_fake import FakeRedis, with_redis
from tests.support.store import (
    BLOCK,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    FakeClock,
    chain,
    get,
    payload,
    put,
)


@pytest.fixture
def redis() -> FakeRedis:
    return FakeRedis()


async def _promote(store: TieredStore, keys: list[bytes], start: int) -> list[BlockMeta]:
    """``from_redis`` of ``keys[start:]``, waited for; the promoted blocks."""
    ns = store.ns.resolve(DIGEST, FP)
    await store.promoter.from_redis(ns, keys[start:], keys, start)
    await store.promoter.settle(10)
    return [store.index[k] for k in keys[start:] if k in store.index]


# --------------------------------------------------------------------------- promoter


async def test_promoted_blocks_keep_their_place_in_the_chain(
        store: TieredStore, client: ArenaMapping, redis: FakeRedis) -> None:
    """Blocks promoted from Redis after a local prefix get their real depth and parent
    (the key before each): the eviction policy and the prefix forest follow these links,
    and a demoted block's nvme frame records the parent that recovery walks (mutants: the
    parent the block's own key, ``chain[depth]``; the depth counted from the promotion's
    first key, not the chain's). They count as issued prefetches (mutant: not counted)."""
    keys = chain(3)
    await put(store, client, keys[:1])
    with_redis(store, redis)
    redis.frames = {k: payload(k) for k in keys[1:]}
    promoted = await _promote(store, keys, 1)
    assert [m.key for m in promoted] == keys[1:]
    assert all(m.in_cpu for m in promoted)
    assert [m.depth for m in promoted] == [1, 2]
    assert [m.parent for m in promoted] == keys[:2]
    assert store.prefetch.issued == 2
    assert await get(store, client, keys) == [payload(k) for k in keys]


async def test_a_promotion_that_raises_serves_no_block(
        store: TieredStore, arena: Arena, redis: FakeRedis) -> None:
    """A Redis read that raises (the tier promises not to; defensive) promotes nothing: the
    loading blocks leave the arena and the index, counted as failed prefetches, and their
    waiters learn they failed (mutant: the ``except`` counting every block moved, which
    served arena slots Redis never filled)."""
    keys = chain(2)
    with_redis(store, redis)
    redis.fail = RuntimeError("boom")
    ns = store.ns.resolve(DIGEST, FP)
    await store.promoter.from_redis(ns, keys, keys, 0)
    futs = [store.index[k].loading for k in keys]
    await store.promoter.settle(10)
    assert all(k not in store.index for k in keys)
    assert arena.used_bytes == 0
    assert store.prefetch.failed == 2
    assert [f.result() for f in futs if f is not None] == [False, False]


async def test_a_block_redis_lost_before_the_read_leaves_no_trace(
        store: TieredStore, client: ArenaMapping, arena: Arena, redis: FakeRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A promotion whose read finds only the first of two blocks (Redis evicted the other
    after the lookup's probe) serves that one; the other leaves its slot and the index (a
    lookup must not report it, say, on nvme), is counted failed, and its waiter learns it
    (mutants: the first missing block skipped by the cleanup, its slot and LOADING entry
    kept; the entry kept with no tier; its future answered True). Only the bytes that
    arrived count as moved and feed the reload bandwidth (mutants: the whole batch)."""
    keys = chain(2)
    observed: list[tuple[str, str, int]] = []
    monkeypatch.setattr(store.transfers.bandwidth, "observe",
                        lambda src, dst, nbytes, seconds: observed.append((src, dst, nbytes)))
    with_redis(store, redis)
    redis.frames = {keys[0]: payload(keys[0])}
    ns = store.ns.resolve(DIGEST, FP)
    await store.promoter.from_redis(ns, keys, keys, 0)
    futs = [store.index[k].loading for k in keys]
    await store.promoter.settle(10)
    assert [f.result() for f in futs if f is not None] == [True, False]
    assert store.index[keys[0]].in_cpu and keys[1] not in store.index
    assert arena.used_bytes == BLOCK
    assert store.prefetch.failed == 1
    assert store.bytes_moved[("redis", "cpu")] == BLOCK
    assert observed == [("redis", "cpu", BLOCK)]
    found = await store.lookup(DIGEST, FP, keys, prefetch=False)
    assert found.tiers == ["cpu"]
    assert await get(store, client, keys) == [payload(keys[0])]


async def test_promoted_blocks_join_the_prefix_forest(
        arena: Arena, nvme: NvmeTier, clock: FakeClock, client: ArenaMapping,
        redis: FakeRedis) -> None:
    """With orphan collection on (a ``PrefixForest``), blocks promoted from Redis are added
    to it under their parent, so that they go when their chain's head goes (mutant: not
    added: promoted blocks never collected as orphans)."""
    forest = PrefixForest()
    store = TieredStore(arena, nvme=nvme, prefetch_wait="wait", clock=clock, forest=forest)
    assert store.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    try:
        keys = chain(3)
        await put(store, client, keys[:1])
        with_redis(store, redis)
        redis.frames = {k: payload(k) for k in keys[1:]}
        await _promote(store, keys, 1)
        assert all(k in forest for k in keys)
        assert set(forest.discard(keys[0])) == set(keys[1:])
    finally:
        await store.drain(clock() + 5)


async def test_a_get_waits_for_a_stalled_redis_promotion_no_longer_than_its_deadline(
        arena: Arena, nvme: NvmeTier, clock: FakeClock, client: ArenaMapping,
        redis: FakeRedis) -> None:
    """Under the ``timeout`` prefetch policy a get whose Redis promotion stalls returns at
    its deadline (base + per block) with the blocks ready, the stalled one a miss; the
    promotion still lands later (mutant: ``asyncio.wait`` without the timeout: the get
    hangs for as long as Redis does; likewise ``settle``, which bounds a drain)."""
    store = TieredStore(arena, nvme=nvme, redis=redis,  # type: ignore[arg-type]
                        prefetch_wait="timeout", prefetch_ms_per_block=1.0,
                        prefetch_base_s=0.05, clock=clock)
    assert store.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    stall = redis.stall = asyncio.Event()
    try:
        keys = chain(2)
        await put(store, client, keys[:1])
        redis.frames = {keys[1]: payload(keys[1])}
        t0 = time.monotonic()
        lease, offsets = await asyncio.wait_for(
            store.prepare_get(1, DIGEST, FP, keys), timeout=5.0)
        assert time.monotonic() - t0 < 2.0
        assert len(offsets) == 1
        assert bytes(client.view(offsets[0], BLOCK, writable=False)) == payload(keys[0])
        await store.release_get(1, lease)
        # a drain's wait for loads in flight is bounded too (mutant: unbounded settle)
        await asyncio.wait_for(store.promoter.settle(0.05), timeout=3.0)
        assert store.index[keys[1]].loading is not None
        stall.set()
        await store.promoter.settle(10)
        assert store.index[keys[1]].in_cpu
        assert await get(store, client, keys) == [payload(k) for k in keys]
    finally:
        stall.set()
        await store.drain(clock() + 5)


async def test_a_block_already_in_the_arena_counts_as_promoted(
        store: TieredStore, client: ArenaMapping) -> None:
    """``from_nvme`` of a block another request already loaded (or is loading) says True:
    False means "no room", and the lookup's prefetch stops there, leaving the rest of the
    chain (and its Redis part) unpromoted (mutant: False)."""
    keys = chain(1)
    await put(store, client, keys)
    meta = store.index[keys[0]]
    assert meta.in_cpu
    assert await store.promoter.from_nvme(meta, prefetched=True) is True


async def test_a_slot_allocated_for_a_block_that_left_nvme_meanwhile_goes_back(
        store: TieredStore, client: ArenaMapping, arena: Arena,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_nvme``: when the block left nvme while its arena slot was being allocated
    (an eviction dropped it), the slot is freed, not kept (mutant: the slot leaked)."""
    keys = chain(1)
    await put(store, client, keys, durable=True)
    meta = store.index[keys[0]]
    assert meta.in_nvme
    store.cpu.drop(meta)
    assert arena.used_bytes == 0
    slot = meta.nvme
    real_alloc = type(store.cpu).alloc

    async def alloc_then_lose(self: object, nbytes: int, *, batch: int = 1) -> int | None:
        off = await real_alloc(store.cpu, nbytes, batch=batch)
        meta.nvme = None   # left nvme during the allocation
        return off

    monkeypatch.setattr(type(store.cpu), "alloc", alloc_then_lose)
    try:
        assert await store.promoter.from_nvme(meta, prefetched=True) is False
        assert arena.used_bytes == 0, "the arena slot of the abandoned promotion leaked"
        assert not meta.nvme_busy
    finally:
        meta.nvme = slot


class _RacingAlloc:
    """Stands in for ``CpuResidency.alloc`` during a promotion: allocates for real, and
    on the first call indexes a stand-in entry for ``key`` (another request storing it
    while this one evicted for room)."""

    def __init__(self, store: TieredStore, key: bytes) -> None:
        self.store, self.key = store, key
        self.calls = 0
        self.stand_in = BlockMeta(key, DIGEST, FP, BLOCK, None, 0)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = type(self.store.cpu).alloc

        async def alloc(cpu: object, nbytes: int, *, batch: int = 1) -> int | None:
            self.calls += 1
            off = await real(self.store.cpu, nbytes, batch=batch)
            if self.calls == 1:
                self.store.index[self.key] = self.stand_in
            return off

        monkeypatch.setattr(type(self.store.cpu), "alloc", alloc)


async def _full_arena_but_one(store: TieredStore, client: ArenaMapping,
                              redis: FakeRedis, keys: list[bytes]) -> None:
    await put(store, client, chain(3, start=7))   # 3 of the 4 slots, evictable
    with_redis(store, redis)
    redis.frames = {k: payload(k) for k in keys}


async def test_a_key_indexed_during_the_promotions_eviction_keeps_its_entry(
        store: TieredStore, client: ArenaMapping, arena: Arena, redis: FakeRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_redis`` evicting for a key that another request indexed meanwhile stops
    there: the other entry stays and the slot just allocated goes back (mutants: the
    ``in index`` recheck after the alloc dropped, the entry replaced and its slot lost;
    the slot not freed)."""
    keys = chain(3)
    await _full_arena_but_one(store, client, redis, keys)
    race = _RacingAlloc(store, keys[1])
    race.install(monkeypatch)
    promoted = await _promote(store, keys, 0)
    try:
        assert store.index[keys[1]] is race.stand_in, "a promotion replaced a live entry"
        assert keys[2] not in store.index
        assert promoted[0].in_cpu
        # 2 of the other chain (one evicted for the abandoned slot) + keys[0]
        assert arena.used_bytes == 3 * BLOCK, "the abandoned promotion slot leaked"
    finally:
        del store.index[keys[1]]


async def test_a_key_indexed_during_an_earlier_eviction_costs_no_eviction(
        store: TieredStore, client: ArenaMapping, arena: Arena, redis: FakeRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_redis`` looks for the next key in the index before evicting for it: a key
    another request stored during the previous eviction ends the promotion without
    evicting a block for nothing (mutant: the check before the alloc dropped: one more
    eviction, its slot freed at once)."""
    keys = chain(3)
    await _full_arena_but_one(store, client, redis, keys)
    race = _RacingAlloc(store, keys[2])
    race.install(monkeypatch)
    try:
        promoted = await _promote(store, keys, 0)
        assert [m.key for m in promoted[:2]] == keys[:2] and all(m.in_cpu for m in promoted[:2])
        assert race.calls == 1
        assert sum(store.cpu.counters.evictions.values()) == 1
    finally:
        del store.index[keys[2]]


async def test_only_promotions_still_in_flight_count_as_late(store: TieredStore) -> None:
    """``prefetch.late`` counts the promotions a get had to wait for, not those already
    over (mutant: every pending promotion counted)."""
    loop = asyncio.get_running_loop()
    over: asyncio.Future[bool] = loop.create_future()
    over.set_result(True)
    stuck: asyncio.Future[bool] = loop.create_future()
    store.promoter.wait_policy = PrefetchWait.BEST_EFFORT
    await store.promoter.wait([over, stuck])
    assert store.prefetch.late == 1
    await store.promoter.wait([over])
    assert store.prefetch.late == 1
