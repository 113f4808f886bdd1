"""Mutation-review survivors of the store's moves to Redis (kvtier/store/transfers.py) and
its write-through (kvtier/store/writes.py, wired by kvtier/store/coordinator.py): decisions
no other test noticed broken. Each docstring names the decision and the mutant that
survived without it. Redis is ``FakeRedis`` (tests/support/redis_port_fake.py): borrowed
writes stay ``held`` (their arena slots pinned) until ``finish``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from kvtier.frame import Codec, FrameHeader
from kvtier.index import BlockMeta
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.store import TieredStore, transfers, writes
from kvtier.store.slices import Turn
from kvtier.store.transfers import Transfer
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.base import TierName
from kvtier.tiers.nvme import NvmeTier
from tests.support.redis_port_fake import FakeRedis, with_redis
from tests.support.store import (
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    FakeClock,
    chain,
    payload,
    put,
)


@pytest.fixture
def redis() -> FakeRedis:
    return FakeRedis()


# --------------------------------------------------------------------------- transfers


async def test_a_copy_for_redis_of_a_block_deleted_meanwhile_is_not_sent(
        store: TieredStore, client: ArenaMapping, redis: FakeRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A large block leaving the arena is copied for Redis on a worker thread; when it is
    no longer its key's live block once copied (deleted meanwhile), the copy is not sent:
    a SET after the key's DEL brings it back for every node (mutants: the ``alive`` check
    dropped; the store's ``alive`` always true). The slot's pin is given back."""
    keys = chain(2)
    await put(store, client, keys)
    with_redis(store, redis)
    gone, kept = store.index[keys[0]], store.index[keys[1]]
    monkeypatch.setattr(transfers, "HASH_OFF_LOOP_BYTES", 1)   # every block "large"
    real_copy = transfers._copy

    def copy_then_delete(dst: memoryview, src: memoryview) -> None:
        real_copy(dst, src)
        if store.index.get(gone.key) is gone:
            store.index.pop(gone.key)   # deleted while being copied

    monkeypatch.setattr(transfers, "_copy", copy_then_delete)
    try:
        done = await store.transfers.move(TierName.CPU, TierName.REDIS,
                                          Transfer([gone, kept], copy=True))
    finally:
        store.index[gone.key] = gone
    assert redis.copies == [kept.key]
    assert done.moved == 1
    assert redis.frames[kept.key] == payload(kept.key)
    assert gone.readers == 0 and kept.readers == 0


async def _on_nvme_only(store: TieredStore, client: ArenaMapping, redis: FakeRedis
                        ) -> BlockMeta:
    keys = chain(1)
    await put(store, client, keys, durable=True)
    meta = store.index[keys[0]]
    store.cpu.drop(meta)
    assert meta.in_nvme and not meta.in_cpu
    with_redis(store, redis)
    return meta


