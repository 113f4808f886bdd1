"""Large blocks stored as stripes in a real redis-server (kvtier.tiers.redis_stripes): exact
bytes and checksums back, a head only ever written after its stripes, deletes that take
the stripes along, and every broken stripe a miss with nothing unverified left behind."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from kvtier.frame import (
    FLAG_STRIPE_TAG,
    FLAG_STRIPED,
    HEADER_SIZE,
    STRIPE_BYTES,
    STRIPED_MIN_BYTES,
    FrameHeader,
)
from kvtier.tiers import redis_stripes
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_blocks import BlockRead
from kvtier.tiers.redis_resp import ErrorReply
from kvtier.tiers.redis_wire import Conn
from tests.support.redis_servers import LocalCluster, RedisServer, running_cluster
from tests.support.redis_tier import (
    LAYOUT_FP,
    NS,
    blocks,
    buffers,
    cfg_for,
    head_at,
    put_all,
    read_exact,
    rkey,
    running,
    stored_bytes,
)

if TYPE_CHECKING:
    from kvtier.tiers.redis_reads import RedisReads

SIZE = STRIPED_MIN_BYTES + 3 * STRIPE_BYTES // 2 + 4096   # head + 3 stripes, the last short
STRIPES = -(-SIZE // STRIPE_BYTES)


@contextlib.asynccontextmanager
async def stored(server: RedisServer, n: int, seed: int
                 ) -> AsyncIterator[tuple[RedisTier, list[bytes], list[bytes]]]:
    """A started tier that stored ``n`` blocks of SIZE bytes: (tier, keys, payloads)."""
    keys, data = blocks(n, size=SIZE, seed=seed)
    async with running(cfg_for(server.url, op_timeout_s=10.0)) as tier:
        await put_all(tier, keys, data)
        yield tier, keys, data


def stripe_keys(admin: Any, key: bytes) -> list[bytes]:
    """The stripe keys of the block stored at ``key`` (named after its write's tag)."""
    header = head_at(admin, key)
    assert header.flags & FLAG_STRIPE_TAG
    return [rkey(key) + b":%016x:%d" % (header.seq, i) for i in range(1, STRIPES)]


async def test_a_large_block_is_stored_in_stripes_and_read_back_exactly(
        redis_server: RedisServer) -> None:
    admin = redis_server.client()
    async with stored(redis_server, 3, seed=21) as (tier, keys, data):
        assert admin.dbsize() == 3 * STRIPES
        for key, raw in zip(keys, data, strict=True):
            head = stored_bytes(admin.get(rkey(key)))
            header = FrameHeader.unpack(head[:HEADER_SIZE])
            assert header.flags & FLAG_STRIPED and header.payload_len == SIZE
            assert head[HEADER_SIZE:] == raw[:STRIPE_BYTES]        # stripe 0 after the header
            assert b"".join(stored_bytes(admin.get(k))
                            for k in stripe_keys(admin, key)) == raw[STRIPE_BYTES:]
        admin.config_resetstat()
        await read_exact(tier, keys, data, SIZE)
        calls = admin.info("commandstats")
        assert calls["cmdstat_get"]["calls"] == 3 * (STRIPES - 1)        # stripes 1..
        assert calls["cmdstat_getrange"]["calls"] == 3 * 2               # header, stripe 0
        assert tier.counters.checksum_failures == 0
        # blocks under the threshold are stored whole, as before
        small_keys, small = blocks(2, size=STRIPED_MIN_BYTES - 4096, seed=22)
        await put_all(tier, small_keys, small)
        assert not head_at(admin, small_keys[0]).flags & FLAG_STRIPED
        # a delete takes the stripes along and counts blocks, not keys
        assert await tier.delete(keys + small_keys, namespace=NS) == 5
        assert admin.dbsize() == 0


async def test_a_corrupt_stripe_is_a_counted_miss_and_the_block_is_deleted(
        redis_server: RedisServer) -> None:
    admin = redis_server.client()
    async with stored(redis_server, 2, seed=23) as (tier, keys, data):
        parts = stripe_keys(admin, keys[1])
        admin.setrange(parts[-1], 100, b"\xff\x00\xff")
        outs = buffers(2, SIZE)
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 1
        assert bytes(outs[0]) == data[0]
        assert bytes(outs[1]) == bytes(SIZE)                # nothing unverified left behind
        assert tier.counters.checksum_failures == 1
        assert not any(admin.exists(k) for k in [rkey(keys[1]), *parts])
        assert admin.exists(rkey(keys[0]))


async def test_a_lost_stripe_is_a_miss_and_the_rest_of_the_block_goes(
        redis_server: RedisServer) -> None:
    admin = redis_server.client()
    async with stored(redis_server, 1, seed=24) as (tier, keys, _data):
        admin.delete(stripe_keys(admin, keys[0])[0])               # as an eviction in Redis would
        out = buffers(1, SIZE)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert bytes(out[0]) == bytes(SIZE)
        assert tier.counters.checksum_failures == 0
        assert tier.counters.evictions["expired"] == 1
        assert admin.dbsize() == 0                          # the head no longer promises it


async def test_a_block_rewritten_while_read_is_a_miss_and_is_kept(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, data = blocks(1, size=SIZE, seed=25)
    admin = redis_server.client()
    real = redis_stripes._read_stripes

    async def rewritten_meanwhile(tier: RedisReads, rk: bytes, header: FrameHeader,
                                  out: memoryview) -> BlockRead:
        # another node stores the same key while this read is between its stripes
        admin.setrange(stripe_keys(admin, keys[0])[1], 0, b"\x01\x02\x03")
        newer = dataclasses.replace(header, seq=header.seq + 1)
        admin.setrange(rk, 0, newer.pack())
        return await real(tier, rk, header, out)

    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        await put_all(tier, keys, data)
        monkeypatch.setattr(redis_stripes, "_read_stripes", rewritten_meanwhile)
        out = buffers(1, SIZE)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert bytes(out[0]) == bytes(SIZE)
        assert tier.counters.checksum_failures == 0
        assert admin.dbsize() == STRIPES                     # another writer's: kept


async def test_a_head_is_written_only_after_all_its_stripes(
        redis_server: RedisServer) -> None:
    """A server that refuses a stripe (out of memory) leaves no head promising the block."""
    keys, data = blocks(1, size=SIZE, seed=26)
    admin = redis_server.client()
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", used + STRIPE_BYTES + STRIPE_BYTES // 2)
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        for key, payload in zip(keys, data, strict=True):
            tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
        await tier.flush(timeout=10)
        assert not admin.exists(rkey(keys[0]))
        assert tier.counters.dropped_writes == 1
        assert (await tier.written(keys, 0.0)) == [False]
        out = buffers(1, SIZE)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0


async def test_compressed_large_blocks_are_striped_by_their_encoded_size(
        redis_server: RedisServer) -> None:
    rng = np.random.default_rng(27)
    sparse = np.zeros(SIZE // 2, np.float16)                 # compresses below one stripe
    sparse[rng.integers(0, sparse.size, 1000)] = 1.0
    _, dense = blocks(1, size=SIZE, seed=28)                 # stays several stripes
    keys = [rng.bytes(16) for _ in range(2)]
    data = [sparse.tobytes(), dense[0]]
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, codec="shuffle-lz4",
                               op_timeout_s=10.0)) as tier:
        await put_all(tier, keys, data)
        for key in keys:
            header = head_at(admin, key)
            assert header.flags & FLAG_STRIPED and header.raw_len == SIZE
            assert admin.exists(rkey(key) + b":%016x:1" % header.seq) == (
                    header.payload_len > STRIPE_BYTES)
        outs = buffers(2, SIZE)
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 2
        assert [bytes(o) for o in outs] == data


async def test_stripes_spread_over_a_clusters_masters(tmp_path: Path) -> None:
    keys, data = blocks(2, size=SIZE, seed=29)
    with running_cluster(tmp_path / "cluster") as cluster:
        assert isinstance(cluster, LocalCluster)
        async with running(cfg_for(cluster.url, op_timeout_s=10.0)) as tier:
            await put_all(tier, keys, data)
            held = [node.client().dbsize() for node in cluster.live_masters()]
            assert sum(held) == 2 * STRIPES and sum(1 for n in held if n) >= 2
            outs = buffers(2, SIZE)
            assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 2
            assert [bytes(o) for o in outs] == data
            assert await tier.delete(keys, namespace=NS) == 2
            assert sum(node.client().dbsize() for node in cluster.live_masters()) == 0


async def test_a_stripe_that_errors_is_a_miss_that_deletes_nothing(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error reply about the server (-LOADING, -OOM) says nothing of the block: no
    stripe is deleted, nothing is left in the buffer, and the error is counted. (A stripe
    of another type, WRONGTYPE, is corrupt: see the test after the next.)"""
    admin = redis_server.client()
    async with stored(redis_server, 1, seed=30) as (tier, keys, _data):
        victim = stripe_keys(admin, keys[0])[1]
        get_exact = Conn.get_exact

        def loading(conn: Conn, key: bytes, dest: memoryview) -> object:
            if key == victim:
                return ErrorReply("LOADING Redis is loading the dataset in memory")
            return get_exact(conn, key, dest)

        monkeypatch.setattr(Conn, "get_exact", loading)
        out = buffers(1, SIZE)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert bytes(out[0]) == bytes(SIZE)
        assert tier.counters.errors >= 1 and tier.counters.checksum_failures == 0
        assert admin.dbsize() == STRIPES


async def test_the_stripes_of_a_block_redis_refused_are_deleted(
        redis_server: RedisServer) -> None:
    """A server at its maxmemory (noeviction) takes some stripes and refuses the others
    (-OOM; 10 MiB of room: a stripe was left on 7.0): the head is never written, so no
    read will ever name the stripes it took. They are deleted at once instead of holding
    the server's memory for good (no TTL)."""
    admin = redis_server.client()
    admin.config_set("maxmemory", admin.info("memory")["used_memory"] + 10 * 2**20)
    keys, data = blocks(1, size=SIZE, seed=31)
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        tier.submit(NS, keys[0], LAYOUT_FP, memoryview(data[0]))
        await tier.flush(timeout=10)
        assert tier.counters.dropped_writes == 1
        assert admin.dbsize() == 0
        admin.config_set("maxmemory", 0)
        await put_all(tier, keys, data)                     # room again: stored whole
        await read_exact(tier, keys, data, SIZE)


async def test_a_stripe_turned_into_another_type_is_corrupt_and_the_block_goes(
        redis_server: RedisServer) -> None:
    """Another writer replaces a stripe with a list (found by review): its GET answered
    WRONGTYPE, an error read that deleted nothing, and ``whole_prefix`` (EXISTS: 1 for any
    type) called the block whole; it stayed a lookup hit that every get missed. Now the
    stripe is corrupt: counted, one miss, the block deleted; a commit's check says not
    whole."""
    admin = redis_server.client()
    async with stored(redis_server, 2, seed=25) as (tier, keys, data):
        part = stripe_keys(admin, keys[0])[0]
        admin.delete(part)
        admin.rpush(part, b"x")
        assert await tier.whole_prefix(keys, namespace=NS) == 0
        assert await tier.exists_prefix(keys, namespace=NS) == 2   # heads only, as before
        assert await tier.get_into(keys, buffers(2, SIZE), namespace=NS,
                                   layout_fp=LAYOUT_FP) == 0
        assert tier.counters.checksum_failures == 1 and tier.up
        assert not any(admin.exists(k) for k in [rkey(keys[0]), part])
        assert await tier.exists_prefix(keys, namespace=NS) == 0
        await read_exact(tier, keys[1:], data[1:], SIZE)
