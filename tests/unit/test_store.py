"""TieredStore in-process: a real shared-memory Arena and a real NvmeTier on tmp_path.

Time is a fake clock (leases expire when the test says so); prefetch waits for completion
(``prefetch_wait="wait"``) so nothing depends on how fast the disk answers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import (
    LayoutMismatch,
    LeaseError,
    LeaseExpired,
    ProtocolError,
    UnknownNamespace,
)
from kvtier.index import SlotState
from kvtier.keys import Namespace, block_keys
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.base import EvictionReason
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.slab import PAGE
from tests.support.store import (
    ARENA_BLOCKS,
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    NVME_BLOCKS,
    OTHER_CLIENT,
    TTL,
    FakeClock,
    chain,
    get,
    nvme_corrupt_payload,
    payload,
    put,
)


# -- put / commit / get ----------------------------------------------------------------------
async def test_put_commit_get_round_trip(store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(3)
    offsets = await put(store, client, keys)
    assert None not in offsets and len(set(offsets)) == 3
    result = await store.lookup(DIGEST, FP, keys)
    assert (result.hits, result.tiers) == (3, ["cpu"] * 3)
    assert await get(store, client, keys) == [payload(k) for k in keys]
    assert store.arena.used_bytes == 3 * BLOCK
    assert store.cpu.blocks == 3
    stats = store.stats()
    assert stats["requests"]["put_blocks"] == 3
    assert stats["requests"]["get_blocks"] == 3
    assert stats["tiers"]["cpu"]["bytes_written"] == 3 * BLOCK
    assert stats["leases"]["active"] == 0


async def test_uncommitted_put_is_invisible(store: TieredStore) -> None:
    keys = chain(2)
    lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, keys)
    assert None not in offsets
    assert (await store.lookup(DIGEST, FP, keys)).hits == 0
    assert await store.prepare_get(CLIENT, DIGEST, FP, keys) == (lease + 1, [])
    assert await store.commit_put(CLIENT, lease) == 2
    assert (await store.lookup(DIGEST, FP, keys)).hits == 2


async def test_a_key_being_written_or_stored_is_not_leased_twice(
        store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(2)
    _, first = await store.prepare_put(CLIENT, DIGEST, FP, keys)
    _, second = await store.prepare_put(OTHER_CLIENT, DIGEST, FP, keys)
    assert None not in first and second == [None, None]
    other = chain(1, start=5)
    assert (await put(store, client, other)) != [None]
    assert (await put(store, client, other)) == [None]


async def test_abort_put_frees_the_slots(store: TieredStore) -> None:
    lease, _ = await store.prepare_put(CLIENT, DIGEST, FP, chain(3))
    store.abort_put(CLIENT, lease)
    assert (store.arena.used_bytes, len(store.index), store.leases) == (0, 0, {})
    with pytest.raises(LeaseError):
        await store.commit_put(CLIENT, lease)


async def test_lookup_stops_at_the_first_missing_block(store: TieredStore,
                                                      client: ArenaMapping) -> None:
    keys = chain(3)
    await put(store, client, [keys[0], keys[2]])
    assert (await store.lookup(DIGEST, FP, keys)).hits == 1
    assert await get(store, client, keys) == [payload(keys[0])]
    assert store.cpu.counters.miss_blocks == 1


# -- leases ----------------------------------------------------------------------------------
async def test_put_lease_expires_with_the_clock(store: TieredStore, clock: FakeClock) -> None:
    lease, _ = await store.prepare_put(CLIENT, DIGEST, FP, chain(2))
    clock.advance(TTL - 0.001)
    assert store.expire_leases() == 0
    clock.advance(0.001)
    assert store.expire_leases() == 1
    # the blocks are gone, the slots quarantined (the client may still write into them) ...
    assert len(store.index) == 0 and store.arena.used_bytes == store.quarantine.bytes > 0
    assert store.requests.lease_expired == 1
    with pytest.raises(LeaseExpired):
        await store.commit_put(CLIENT, lease)
    # ... until its connection closes
    store.release_owner(CLIENT)
    assert (store.arena.used_bytes, store.quarantine.bytes, store.quarantine.slots) == (0, 0, 0)


async def test_expired_get_lease_unpins_its_blocks(store: TieredStore, client: ArenaMapping,
                                                   clock: FakeClock) -> None:
    held = chain(ARENA_BLOCKS)
    await put(store, client, held)
    lease, offsets = await store.prepare_get(CLIENT, DIGEST, FP, held)
    assert len(offsets) == ARENA_BLOCKS
    assert all(store.index[k].readers == 1 for k in held)
    clock.advance(TTL)
    assert store.expire_leases() == 1
    assert all(store.index[k].readers == 0 for k in held)
    with pytest.raises(LeaseError):
        await store.release_get(CLIENT, lease)
    assert await put(store, client, chain(1, start=9)) != [None]  # something could be evicted


async def test_a_lease_belongs_to_its_owner_and_kind(store: TieredStore,
                                                    client: ArenaMapping) -> None:
    keys = chain(1)
    lease, _ = await store.prepare_put(CLIENT, DIGEST, FP, keys)
    with pytest.raises(LeaseError):
        await store.commit_put(OTHER_CLIENT, lease)
    with pytest.raises(LeaseError):
        await store.release_get(CLIENT, lease)
    with pytest.raises(LeaseError):
        await store.commit_put(CLIENT, lease + 100)
    assert await store.commit_put(CLIENT, lease) == 1  # still valid for its owner
    with pytest.raises(LeaseError):
        await store.commit_put(CLIENT, lease)  # used once


async def test_release_owner_aborts_puts_and_releases_reads(
        store: TieredStore, client: ArenaMapping) -> None:
    stored = chain(2)
    await put(store, client, stored)
    get_lease, _ = await store.prepare_get(CLIENT, DIGEST, FP, stored)
    _, _ = await store.prepare_put(CLIENT, DIGEST, FP, chain(1, start=1))
    other_lease, _ = await store.prepare_put(OTHER_CLIENT, DIGEST, FP, chain(1, start=2))
    assert store.release_owner(CLIENT) == 2
    assert all(store.index[k].readers == 0 for k in stored)
    assert chain(1, start=1)[0] not in store.index
    assert list(store.leases) == [other_lease]
    assert await store.commit_put(OTHER_CLIENT, other_lease) == 1
    assert store.release_owner(CLIENT) == 0
    with pytest.raises(LeaseError):
        await store.release_get(CLIENT, get_lease)


# -- eviction and promotion ------------------------------------------------------------------
async def test_full_arena_demotes_lru_blocks_to_nvme(store: TieredStore, nvme: NvmeTier,
                                                     client: ArenaMapping) -> None:
    keys = chain(ARENA_BLOCKS + 2)
    for k in keys:  # one put per block: LRU order is the put order
        assert await put(store, client, [k]) != [None]
    assert store.arena.used_bytes == ARENA_BLOCKS * BLOCK
    assert [store.index[k].where for k in keys] == ["nvme"] * 2 + ["cpu"] * ARENA_BLOCKS
    assert nvme.blocks == 2
    assert store.cpu.counters.evictions[EvictionReason.CAPACITY.value] == 2
    assert store.bytes_moved[("cpu", "nvme")] == 2 * BLOCK
    result = await store.lookup(DIGEST, FP, keys, prefetch=False)
    assert (result.hits, result.tiers) == (6, ["nvme"] * 2 + ["cpu"] * ARENA_BLOCKS)


async def test_a_full_nvme_tier_that_evicts_to_make_room_counts_no_allocation_failure(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    """A full tier that evicts is a cache's normal state: ``allocation_failures`` (which
    the KVTierAllocationFailures alert reads) counts only an allocation eviction could not
    satisfy. Each tier attempt before an eviction used to count one."""
    keys = chain(ARENA_BLOCKS + NVME_BLOCKS + 5)
    for k in keys:
        assert await put(store, client, [k]) != [None]
    assert nvme.blocks == NVME_BLOCKS
    assert nvme.counters.evictions[EvictionReason.CAPACITY.value] == 5
    assert nvme.counters.allocation_failures == 0
    assert store.cpu.counters.allocation_failures == 0


async def test_a_block_being_promoted_is_not_evicted_from_nvme_by_its_own_room(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    """Promoting X needs an arena slot; evicting for it demotes a cpu-only block to a full
    nvme tier, whose eviction picked X itself (the oldest there): X was gone from every
    tier, read by nobody (found by a crash/fuzz reviewer). X is busy from the start."""
    x = chain(1, start=500)[0]
    assert await put(store, client, [x]) != [None]
    for i in range(ARENA_BLOCKS + NVME_BLOCKS - 1):           # X is the oldest on nvme
        assert await put(store, client, chain(1, start=600 + i)) != [None]
    assert store.index[x].where == "nvme" and nvme.used_bytes == nvme.capacity_bytes
    residency = store.nvme_residency
    assert residency is not None

    class XFirst:
        """The nvme policy, offering X first (a choice a policy may well make)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def victim(self) -> Any:
            pinned = store.index[x].nvme_busy
            return x if x in self.inner and not pinned else self.inner.victim()

        def __contains__(self, key: object) -> bool:
            return key in self.inner

        def __len__(self) -> int:
            return len(self.inner)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    residency.policy = XFirst(residency.policy)
    result = await store.lookup(DIGEST, FP, [x], prefetch=True)
    assert result.hits == 1
    data = await get(store, client, [x])
    assert data == [payload(x)]
    # nvme evicted another block for the demotion, and X may be evicted again later
    assert nvme.counters.evictions[EvictionReason.CAPACITY.value] >= 1
    assert not store.index[x].nvme_busy


