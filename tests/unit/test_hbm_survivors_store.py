"""The store's HBM placement (``kvtier.store.hbm.HbmPlacement``) over the host-memory fake
pool: recency of hbm hits, gets that wait on another get's copy, and copies that fail
(mutation review survivors: a test here fails on each mutant)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.hbm import HbmTier
from tests.support.arena import temp_arena
from tests.support.fake_hbm import ShmDevicePool
from tests.support.store import BLOCK, CLIENT, DIGEST, FP, OTHER_CLIENT, FakeClock, chain, put
from tests.unit.test_hbm_store import check_invariants, device_get, make_store


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(8 * BLOCK, BLOCK) as a:
        yield a


@pytest.fixture
def client(arena: Arena) -> Iterator[ArenaMapping]:
    m = ArenaMapping(str(arena.path), arena.size)
    yield m
    m.close()


@pytest.fixture
async def store(arena: Arena, clock: FakeClock) -> AsyncIterator[TieredStore]:
    hbm = HbmTier(2 * BLOCK, slab_bytes=BLOCK, pool_factory=ShmDevicePool)
    hbm.open()
    s = make_store(arena, hbm, clock)
    yield s
    await s.drain(clock() + 5)
    hbm.close()


def place(store: TieredStore) -> Any:
    assert store.hbm_place is not None
    return store.hbm_place


def gate(store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event,
                                                                        threading.Event]:
    """Hold the next copies in their worker thread until ``go`` is set."""
    assert store.hbm is not None
    real, started, go = store.hbm.copy_in, threading.Event(), threading.Event()

    def gated(items: Any) -> None:
        started.set()
        go.wait(5)
        real(items)

    monkeypatch.setattr(store.hbm, "copy_in", gated)
    return started, go


async def until(event: threading.Event) -> None:
    for _ in range(500):
        if event.is_set():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the copy never started")


async def test_an_hbm_hit_keeps_its_block_over_colder_ones(
        store: TieredStore, client: ArenaMapping, clock: FakeClock) -> None:
    """A device get that hits in hbm touches the block in the hbm policy: without it a
    block read at every step is evicted as if it were only read once, when it entered."""
    a, b, c = (chain(1, start=i) for i in range(3))
    for keys in (a, b, c):
        await put(store, client, keys)
    assert (await device_get(store, a))[1] == ["hbm"]
    clock.advance(1)
    assert (await device_get(store, b))[1] == ["hbm"]
    clock.advance(1)
    assert (await device_get(store, a))[1] == ["hbm"]      # a hit: now the warmest
    clock.advance(1)
    assert (await device_get(store, c))[1] == ["hbm"]      # the pool is full: evicts b
    assert set(place(store).entries) == {a[0], c[0]}
    check_invariants(store)


async def test_a_cancelled_waiter_does_not_cancel_the_copy_others_wait_for(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two gets wait for a third get's copy of the same blocks; one of them is cancelled
    (its engine went away). The other must still get the blocks from hbm: awaiting the
    shared copy unshielded cancels it for every waiter, and the innocent get fails."""
    keys = chain(2)
    await put(store, client, keys)
    started, go = gate(store, monkeypatch)
    copier = asyncio.ensure_future(store.prepare_get_device(CLIENT, DIGEST, FP, keys))
    await until(started)
    quitter = asyncio.ensure_future(store.prepare_get_device(OTHER_CLIENT, DIGEST, FP, keys))
    waiter = asyncio.ensure_future(store.prepare_get_device(77, DIGEST, FP, keys))
    await asyncio.sleep(0.01)
    quitter.cancel()
    await asyncio.sleep(0.01)
    go.set()
    lease1, _, devices1 = await copier
    lease3, _, devices3 = await waiter
    assert devices1 == devices3 == ["hbm", "hbm"]
    with pytest.raises(asyncio.CancelledError):
        await quitter
    await store.release_get(CLIENT, lease1)
    await store.release_get(77, lease3)
    assert all(e.readers == 0 for e in place(store).entries.values())
    check_invariants(store)


async def test_a_cancelled_get_gives_back_its_hbm_hits(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device get that hit one block in hbm and is copying the next is cancelled: the
    hit's read-lock goes back too (no lease holds it), else the block stays pinned in
    hbm for good and the pool fills with slots nothing can evict."""
    keys = chain(2)
    await put(store, client, keys)
    assert (await device_get(store, keys[:1]))[1] == ["hbm"]
    started, go = gate(store, monkeypatch)
    task = asyncio.ensure_future(store.prepare_get_device(CLIENT, DIGEST, FP, keys))
    await until(started)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go.set()
    for _ in range(500):
        if all(e.ready for e in place(store).entries.values()):
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.01)
    assert [place(store).entries[k].readers for k in keys] == [0, 0]
    assert store.leases == {}
    check_invariants(store)


async def test_a_copied_chain_loses_its_tail_before_its_parent(
        store: TieredStore, client: ArenaMapping) -> None:
    """A chain read from hbm and released is shortened from its tail under pressure
    (``touch_chain``'s rule, which ``_settle`` follows by inserting tail first): evicting
    the head keeps a tail whose prefix must be copied again before it is any use, and
    the next copy of the head then evicts that tail."""
    keys = chain(2)
    other = chain(1, start=5)
    await put(store, client, keys)
    await put(store, client, other)
    assert (await device_get(store, keys))[1] == ["hbm", "hbm"]
    assert (await device_get(store, other))[1] == ["hbm"]
    assert set(place(store).entries) == {keys[0], other[0]}
    check_invariants(store)
