"""Mutation-review survivors of the synchronous Redis commit (kvtier/daemon/redis_sync.py):
what a kv_producer's ``put_commit`` with ``redis_sync_s`` promises, pinned where no test
noticed a decision broken. Never report a block visible that Redis lacks; stay within the
bound; count every sync that ends short. Each docstring names the mutant that survived.
Redis is ``SyncRedis``, an in-process stand-in for what ``RedisSync`` asks of a
``RedisTier`` (no server): which writes ended and how, what a probe finds, an outage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

import kvtier.daemon.redis_sync as redis_sync
from kvtier.daemon.redis_sync import RedisSync
from kvtier.index import SlotState
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.redis_queue import Borrowed
from tests.support.control import connection, request, server
from tests.support.store import (
    BLOCK,
    DIGEST,
    LAYOUT,
    NAMESPACE,
    FakeClock,
    chain,
    payload,
    put,
)


class SyncRedis:
    """The Redis side of a sync, in memory: ``frames`` what Redis holds; ``outcomes``
    each key's last write (stored or not, when it ended); ``submit_many`` writes at once
    (``auto``) or keeps the blocks in ``held``; ``stall`` makes probes wait for it."""

    def __init__(self) -> None:
        self.up = True
        self.healing_since: float | None = None
        self.frames: dict[bytes, bytes] = {}
        self.outcomes: dict[bytes, tuple[bool, float]] = {}
        self.held: list[Borrowed] = []
        self.sent: list[bytes] = []
        self.auto = True
        self.stall: asyncio.Event | None = None

    def submit_many(self, blocks: Sequence[Borrowed]) -> None:
        for b in blocks:
            self.sent.append(b.key)
            if self.auto:
                self.frames[b.key] = bytes(b.payload)
                self.outcomes[b.key] = (True, time.monotonic())
                b.release()
            else:
                self.held.append(b)

    async def written(self, keys: Sequence[bytes], since: float) -> list[bool | None]:
        out: list[bool | None] = []
        for k in keys:
            o = self.outcomes.get(k)
            out.append(None if o is None or o[1] < since else o[0])
        return out

    async def whole_prefix(self, keys: Sequence[bytes], *, namespace: bytes) -> int:
        if self.stall is not None:
            await self.stall.wait()
        if not self.up:
            return 0
        return next((i for i, k in enumerate(keys) if k not in self.frames), len(keys))

    async def room(self, n: int, timeout: float) -> int:
        return n

    async def forget_writes(self, keys: Sequence[bytes], *, namespace: bytes) -> int:
        return 0

    async def flush(self, timeout: float | None = None) -> bool:
        return True

    def release_held(self) -> None:
        held, self.held = self.held, []
        for b in held:
            b.release()


@pytest.fixture
def redis(store: TieredStore) -> SyncRedis:
    """``store`` with ``SyncRedis`` as its Redis tier, write-through off (the commits here
    queue nothing: what a sync sends, it sends itself)."""
    tier = SyncRedis()
    store.redis = tier  # type: ignore[assignment]
    store.transfers.redis = tier  # type: ignore[assignment]
    store.redis_write_through = False
    return tier


async def _sync(store: TieredStore, keys: list[bytes], timeout_s: float = 2.0, *,
                since: float | None = None,
                sync: RedisSync | None = None) -> redis_sync.SyncResult:
    s = sync if sync is not None else RedisSync(store)
    began = time.monotonic() if since is None else since
    return await asyncio.wait_for(s.sync(DIGEST, keys, [], timeout_s, began), timeout=10.0)


async def test_a_sync_cut_by_its_bound_reports_only_what_was_confirmed(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The head in Redis, the tail's probe stalled: the sync ends at its bound with the
    head visible, not complete, counted as given up for "timeout" (mutants: no bound; the
    reported prefix one block longer than confirmed; the give-up or its reason not
    counted)."""
    keys = chain(2)
    await put(store, client, keys)
    redis.frames = {keys[0]: payload(keys[0])}
    redis.auto = False   # the tail's write does not end: the probe after it stalls
    stall = redis.stall = asyncio.Event()
    rs = RedisSync(store)
    probes = 0
    real_probe = redis.whole_prefix

    async def first_free(keys_: Sequence[bytes], *, namespace: bytes) -> int:
        nonlocal probes
        probes += 1
        if probes == 1:
            return next((i for i, k in enumerate(keys_) if k not in redis.frames), len(keys_))
        return await real_probe(keys_, namespace=namespace)

    monkeypatch.setattr(redis, "whole_prefix", first_free)
    t0 = time.monotonic()
    try:
        done = await _sync(store, keys, 0.2, sync=rs)
    finally:
        stall.set()
        redis.release_held()
    assert time.monotonic() - t0 < 5.0
    assert (done.visible, done.complete, done.reason) == (1, False, "timeout")
    st = rs.stats()
    assert (st["commits"], st["blocks"], st["gave_up"]) == (1, 1, 1)
    assert st["gave_up_by_reason"] == {"timeout": 1}


