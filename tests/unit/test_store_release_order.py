"""A get's read-locks are given back a chain's tail first, so a recency policy shortens the
chain from its tail (``touch_chain``'s rule). Given back head first, LRU took the head as
the least recent block of the chain: its descendants stayed in the arena, unreachable by
any prefix lookup, while the block every one of them needs went to a lower tier."""

from __future__ import annotations

import pytest

from kvtier.store import TieredStore, leasing
from kvtier.tiers.arena_mapping import ArenaMapping
from tests.support.store import CLIENT, DIGEST, FP, TTL, FakeClock, chain, get, put


def in_cpu(store: TieredStore, keys: list[bytes]) -> list[bool]:
    return [(m := store.index.get(k)) is not None and m.in_cpu for k in keys]


async def test_a_released_chain_loses_its_tail_first(store: TieredStore,
                                                     client: ArenaMapping) -> None:
    """Arena of 4 blocks, LRU: a 3-block chain read and released, then 2 new blocks need
    one slot: the tail leaves the arena, the head and middle stay."""
    keys = chain(3)
    await put(store, client, keys)
    assert await get(store, client, keys)
    await put(store, client, chain(2, start=7))
    assert in_cpu(store, keys) == [True, True, False]


async def test_an_expired_get_lease_gives_back_its_chain_tail_first(
        store: TieredStore, client: ArenaMapping, clock: FakeClock) -> None:
    """The same order when the lease is not released but expires (its owner stalled)."""
    keys = chain(3)
    await put(store, client, keys)
    await store.prepare_get(CLIENT, DIGEST, FP, keys)
    clock.advance(TTL + 1)
    assert store.expire_leases() == 1
    await put(store, client, chain(2, start=7))
    assert in_cpu(store, keys) == [True, True, False]


async def test_a_release_in_pieces_gives_back_the_last_piece_first(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long chain is unpinned a piece at a time (the loop takes turns between pieces):
    the pieces too go tail first, else each piece's head ends older than the piece before."""
    monkeypatch.setattr(leasing, "RELEASE_PIECE", 1)
    keys = chain(3)
    await put(store, client, keys)
    assert await get(store, client, keys)
    await put(store, client, chain(2, start=7))
    assert in_cpu(store, keys) == [True, True, False]