async def test_a_block_leaving_nvme_reaches_redis_whole_and_unbusied(
        store: TieredStore, client: ArenaMapping, redis: FakeRedis) -> None:
    """A block on nvme only, of a size that is no whole number of pages, leaving nvme for
    Redis, is read back and sent as exactly its bytes (the frame's page padding cut off),
    and its nvme slot is not left busy, which would keep it from ever leaving nvme
    (mutants: the whole padded buffer sent; the busy flag not cleared)."""
    odd = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
                   tokens_per_block=100)
    assert odd.block_bytes % 4096 != 0
    ns = store.register_namespace(odd, "odd/model", 0, 1, None)
    (key,) = block_keys(ns, list(range(odd.tokens_per_block)))
    data = (key * (odd.block_bytes // len(key) + 1))[:odd.block_bytes]
    lease, offsets = await store.prepare_put(1, ns.digest, odd.fingerprint, [key])
    assert offsets[0] is not None
    client.view(offsets[0], odd.block_bytes, writable=True)[:] = memoryview(data)
    assert await store.commit_put(1, lease, durable=True) == 1
    meta = store.index[key]
    store.cpu.drop(meta)
    with_redis(store, redis)
    done = await store.transfers.move(TierName.NVME, TierName.REDIS, Transfer([meta]))
    assert done.moved == 1
    assert redis.frames[key] == data
    assert not meta.nvme_busy


async def test_a_block_leaving_nvme_whose_frame_is_not_plain_is_not_sent(
        store: TieredStore, client: ArenaMapping, redis: FakeRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified nvme frame that does not hold the block's raw bytes (an encoded frame,
    which kvtier never writes to nvme) is not sent to Redis as the block, and counts as a
    checksum failure (mutant: the ``_not_plain`` check dropped: foreign bytes under the
    block's key, for every node)."""
    meta = await _on_nvme_only(store, client, redis)
    nvme = store.nvme
    assert nvme is not None
    real = type(nvme).read_into

    async def encoded(self: object, *args: object, **kw: object) -> FrameHeader:
        header = await real(nvme, *args, **kw)  # type: ignore[arg-type]
        return dataclasses.replace(header, codec=Codec.LZ4)

    monkeypatch.setattr(type(nvme), "read_into", encoded)
    failures = nvme.counters.checksum_failures
    done = await store.transfers.move(TierName.NVME, TierName.REDIS, Transfer([meta]))
    assert done.moved == 0
    assert meta.key not in redis.frames and redis.copies == []
    assert nvme.counters.checksum_failures == failures + 1
    assert not meta.nvme_busy


# --------------------------------------------------------------------------- write-through


@pytest.fixture
async def wt(arena: Arena, nvme: NvmeTier, clock: FakeClock,
             redis: FakeRedis) -> AsyncIterator[TieredStore]:
    """A store writing every commit through to ``redis``."""
    s = TieredStore(arena, nvme=nvme, redis=redis,  # type: ignore[arg-type]
                    redis_write_through=True, prefetch_wait="wait", clock=clock)
    assert s.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    yield s
    redis.stall = None
    redis.finish()
    await s.drain(clock() + 5)


async def _put_sync(store: TieredStore, client: ArenaMapping, keys: list[bytes],
                    wait_s: float) -> int:
    """``put`` with a synchronous commit's ``redis_wait_s``."""
    lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, keys)
    for key, off in zip(keys, offsets, strict=True):
        if off is not None:
            client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    return await store.commit_put(CLIENT, lease, redis_wait_s=wait_s)


def _readers(store: TieredStore, keys: list[bytes]) -> list[int]:
    return [store.index[k].readers for k in keys]


async def test_a_synced_commit_leaves_only_the_writes_pins(
        wt: TieredStore, client: ArenaMapping, redis: FakeRedis) -> None:
    """A synchronous commit pins its blocks until each piece is queued, then lets go: only
    the borrowed write's own pin stays until the SET is over, and none after (mutants: the
    commit's pins never given back; the whole write-through skipped)."""
    keys = chain(2)
    assert await _put_sync(wt, client, keys, 1.0) == 2
    assert redis.batches == [keys]
    assert _readers(wt, keys) == [1, 1]
    redis.finish()
    assert _readers(wt, keys) == [0, 0]
    assert redis.frames == {k: payload(k) for k in keys}


async def test_a_synced_commit_pins_its_chain_before_waiting_for_room(
        wt: TieredStore, client: ArenaMapping, redis: FakeRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While a synchronous commit waits for room in the write queue, the blocks not queued
    yet are pinned (none evicted before its turn), and it queues no more than the room
    there is, so that a chain longer than the queue never pushes its own head out
    (mutants: no pins; the room ignored; no deadline, so neither)."""
    monkeypatch.setattr(writes, "WRITE_THROUGH_PIECE", 2)
    keys = chain(3)
    seen: list[list[int]] = []

    async def one_at_a_time(n: int, timeout: float) -> int:
        seen.append(_readers(wt, keys))
        return 1

    redis.room_for = one_at_a_time
    assert await _put_sync(wt, client, keys, 1.0) == 3
    assert seen and all(r >= 1 for r in seen[0]), f"unpinned while waiting: {seen[0]}"
    assert redis.batches == [[k] for k in keys]


async def test_a_synced_commit_waits_for_room_no_longer_than_its_bound(
        wt: TieredStore, client: ArenaMapping, redis: FakeRedis) -> None:
    """A write queue that never has room holds a synchronous commit no longer than its
    ``redis_wait_s`` (mutant: each wait for room given an hour)."""
    async def never(n: int, timeout: float) -> int:
        await asyncio.sleep(max(0.0, timeout))
        return 0

    redis.room_for = never
    keys = chain(2)
    stored = await asyncio.wait_for(_put_sync(wt, client, keys, 0.2), timeout=3.0)
    assert stored == 2
    assert redis.batches == [keys]


async def test_a_cancelled_synced_commit_gives_its_pins_back(
        wt: TieredStore, client: ArenaMapping, redis: FakeRedis) -> None:
    """A synchronous commit cancelled while waiting for room (its client went) unpins the
    blocks it had not queued (mutant: the ``except`` unpin dropped: slots pinned for
    good, never evicted)."""
    entered = asyncio.Event()

    async def stuck(n: int, timeout: float) -> int:
        entered.set()
        await asyncio.Event().wait()
        return n

    redis.room_for = stuck
    keys = chain(2)
    task = asyncio.create_task(_put_sync(wt, client, keys, 30.0))
    await asyncio.wait_for(entered.wait(), timeout=5.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _readers(wt, keys) == [0, 0]
    assert redis.batches == []


class _EvictingTurn(Turn):
    """A turn always over; its pause drops ``victim`` from the arena (evicted meanwhile)
    once the write-through has begun."""

    victim: BlockMeta | None = None
    store: TieredStore | None = None
    redis: FakeRedis | None = None

    def over(self) -> bool:
        return True

    async def pause(self) -> None:
        await super().pause()
        v, s, r = _EvictingTurn.victim, _EvictingTurn.store, _EvictingTurn.redis
        if v is not None and s is not None and r is not None and r.batches and v.in_cpu:
            s.cpu.drop(v)


async def test_a_block_evicted_between_write_through_pieces_is_skipped(
        wt: TieredStore, client: ArenaMapping, redis: FakeRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain write-through queues a piece at a time, unpinned: a block evicted during a
    pause is skipped, not framed from a slot it no longer has (mutant: the ``in_cpu``
    check dropped: an AssertionError to the engine's commit)."""
    monkeypatch.setattr(writes, "WRITE_THROUGH_PIECE", 1)
    monkeypatch.setattr(writes, "Turn", _EvictingTurn)
    keys = chain(2)
    lease, offsets = await wt.prepare_put(CLIENT, DIGEST, FP, keys)
    for key, off in zip(keys, offsets, strict=True):
        assert off is not None
        client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    monkeypatch.setattr(_EvictingTurn, "victim", wt.index[keys[1]])
    monkeypatch.setattr(_EvictingTurn, "store", wt)
    monkeypatch.setattr(_EvictingTurn, "redis", redis)
    assert await wt.commit_put(CLIENT, lease) == 2
    assert redis.batches == [keys[:1]]


async def test_a_written_through_block_is_not_sent_again_when_it_leaves_nvme(
        wt: TieredStore, client: ArenaMapping, redis: FakeRedis) -> None:
    """With write-through every commit is in Redis already: a block leaving nvme is not
    sent again (mutant: the demoter not told of write-through: each block written twice)."""
    keys = chain(1)
    await put(wt, client, keys, durable=True)
    redis.finish()
    meta = wt.index[keys[0]]
    wt.cpu.drop(meta)
    await wt.demoter.evict_nvme(keys[0])
    assert not meta.in_nvme
    assert redis.batches == [keys] and redis.copies == []


async def test_a_delete_right_after_a_written_through_put_deletes_it(
        wt: TieredStore, client: ArenaMapping, redis: FakeRedis) -> None:
    """A delete first drops the key's queued writes (releasing their pins), so it can
    delete blocks just written through, and counts what Redis held (mutants: the queued
    writes kept: every pinned block skipped; Redis' count ignored)."""
    keys = chain(1)
    await put(wt, client, keys)
    assert redis.held
    assert await wt.delete(DIGEST, FP, keys) == 1
    assert keys[0] not in wt.index and not redis.held
    other = chain(1, start=3)
    redis.frames[other[0]] = payload(other[0])   # only in Redis
    assert await wt.delete(DIGEST, FP, other) == 1


async def test_a_drain_waits_for_a_stalled_redis_no_longer_than_its_deadline(
        wt: TieredStore, clock: FakeClock, redis: FakeRedis) -> None:
    """Shutdown's flush of the Redis queue is bounded by the drain's deadline (mutant: no
    timeout: a stalled Redis held a SIGTERM drain for ever)."""
    redis.stall = asyncio.Event()
    await asyncio.wait_for(wt.drain(clock() + 0.2), timeout=3.0)


async def test_write_through_without_a_redis_tier_is_off(
        arena: Arena, nvme: NvmeTier, clock: FakeClock, client: ArenaMapping) -> None:
    """``redis_write_through`` without a Redis tier writes nothing through (mutant: the
    writer told to: every commit failed on the missing tier)."""
    s = TieredStore(arena, nvme=nvme, redis_write_through=True, clock=clock)
    assert s.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    try:
        keys = chain(2)
        await put(s, client, keys)
        assert all(s.index[k].in_cpu for k in keys)
    finally:
        await s.drain(clock() + 5)