async def test_a_victim_whose_demotion_fails_stays_evictable(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch eviction takes its victims out of the policy first; one whose write to nvme
    raised stayed in the arena but out of the policy, never evictable again."""
    held = chain(ARENA_BLOCKS)
    for k in held:
        assert await put(store, client, [k]) != [None]

    async def broken(self: object, meta: object, *, sync: bool = False) -> bool:
        raise RuntimeError("nvme write path broke")

    monkeypatch.setattr(type(store.demoter), "persist", broken)
    with pytest.raises(RuntimeError):
        await put(store, client, chain(2, start=900))   # evicts 2 at once
    assert all(k in store.cpu.policy for k in held if store.index[k].in_cpu)
    monkeypatch.undo()
    assert await put(store, client, chain(2, start=900)) != [None, None]


async def test_lookup_promotes_nvme_blocks_back_into_the_arena(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    old, new = chain(2), chain(ARENA_BLOCKS, start=1)
    await put(store, client, old)
    await put(store, client, new)  # pushes `old` down to nvme
    assert [store.index[k].where for k in old] == ["nvme", "nvme"]
    result = await store.lookup(DIGEST, FP, old)
    assert result.tiers == ["nvme", "nvme"]
    assert store.prefetch.issued == 2
    assert await get(store, client, old) == [payload(k) for k in old]
    assert all(store.index[k].in_cpu for k in old)
    assert store.prefetch.hit_before_use == 2
    assert store.bytes_moved[("nvme", "cpu")] == 2 * BLOCK
    assert nvme.counters.bytes_read >= 2 * BLOCK
    assert nvme.counters.checksum_failures == 0


async def test_get_promotes_without_a_lookup(store: TieredStore, client: ArenaMapping) -> None:
    old = chain(1)
    await put(store, client, old)
    await put(store, client, chain(ARENA_BLOCKS, start=1))
    assert store.index[old[0]].where == "nvme"
    assert await get(store, client, old) == [payload(old[0])]
    assert store.prefetch.issued == 0


async def test_read_leased_blocks_are_never_evicted(store: TieredStore,
                                                    client: ArenaMapping) -> None:
    held = chain(ARENA_BLOCKS)
    await put(store, client, held)
    lease, _ = await store.prepare_get(CLIENT, DIGEST, FP, held)
    assert await put(store, client, chain(1, start=7)) == [None]
    assert store.cpu.counters.allocation_failures == 1
    assert all(store.index[k].in_cpu for k in held)
    await store.release_get(CLIENT, lease)
    assert await put(store, client, chain(1, start=7)) != [None]


async def test_durable_commit_writes_through_to_nvme(store: TieredStore, nvme: NvmeTier,
                                                     client: ArenaMapping) -> None:
    keys = chain(2)
    lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, keys)
    for key, off in zip(keys, offsets, strict=True):
        assert off is not None
        client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    assert await store.commit_put(CLIENT, lease, durable=True) == 2
    assert nvme.blocks == 2
    assert all(store.index[k].in_cpu and store.index[k].in_nvme for k in keys)


async def test_a_durable_commit_counts_only_blocks_a_cold_start_would_keep(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    """Its chain's ancestors and its keys stored before go to nvme with it (a cold start
    erases frames no head leads to); a commit below an ancestor in no tier counts 0."""
    keys = chain(4)
    await put(store, client, keys[:2])                        # the head: arena only
    lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, keys[1:], parent=keys[0],
                                             depth=1)
    assert offsets[0] is None                                 # keys[1] is stored already
    for key, off in zip(keys[1:], offsets, strict=True):
        if off is not None:
            client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    assert await store.commit_put(CLIENT, lease, durable=True) == 2
    assert nvme.blocks == 4 and all(store.index[k].in_nvme for k in keys)
    # below a parent the index does not hold: stored, written, but counted 0 durable
    orphan = chain(2, start=9)
    lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, orphan[1:], parent=orphan[0],
                                             depth=1)
    assert offsets[0] is not None
    client.view(offsets[0], BLOCK, writable=True)[:] = memoryview(payload(orphan[1]))
    assert await store.commit_put(CLIENT, lease, durable=True) == 0


# -- delete ----------------------------------------------------------------------------------
async def test_delete_removes_blocks_from_every_tier(store: TieredStore, nvme: NvmeTier,
                                                     client: ArenaMapping) -> None:
    old = chain(1)
    await put(store, client, old)
    await put(store, client, chain(ARENA_BLOCKS, start=1))
    cpu_key = chain(1, start=1)[0]
    assert store.index[old[0]].where == "nvme" and store.index[cpu_key].where == "cpu"
    assert await store.delete(DIGEST, FP, [old[0], cpu_key, b"\x00" * 16]) == 2
    assert old[0] not in store.index and cpu_key not in store.index
    assert nvme.blocks == 0
    assert (await store.lookup(DIGEST, FP, old)).hits == 0
    assert store.cpu.counters.evictions[EvictionReason.DELETED.value] == 1
    assert nvme.counters.evictions[EvictionReason.DELETED.value] == 1


def keys_after_a_crash(nvme: NvmeTier, tmp_path: Path) -> set[bytes]:
    """The keys a restart would adopt from a copy of the nvme directory as it is now."""
    shutil.copytree(nvme.root, tmp_path / "restart")
    again = NvmeTier(tmp_path / "restart", nvme.capacity_bytes, direct="off", io_threads=1)
    try:
        return {h.key for _, h in again.open()}
    finally:
        again.close()


async def test_a_deleted_key_leaves_no_evicted_frame_for_a_restart(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping, tmp_path: Path) -> None:
    """A block evicted from nvme leaves its frame on disk (the bytes are right: no write
    is spent on it); deleting its key later must erase that frame too, else the next start
    adopts the deleted block again."""
    gone, kept, evicted = chain(1, start=1), chain(1, start=2), chain(1, start=3)
    for keys in (gone, kept, evicted):   # nvme slots 0, 1, 2
        await put(store, client, keys, durable=True)
    residency = store.nvme_residency
    assert residency is not None
    for keys in (gone, evicted):          # what eviction does: the frames stay on disk
        residency.drop(store.index[keys[0]], EvictionReason.CAPACITY)
        assert not store.index[keys[0]].in_nvme and store.index[keys[0]].in_cpu
    assert await store.delete(DIGEST, FP, gone) == 1
    await nvme.erased()
    found = keys_after_a_crash(nvme, tmp_path)
    assert gone[0] not in found
    assert kept[0] in found and evicted[0] in found


async def test_an_evicted_frame_stays_named_until_a_new_frame_is_stored_in_its_slot(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot handed out again may keep its evicted frame: here the new frame's write fails
    (ENOSPC) before it reaches the disk. The old key's delete must still erase it."""
    gone = chain(1, start=1)
    await put(store, client, gone, durable=True)             # nvme slot 0
    residency = store.nvme_residency
    assert residency is not None
    residency.drop(store.index[gone[0]], EvictionReason.CAPACITY)   # the frame stays

    async def full_disk(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nvme, "write", full_disk)
    await put(store, client, chain(1, start=2), durable=True)   # gets slot 0, write fails
    monkeypatch.undo()
    assert await store.delete(DIGEST, FP, gone) == 1
    await nvme.erased()
    found = keys_after_a_crash(nvme, tmp_path)
    assert gone[0] not in found


