"""Blocks promoted from Redis into the arena, against a real redis-server: the journal takes
the frame's verified checksum instead of hashing the block again (uncompressed frames only),
and a lookup starts reading its Redis tail before its probe answers (into free slots only,
indexed once the probe confirmed them, ready once the read verified them); the get that
follows is served from that read."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import xxhash

from kvtier.frame import payload_checksum
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_journal import ArenaJournal, read_journal
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.redis import RedisTier
from tests.support.arena import temp_arena
from tests.support.redis_servers import RedisServer, running_server
from tests.support.redis_tier import blocks, buffers, cfg_for, running
from tests.support.store import BLOCK, CLIENT, DIGEST, FP, LAYOUT, NAMESPACE, chain, payload

ARENA_BLOCKS = 8


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def journaled_arena(tmp_path: Path) -> Iterator[Arena]:
    with temp_arena(ARENA_BLOCKS * BLOCK, BLOCK) as arena:
        arena.journal = ArenaJournal(tmp_path / "arena.journal", arena.size, arena.slab_bytes)
        yield arena


async def _store(arena: Arena, tier: RedisTier) -> TieredStore:
    store = TieredStore(arena, redis=tier, eviction="lru", prefetch_wait="wait")
    assert store.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    return store


async def _seed(tier: RedisTier, keys: list[bytes]) -> None:
    """Blocks another node wrote: in Redis only."""
    for key in keys:
        tier.submit(DIGEST, key, FP, memoryview(payload(key)))
    assert await tier.flush(timeout=10)


@pytest.fixture
async def tier(redis_server: RedisServer) -> AsyncIterator[RedisTier]:
    async with running(cfg_for(redis_server.url)) as t:
        yield t


async def test_get_into_reports_the_verified_checksum_of_uncompressed_frames(
        redis_server: RedisServer) -> None:
    keys, data = blocks(3)
    for codec, expect_sums in (("none", True), ("lz4", False)):
        async with running(cfg_for(redis_server.url, codec=codec)) as tier:
            for key, value in zip(keys, data, strict=True):
                tier.submit(bytes(range(16)), key, 7, memoryview(value))
            assert await tier.flush(timeout=10)
            sums: list[int | None] = [-1] * 4
            outs = buffers(4)
            got = await tier.get_into([*keys, bytes(16)], outs, namespace=bytes(range(16)),
                                      layout_fp=7, checksums=sums)
            assert got == 3 and [bytes(o) for o in outs[:3]] == data
            want = [payload_checksum(d) if expect_sums else None for d in data]
            assert sums[:3] == want, codec
            assert sums[3] == -1              # past the run: untouched
            await tier.delete(keys)


async def test_blocks_from_redis_are_journaled_with_the_frame_checksum(
        journaled_arena: Arena, tier: RedisTier) -> None:
    store = await _store(journaled_arena, tier)
    keys = chain(3)
    await _seed(tier, keys)
    assert (await store.lookup(DIGEST, FP, keys)).tiers == ["redis"] * 3
    await store.promoter.settle(10)
    assert all(store.index[k].in_cpu for k in keys)
    await store.commit_log.flush()
    assert store.commit_log.hashed == 0          # nothing hashed a second time
    journal = journaled_arena.journal
    assert journal is not None
    state = read_journal(journal.path)
    assert state is not None
    committed = {c.info.key: c for c in state.committed}
    for key in keys:   # the recorded number is the arena bytes' own xxh3-64
        slot = committed[key]
        assert slot.offset == store.index[key].cpu
        assert slot.checksum == xxhash.xxh3_64_intdigest(payload(key))
        assert slot.checksum == xxhash.xxh3_64_intdigest(
            journaled_arena.view(slot.offset, BLOCK))


async def test_compressed_frames_are_still_hashed_by_the_journal(
        journaled_arena: Arena, redis_server: RedisServer) -> None:
    async with running(cfg_for(redis_server.url, codec="lz4")) as tier:
        store = await _store(journaled_arena, tier)
        keys = chain(2)
        await _seed(tier, keys)
        assert (await store.lookup(DIGEST, FP, keys)).hits == 2
        await store.promoter.settle(10)
        await store.commit_log.flush()
        assert store.commit_log.hashed == 2      # the frame's checksum covers lz4 bytes
        state = read_journal(journaled_arena.journal.path)  # type: ignore[union-attr]
        assert state is not None
        assert sorted(c.checksum for c in state.committed) == sorted(
            xxhash.xxh3_64_intdigest(payload(k)) for k in keys)


# --- reading with the probe ---------------------------------------------------------------

async def _get(store: TieredStore, arena: Arena, keys: list[bytes]) -> list[bytes]:
    """prepare_get + the bytes of every leased block (through a client mapping) + release."""
    lease, offsets = await store.prepare_get(CLIENT, DIGEST, FP, keys)
    mapping = ArenaMapping(str(arena.path), arena.size)
    try:
        return [bytes(mapping.view(off, BLOCK, writable=False)) for off in offsets]
    finally:
        mapping.close()
        store.release_get(CLIENT, lease)


def _rkey(key: bytes) -> bytes:
    return b"kvtier:" + key.hex().encode()


async def test_a_lookup_reads_its_redis_tail_with_the_probe_and_the_get_uses_it(
        journaled_arena: Arena, tier: RedisTier) -> None:
    store = await _store(journaled_arena, tier)
    keys = chain(5)
    await _seed(tier, keys[:3])                 # the last two blocks are nowhere
    assert (await store.lookup(DIGEST, FP, keys)).tiers == ["redis"] * 3
    promoter = store.promoter
    assert promoter.speculated == 5             # read before the probe answered ...
    assert store.prefetch.issued == 3           # ... only the confirmed ones indexed
    assert [k in store.index for k in keys] == [True] * 3 + [False] * 2
    assert await _get(store, journaled_arena, keys) == [payload(k) for k in keys[:3]]
    await promoter.settle(10)
    # one read of the five keys (three found), none for the get
    assert (tier.counters.hit_blocks, tier.counters.miss_blocks) == (3, 2)
    assert promoter.speculated_unused == 2
    assert journaled_arena.used_bytes == 3 * BLOCK  # the unconfirmed slots went back
    assert store.prefetch.hit_before_use == 3 and store.prefetch.failed == 0


async def test_a_frame_failing_its_checksum_is_a_miss_never_wrong_bytes(
        journaled_arena: Arena, tier: RedisTier, redis_server: RedisServer) -> None:
    store = await _store(journaled_arena, tier)
    keys = chain(3)
    await _seed(tier, keys)
    raw = redis_server.client()
    value = raw.get(_rkey(keys[1]))
    assert value is not None
    raw.setrange(_rkey(keys[1]), len(value) - 10, b"X")   # a payload byte, not the header
    # the probe reads the namespace field only: it counts the block ...
    assert (await store.lookup(DIGEST, FP, keys)).hits == 3
    # ... the read does not: the get serves the sound head, never the corrupt block
    assert await _get(store, journaled_arena, keys) == [payload(keys[0])]
    await store.promoter.settle(10)
    assert tier.counters.checksum_failures == 1 and store.prefetch.failed == 2
    assert [k in store.index for k in keys] == [True, False, False]
    assert journaled_arena.used_bytes == BLOCK
    assert raw.exists(_rkey(keys[1])) == 0      # the corrupt frame was deleted


async def test_another_namespace_frame_is_neither_read_nor_indexed(
        journaled_arena: Arena, tier: RedisTier) -> None:
    store = await _store(journaled_arena, tier)
    keys = chain(2)
    for key in keys:   # a stolen key: the same block key under another tenant's namespace
        tier.submit(bytes(16), key, FP, memoryview(payload(key)))
    assert await tier.flush(timeout=10)
    assert (await store.lookup(DIGEST, FP, keys)).hits == 0
    await store.promoter.settle(10)
    assert not store.index and journaled_arena.used_bytes == 0
    assert store.promoter.speculated_unused == store.promoter.speculated
    assert tier.namespace_mismatches >= 1


async def test_reading_early_takes_free_slots_only_and_never_evicts(
        journaled_arena: Arena, tier: RedisTier) -> None:
    store = await _store(journaled_arena, tier)
    mapping = ArenaMapping(str(journaled_arena.path), journaled_arena.size)
    cached = chain(ARENA_BLOCKS - 1, start=1)
    try:   # the arena holds 7 cached blocks: one free slot
        lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, cached)
        for key, off in zip(cached, offsets, strict=True):
            assert off is not None
            mapping.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
        await store.commit_put(CLIENT, lease, durable=False)
    finally:
        mapping.close()
    keys = chain(3)
    await _seed(tier, keys)
    assert (await store.lookup(DIGEST, FP, keys, prefetch=False)).hits == 3
    assert store.promoter.speculated == 0       # no prefetch asked: nothing read early
    assert (await store.lookup(DIGEST, FP, keys)).hits == 3
    assert store.promoter.speculated == 1       # the one free slot, nothing evicted for it
    assert all(store.index[k].in_cpu for k in cached[-2:])
    # the probe confirmed all three: the other two are promoted as before (evicting LRU)
    assert await _get(store, journaled_arena, keys) == [payload(k) for k in keys]


async def test_a_speculative_read_is_bounded_by_bytes(
        journaled_arena: Arena, tier: RedisTier) -> None:
    store = await _store(journaled_arena, tier)
    store.promoter.speculate_bytes = 2 * BLOCK
    keys = chain(4)
    await _seed(tier, keys)
    assert (await store.lookup(DIGEST, FP, keys)).hits == 4
    assert store.promoter.speculated == 2
    assert await _get(store, journaled_arena, keys) == [payload(k) for k in keys]
    await store.promoter.settle(10)
    assert journaled_arena.used_bytes == 4 * BLOCK
