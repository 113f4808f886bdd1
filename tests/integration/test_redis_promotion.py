"""Blocks promoted from Redis into the arena, against a real redis-server: the journal takes
the frame's verified checksum instead of hashing the block again (uncompressed frames only),
and a lookup's prefetch is what the get that follows is served from."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import xxhash

from kvtier.frame import payload_checksum
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_journal import ArenaJournal, read_journal
from kvtier.tiers.redis import RedisTier
from tests.support.arena import temp_arena
from tests.support.redis_servers import RedisServer, running_server
from tests.support.redis_tier import blocks, buffers, cfg_for, running
from tests.support.store import BLOCK, DIGEST, FP, LAYOUT, NAMESPACE, chain, payload

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
