"""Long requests take turns on the event loop (kvtier.store.slices), and what they leave is
the same as when they ran in one go.

Each test shortens the turn to nothing (``SLICE_S = 0``), so a request over many blocks
pauses at every check; a competitor task counts how often it ran meanwhile. Without the
pauses a request that meets no other await finishes before the competitor runs once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import pytest

from kvtier.index import SlotState
from kvtier.store import TieredStore, slices
from kvtier.store.reads import touch_chain_in_turns
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from tests.support.arena import temp_arena
from tests.support.store import (
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    OTHER_CLIENT,
    chain,
    payload,
    put,
)

T = TypeVar("T")
N = 1024   # blocks per long request: N / CHECK_EVERY checks, each a pause here


@pytest.fixture
def arena() -> Iterator[Arena]:
    """Room for two long chains (the shared store and client fixtures map this arena)."""
    with temp_arena(2 * N * BLOCK, BLOCK) as a:
        yield a


@pytest.fixture(autouse=True)
def no_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slices, "SLICE_S", 0.0)


async def interleaved(request: Awaitable[T]) -> tuple[T, int]:
    """Run ``request``; its result and how many times a competing task ran meanwhile."""
    task = asyncio.ensure_future(request)
    turns = 0
    while not task.done():
        await asyncio.sleep(0)
        turns += 1
    return await task, turns


def min_turns() -> int:
    return N // slices.CHECK_EVERY // 2


async def test_lookup_get_release_and_delete_of_a_long_chain_take_turns(
        store: TieredStore, client: ArenaMapping, arena: Arena) -> None:
    keys = chain(N)
    await put(store, client, keys)
    found, turns = await interleaved(store.lookup(DIGEST, FP, keys))
    assert found.hits == N and turns >= min_turns()
    (lease, offsets), turns = await interleaved(store.prepare_get(CLIENT, DIGEST, FP, keys))
    assert len(offsets) == N and turns >= min_turns()
    for key, off in zip(keys[::97], offsets[::97], strict=True):
        assert bytes(client.view(off, BLOCK, writable=False)) == payload(key)
    _, turns = await interleaved(store.release_get(CLIENT, lease))
    assert turns >= 1 and all(store.index[k].readers == 0 for k in keys)
    deleted, turns = await interleaved(store.delete(DIGEST, FP, keys))
    assert deleted == N and turns >= min_turns()
    assert not any(k in store.index for k in keys)
    assert arena.used_bytes == 0


async def test_put_of_a_long_chain_takes_turns(store: TieredStore,
                                               client: ArenaMapping) -> None:
    keys = chain(N)
    (lease, offsets), turns = await interleaved(store.prepare_put(CLIENT, DIGEST, FP, keys))
    assert None not in offsets and turns >= 2
    for key, off in zip(keys, offsets, strict=True):
        assert off is not None
        client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    stored, turns = await interleaved(store.commit_put(CLIENT, lease))
    assert stored == N and turns >= min_turns()
    assert all(store.index[k].cpu_state is SlotState.READY for k in keys)
    assert (await store.lookup(DIGEST, FP, keys)).hits == N


async def test_overlapping_puts_that_pause_place_each_block_once(
        store: TieredStore, client: ArenaMapping) -> None:
    """Two puts of overlapping chains, interleaved at every batch: a key is placed by one
    of them only (the other gets None for it), and every committed block reads back."""
    a, b = chain(N), chain(N)[N // 2:] + chain(N // 2, start=7)
    (la, oa), (lb, ob) = await asyncio.gather(
        store.prepare_put(CLIENT, DIGEST, FP, a), store.prepare_put(OTHER_CLIENT, DIGEST, FP, b))
    placed_a = {k: o for k, o in zip(a, oa, strict=True) if o is not None}
    placed_b = {k: o for k, o in zip(b, ob, strict=True) if o is not None}
    assert not placed_a.keys() & placed_b.keys()   # no key has two slots
    assert placed_a.keys() | placed_b.keys() == set(a) | set(b)
    assert len(set(placed_a.values()) | set(placed_b.values())) == len(set(a) | set(b))
    for key, off in [*placed_a.items(), *placed_b.items()]:
        client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    assert sum(await asyncio.gather(store.commit_put(CLIENT, la),
                                    store.commit_put(OTHER_CLIENT, lb))) == len(set(a) | set(b))
    lease, offsets = await store.prepare_get(CLIENT, DIGEST, FP, b)
    assert len(offsets) == len(b)
    for key, off in zip(b, offsets, strict=True):
        assert bytes(client.view(off, BLOCK, writable=False)) == payload(key)
    await store.release_get(CLIENT, lease)


async def test_delete_that_pauses_skips_blocks_read_meanwhile(
        store: TieredStore, client: ArenaMapping) -> None:
    """A get that takes the chain's head while a delete of the chain pauses keeps what it
    leased; the delete removes the rest."""
    keys = chain(N)
    await put(store, client, keys)
    deleting = asyncio.ensure_future(store.delete(DIGEST, FP, keys))
    await asyncio.sleep(0)   # the delete has started (tail first) and paused
    assert not deleting.done()
    lease, offsets = await store.prepare_get(OTHER_CLIENT, DIGEST, FP, keys[:8])
    deleted = await deleting
    assert len(offsets) == 8 and deleted == N - 8
    for key, off in zip(keys[:8], offsets, strict=True):
        assert bytes(client.view(off, BLOCK, writable=False)) == payload(key)
    await store.release_get(OTHER_CLIENT, lease)


class _Recorder:
    """A policy that records the keys it is told were used."""

    def __init__(self) -> None:
        self.touched: list[bytes] = []

    def touch(self, key: bytes, *, now: float = 0.0) -> None:
        self.touched.append(key)


async def test_a_long_chain_is_touched_tail_first_in_turns() -> None:
    """A lookup or get touches its whole chain: 131,072 one-token blocks held the event
    loop for 200 ms in one piece (found by review)."""
    keys = chain(N)
    policy = _Recorder()
    _, turns = await interleaved(touch_chain_in_turns(
        policy, keys, 0.0, slices.Turn()))   # type: ignore[arg-type]
    assert policy.touched == keys[::-1] and turns >= min_turns()
