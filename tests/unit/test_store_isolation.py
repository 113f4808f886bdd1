# ruff: noqa: F811  (the fixtures of tests/unit/test_store.py are imported by name)
"""TieredStore in-process: expired leases never produce wrong bytes, namespaces are enforced.

Same real arena, nvme tier and fake clock as tests/unit/test_store.py (its fixtures and
helpers are reused). The daemon-level versions of these checks, with real client processes
that stall, are tests/integration/test_lease_expiry.py and test_namespace_isolation.py.
"""

from __future__ import annotations

import pytest

from kvtier.errors import LeaseError, LeaseExpired
from kvtier.keys import block_keys
from kvtier.store import TieredStore
from kvtier.tiers.arena_mapping import ArenaMapping
from tests.support.store import (  # noqa: F401 - fixtures
    ARENA_BLOCKS,
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    LAYOUT,
    OTHER_CLIENT,
    TTL,
    FakeClock,
    arena,
    chain,
    client,
    clock,
    get,
    nvme,
    payload,
    put,
    store,
)


# -- leases ----------------------------------------------------------------------------------
async def test_a_commit_past_the_deadline_fails_before_the_sweep_and_stores_nothing(
        store: TieredStore, client: ArenaMapping, clock: FakeClock) -> None:
    keys = chain(2)
    lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, keys)
    for key, off in zip(keys, offsets, strict=True):
        assert off is not None
        client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    clock.advance(TTL)  # no sweep ran: the deadline alone decides
    with pytest.raises(LeaseExpired, match="nothing was stored"):
        await store.commit_put(CLIENT, lease)
    assert len(store.index) == 0 and store.requests.lease_expired == 1
    # the commit says the copy is over: nothing to quarantine, the slots are free again
    assert store.quarantine.slots == 0 and store.arena.used_bytes == 0
    with pytest.raises(LeaseError):  # used once: the expiry is reported once
        await store.commit_put(CLIENT, lease)


async def test_quarantined_slots_are_never_handed_to_another_client(
        store: TieredStore, client: ArenaMapping, clock: FakeClock) -> None:
    slow = chain(2, start=1)
    lease, slow_offsets = await store.prepare_put(CLIENT, DIGEST, FP, slow)
    clock.advance(TTL)
    assert store.expire_leases() == 1
    # another client fills the arena: it gets the other slots and nothing more
    others = chain(ARENA_BLOCKS, start=2)
    got = await put(store, client, others, owner=OTHER_CLIENT)
    assert set(got) - {None} and not set(got) & set(slow_offsets)
    assert got.count(None) == 2   # two slots stay quarantined, nothing else to evict
    # the slow writer's late writes land in its quarantined slots only
    for off in slow_offsets:
        assert off is not None
        client.view(off, BLOCK, writable=True)[:] = 0xAB
    stored = [k for k, off in zip(others, got, strict=True) if off is not None]
    assert await get(store, client, stored, owner=OTHER_CLIENT) == [payload(k) for k in stored]
    with pytest.raises(LeaseExpired):
        await store.commit_put(CLIENT, lease)
    assert (await store.lookup(DIGEST, FP, slow)).hits == 0
    # its connection closes: the slots go back to the allocator
    store.release_owner(CLIENT)
    assert store.quarantine.slots == 0
    rest = [k for k, off in zip(others, got, strict=True) if off is None]
    assert None not in await put(store, client, rest, owner=OTHER_CLIENT)


async def test_a_release_past_the_deadline_says_the_bytes_may_be_wrong(
        store: TieredStore, client: ArenaMapping, clock: FakeClock) -> None:
    keys = chain(2)
    await put(store, client, keys)
    before, _ = await store.prepare_get(CLIENT, DIGEST, FP, keys)
    swept, _ = await store.prepare_get(CLIENT, DIGEST, FP, keys)
    clock.advance(TTL)
    with pytest.raises(LeaseExpired, match="must be discarded"):
        await store.release_get(CLIENT, before)           # past the deadline, not swept yet
    assert store.expire_leases() == 1
    with pytest.raises(LeaseExpired):
        await store.release_get(CLIENT, swept)            # swept
    assert all(store.index[k].readers == 0 for k in keys)
    assert store.quarantine.slots == 0              # reads quarantine nothing
    assert store.requests.lease_expired == 2


async def test_an_abort_past_the_deadline_is_quiet_and_ends_the_quarantine(
        store: TieredStore, clock: FakeClock) -> None:
    """A late abort (or commit) is the client saying it stopped writing into the lease's
    slots: they go back at once, swept or not; another lease's stay quarantined."""
    late, _ = await store.prepare_put(CLIENT, DIGEST, FP, chain(1))
    swept, _ = await store.prepare_put(CLIENT, DIGEST, FP, chain(1, start=1))
    await store.prepare_put(CLIENT, DIGEST, FP, chain(1, start=2))   # never committed
    clock.advance(TTL)
    store.abort_put(CLIENT, late)
    store.expire_leases()
    assert store.quarantine.slots == 2
    store.abort_put(CLIENT, swept)
    assert len(store.index) == 0 and store.quarantine.slots == 1
    assert store.arena.used_bytes == store.quarantine.bytes > 0   # the silent one's
    store.release_owner(CLIENT)
    assert store.quarantine.slots == 0 and store.arena.used_bytes == 0


async def test_expired_ids_are_forgotten_when_the_connection_closes(
        store: TieredStore, clock: FakeClock) -> None:
    lease, _ = await store.prepare_put(CLIENT, DIGEST, FP, chain(1))
    clock.advance(TTL)
    store.expire_leases()
    store.release_owner(CLIENT)
    with pytest.raises(LeaseError) as info:
        await store.commit_put(CLIENT, lease)
    assert type(info.value) is LeaseError


# -- namespaces ------------------------------------------------------------------------------
async def test_stolen_keys_of_another_namespace_are_misses_and_never_deleted(
        store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(3)
    await put(store, client, keys, durable=True)     # on cpu and nvme
    thief = store.register_namespace(LAYOUT, "test/model", 0, 1, "another-tenant")
    t_digest = thief.digest
    assert (await store.lookup(t_digest, FP, keys)).hits == 0
    lease, offsets = await store.prepare_get(OTHER_CLIENT, t_digest, FP, keys)
    assert offsets == []
    await store.release_get(OTHER_CLIENT, lease)
    assert await store.delete(t_digest, FP, keys) == 0
    assert store.requests.namespace_mismatch == 1 + 1 + 3  # lookup and get stop at the first
    assert await get(store, client, keys) == [payload(k) for k in keys]
    # its own keys (same tokens, its namespace) are its own blocks
    own = block_keys(thief, list(range(3 * LAYOUT.tokens_per_block)))
    assert not set(own) & set(keys)


async def test_a_larger_block_size_never_reads_a_smaller_block(
        store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(2)
    await put(store, client, keys)
    big = LAYOUT.__class__(num_layers=4, num_kv_heads=1, head_dim=8, dtype="float16",
                           tokens_per_block=128)
    ns = store.register_namespace(big, "test/model", 0, 1, None)
    assert (await store.lookup(ns.digest, big.fingerprint, keys)).hits == 0
    lease, offsets = await store.prepare_get(CLIENT, ns.digest, big.fingerprint, keys)
    assert offsets == []
    await store.release_get(CLIENT, lease)
    assert store.requests.namespace_mismatch == 2
    # a block of the caller's namespace whose recorded size is not the layout's is a miss
    store.index[keys[0]].nbytes = BLOCK // 2
    assert (await store.lookup(DIGEST, FP, keys)).hits == 0
    assert store.requests.layout_mismatch == 1
