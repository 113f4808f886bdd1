"""Batch eviction (kvtier.store.alloc): a put into a full arena evicts several victims at
once so their writes to nvme overlap, choosing them exactly as one eviction at a time
would, and giving back to the policy a victim it could not evict."""

from __future__ import annotations

import asyncio

from kvtier.policy.base import EvictionPolicy, Key
from kvtier.policy.cost import CostPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.store import TieredStore
from kvtier.store.alloc import _victims
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.nvme import NvmeTier
from tests.support.store import (
    ARENA_BLOCKS,
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    OTHER_CLIENT,
    chain,
    get,
    payload,
    put,
)


def _chains(policy: EvictionPolicy) -> EvictionPolicy:
    """Two chains (a prompt of 5 blocks, one of 3) and a reused block, leaves last."""
    for name, n in ((b"a", 5), (b"b", 3)):
        parent = None
        for i in range(n):
            key = name + bytes([i]) * 15
            policy.insert(key, nbytes=BLOCK, parent=parent, depth=i, now=float(i))
            parent = key
    policy.touch(b"a" + bytes([1]) * 15, now=9.0)
    return policy


def _one_at_a_time(policy: EvictionPolicy, n: int) -> list[Key]:
    out: list[Key] = []
    for _ in range(n):
        key = policy.victim()
        if key is None:
            break
        policy.remove(key)   # (what the eviction does)
        out.append(key)
    return out


def test_a_batch_is_the_victims_one_eviction_at_a_time_would_choose() -> None:
    for make in (CostPolicy, LRUPolicy):
        for n in (1, 3, 6, 20):
            want = _one_at_a_time(_chains(make()), n)
            policy = _chains(make())
            got = _victims(policy, n)
            assert got == want, (make.__name__, n)
            if n > 1:   # chosen ones left the policy, as their eviction removes them
                assert not any(k in policy for k in got)
            assert len(policy) == 8 - (len(got) if n > 1 else 0)


async def test_a_put_into_a_full_arena_evicts_its_victims_together(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    old, new = chain(ARENA_BLOCKS), chain(ARENA_BLOCKS, start=1)
    await put(store, client, old)
    await put(store, client, new)            # needs every slot: the old chain goes down
    assert [store.index[k].where for k in old] == ["nvme"] * ARENA_BLOCKS
    assert nvme.blocks == ARENA_BLOCKS
    assert await get(store, client, new) == [payload(k) for k in new]
    assert await get(store, client, old[:2]) == [payload(k) for k in old[:2]]


async def test_a_victim_read_while_it_is_written_stays_and_can_go_later(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    old, new = chain(ARENA_BLOCKS), chain(ARENA_BLOCKS, start=1)
    await put(store, client, old)
    putting = asyncio.ensure_future(store.prepare_put(OTHER_CLIENT, DIGEST, FP, new))
    for _ in range(3):                         # the batch's writes are in flight
        await asyncio.sleep(0)
    assert not putting.done() and store.index[old[0]].nvme_busy
    lease, offsets = await store.prepare_get(CLIENT, DIGEST, FP, old[:1])
    assert len(offsets) == 1
    put_lease, put_offsets = await putting
    # old[0] was being read: it stayed (and the put got one slot fewer)
    assert store.index[old[0]].in_cpu and old[0] in store.cpu.policy
    assert put_offsets.count(None) == 1
    assert bytes(client.view(offsets[0], BLOCK, writable=False)) == payload(old[0])
    await store.release_get(CLIENT, lease)
    store.abort_put(OTHER_CLIENT, put_lease)
    # given back to the policy, it is evicted like any other block
    await put(store, client, chain(ARENA_BLOCKS, start=2))
    assert not store.index[old[0]].in_cpu and store.index[old[0]].in_nvme
    assert await get(store, client, old[:1]) == [payload(old[0])]



async def test_a_put_evicts_only_for_the_keys_it_still_has_to_place(
        store: TieredStore, nvme: NvmeTier, client: ArenaMapping) -> None:
    stored = chain(ARENA_BLOCKS)
    await put(store, client, stored)
    # a put naming one new key and three stored ones: one victim, not one per key named
    await put(store, client, chain(1, start=5) + stored[:3])
    assert nvme.blocks == 1
    assert sum(store.index[k].in_cpu for k in stored) == ARENA_BLOCKS - 1
