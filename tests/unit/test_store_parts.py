"""The store's parts on their own: the allocate-with-eviction loop, the lazy prefix walk,
transfers dispatched by tier pair and the prefetch wait (the policy module's deadline)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.policy.base import FakeClock, Key, make_eviction_policy
from kvtier.policy.prefetch import PrefetchWait
from kvtier.store.alloc import MAX_EVICTIONS_PER_ALLOC, allocate_with_eviction
from kvtier.store.blocks import Blocks
from kvtier.store.cpu import CpuResidency
from kvtier.store.nvme import EvictedFrames
from kvtier.store.promoter import Promoter
from kvtier.store.stats import PrefetchCounters
from kvtier.store.transfers import Transfer, Transfers
from kvtier.tiers.arena import Arena
from kvtier.tiers.base import TierName
from kvtier.tiers.nvme import PAGE, NvmeSlot, NvmeTier
from tests.support.arena import temp_arena

BLOCK = 4096


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(4 * BLOCK, BLOCK) as a:
        yield a


def meta(key: bytes, *, cpu: int | None = None) -> BlockMeta:
    m = BlockMeta(key, b"n" * 16, 1, BLOCK, None, 0, cpu=cpu)
    if cpu is not None:
        m.set_cpu_state(SlotState.LOADING)
        m.set_cpu_state(SlotState.READY)
    return m


def no_slot() -> int | None:
    """An allocator with no room left."""
    return None



async def test_allocation_evicts_policy_victims_until_it_fits() -> None:
    policy = make_eviction_policy("lru")
    free: list[int] = []
    evicted: list[Key] = []
    for i in range(3):
        policy.insert(bytes([i]), nbytes=1, parent=None, depth=0, now=float(i))

    async def evict(key: Key) -> None:
        evicted.append(key)
        policy.remove(key)
        if len(evicted) == 2:
            free.append(7)

    got = await allocate_with_eviction(lambda: free.pop() if free else None, policy, evict)
    assert got == 7 and evicted == [b"\x00", b"\x01"]   # least recently used first
    assert await allocate_with_eviction(no_slot, policy, evict) is None
    assert evicted == [b"\x00", b"\x01", b"\x02"]       # no victim left: None


async def test_allocation_is_bounded_when_victims_cannot_go() -> None:
    policy = make_eviction_policy("lru")
    policy.insert(b"stuck", nbytes=1, parent=None, depth=0, now=0.0)
    calls = 0

    async def refuse(key: Key) -> None:   # an evictor that cannot free anything
        nonlocal calls
        calls += 1

    assert await allocate_with_eviction(no_slot, policy, refuse) is None
    assert calls == MAX_EVICTIONS_PER_ALLOC


def test_leading_walk_is_lazy_and_stops_at_the_first_miss() -> None:
    index = BlockIndex()
    keys = [bytes([i]) * 16 for i in range(4)]
    for k in keys[:3]:
        index[k] = meta(k, cpu=0)
    walk = index.leading(keys)
    assert next(walk).key == keys[0]
    del index[keys[1]]          # gone between two steps: the walk sees it gone
    assert list(walk) == []
    assert index.leading_present(keys) == 1
    index[keys[1]] = meta(keys[1], cpu=0)
    assert [m.key for m in index.leading(keys, lambda m: m.key != keys[2])] == keys[:2]


async def test_transfers_dispatch_by_tier_pair_and_count_bytes(arena: Arena,
                                                                tmp_path: Path) -> None:
    nvme = NvmeTier(tmp_path / "nvme", 4 * (PAGE + BLOCK), direct="off", io_threads=1)
    nvme.open()
    try:
        src, dst = arena.alloc(BLOCK), arena.alloc(BLOCK)
        assert src is not None and dst is not None
        arena.view(src, BLOCK)[:] = np.frombuffer(bytes(range(256)) * (BLOCK // 256), np.uint8)
        block = meta(b"k" * 16, cpu=src)
        moves = Transfers(arena, nvme)
        slot = nvme.alloc(BLOCK)
        done = await moves.move(TierName.CPU, TierName.NVME, Transfer([block], slot=slot))
        assert done.moved == 1
        block.nvme, block.nvme_ready, block.cpu = slot, True, dst
        done = await moves.move(TierName.NVME, TierName.CPU, Transfer([block]))
        assert done.moved == 1 and done.checksum is not None
        assert bytes(arena.view(dst, BLOCK)) == bytes(arena.view(src, BLOCK))
        assert moves.moved.by_pair == {("cpu", "nvme"): BLOCK, ("nvme", "cpu"): BLOCK}
        with pytest.raises(KeyError):   # no route: hbm copies run in the hbm residency
            await moves.move(TierName.CPU, TierName.HBM, Transfer([block]))
    finally:
        nvme.close()


@pytest.mark.parametrize("policy, waits", [(PrefetchWait.BEST_EFFORT, False),
                                           (PrefetchWait.TIMEOUT, True),
                                           (PrefetchWait.WAIT, True)])
async def test_prefetch_wait_follows_the_policy_module(arena: Arena, policy: PrefetchWait,
                                                       waits: bool) -> None:
    clock = FakeClock()
    cpu = CpuResidency(arena, BlockIndex(), make_eviction_policy("lru"))
    counters = PrefetchCounters()
    promoter = Promoter(Blocks(cpu.index, cpu, None, None), cpu, None,
                        Transfers(arena), counters, clock, policy, per_block_s=5.0, base_s=5.0)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bool] = loop.create_future()
    loop.call_later(0.05, fut.set_result, True)
    await promoter.wait([fut])
    assert fut.done() is waits and counters.late == 1


def test_evicted_frames_are_remembered_per_slot_and_namespace() -> None:
    """Only a delete in the frame's own namespace finds it (knowing a key is no permission);
    a slot that stored a new frame, or holds a newer evicted frame, no longer names the old
    key."""
    frames = EvictedFrames()
    s0, s1, s2 = NvmeSlot(8192, 0), NvmeSlot(8192, 1), NvmeSlot(16384, 0)
    frames.add(s0, b"k", b"ns-a")
    frames.add(s1, b"k", b"ns-a")      # an older copy of the same key, evicted too
    frames.add(s2, b"j", b"ns-a")
    assert frames.of(b"k", b"ns-b") == []
    frames.forget(s1)                  # a new frame stored there: the old one is overwritten
    frames.add(s2, b"x", b"ns-a")      # reused and evicted again under another key
    assert frames.of(b"j", b"ns-a") == []
    assert frames.of(b"k", b"ns-a") == [s0]
    frames.forget(s0)
    assert frames.of(b"k", b"ns-a") == []
    assert frames.of(b"x", b"ns-a") == [s2]
    frames.forget(s2)
    assert not frames.by_slot and not frames.by_key
