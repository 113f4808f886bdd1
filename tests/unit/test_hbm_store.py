"""The store's HBM placement on the CPU: a real arena and a host-memory fake device pool.

Only the device is faked (tests/support/fake_hbm.py: ``ShmDevicePool`` behind the real
``HbmTier``); placement, hits, eviction, inclusion in cpu, leases, capacity, counters and
stats are the production code. The real cupy copies are tested in tests/gpu/.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.config import load_config
from kvtier.index import SlotState
from kvtier.policy.base import make_eviction_policy
from kvtier.policy.factory import build_policies
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.base import TierName
from kvtier.tiers.hbm import HbmTier
from tests.support.arena import temp_arena
from tests.support.fake_hbm import ShmDevicePool
from tests.support.store import (
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    OTHER_CLIENT,
    TTL,
    FakeClock,
    chain,
    get,
    payload,
    put,
)

ARENA_BLOCKS = 8
HBM_BLOCKS = 2


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(ARENA_BLOCKS * BLOCK, BLOCK) as a:
        yield a


@pytest.fixture
def hbm() -> Iterator[HbmTier]:
    t = HbmTier(HBM_BLOCKS * BLOCK, slab_bytes=BLOCK, pool_factory=ShmDevicePool)
    t.open()
    yield t
    t.close()


@pytest.fixture
def client(arena: Arena) -> Iterator[ArenaMapping]:
    m = ArenaMapping(str(arena.path), arena.size)
    yield m
    m.close()


def make_store(arena: Arena, hbm: HbmTier | None, clock: FakeClock,
               **kw: Any) -> TieredStore:
    kw.setdefault("eviction", "lru")
    s = TieredStore(arena, hbm=hbm, lease_ttl_s=TTL, prefetch_wait="wait", clock=clock, **kw)
    assert s.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    return s


@pytest.fixture
async def store(arena: Arena, hbm: HbmTier, clock: FakeClock) -> AsyncIterator[TieredStore]:
    s = make_store(arena, hbm, clock)
    yield s
    await s.drain(clock() + 5)


def pool(store: TieredStore) -> ShmDevicePool:
    assert isinstance(store.hbm, HbmTier)
    p = store.hbm._pool
    assert isinstance(p, ShmDevicePool)
    return p


def hbm_bytes(store: TieredStore, off: int) -> bytes:
    return bytes(pool(store).view(off, BLOCK))


async def device_get(store: TieredStore, keys: list[bytes], *, owner: int = CLIENT,
                     release: bool = True) -> tuple[int, list[str], list[bytes]]:
    """prepare_get_device + read every block where it was placed (+ release)."""
    lease, offsets, devices = await store.prepare_get_device(owner, DIGEST, FP, keys)
    data = [hbm_bytes(store, off) if dev == "hbm"
            else bytes(store.arena.view(off, BLOCK)) for off, dev in zip(offsets, devices,
                                                                          strict=True)]
    if release:
        await store.release_get(owner, lease)
    return lease, devices, data


def check_invariants(store: TieredStore) -> None:
    """hbm never over capacity, inclusive of cpu, and every hbm slot holds its block."""
    assert store.hbm is not None and store.hbm_place is not None
    assert store.hbm.used_bytes <= store.hbm.capacity_bytes
    for key, entry in store.hbm_place.entries.items():
        meta = store.index[key]
        assert meta.in_cpu, "a block is in hbm only while its cpu copy is"
        if entry.ready:
            assert hbm_bytes(store, entry.offset) == payload(key)
            assert entry.readers <= meta.readers
    assert len(store.hbm_place.policy) == sum(e.ready for e in store.hbm_place.entries.values())


# -- placement ---------------------------------------------------------------------------------
async def test_device_get_places_blocks_in_hbm_and_hits_there_next_time(
        store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(2)
    await put(store, client, keys)
    _, devices, data = await device_get(store, keys)
    assert devices == ["hbm", "hbm"] and data == [payload(k) for k in keys]
    hbm = store.hbm
    assert hbm is not None
    c = hbm.counters
    assert (c.hit_blocks, c.miss_blocks, c.bytes_written) == (0, 2, 2 * BLOCK)
    assert pool(store).copies == 2 and hbm.used_bytes == 2 * BLOCK and hbm.blocks == 2

    _, devices, data = await device_get(store, keys)       # the second get: an hbm hit
    assert devices == ["hbm", "hbm"] and data == [payload(k) for k in keys]
    assert pool(store).copies == 2, "no second copy"
    assert (c.hit_blocks, c.miss_blocks, c.hit_tokens) == (2, 2, 2 * LAYOUT.tokens_per_block)
    assert c.bytes_read == 4 * BLOCK
    stats = store.stats()
    assert list(stats["tiers"]) == ["hbm", "cpu"]
    assert stats["tiers"]["hbm"]["placement"].startswith("store:")
    assert {"src": "cpu", "dst": "hbm", "bytes": 2 * BLOCK} in stats["bytes_moved"]
    assert stats["tiers"]["cpu"]["bytes_read"] == 2 * BLOCK   # copied once, then hbm hits
    assert stats["leases"]["active"] == 0
    check_invariants(store)


async def test_plain_gets_never_touch_hbm(store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(3)
    await put(store, client, keys)
    assert await get(store, client, keys) == [payload(k) for k in keys]
    assert store.hbm is not None and store.hbm.used_bytes == 0 and pool(store).copies == 0
    assert store.hbm.counters.miss_blocks == 0


async def test_without_an_hbm_tier_device_gets_are_cpu_gets(
        arena: Arena, client: ArenaMapping, clock: FakeClock) -> None:
    store = make_store(arena, None, clock)
    keys = chain(2)
    await put(store, client, keys)
    _, devices, data = await device_get(store, keys)
    assert devices == ["cpu", "cpu"] and data == [payload(k) for k in keys]
    assert list(store.stats()["tiers"]) == ["cpu"]
    assert store.hbm_place is None


async def test_only_the_readable_prefix_is_placed(store: TieredStore,
                                                 client: ArenaMapping) -> None:
    keys = chain(3)
    await put(store, client, [keys[0], keys[2]])
    _, devices, _ = await device_get(store, keys)
    assert devices == ["hbm"]
    assert store.hbm_place is not None and list(store.hbm_place.entries) == [keys[0]]


# -- capacity and eviction ---------------------------------------------------------------------
async def test_hbm_eviction_frees_the_slot_and_the_block_stays_readable_from_cpu(
        store: TieredStore, client: ArenaMapping) -> None:
    a, b = chain(2), chain(2, start=1)
    await put(store, client, a + b)
    assert (await device_get(store, a))[1] == ["hbm", "hbm"]
    _, devices, data = await device_get(store, b)          # the pool holds 2 blocks: a goes
    assert devices == ["hbm", "hbm"] and data == [payload(k) for k in b]
    assert store.hbm is not None and store.hbm.used_bytes == 2 * BLOCK
    assert store.hbm.counters.evictions == {"capacity": 2}
    assert store.hbm_place is not None and set(store.hbm_place.entries) == set(b)
    assert await get(store, client, a) == [payload(k) for k in a]   # bytes kept in cpu
    assert all(store.index[k].in_cpu for k in a)
    _, devices, data = await device_get(store, a)          # and back into hbm on demand
    assert devices == ["hbm", "hbm"] and data == [payload(k) for k in a]
    check_invariants(store)


async def test_leased_hbm_blocks_are_never_evicted(store: TieredStore,
                                                   client: ArenaMapping) -> None:
    a, b = chain(2), chain(2, start=1)
    await put(store, client, a + b)
    lease, devices, _ = await device_get(store, a, release=False)
    assert devices == ["hbm", "hbm"]
    _, devices, data = await device_get(store, b, owner=OTHER_CLIENT)
    assert devices == ["cpu", "cpu"] and data == [payload(k) for k in b]
    assert store.hbm is not None and store.hbm.counters.allocation_failures == 1
    assert store.hbm.counters.evictions == {}
    await store.release_get(CLIENT, lease)
    assert (await device_get(store, b))[1] == ["hbm", "hbm"]   # a is evictable again
    check_invariants(store)


async def test_a_full_pool_serves_the_rest_from_cpu_but_still_uses_hbm_hits(
        store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(4)
    await put(store, client, keys)
    lease, devices, _ = await device_get(store, keys[2:], release=False)
    assert devices == ["hbm", "hbm"]                    # pinned by this lease
    _, devices, data = await device_get(store, keys, owner=OTHER_CLIENT)
    assert devices == ["cpu", "cpu", "hbm", "hbm"]
    assert data == [payload(k) for k in keys]
    await store.release_get(CLIENT, lease)
    check_invariants(store)


@pytest.mark.parametrize("end", ["expire", "owner_gone"])
async def test_expired_or_abandoned_leases_unpin_hbm(store: TieredStore, client: ArenaMapping,
                                                     clock: FakeClock, end: str) -> None:
    a, b = chain(2), chain(2, start=1)
    await put(store, client, a + b)
    await device_get(store, a, release=False)
    if end == "expire":
        clock.advance(TTL + 1)
        assert store.expire_leases() == 1
    else:
        assert store.release_owner(CLIENT) == 1
    assert store.hbm_place is not None
    assert all(e.readers == 0 for e in store.hbm_place.entries.values())
    assert all(store.index[k].readers == 0 for k in a)
    assert (await device_get(store, b, owner=OTHER_CLIENT))[1] == ["hbm", "hbm"]
    check_invariants(store)


async def test_cpu_eviction_takes_the_hbm_copy_along(store: TieredStore,
                                                     client: ArenaMapping) -> None:
    first = chain(2)
    await put(store, client, first)
    await device_get(store, first)
    await put(store, client, chain(ARENA_BLOCKS, start=1))   # no nvme: first is dropped
    assert all(k not in store.index for k in first)
    assert store.hbm is not None and store.hbm.used_bytes == 0
    assert store.hbm.counters.evictions == {"capacity": 2}
    check_invariants(store)


async def test_delete_frees_hbm_slots(store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(2)
    await put(store, client, keys)
    await device_get(store, keys)
    assert await store.delete(DIGEST, FP, keys) == 2
    assert store.hbm is not None and store.hbm.used_bytes == 0
    assert store.hbm.counters.evictions == {"deleted": 2}
    assert store.hbm_place is not None and not store.hbm_place.entries


async def test_delete_skips_blocks_read_from_hbm(store: TieredStore,
                                                client: ArenaMapping) -> None:
    keys = chain(1)
    await put(store, client, keys)
    lease, _, _ = await device_get(store, keys, release=False)
    assert await store.delete(DIGEST, FP, keys) == 0
    assert store.hbm is not None and store.hbm.used_bytes == BLOCK
    await store.release_get(CLIENT, lease)
    assert await store.delete(DIGEST, FP, keys) == 1
    assert store.hbm.used_bytes == 0


# -- copies ------------------------------------------------------------------------------------
async def test_a_failed_copy_serves_from_cpu_and_frees_the_slot(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = chain(2)
    await put(store, client, keys)

    def broken(items: Any) -> None:
        raise RuntimeError("cudaErrorIllegalAddress")

    assert store.hbm is not None
    monkeypatch.setattr(store.hbm, "copy_in", broken)
    _, devices, data = await device_get(store, keys)
    assert devices == ["cpu", "cpu"] and data == [payload(k) for k in keys]
    assert store.hbm.used_bytes == 0 and store.hbm.counters.errors == 1
    monkeypatch.undo()
    assert (await device_get(store, keys))[1] == ["hbm", "hbm"]
    check_invariants(store)


async def test_concurrent_device_gets_of_a_block_copy_it_once(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = chain(2)
    await put(store, client, keys)
    assert store.hbm is not None
    real = store.hbm.copy_in

    def slow(items: Any) -> None:
        import time

        time.sleep(0.05)
        real(items)

    monkeypatch.setattr(store.hbm, "copy_in", slow)
    r1, r2 = await asyncio.gather(device_get(store, keys),
                                  device_get(store, keys, owner=OTHER_CLIENT))
    assert r1[1] == r2[1] == ["hbm", "hbm"]
    assert r1[2] == r2[2] == [payload(k) for k in keys]
    assert pool(store).copies == 2
    assert store.hbm.counters.hit_blocks == 2 and store.hbm.counters.miss_blocks == 2
    check_invariants(store)


# -- policy wiring and a random walk -----------------------------------------------------------
async def test_the_hbm_policy_comes_from_the_same_factory(arena: Arena, hbm: HbmTier,
                                                          clock: FakeClock) -> None:
    asked: list[tuple[str, TierName]] = []

    def factory(name: str, tier: TierName) -> Any:
        asked.append((name, tier))
        return make_eviction_policy(name)

    store = make_store(arena, hbm, clock, policy_factory=factory)
    assert ("lru", TierName.HBM) in asked
    assert store.hbm_place is not None and store.hbm_place.policy.name == "lru"


@pytest.mark.parametrize("eviction", ["lru", "cost"])
async def test_random_walk_keeps_capacity_inclusion_and_bytes(
        arena: Arena, client: ArenaMapping, clock: FakeClock, tmp_path: Path,
        eviction: str) -> None:
    """Random puts, device gets, deletes, expiries and releases, under LRU and under the
    daemon's own cost-policy wiring (``build_policies``)."""
    cfg = load_config(env={}, overrides={"daemon.data_dir": tmp_path, "policy.eviction": eviction,
                                         "nvme.enabled": False})
    hbm = HbmTier(3 * BLOCK, slab_bytes=BLOCK, pool_factory=ShmDevicePool)
    hbm.open()
    store = make_store(arena, hbm, clock, **build_policies(cfg))
    rng = random.Random(7)
    chains = [chain(rng.randint(1, 3), start=i) for i in range(6)]
    open_leases: list[tuple[int, int]] = []
    try:
        for _ in range(300):
            op = rng.random()
            keys = rng.choice(chains)
            if op < 0.3:
                await put(store, client, keys)
            elif op < 0.65:
                owner = rng.choice([CLIENT, OTHER_CLIENT])
                lease, _devices, data = await device_get(store, keys, owner=owner,
                                                        release=False)
                assert data == [payload(k) for k in keys[: len(data)]]
                open_leases.append((owner, lease))
            elif op < 0.75:
                await store.delete(DIGEST, FP, keys)
            elif op < 0.8:
                clock.advance(TTL + 1)
                store.expire_leases()
                open_leases = [(o, lease) for o, lease in open_leases if lease in store.leases]
            elif open_leases:
                owner, lease = open_leases.pop(rng.randrange(len(open_leases)))
                await store.release_get(owner, lease)
            check_invariants(store)
            assert hbm.used_bytes <= hbm.capacity_bytes
        for owner, lease in open_leases:
            await store.release_get(owner, lease)
        assert store.hbm_place is not None
        assert all(e.readers == 0 for e in store.hbm_place.entries.values())
        assert all(m.readers == 0 and m.cpu_state is SlotState.READY
                   for m in store.index.values())
        c = hbm.counters
        assert c.hit_blocks > 0 and c.miss_blocks > 0 and sum(c.evictions.values()) > 0
    finally:
        hbm.close()


