"""A promotion whose move raises (beyond what its handlers catch) is a miss: the blocks'
futures resolve and their arena slots go back. Before, the futures never resolved, so a
get waiting on them under ``prefetch_wait = "wait"`` (no deadline) waited for good and the
blocks stayed LOADING, holding their slots."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.index import SlotState
from kvtier.store import TieredStore
from kvtier.store.transfers import Transfer, TransferResult, Transfers
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.base import TierName
from tests.support.redis_port_fake import FakeRedis, with_redis
from tests.support.store import ARENA_BLOCKS, BLOCK, CLIENT, DIGEST, FP, chain, get, payload, put


def no_slot_lost(store: TieredStore) -> bool:
    """Nothing LOADING, and the arena holds exactly the blocks the index says it holds."""
    metas = list(store.index.values())
    return all(m.cpu_state is not SlotState.LOADING for m in metas) and \
        store.arena.used_bytes == sum(BLOCK for m in metas if m.cpu is not None)


def break_loads(monkeypatch: pytest.MonkeyPatch, src: TierName) -> None:
    """Moves from ``src`` to cpu raise a bug's exception; the other moves work."""
    real = Transfers.move

    async def move(self: Transfers, a: TierName, b: TierName,
                   job: Transfer) -> TransferResult:
        if (a, b) == (src, TierName.CPU):
            raise RuntimeError("injected: a bug in the move")
        return await real(self, a, b, job)

    monkeypatch.setattr(Transfers, "move", move)


async def test_an_nvme_load_that_raises_is_a_miss_and_keeps_the_frame(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = chain(ARENA_BLOCKS)
    await put(store, client, keys)
    await put(store, client, chain(ARENA_BLOCKS, start=1))   # keys demoted to nvme
    assert all(store.index[k].in_nvme and not store.index[k].in_cpu for k in keys)
    break_loads(monkeypatch, TierName.NVME)
    lease, offsets = await asyncio.wait_for(store.prepare_get(CLIENT, DIGEST, FP, keys), 10)
    assert offsets == []
    await store.release_get(CLIENT, lease)
    await store.promoter.settle(5)
    meta = store.index[keys[0]]
    assert meta.in_nvme and not meta.in_cpu and meta.loading is None
    assert no_slot_lost(store)
    monkeypatch.undo()
    assert await get(store, client, keys[:1]) == [payload(keys[0])]


async def test_a_redis_load_that_raises_is_a_miss_and_gives_its_slots_back(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = chain(2, start=3)
    redis = FakeRedis()
    redis.frames = {k: payload(k) for k in keys}
    with_redis(store, redis)
    ns = store.ns.resolve(DIGEST, FP)
    break_loads(monkeypatch, TierName.REDIS)
    await store.promoter.from_redis(ns, keys, keys, 0)
    waiting = [m.loading for m in store.index.values() if m.loading is not None]
    assert len(waiting) == 2
    assert await asyncio.wait_for(asyncio.gather(*waiting), 10) == [False, False]
    await store.promoter.settle(5)
    assert all(k not in store.index for k in keys)
    assert no_slot_lost(store) and store.arena.used_bytes == 0
    monkeypatch.undo()
    await store.promoter.from_redis(ns, keys, keys, 0)
    await store.promoter.settle(5)
    assert await get(store, client, keys) == [payload(k) for k in keys]