async def test_delete_skips_blocks_in_use(store: TieredStore, client: ArenaMapping) -> None:
    read, writing = chain(1), chain(1, start=1)
    await put(store, client, read)
    lease, _ = await store.prepare_get(CLIENT, DIGEST, FP, read)
    await store.prepare_put(CLIENT, DIGEST, FP, writing)
    assert await store.delete(DIGEST, FP, read + writing) == 0
    assert store.index[read[0]].in_cpu
    assert store.index[writing[0]].cpu_state is SlotState.WRITING
    await store.release_get(CLIENT, lease)
    assert await store.delete(DIGEST, FP, read) == 1


# -- corruption ------------------------------------------------------------------------------
async def test_corrupt_nvme_frame_is_a_counted_miss(store: TieredStore, nvme: NvmeTier,
                                                    client: ArenaMapping) -> None:
    old = chain(2)
    await put(store, client, old)
    await put(store, client, chain(ARENA_BLOCKS, start=1))
    assert [store.index[k].where for k in old] == ["nvme", "nvme"]
    nvme_corrupt_payload(nvme, store, old[0])
    assert await get(store, client, old) == []  # never the corrupt bytes
    assert nvme.counters.checksum_failures == 1
    assert nvme.counters.evictions[EvictionReason.CORRUPT.value] == 1
    assert store.prefetch.failed == 1
    assert old[0] not in store.index
    assert (await store.lookup(DIGEST, FP, old)).hits == 0
    # the intact second block is still served
    assert await get(store, client, old[1:]) == [payload(old[1])]