def test_fake_pool_is_a_device_pool() -> None:
    p = ShmDevicePool(4 * BLOCK)
    try:
        src = np.arange(BLOCK, dtype=np.uint8)
        p.copy_in([(BLOCK, src)])
        assert bytes(p.view(BLOCK, BLOCK)) == src.tobytes()
        assert len(p.export_handle()) == 64 and p.describe()["pci_bus_id"]
    finally:
        p.close()
    assert not p.path.exists()


async def test_a_cancelled_device_get_leaves_no_locks_behind(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    keys = chain(2)
    await put(store, client, keys)
    assert store.hbm is not None and store.hbm_place is not None
    real, started, go = store.hbm.copy_in, threading.Event(), threading.Event()

    def gated(items: Any) -> None:
        started.set()
        go.wait(5)
        real(items)

    monkeypatch.setattr(store.hbm, "copy_in", gated)
    task = asyncio.ensure_future(store.prepare_get_device(CLIENT, DIGEST, FP, keys))
    while not started.is_set():
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the copy is still running: its source blocks stay read-locked in cpu
    assert all(store.index[k].readers == 1 for k in keys)
    assert await store.delete(DIGEST, FP, keys) == 0
    go.set()
    for _ in range(500):
        if all(e.ready for e in store.hbm_place.entries.values()):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)
    assert all(store.index[k].readers == 0 for k in keys)
    assert all(e.ready and e.readers == 0 for e in store.hbm_place.entries.values())
    assert store.leases == {}
    _, devices, data = await device_get(store, keys)      # hits: the copy was kept
    assert devices == ["hbm", "hbm"] and data == [payload(k) for k in keys]
    assert store.hbm.counters.hit_blocks == 2
    check_invariants(store)
