"""Striped writes against a real redis-server, at edges the mutation review found
unpinned: a head is sent only once every stripe of its block was stored, and a rewrite
whose head the server refuses leaves the version it meant to replace whole (its stripes
are deleted only once a new head is stored) and takes its own stripes back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvtier.frame import STRIPE_BYTES, STRIPED_MIN_BYTES
from kvtier.tiers import redis_writes
from kvtier.tiers.redis_blocks import WireSet
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import (
    LAYOUT_FP,
    NS,
    blocks,
    cfg_for,
    eventually,
    put_all,
    read_exact,
    running,
)

LARGE = STRIPED_MIN_BYTES + STRIPE_BYTES   # a head and two stripes
# may read every kvtier key and write only stripes (key:tag:i): each head SET is refused
STRIPES_ONLY = ["on", ">pw", "resetkeys", "%R~kvtier:*", "%W~kvtier:*:*", "+@all"]
# ... and only heads (kvtier: and 32 hex digits): each stripe SET is refused
HEADS_ONLY = ["on", ">pw", "resetkeys", "%R~kvtier:*", "%W~kvtier:" + "?" * 32, "+@all"]


async def test_a_rewrite_whose_head_is_refused_keeps_the_old_version_whole(
        redis_server: RedisServer) -> None:
    """Version 1 stored; a rewrite's stripes stored and its head refused (NOPERM here;
    -OOM alike). The old head still names the old stripes: deleting them as "replaced"
    would leave a head without its stripes (a lookup hit every get misses). The
    rewrite's own stripes, named by no head, are deleted."""
    keys, old = blocks(1, LARGE, seed=9)
    _, new = blocks(1, LARGE, seed=10)
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "kv", *STRIPES_ONLY)
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        await put_all(tier, keys, old)
    url = f"redis://kv:pw@127.0.0.1:{redis_server.port}/0"
    async with running(cfg_for(url, op_timeout_s=5.0)) as tier:
        tier.submit(NS, keys[0], LAYOUT_FP, memoryview(new[0]))
        assert await tier.flush(timeout=10)
        assert tier.counters.dropped_writes == 1
        assert await tier.written(keys, 0.0) == [False]
        assert admin.dbsize() == 3   # the old head and its two stripes, nothing else
        await read_exact(tier, keys, old, LARGE)


async def test_a_head_whose_stripe_was_refused_is_never_sent(
        redis_server: RedisServer) -> None:
    """A server that refuses a stripe but would take the head (NOPERM on stripe keys
    here): the head must not be stored, or it promises a block no read can assemble (a
    lookup hit, then a miss and a cleanup, on every node). Nothing stays; the write
    failed and is counted."""
    keys, data = blocks(1, LARGE, seed=11)
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "kv", *HEADS_ONLY)
    url = f"redis://kv:pw@127.0.0.1:{redis_server.port}/0"
    async with running(cfg_for(url, op_timeout_s=5.0)) as tier:
        tier.submit(NS, keys[0], LAYOUT_FP, memoryview(data[0]))
        assert await tier.flush(timeout=10)
        assert tier.counters.dropped_writes == 1
        assert await tier.written(keys, 0.0) == [False]
    assert admin.dbsize() == 0


async def test_a_stored_batch_restarts_the_count_of_soft_failures(
        redis_server: RedisServer) -> None:
    """Two timeouts, then a batch of writes stored: the server answered, so one more
    timeout leaves the tier up (counted from a stored batch, not from the last read)."""
    keys, data = blocks(2, 4096, seed=12)
    async with running(cfg_for(redis_server.url)) as tier:
        tier._failed(TimeoutError("slow"))
        tier._failed(TimeoutError("slow"))
        await put_all(tier, keys, data)
        tier._failed(TimeoutError("slow"))
        assert tier.up


async def test_a_batch_that_fails_keeps_its_buffers_until_its_stripes_are_sent(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncompressed stripes go out while the head is framed. When framing fails (a bug),
    the borrowed buffers are released only once that send is over: released earlier,
    the arena slot could be reused while a worker thread still sends it to Redis."""
    keys, data = blocks(1, LARGE, seed=13)
    events: list[str] = []

    def boom(*_args: object) -> None:
        raise RuntimeError("framing failed")

    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        send = tier._send_sets

        async def slow(sets: list[WireSet]) -> list[Any]:
            await asyncio.sleep(0.2)
            replies = await send(sets)
            events.append("sent")
            return replies

        monkeypatch.setattr(tier, "_send_sets", slow)
        monkeypatch.setattr(redis_writes, "frame_pending", boom)
        tier.submit(NS, keys[0], LAYOUT_FP, memoryview(data[0]),
                    release=lambda: events.append("released"))
        assert await tier.flush(timeout=5)
        await eventually(lambda: "released" in events, timeout=5)
        assert events == ["sent", "released"]
        assert tier.counters.dropped_writes == 1