async def test_the_bound_is_capped_at_max_sync_s(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller's bound above ``MAX_SYNC_S`` is cut to it (mutant: the cap dropped: a
    redis_sync_s of 3600 held the commit an hour)."""
    monkeypatch.setattr(redis_sync, "MAX_SYNC_S", 0.2)
    keys = chain(1)
    await put(store, client, keys)
    stall = redis.stall = asyncio.Event()
    t0 = time.monotonic()
    try:
        done = await _sync(store, keys, 3600.0)
    finally:
        stall.set()
    assert time.monotonic() - t0 < 5.0
    assert (done.visible, done.complete, done.reason) == (0, False, "timeout")


async def test_without_a_redis_tier_a_chain_is_never_synced(
        store: TieredStore, client: ArenaMapping) -> None:
    """A daemon without Redis answers "off", not synced, and counts the give-up; only an
    empty chain is trivially complete (mutants: "off" reported complete; an empty chain
    reported incomplete)."""
    keys = chain(1)
    await put(store, client, keys)
    rs = RedisSync(store)
    done = await _sync(store, keys, sync=rs)
    assert (done.visible, done.complete, done.reason) == (0, False, "off")
    assert rs.stats()["gave_up_by_reason"] == {"off": 1}
    store.redis = SyncRedis()  # type: ignore[assignment]
    empty = await _sync(store, [], sync=rs)
    assert (empty.visible, empty.complete, empty.reason) == (0, True, "ok")
    assert rs.stats()["gave_up"] == 1


async def test_a_block_sent_by_the_sync_counts_after_the_head_it_follows(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis) -> None:
    """Head in Redis already (a probe confirms it), the tail sent by the sync and
    confirmed by its write's reply: both visible, complete (mutants: the tail's count
    replacing the head's; the tail looked up one key too far)."""
    keys = chain(3)
    await put(store, client, keys)
    redis.frames = {keys[0]: payload(keys[0])}
    done = await _sync(store, keys)
    assert (done.visible, done.complete, done.reason) == (3, True, "ok")
    assert redis.sent == keys[1:]
    assert all(redis.frames[k] == payload(k) for k in keys)


async def test_a_failed_write_ends_the_confirmed_prefix(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis) -> None:
    """This daemon's write of the head failed, the tail's succeeded: nothing is visible
    (a chain with a hole is no prefix), even though the tail is in Redis (mutant: a failed
    write skipped, later ones still counted)."""
    keys = chain(2)
    await put(store, client, keys)
    store.cpu.drop(store.index[keys[0]])   # not in the arena: the sync cannot resend it
    now = time.monotonic()
    redis.outcomes = {keys[0]: (False, now), keys[1]: (True, now)}
    redis.frames = {keys[1]: payload(keys[1])}
    done = await _sync(store, keys, since=now - 1)
    assert (done.visible, done.complete) == (0, False)
    assert done.reason == "missing"


async def test_a_write_that_ended_before_the_commit_began_is_checked_in_redis(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis) -> None:
    """A block this daemon wrote to Redis before the commit began, since lost there
    (evicted, expired) and no longer in the arena, is asked of Redis, not confirmed by the
    old reply (mutant: every past reply counted: reported visible, it is not)."""
    keys = chain(1)
    await put(store, client, keys)
    store.cpu.drop(store.index[keys[0]])
    redis.outcomes = {keys[0]: (True, time.monotonic() / 2)}   # an old write, lost
    done = await _sync(store, keys)
    assert (done.visible, done.complete, done.reason) == (0, False, "missing")


async def test_a_block_being_loaded_into_the_arena_is_not_sent(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis) -> None:
    """A chain block whose arena slot is still being filled (LOADING from nvme) is not
    sent from it: its bytes are not the block's yet (mutant: every block with a slot sent,
    the slot's stale bytes written to Redis under the block's key)."""
    keys = chain(1)
    await put(store, client, keys, durable=True)
    meta = store.index[keys[0]]
    store.cpu.drop(meta)
    assert await store.promoter.from_nvme(meta, prefetched=True)
    assert meta.cpu_state is SlotState.LOADING
    done = await _sync(store, keys, 0.2)
    await store.promoter.settle(10)
    assert keys[0] not in redis.sent
    assert not done.complete


async def test_a_complete_sync_does_not_wait_for_an_unrelated_outage(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis) -> None:
    """A chain confirmed whole during an outage elsewhere (a slot healing) answers at once
    (mutant: the ``visible == len(chain)`` exit dropped: it waited out the outage until its
    bound and reported a timeout)."""
    keys = chain(2)
    await put(store, client, keys)
    redis.healing_since = 5.0
    t0 = time.monotonic()
    done = await _sync(store, keys, 1.0)
    assert (done.visible, done.complete, done.reason) == (2, True, "ok")
    assert time.monotonic() - t0 < 0.9   # (the bound is 1.0)


