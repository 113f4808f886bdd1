"""Warm restart decisions (``kvtier.store.recovery``), pinned where the mutation review
found no test: slots in flight at the crash are held back for one lease TTL (journaled,
so a second crash holds them too) and then given back; orphans are freed in the arena and
erased on nvme; adopted blocks keep their commit order in the cpu tier's LRU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvtier.frame import make_header
from kvtier.store import TieredStore
from kvtier.store.recovery import RecoveryCounters
from kvtier.tiers.arena import Arena, journal_path, stable_arena_name
from kvtier.tiers.arena_journal import ArenaJournal
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.journal_replay import read_journal
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.slab import PAGE
from tests.support.arena import kill_arena, temp_arena
from tests.support.store import (
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    NVME_BLOCKS,
    chain,
    get,
    payload,
    put,
)

ARENA_BLOCKS = 4
RUN, NEXT_RUN = bytes(range(16)), bytes(range(16, 32))
TTL = 0.2


def nvme_tier(root: Path) -> NvmeTier:
    """An nvme tier of NVME_BLOCKS blocks at ``root`` (not opened)."""
    return NvmeTier(root, NVME_BLOCKS * (PAGE + BLOCK), direct="off", io_threads=2)


def new_arena(shm_dir: Path, name: str, *, adopt: bool = False) -> Arena:
    return Arena(ARENA_BLOCKS * BLOCK, shm_dir=shm_dir, slab_bytes=BLOCK, prefault=False,
                 name=name, adopt=adopt)


def new_store(arena: Arena, nvme: NvmeTier | None = None) -> TieredStore:
    store = TieredStore(arena, nvme=nvme, eviction="lru", lease_ttl_s=TTL,
                        prefetch_wait="wait")
    assert store.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    return store


def journaled(shm_dir: Path, name: str) -> tuple[Arena, Path]:
    arena = new_arena(shm_dir, name)
    jpath = journal_path(arena.path)
    arena.journal = ArenaJournal(jpath, arena.size, arena.slab_bytes, run=RUN)
    return arena, jpath


async def restart(shm_dir: Path, name: str, jpath: Path, run: bytes = RUN,
                  ) -> tuple[Arena, TieredStore, RecoveryCounters]:
    again = new_arena(shm_dir, name, adopt=True)
    assert again.adopted
    store = new_store(again)
    rec = await store.recover(read_journal(jpath), last_run=run, begin_run=lambda: NEXT_RUN,
                              journal=jpath)
    assert rec.mode == "warm"
    return again, store, rec


async def test_a_slot_in_flight_at_the_crash_is_held_for_a_lease_ttl_then_freed(
        shm_dir: Path, tmp_path: Path) -> None:
    """A put prepared but never committed: its slot may still be written by the dead
    daemon's stalled client, so the restart holds it (counted, and in the new journal,
    so a second crash holds it too) and gives it back one lease TTL later. Held for good,
    the arena would lose the slot at every such crash; never held, a new block could be
    overwritten by the stalled client."""
    name = stable_arena_name(tmp_path)
    arena, jpath = journaled(shm_dir, name)
    store = new_store(arena)
    done, stalled = chain(2)
    client = ArenaMapping(str(arena.path), arena.size)
    try:
        await put(store, client, [done])
        await store.commit_log.flush()
        _, offsets = await store.prepare_put(CLIENT, DIGEST, FP, [stalled])
    finally:
        client.close()
    held = offsets[0]
    assert held is not None
    kill_arena(arena)

    again, store2, rec = await restart(shm_dir, name, jpath)
    try:
        assert (rec.adopted_blocks, rec.dropped_inflight, rec.quarantined_slots) == (1, 1, 1)
        assert again.used_bytes == 2 * BLOCK and stalled not in store2.index
        state = read_journal(jpath)
        assert state is not None and state.writing == [(held, BLOCK)]
        assert [c.info.key for c in state.committed] == [done]
        await asyncio.sleep(TTL * 2 + 0.1)
        assert again.used_bytes == BLOCK, "the quarantined slot was never given back"
        state = read_journal(jpath)
        assert state is not None and state.writing == []
    finally:
        again.close()


async def test_an_adopted_block_whose_parent_failed_its_checksum_is_freed(
        shm_dir: Path, tmp_path: Path) -> None:
    """A chain a <- b committed in the arena; a's bytes change before the restart (it
    fails verification). b is then unreachable: dropped as an orphan and its slot given
    back (kept, the slot was held by no block until the next cold start)."""
    name = stable_arena_name(tmp_path)
    arena, jpath = journaled(shm_dir, name)
    store = new_store(arena)
    a, b = chain(2)
    client = ArenaMapping(str(arena.path), arena.size)
    try:
        offsets = await put(store, client, [a, b])
        await store.commit_log.flush()
    finally:
        client.close()
    assert offsets[0] is not None
    arena.view(offsets[0], 8)[:] ^= 0xFF
    kill_arena(arena)

    again, store2, rec = await restart(shm_dir, name, jpath)
    try:
        assert (rec.dropped_checksum, rec.orphans_dropped, rec.adopted_blocks) == (1, 1, 0)
        assert a not in store2.index and b not in store2.index
        assert again.used_bytes == 0, "the orphan's arena slot is held by no block"
    finally:
        again.close()


async def test_an_nvme_frame_behind_a_lost_head_is_erased_not_only_unindexed(
        tmp_path: Path) -> None:
    """A frame whose parent is in no tier is dropped at the restart, and its header is
    zeroed: without the erase it is found again at every start (and served again if
    its parent key is ever stored anew)."""
    root = tmp_path / "nvme"
    head, kid = chain(2)
    nvme = nvme_tier(root)
    nvme.open()
    try:
        slot = nvme.alloc(BLOCK)
        assert slot is not None
        data = payload(kid)
        await nvme.write(slot, make_header(DIGEST, kid, FP, data, seq=nvme.next_seq(),
                                           chain=(head,)), memoryview(data))
    finally:
        nvme.close()
    nvme2 = nvme_tier(root)
    try:
        with temp_arena(ARENA_BLOCKS * BLOCK, BLOCK) as arena:
            store = new_store(arena, nvme2)
            rec = await store.recover(None, last_run=None, begin_run=lambda: NEXT_RUN)
            assert (rec.nvme_blocks, rec.orphans_dropped) == (1, 1)
            assert kid not in store.index and nvme2.used_bytes == 0
            await nvme2.erased()
    finally:
        nvme2.close()
    nvme3 = nvme_tier(root)
    try:
        assert nvme3.open() == []
    finally:
        nvme3.close()


async def test_adopted_blocks_keep_their_commit_order_for_eviction(
        shm_dir: Path, tmp_path: Path) -> None:
    """Three single-block prompts committed x, y, z: after the restart the cpu tier's
    LRU must hold them in that order, so the first eviction takes x (the oldest), not
    the block committed last."""
    name = stable_arena_name(tmp_path)
    arena, jpath = journaled(shm_dir, name)
    store = new_store(arena)
    keys = [chain(1, start=s)[0] for s in (1, 2, 3)]
    client = ArenaMapping(str(arena.path), arena.size)
    try:
        for k in keys:
            await put(store, client, [k])
            await store.commit_log.flush()
    finally:
        client.close()
    kill_arena(arena)

    again, store2, rec = await restart(shm_dir, name, jpath)
    client2 = ArenaMapping(str(again.path), again.size)
    try:
        assert rec.adopted_blocks == 3
        fresh = [chain(1, start=s)[0] for s in (4, 5)]
        await put(store2, client2, fresh)
        assert keys[0] not in store2.index, "not the oldest adopted block evicted"
        assert await get(store2, client2, keys[1:] + fresh) == [
            payload(k) for k in keys[1:] + fresh]
    finally:
        client2.close()
        again.close()


@pytest.mark.parametrize("change", ["run", "slab"])
async def test_a_journal_of_another_run_or_slab_geometry_is_not_adopted(
        shm_dir: Path, tmp_path: Path, change: str) -> None:
    """A journal whose run is not the data directory's last (a start in between served
    without adopting it: its blocks may be stale or deleted since), or whose slab size is
    not the arena's (its offsets name other slots): the cpu tier starts cold, nothing of
    the old arena is indexed and no slot stays reserved."""
    name = stable_arena_name(tmp_path)
    arena, jpath = journaled(shm_dir, name)
    store = new_store(arena)
    key = chain(1)[0]
    client = ArenaMapping(str(arena.path), arena.size)
    try:
        await put(store, client, [key])
        await store.commit_log.flush()
    finally:
        client.close()
    kill_arena(arena)

    again = new_arena(shm_dir, name, adopt=True)
    try:
        assert again.adopted
        store2 = new_store(again)
        state = read_journal(jpath)
        assert state is not None and len(state.committed) == 1
        if change == "slab":
            state.slab_bytes //= 2
        last = NEXT_RUN if change == "run" else RUN
        rec = await store2.recover(state, last_run=last, begin_run=lambda: bytes(16),
                                   journal=jpath)
        assert rec.mode == "cold" and rec.cold_reason
        assert rec.adopted_blocks == 0 and key not in store2.index
        assert again.used_bytes == 0
    finally:
        again.close()


async def test_nvme_frames_reenter_the_nvme_lru_oldest_first(tmp_path: Path) -> None:
    """Frames x, y, z written in that order: after a restart the nvme tier's next victim
    is x, the oldest (reversed, a restart would evict the newest frames first)."""
    root = tmp_path / "nvme"
    keys = [chain(1, start=s)[0] for s in (1, 2, 3)]
    nvme = nvme_tier(root)
    nvme.open()
    try:
        for k in keys:
            slot = nvme.alloc(BLOCK)
            assert slot is not None
            data = payload(k)
            await nvme.write(slot, make_header(DIGEST, k, FP, data, seq=nvme.next_seq(),
                                               chain=(None,)), memoryview(data))
    finally:
        nvme.close()
    nvme2 = nvme_tier(root)
    try:
        with temp_arena(ARENA_BLOCKS * BLOCK, BLOCK) as arena:
            store = new_store(arena, nvme2)
            rec = await store.recover(None, last_run=None, begin_run=lambda: NEXT_RUN)
            assert rec.nvme_blocks == 3
            assert store.nvme_policy.victim() == keys[0]
    finally:
        nvme2.close()
