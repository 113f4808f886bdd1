"""Warm restart (``kvtier.store.recovery``) when one key survives twice, pinned where the
mutation review found no test: two arena commits of one key in the journal, and two nvme
frames of one key under two namespaces. Either way one copy is indexed and the other's
arena slot or nvme slot goes back (and the stale frame is erased): none is held by no
block, the leak a restart would otherwise repeat at every start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xxhash

from kvtier.frame import make_header
from kvtier.keys import Namespace
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena, journal_path, stable_arena_name
from kvtier.tiers.arena_journal import ArenaJournal
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.journal_format import CommitInfo
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

ARENA_BLOCKS = 8
RUN, NEXT_RUN = bytes(range(16)), bytes(range(16, 32))
OTHER = Namespace("other/model", LAYOUT)   # another tenant's namespace, same layout


def new_store(arena: Arena, nvme: NvmeTier | None = None) -> TieredStore:
    store = TieredStore(arena, nvme=nvme, eviction="lru", prefetch_wait="wait")
    assert store.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    return store


async def test_a_key_committed_in_two_arena_slots_is_adopted_from_one_and_frees_the_other(
        shm_dir: Path, tmp_path: Path) -> None:
    """The journal of a crashed run holds two verified commits of one key (its block at
    slot A, then another slot B committed for the same key). The warm restart adopts the
    first, counts the second a conflict and gives its slot back: the arena then holds one
    slot, the block reads back exactly from slot A, and deleting it empties the arena
    (adopting both left a slot that no block owned, for good)."""
    name = stable_arena_name(tmp_path)
    arena = Arena(ARENA_BLOCKS * BLOCK, shm_dir=shm_dir, slab_bytes=BLOCK, prefault=False,
                  name=name)
    jpath = journal_path(arena.path)
    arena.journal = ArenaJournal(jpath, arena.size, arena.slab_bytes, run=RUN)
    store = new_store(arena)
    key = chain(1)[0]
    client = ArenaMapping(str(arena.path), arena.size)
    first = (await put(store, client, [key]))[0]
    await store.commit_log.flush()
    client.close()
    second = arena.alloc(BLOCK)                  # the same key committed in another slot
    assert first is not None and second is not None and second != first
    arena.view(second, BLOCK)[:] = np.frombuffer(payload(key), np.uint8)
    gen = arena.journal.generation(second)
    assert gen is not None
    assert arena.journal.commit(second, gen, CommitInfo(key, DIGEST, FP, BLOCK, None, 0, 0),
                                xxhash.xxh3_64_intdigest(payload(key)))
    kill_arena(arena)

    again = Arena(ARENA_BLOCKS * BLOCK, shm_dir=shm_dir, slab_bytes=BLOCK, prefault=False,
                  name=name, adopt=True)
    try:
        assert again.adopted
        store2 = new_store(again)
        state = read_journal(jpath)
        assert state is not None and [c.info.key for c in state.committed] == [key, key]
        rec = await store2.recover(state, last_run=RUN, begin_run=lambda: NEXT_RUN,
                                   journal=jpath)
        assert store2.index[key].cpu == first
        assert again.used_bytes == BLOCK, "an arena slot of the key is held by no block"
        assert (rec.mode, rec.adopted_blocks, rec.dropped_conflict) == ("warm", 1, 1)
        client2 = ArenaMapping(str(again.path), again.size)
        try:
            assert await get(store2, client2, [key]) == [payload(key)]
        finally:
            client2.close()
        assert await store2.delete(DIGEST, FP, [key]) == 1
        assert again.used_bytes == 0
    finally:
        again.close()


async def test_one_key_on_nvme_under_two_namespaces_keeps_the_newest_frame_only(
        tmp_path: Path) -> None:
    """nvme holds the key's frame under namespace A (a durable put) and a newer frame of
    the same key under namespace B. A restart indexes the newest (B, its own bytes), frees
    the older frame's slot and erases it: the tier holds one slot, and the start after
    finds one frame (a slot held by no block was lost to every later start)."""
    root = tmp_path / "nvme"
    other = OTHER.digest
    key = chain(1)[0]
    theirs = payload(key)[::-1]
    nvme = NvmeTier(root, NVME_BLOCKS * (PAGE + BLOCK), direct="off", io_threads=2)
    nvme.open()
    try:
        with temp_arena(ARENA_BLOCKS * BLOCK, BLOCK) as arena:
            store = new_store(arena, nvme)
            client = ArenaMapping(str(arena.path), arena.size)
            try:
                await put(store, client, [key], durable=True)
            finally:
                client.close()
            assert store.index[key].in_nvme
            slot = nvme.alloc(BLOCK)                 # the same key, namespace B, newer
            assert slot is not None
            await nvme.write(slot, make_header(other, key, FP, theirs, seq=nvme.next_seq(),
                                               chain=(None,)), memoryview(theirs))
            assert nvme.blocks == 2
    finally:
        nvme.close()

    nvme2 = NvmeTier(root, NVME_BLOCKS * (PAGE + BLOCK), direct="off", io_threads=2)
    try:
        with temp_arena(ARENA_BLOCKS * BLOCK, BLOCK) as arena2:
            store2 = new_store(arena2, nvme2)
            rec = await store2.recover(None, last_run=None, begin_run=lambda: NEXT_RUN)
            assert rec.nvme_blocks == 1
            meta = store2.index[key]
            assert (meta.namespace, meta.nvme) == (other, slot)
            assert nvme2.used_bytes == PAGE + BLOCK, "an nvme slot is held by no block"
            assert nvme2.blocks == 1
            await nvme2.erased()
            assert store2.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
            assert (await store2.lookup(DIGEST, FP, [key], prefetch=False)).hits == 0
            assert store2.register_namespace(LAYOUT, "other/model", 0, 1, None) == OTHER
            lease, offsets = await store2.prepare_get(CLIENT, other, FP, [key])
            assert len(offsets) == 1
            assert bytes(arena2.view(offsets[0], BLOCK)) == theirs
            await store2.release_get(CLIENT, lease)
            await store2.drain(store2.clock() + 5)
    finally:
        nvme2.close()

    nvme3 = NvmeTier(root, NVME_BLOCKS * (PAGE + BLOCK), direct="off", io_threads=2)
    try:
        frames = nvme3.open()
        assert [(h.namespace, h.key) for _, h in frames] == [(other, key)]
    finally:
        nvme3.close()
