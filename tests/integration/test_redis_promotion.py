"""The arena journal and the Redis tier hash a block once, against a real redis-server: a block
promoted from Redis is journaled with its frame's verified checksum, and a put written
through to Redis with the checksum its frame was built with (uncompressed frames only: a
compressed frame's checksum covers other bytes, so the journal hashes those blocks itself)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import xxhash

from kvtier.frame import payload_checksum
from kvtier.store import TieredStore, slices
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_journal import ArenaJournal
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.journal_replay import read_journal
from kvtier.tiers.redis import RedisTier
from tests.support.arena import temp_arena
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import blocks, buffers, cfg_for, running
from tests.support.store import (
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    chain,
    payload,
    seed_redis,
)

ARENA_BLOCKS = 8


@pytest.fixture
def journaled_arena(tmp_path: Path) -> Iterator[Arena]:
    with temp_arena(ARENA_BLOCKS * BLOCK, BLOCK) as arena:
        arena.journal = ArenaJournal(tmp_path / "arena.journal", arena.size, arena.slab_bytes,
                                     run=bytes(16))
        yield arena


async def _store(arena: Arena, tier: RedisTier, *, write_through: bool = False) -> TieredStore:
    store = TieredStore(arena, redis=tier, eviction="lru", prefetch_wait="wait",
                        redis_write_through=write_through)
    assert store.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    return store


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
    await seed_redis(tier, keys)
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
            journaled_arena.view(slot.offset, BLOCK).data)


async def test_compressed_frames_are_still_hashed_by_the_journal(
        journaled_arena: Arena, redis_server: RedisServer) -> None:
    async with running(cfg_for(redis_server.url, codec="lz4")) as tier:
        store = await _store(journaled_arena, tier)
        keys = chain(2)
        await seed_redis(tier, keys)
        assert (await store.lookup(DIGEST, FP, keys)).hits == 2
        await store.promoter.settle(10)
        await store.commit_log.flush()
        assert store.commit_log.hashed == 2      # the frame's checksum covers lz4 bytes
        state = read_journal(journaled_arena.journal.path)  # type: ignore[union-attr]
        assert state is not None
        assert sorted(c.checksum for c in state.committed) == sorted(
            xxhash.xxh3_64_intdigest(payload(k)) for k in keys)


# --- puts written through -----------------------------------------------------------------

async def _put(store: TieredStore, arena: Arena, keys: list[bytes]) -> None:
    """prepare_put, each block written through a client mapping, commit."""
    mapping = ArenaMapping(str(arena.path), arena.size)
    try:
        lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, keys)
        for key, off in zip(keys, offsets, strict=True):
            assert off is not None
            mapping.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
        assert await store.commit_put(CLIENT, lease) == len(keys)
    finally:
        mapping.close()


def _journaled(arena: Arena) -> dict[bytes, int]:
    """key -> recorded checksum, as a restart would read the journal."""
    assert arena.journal is not None
    state = read_journal(arena.journal.path)
    assert state is not None
    return {c.info.key: c.checksum for c in state.committed}


@pytest.mark.parametrize("turns", ["whole", "short"])
@pytest.mark.parametrize(("codec", "borrowed"), [("none", 3), ("lz4", 0)])
async def test_a_written_through_put_is_journaled_with_its_frame_checksum(
        journaled_arena: Arena, redis_server: RedisServer, codec: str, borrowed: int,
        turns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``short``: every look at the commit's turn pauses (a loaded machine); the first
    write-through piece still goes out in the commit's own turn, before the journal's
    drain could hash its blocks (it once paused first, and the hash was done twice)."""
    if turns == "short":
        monkeypatch.setattr(slices, "SLICE_S", 0.0)
    async with running(cfg_for(redis_server.url, codec=codec)) as tier:
        store = await _store(journaled_arena, tier, write_through=True)
        keys = chain(3)
        await _put(store, journaled_arena, keys)
        assert await tier.flush(timeout=10)
        await store.commit_log.flush()
        log = store.commit_log
        assert (log.borrowed, log.hashed) == (borrowed, 3 - borrowed)
        assert _journaled(journaled_arena) == {
            k: xxhash.xxh3_64_intdigest(payload(k)) for k in keys}


async def test_a_put_redis_cannot_take_is_hashed_by_the_journal(
        journaled_arena: Arena, redis_server: RedisServer) -> None:
    async with running(cfg_for(redis_server.url)) as tier:
        store = await _store(journaled_arena, tier, write_through=True)
    # the tier is closed: the write-through drops every block at once
    keys = chain(2)
    await _put(store, journaled_arena, keys)
    await store.commit_log.flush()
    assert (store.commit_log.borrowed, store.commit_log.hashed) == (0, 2)
    assert _journaled(journaled_arena) == {k: xxhash.xxh3_64_intdigest(payload(k)) for k in keys}
    assert all(store.index[k].readers == 0 for k in keys)   # slots released