async def test_corrupt_frame_found_by_a_prefetch_is_dropped(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    old = chain(1)
    await put(store, client, old)
    await put(store, client, chain(ARENA_BLOCKS, start=1))
    nvme_corrupt_payload(nvme, store, old[0])
    assert (await store.lookup(DIGEST, FP, old)).hits == 1  # the index cannot know yet
    assert store.index[old[0]].cpu_state is SlotState.LOADING
    assert await get(store, client, old) == []  # waits for the load, which fails
    assert nvme.counters.checksum_failures == 1
    assert old[0] not in store.index
    # the promotion made room by demoting one block, then gave its own slot back
    assert store.arena.used_bytes == (ARENA_BLOCKS - 1) * BLOCK
    assert store.arena.allocated_slots == store.cpu.blocks == ARENA_BLOCKS - 1


# -- namespaces and input checks -------------------------------------------------------------
async def test_unknown_namespace_and_layout_mismatch(store: TieredStore) -> None:
    other = Namespace("test/model", LAYOUT, cache_salt="tenant-b")
    with pytest.raises(UnknownNamespace, match="register_layout"):
        await store.lookup(other.digest, FP, chain(1))
    with pytest.raises(LayoutMismatch):
        await store.prepare_put(CLIENT, DIGEST, FP ^ 1, chain(1))


async def test_salted_namespace_does_not_see_other_tenants_blocks(
        store: TieredStore, client: ArenaMapping) -> None:
    tokens = list(range(2 * LAYOUT.tokens_per_block))
    await put(store, client, block_keys(NAMESPACE, tokens))
    salted = store.register_namespace(LAYOUT, "test/model", 0, 1, "tenant-b")
    result = await store.lookup(salted.digest, FP, block_keys(salted, tokens))
    assert result.hits == 0


def test_split_keys() -> None:
    keys = chain(3)
    assert TieredStore.split_keys(b"".join(keys)) == keys
    assert TieredStore.split_keys(b"") == []
    for bad in (b"x" * 15, b"x" * 33, "k" * 16):
        with pytest.raises(ProtocolError):
            TieredStore.split_keys(bad)  # type: ignore[arg-type]


async def test_drain_persists_cpu_only_blocks(store: TieredStore, nvme: NvmeTier,
                                              client: ArenaMapping, clock: FakeClock) -> None:
    keys = chain(3)
    await put(store, client, keys)
    assert await store.drain(clock() + 10) == 3
    assert nvme.blocks == 3
    assert all(store.index[k].in_nvme for k in keys)


# -- randomized consistency ------------------------------------------------------------------
def assert_consistent(store: TieredStore, nvme: NvmeTier) -> None:
    """The index, the arena, the nvme tier and both policies agree with each other."""
    metas = list(store.index.values())
    assert all(m.cpu is not None or m.nvme is not None for m in metas), "orphan index entry"
    assert store.arena.used_bytes == BLOCK * sum(m.cpu is not None for m in metas)
    assert store.arena.allocated_slots == sum(m.cpu is not None for m in metas)
    assert store.cpu.blocks == sum(m.in_cpu for m in metas)
    assert nvme.blocks == sum(m.in_nvme for m in metas)
    assert nvme.used_bytes <= nvme.capacity_bytes
    assert len(store.cpu_policy) == sum(m.in_cpu for m in metas)
    assert len(store.nvme_policy) == sum(m.in_nvme for m in metas)
    assert len({m.cpu for m in metas if m.cpu is not None}) == store.arena.allocated_slots


@pytest.mark.parametrize("seed", range(6))
async def test_random_workload_keeps_every_tier_consistent(
        tmp_path: Path, arena: Arena, client: ArenaMapping, clock: FakeClock,
        seed: int) -> None:
    import random

    rng = random.Random(seed)
    small = NvmeTier(tmp_path / "small-nvme", 6 * (PAGE + BLOCK), direct="off", io_threads=2)
    small.open()
    store = TieredStore(arena, nvme=small, eviction="lru", lease_ttl_s=TTL,
                        prefetch_wait="wait", clock=clock)
    store.register_namespace(LAYOUT, "test/model", 0, 1, None)
    chains = [chain(rng.randint(1, 3), start=i) for i in range(8)]
    try:
        for _ in range(60):
            keys = rng.choice(chains)
            op = rng.choice(["put", "put", "get", "get", "lookup", "delete", "hold", "expire"])
            if op == "put":
                await put(store, client, keys, durable=rng.random() < 0.3)
            elif op == "get":
                data = await get(store, client, keys)
                assert data == [payload(k) for k in keys[: len(data)]]
            elif op == "lookup":
                result = await store.lookup(DIGEST, FP, keys)
                assert result.hits <= len(keys)
            elif op == "delete":
                await store.delete(DIGEST, FP, keys)
            elif op == "hold":
                await store.prepare_get(OTHER_CLIENT, DIGEST, FP, keys)
            else:
                clock.advance(TTL)
                store.expire_leases()
            assert_consistent(store, small)
        await store.drain(clock() + 5)
        store.release_owner(OTHER_CLIENT)
        assert_consistent(store, small)
        assert all(m.readers == 0 for m in store.index.values())
    finally:
        small.close()


async def test_get_longer_than_the_arena_serves_the_prefix_that_fits(
        store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(ARENA_BLOCKS + 2)
    for k in keys:
        await put(store, client, [k])
    await put(store, client, chain(ARENA_BLOCKS, start=1))  # every `keys` block now on nvme
    assert await get(store, client, keys[:ARENA_BLOCKS]) == [payload(k) for k in
                                                             keys[:ARENA_BLOCKS]]
    # the first ARENA_BLOCKS are in the arena; asking for two more must not lose them
    got = await get(store, client, keys)
    assert got == [payload(k) for k in keys[:ARENA_BLOCKS]]
