"""Orphans in use when their parent went (``kvtier.store.blocks``), pinned where the
mutation review found no test: a pending orphan whose parent is stored again meanwhile
rejoins the forest (reachable, bytes exact, and orphaned again when that parent goes)
instead of being dropped at the next sweep."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from kvtier.policy.prefix import PrefixForest
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.nvme import NvmeTier
from tests.support.arena import temp_arena
from tests.support.store import (
    BLOCK,
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

ROOMY = 8   # arena blocks: no eviction in these tests, only deletes make orphans


@pytest.fixture
def roomy_arena() -> Iterator[Arena]:
    with temp_arena(ROOMY * BLOCK, BLOCK) as a:
        yield a


@pytest.fixture
def forest() -> PrefixForest:
    return PrefixForest()


@pytest.fixture
async def fstore(roomy_arena: Arena, nvme: NvmeTier, clock: FakeClock,
                 forest: PrefixForest) -> AsyncIterator[TieredStore]:
    """The bench's store with a prefix forest, as the daemon wires it (orphans collected)."""
    s = TieredStore(roomy_arena, nvme=nvme, eviction="lru", lease_ttl_s=TTL,
                    prefetch_wait="wait", clock=clock, forest=forest)
    assert s.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    yield s
    await s.drain(clock() + 5)


@pytest.fixture
def rclient(roomy_arena: Arena) -> Iterator[ArenaMapping]:
    m = ArenaMapping(str(roomy_arena.path), roomy_arena.size)
    yield m
    m.close()


async def hits(store: TieredStore, keys: list[bytes]) -> int:
    return (await store.lookup(DIGEST, FP, keys, prefetch=False)).hits


async def test_a_pending_orphan_whose_parent_is_stored_again_rejoins_the_forest(
        fstore: TieredStore, rclient: ArenaMapping, forest: PrefixForest,
        roomy_arena: Arena) -> None:
    """Chain A-B-C; C is read (a get lease) when B is deleted, so C waits as a pending
    orphan. B is then stored again under A. When the sweep runs after C's read ended, C's
    parent is back: C must rejoin the forest and stay readable with its exact bytes, not
    be dropped (and erased) as if it were still unreachable. Having rejoined, it is
    orphaned again (and dropped) when B goes a second time."""
    a, b, c = keys = chain(3)
    await put(fstore, rclient, keys)
    lease, _ = await fstore.prepare_get(OTHER_CLIENT, DIGEST, FP, [c])
    assert await fstore.delete(DIGEST, FP, [b]) == 1
    assert c in fstore.index and c not in forest       # waiting: in use, unreachable
    assert await hits(fstore, keys) == 1
    offsets = await put(fstore, rclient, [a, b])       # B stored again under A
    assert offsets[0] is None and offsets[1] is not None
    await fstore.release_get(OTHER_CLIENT, lease)
    assert fstore.retry_orphans() == 0                 # nothing dropped: C is reachable
    assert c in forest and forest.parent(c) == b
    assert not fstore.blocks.pending
    assert await hits(fstore, keys) == 3
    assert await get(fstore, rclient, keys) == [payload(k) for k in keys]
    assert roomy_arena.used_bytes == 3 * BLOCK
    # rejoined for real: B deleted again orphans C at once (C is not in use now)
    assert await fstore.delete(DIGEST, FP, [b]) == 1
    assert c not in fstore.index and await hits(fstore, [c]) == 0
    assert roomy_arena.used_bytes == BLOCK


async def test_a_stale_pending_entry_of_a_parent_stored_again_does_not_drop_its_child(
        fstore: TieredStore, rclient: ArenaMapping, forest: PrefixForest,
        roomy_arena: Arena) -> None:
    """Chain H-M-P-Y. Y is read while P goes (Y pending); P is stored again, then read
    while M goes, so P's entry is pending too; P's read ends and P is deleted and stored
    anew before any sweep. ``pending`` still holds P's old entry, but P is back: Y must
    rejoin under it, not be dropped because a stale entry of its parent's key waits."""
    h, m, p, y = keys = chain(4)
    await put(fstore, rclient, keys)
    lease_y, _ = await fstore.prepare_get(OTHER_CLIENT, DIGEST, FP, [y])
    assert await fstore.delete(DIGEST, FP, [p]) == 1
    await put(fstore, rclient, [h, m, p])
    lease_p, _ = await fstore.prepare_get(OTHER_CLIENT + 1, DIGEST, FP, [p])
    assert await fstore.delete(DIGEST, FP, [m]) == 1
    await fstore.release_get(OTHER_CLIENT + 1, lease_p)
    assert await fstore.delete(DIGEST, FP, [p]) == 1
    stale = fstore.blocks.pending.get(p)
    assert stale is not None and p not in fstore.index   # P's old entry waits
    await put(fstore, rclient, [h, m, p])
    assert fstore.index.get(p) is not stale
    await fstore.release_get(OTHER_CLIENT, lease_y)
    assert fstore.retry_orphans() == 0
    assert y in forest and forest.parent(y) == p
    assert await hits(fstore, keys) == 4
    assert await get(fstore, rclient, keys) == [payload(k) for k in keys]
    assert roomy_arena.used_bytes == 4 * BLOCK
