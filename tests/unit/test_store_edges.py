"""Edges of the store's reads and writes a mutation review found no test pinned: a put's
``max_new`` on a full arena, a chain piece's parent, a durable commit behind a block that
did not reach nvme, the tier a lookup reports for a block being promoted, and the read lock
of a get that could not promote, and a put naming a key twice."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.index import SlotState
from kvtier.store import TieredStore
from kvtier.store.demotion import Demoter
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.nvme import NvmeTier
from tests.support.store import ARENA_BLOCKS, CLIENT, DIGEST, FP, chain, get, put


async def test_max_new_gets_that_many_slots_on_a_full_arena(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    """``max_new`` caps a put's new slots at that many, not one fewer, also when the arena
    is full and each slot is made by evicting (the daemon's put share hands it out)."""
    await put(store, client, chain(ARENA_BLOCKS, start=100))   # the arena full
    keys = chain(3)
    _, offsets = await store.prepare_put(CLIENT, DIGEST, FP, keys, max_new=2)
    assert [o is not None for o in offsets] == [True, True, False]
    _, offsets = await store.prepare_put(CLIENT, DIGEST, FP, chain(2, start=50), max_new=1)
    assert [o is not None for o in offsets] == [True, False]


async def test_a_piece_of_a_chain_keeps_its_parent(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    """A put of a chain's second piece (``parent``, ``depth``) links its first block to
    the parent: what the frames on nvme record, and what recovery and orphan collection
    walk (a piece stored as a chain head outlived its prefix)."""
    keys = chain(3)
    await put(store, client, keys[:1])
    lease, _ = await store.prepare_put(CLIENT, DIGEST, FP, keys[1:], parent=keys[0], depth=1)
    assert await store.commit_put(CLIENT, lease) == 2
    assert [store.index[k].parent for k in keys[1:]] == keys[:2]
    assert [store.index[k].depth for k in keys] == [0, 1, 2]


async def test_a_durable_commit_counts_no_block_behind_one_not_on_nvme(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The nvme write of a chain's middle block fails: the blocks after it are not durable
    (a cold start erases frames no chain head leads to), so the commit counts the first
    block only."""
    keys = chain(3)
    real = Demoter.persist

    async def refuse_middle(self: Demoter, meta: Any, *, sync: bool = False) -> bool:
        return False if meta.key == keys[1] else await real(self, meta, sync=sync)

    monkeypatch.setattr(Demoter, "persist", refuse_middle)
    lease, _ = await store.prepare_put(CLIENT, DIGEST, FP, keys)
    assert await store.commit_put(CLIENT, lease, durable=True) == 1


async def test_a_block_being_promoted_is_reported_in_cpu(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    """A lookup while a block's promotion nvme -> cpu is in flight reports it in the cpu
    tier (the connector weighs reload against recompute by tier: "nvme" for a block about
    to be in the arena made it look slower than it is) and starts no second promotion."""
    old = chain(1)
    await put(store, client, old)
    await put(store, client, chain(ARENA_BLOCKS, start=1))   # old -> nvme
    assert (await store.lookup(DIGEST, FP, old)).tiers == ["nvme"]
    assert store.index[old[0]].cpu_state is SlotState.LOADING
    issued = store.prefetch.issued
    assert (await store.lookup(DIGEST, FP, old)).tiers == ["cpu"]
    assert store.prefetch.issued == issued


async def test_a_get_that_cannot_promote_leaves_the_block_unpinned(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    """A get finds a block on nvme but no room in the arena (every slot read-leased): it
    serves nothing and leaves no read lock behind, so the block can be deleted (and later
    evicted) as any other."""
    old, new = chain(1), chain(ARENA_BLOCKS, start=1)
    await put(store, client, old)
    await put(store, client, new)              # old -> nvme
    held, _ = await store.prepare_get(CLIENT, DIGEST, FP, new)   # the whole arena pinned
    assert await store.prepare_get(CLIENT, DIGEST, FP, old) == (held + 1, [])
    await store.release_get(CLIENT, held)
    assert store.index[old[0]].readers == 0
    assert await store.delete(DIGEST, FP, old) == 1
    assert old[0] not in store.index
    assert await get(store, client, new) != []


async def test_a_put_naming_a_key_twice_takes_one_slot(
        store: TieredStore, client: ArenaMapping) -> None:
    """A put whose keys name one block twice (a client's bug, or a hostile one) gets a
    slot for its first occurrence only: a second slot would be written under a key the
    index maps to the other, reachable by no lookup and never freed (the arena shrinks by
    a slot per such put)."""
    k = chain(1)[0]
    lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, [k, k])
    assert offsets[0] is not None and offsets[1] is None
    await store.commit_put(CLIENT, lease)
    assert store.index[k].in_cpu