async def test_an_outage_that_cost_one_sync_its_bound_is_not_waited_out_again(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis) -> None:
    """A block Redis lacks (not in the arena, cannot be resent) while a slot heals: the
    first sync waits for the heal until its bound; a second sync in the same outage gives
    up at once, "missing" (mutants: the outage not remembered; remembered but not
    honoured: every sync waiting its whole bound)."""
    keys = chain(1)
    await put(store, client, keys)
    store.cpu.drop(store.index[keys[0]])
    redis.healing_since = 5.0
    rs = RedisSync(store)
    first = await _sync(store, keys, 0.2, sync=rs)
    assert (first.complete, first.reason) == (False, "timeout")
    t0 = time.monotonic()
    second = await _sync(store, keys, 2.0, sync=rs)
    assert time.monotonic() - t0 < 1.5   # (the bound is 2.0)
    assert (second.visible, second.complete, second.reason) == (0, False, "missing")
    assert rs.stats()["gave_up_by_reason"] == {"timeout": 1, "missing": 1}


async def test_a_sync_cut_while_waiting_for_a_heal_reports_what_its_resend_confirmed(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis) -> None:
    """Head in Redis, block 1 resent and confirmed, block 2 gone from the arena while a
    slot heals: the bound ends the wait, and the result counts the two confirmed blocks
    (mutant: the progress not updated after the resend, reporting 1)."""
    keys = chain(3)
    await put(store, client, keys)
    redis.frames = {keys[0]: payload(keys[0])}
    store.cpu.drop(store.index[keys[2]])
    redis.healing_since = 5.0
    done = await _sync(store, keys, 0.3)
    assert (done.visible, done.complete, done.reason) == (2, False, "timeout")
    assert redis.sent == [keys[1]]


async def test_a_heal_that_ends_lets_the_sync_send_again(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis) -> None:
    """Outage over mid-sync: the sync looks again after the heal and finishes (the held
    write failed with the dead master; resent after the heal, it lands)."""
    keys = chain(1)
    await put(store, client, keys)
    redis.auto = False
    redis.healing_since = 5.0

    async def heal() -> None:
        await asyncio.sleep(0.2)
        now = time.monotonic()
        for b in redis.held:
            redis.outcomes[b.key] = (False, now)
        redis.release_held()
        redis.auto = True
        redis.healing_since = None

    healer = asyncio.create_task(heal())
    done = await _sync(store, keys, 3.0)
    await healer
    assert (done.visible, done.complete, done.reason) == (1, True, "ok")
    assert redis.sent == keys * 2
    assert redis.frames[keys[0]] == payload(keys[0])


async def test_a_sync_to_a_down_tier_gives_up_at_once_and_sends_nothing(
        store: TieredStore, client: ArenaMapping, redis: SyncRedis) -> None:
    """Redis down: the sync answers "down" at once, counted, sending nothing (a write
    queued for a down tier is a copy of the block, kept until it is back) (mutant: the
    ``up`` check dropped: the chain copied into the queue on every synced commit)."""
    keys = chain(2)
    await put(store, client, keys)
    redis.up = False
    rs = RedisSync(store)
    done = await _sync(store, keys, sync=rs)
    assert (done.visible, done.complete, done.reason) == (0, False, "down")
    assert redis.sent == []
    assert rs.stats()["gave_up_by_reason"] == {"down": 1}


class _FullQueueRedis(SyncRedis):
    """A write queue that never has room (each wait for it lasts its whole timeout), and
    probes that never answer: a Redis too slow for any synchronous commit."""

    async def room(self, n: int, timeout: float) -> int:
        await asyncio.sleep(max(0.0, timeout))
        return 0


async def test_a_synced_commit_answers_within_its_redis_sync_s(
        arena: Arena, nvme: NvmeTier, clock: FakeClock, client: ArenaMapping,
        tmp_path: Path) -> None:
    """``put_commit`` with ``redis_sync_s`` answers "once the put's whole chain is in
    Redis, or that many seconds passed" (kvtier.daemon.ops): with a full write queue and a
    stalled probe, the whole commit ends within the bound (plus scheduling slack). It took
    twice the bound before the fix: the wait for room in the write queue spent the bound,
    then the sync started a fresh one (found by a mutation review)."""
    tier = _FullQueueRedis()
    tier.auto = False
    stall = tier.stall = asyncio.Event()
    s = TieredStore(arena, nvme=nvme, redis=tier,  # type: ignore[arg-type]
                    redis_write_through=True, prefetch_wait="wait", clock=clock)
    assert s.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    srv = server(s, arena, tmp_path)
    conn = connection(srv)
    keys = chain(1)
    try:
        prep = await srv._put_prepare(conn, request(keys))
        for key, off in zip(keys, prep["offsets"], strict=True):
            client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
        bound = 0.5
        t0 = time.monotonic()
        reply = await asyncio.wait_for(
            srv._put_commit(conn, {"lease": prep["lease"], "redis_sync_s": bound}), 10.0)
        took = time.monotonic() - t0
        assert (reply["redis_synced"], reply["redis_sync_reason"]) == (False, "timeout")
        assert took < bound * 1.5, f"a {bound}s synced commit took {took:.2f}s"
    finally:
        stall.set()
        tier.release_held()
        await s.drain(clock() + 5)
