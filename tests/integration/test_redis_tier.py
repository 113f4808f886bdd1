"""RedisTier against real redis-server processes: single server, two nodes, a 3-master
cluster, a server killed and restarted, corrupted values, AUTH/ACL and TLS."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.frame import HEADER_SIZE, FrameHeader, make_header
from kvtier.layout import KVLayout
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_queue import Borrowed, PendingWrite, WriteQueue
from tests.support.redis_servers import (
    LocalCluster,
    RedisServer,
    TlsCerts,
    free_port,
    make_certs,
    redis_server_or_skip,
    running_cluster,
    start_server,
    tls_terminator,
    tls_unsupported_reason,
)
from tests.support.redis_tier import (
    BLOCK,
    LAYOUT_FP,
    NS,
    blocks,
    buffers,
    cfg_for,
    eventually,
    put_all,
    read_exact,
    running,
    stored_bytes,
)

MiB = 1 << 20


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path / "cluster") as cluster:
        yield cluster


# --- single server ------------------------------------------------------------------------

async def test_put_lookup_get_delete(redis_server: RedisServer) -> None:
    keys, data = blocks(6)
    async with running(cfg_for(redis_server.url)) as tier:
        assert tier.up and tier.backend == "redis"
        await put_all(tier, keys[:5], data[:5])
        assert await tier.exists_prefix(keys) == 5          # key 5 was never written
        assert await tier.exists_prefix([keys[0], keys[5], keys[1]]) == 1
        outs = buffers(6)
        got = await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP)
        assert got == 5
        assert all(bytes(outs[i]) == data[i] for i in range(5))
        assert tier.fetched_blocks == 5 and tier.fetch_missed_blocks == 1
        # a fetch is not a lookup: the store counts hits and misses from its probe
        assert tier.counters.hit_blocks == 0 and tier.counters.miss_blocks == 0
        assert tier.counters.bytes_written >= 5 * (BLOCK + HEADER_SIZE)
        assert tier.counters.bytes_read >= 5 * BLOCK
        assert await tier.delete(keys[2:3]) == 1
        assert await tier.exists_prefix(keys) == 2
        assert tier.counters.errors == 0
    # key layout: prefix + hex, no hash tags
    assert redis_server.client().exists(b"kvtier:" + keys[0].hex().encode())


async def test_get_into_stops_at_first_miss_across_batches(redis_server: RedisServer) -> None:
    keys, data = blocks(80, size=4096)
    async with running(cfg_for(redis_server.url)) as tier:
        await put_all(tier, keys[:70], data[:70])
        await tier.delete([keys[50]])
        outs = buffers(80, 4096)
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 50
        assert await tier.exists_prefix(keys) == 50
        assert [bytes(o) for o in outs[:50]] == data[:50]
        assert bytes(outs[50]) == bytes(4096)  # nothing written past the miss


async def test_submit_copies_payload_and_sets_ttl(redis_server: RedisServer) -> None:
    keys, data = blocks(1)
    source = bytearray(data[0])
    async with running(cfg_for(redis_server.url, ttl_s=120)) as tier:
        tier.submit(NS, keys[0], LAYOUT_FP, memoryview(source))
        source[:] = bytes(len(source))  # the arena slot is reused right away
        assert await tier.flush(timeout=10)
        out = buffers(1)
        assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 1
        assert bytes(out[0]) == data[0]
    ttl = redis_server.client().ttl(b"kvtier:" + keys[0].hex().encode())
    assert 0 < ttl <= 120


async def test_close_drains_pending_writes(redis_server: RedisServer) -> None:
    keys, data = blocks(8)
    tier = RedisTier(cfg_for(redis_server.url))
    await tier.start()
    for key, payload in zip(keys, data, strict=True):
        tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
    await tier.close()
    assert redis_server.client().dbsize() == 8


async def test_write_queue_drops_oldest_when_full(redis_server: RedisServer) -> None:
    keys, data = blocks(10)
    async with running(cfg_for(redis_server.url, write_queue_blocks=4)) as tier:
        for key, payload in zip(keys, data, strict=True):  # no await: the writer cannot run
            tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
        assert tier.stats_extra()["queue_depth"] == 4
        assert tier.counters.dropped_writes == 6
        assert await tier.flush(timeout=10)
        assert await tier.exists_prefix(keys[6:]) == 4
        assert await tier.exists_prefix(keys[:6]) == 0


def test_write_queue_unit() -> None:
    q = WriteQueue(3)
    items = [PendingWrite.copy_of(b"k%d" % i, NS, bytes(16), 0, i, memoryview(b"x" * 10))
             for i in range(5)]
    dropped = [q.push(it) for it in items]
    assert [[d.seq for d in ds] for ds in dropped] == [[], [], [], [0], [1]]
    assert q.dropped == 2 and q.queued_bytes == 30
    assert [it.seq for it in q.take(2, 1 << 20)] == [2, 3]
    assert [it.seq for it in q.take(9, 1)] == [4]  # at least one, even over the byte bound
    assert len(q) == 0 and q.queued_bytes == 0


@pytest.mark.parametrize("codec", ["none", "lz4", "shuffle-lz4", "shuffle-zstd", "auto"])
async def test_codecs_round_trip_through_redis(redis_server: RedisServer, codec: str) -> None:
    if codec == "shuffle-zstd":
        pytest.importorskip("zstandard")
    keys, data = blocks(20, seed=3)
    async with running(cfg_for(redis_server.url, codec=codec)) as tier:
        await put_all(tier, keys, data)
        outs = buffers(20)
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 20
        assert [bytes(o) for o in outs] == data
        ratio = tier.stats_extra()["codec_ratio"]
        if codec in ("shuffle-zstd", "auto"):
            assert ratio > 1.15, ratio  # fp16 normal data: byte planes compress ~1.18x
        assert tier.counters.checksum_failures == 0


async def test_shuffle_width_comes_from_the_namespace_layout(redis_server: RedisServer) -> None:
    """Each queued block carries its namespace's element width (use_layouts); an unknown
    namespace falls back to elem_bytes_hint (2); blocks round-trip exactly either way."""
    fp32 = KVLayout(num_layers=1, num_kv_heads=2, head_dim=128, dtype="float32",
                    tokens_per_block=32)   # 32 KiB blocks
    other = bytes(16)
    keys, data = blocks(3, size=fp32.block_bytes, seed=5)
    async with running(cfg_for(redis_server.url, codec="shuffle-lz4")) as tier:
        tier.use_layouts({NS: fp32}.get)
        tier.submit(NS, keys[0], LAYOUT_FP, memoryview(data[0]))
        tier.submit(other, keys[1], LAYOUT_FP, memoryview(data[1]))
        tier.submit(other, keys[2], LAYOUT_FP, memoryview(data[2]), elem_bytes=8)
        assert await tier.flush(timeout=10)
        admin = redis_server.client()
        widths = [stored_bytes(admin.get(tier._rkey(k)))[HEADER_SIZE] for k in keys]
        assert widths == [4, 2, 8]
        for i, ns in enumerate((NS, other, other)):
            out = buffers(1, fp32.block_bytes)
            assert await tier.get_into([keys[i]], out, namespace=ns, layout_fp=LAYOUT_FP) == 1
            assert bytes(out[0]) == data[i]


# --- two nodes, cluster -------------------------------------------------------------------

async def test_two_nodes_share_one_server(redis_server: RedisServer) -> None:
    keys, data = blocks(4, size=256 * 1024, seed=7)
    async with running(cfg_for(redis_server.url)) as node_a, \
            running(cfg_for(redis_server.url)) as node_b:
        await put_all(node_a, keys, data)
        assert await node_b.exists_prefix(keys) == 4
        outs = buffers(4, 256 * 1024)
        assert await node_b.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 4
        assert [bytes(o) for o in outs] == data
        # another layout (or namespace) never reads these bytes
        other = buffers(1, 256 * 1024)
        assert await node_b.get_into(keys[:1], other, namespace=NS, layout_fp=1) == 0
        assert node_b.counters.checksum_failures == 1
        # a buffer too small is the caller's error: a counted miss, the block stays
        small = buffers(1, 1024)
        assert await node_b.get_into(keys[1:2], small, namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert node_b.counters.errors == 1 and node_b.counters.checksum_failures == 1
        assert await node_b.exists_prefix(keys[1:2]) == 1


async def test_cluster_spreads_blocks_over_all_masters(redis_cluster: LocalCluster) -> None:
    keys, data = blocks(48, size=16 * 1024, seed=11)
    async with running(cfg_for(redis_cluster.url)) as writer, \
            running(cfg_for(redis_cluster.url.replace("+cluster", ""), cluster=True)) as reader:
        assert writer.backend == reader.backend == "redis-cluster"
        await put_all(writer, keys, data)
        sizes = [node.client().dbsize() for node in redis_cluster.nodes]
        assert sum(sizes) == 48 and all(s > 0 for s in sizes), sizes
        assert await reader.exists_prefix(keys) == 48
        outs = buffers(48, 16 * 1024)
        assert await reader.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 48
        assert [bytes(o) for o in outs] == data
        assert await reader.delete(keys) == 48


# --- failures -----------------------------------------------------------------------------

async def test_redis_killed_and_restarted(redis_server: RedisServer) -> None:
    keys, data = blocks(6)
    async with running(cfg_for(redis_server.url)) as tier:
        await put_all(tier, keys[:3], data[:3])
        redis_server.kill()
        outs = buffers(6)
        # no exception reaches the caller; everything is a miss while Redis is gone
        assert await tier.exists_prefix(keys) == 0
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 0
        tier.submit(NS, keys[3], LAYOUT_FP, memoryview(data[3]))
        assert await tier.delete(keys[:1]) == 0
        await eventually(lambda: not tier.up)
        assert tier.counters.errors >= 1 and tier.stats_extra()["last_error"]
        assert await tier.exists_prefix(keys) == 0
        assert await tier.flush(timeout=1) is False  # down: returns instead of hanging
        redis_server.start()  # same port, empty (nothing persisted)
        await eventually(lambda: tier.up)
        assert tier.stats_extra()["reconnects"] >= 1
        await put_all(tier, keys[4:], data[4:])  # the write queued while down went too
        assert await tier.exists_prefix(keys[3:]) == 3
        assert await tier.get_into(keys[3:], outs[3:], namespace=NS, layout_fp=LAYOUT_FP) == 3
        assert [bytes(o) for o in outs[3:]] == data[3:]


async def test_hung_server_times_out_and_recovers(redis_server: RedisServer) -> None:
    """A server that stops answering (SIGSTOP) costs at most the op timeout per call."""
    keys, data = blocks(2)
    async with running(cfg_for(redis_server.url, op_timeout_s=0.3)) as tier:
        await put_all(tier, keys, data)
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            for _ in range(3):
                assert await tier.exists_prefix(keys) == 0
            assert time.monotonic() - t0 < 3 * 0.3 + 1.0
            assert not tier.up and tier.counters.errors >= 3
            assert "timeout" in tier.stats_extra()["last_error"].lower()
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await eventually(lambda: tier.up)
        assert await tier.exists_prefix(keys) == 2


async def test_large_writes_to_a_hung_server_end_at_the_op_timeout(
        redis_server: RedisServer) -> None:
    """Sends first try without blocking (no send timeout to arm for a pipeline that fits
    the socket's buffer); 64 MiB of frames to a server that stopped reading do not fit, and
    the rest of the send still ends at the op timeout: the tier goes down, not hangs, and
    once the server is back the next writes and reads are exact."""
    keys, data = blocks(4, size=16 * MiB, seed=3)
    async with running(cfg_for(redis_server.url, op_timeout_s=0.3)) as tier:
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            for key, payload in zip(keys, data, strict=True):
                tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
            await eventually(lambda: not tier.up, timeout=5.0)
            took = time.monotonic() - t0
            assert took < 0.3 * 4 + 2.0, f"a hung server held the writer {took:.2f} s"
            assert "timeout" in tier.stats_extra()["last_error"].lower()
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await eventually(lambda: tier.up)
        await put_all(tier, keys, data)
        await read_exact(tier, keys, data, 16 * MiB)


async def test_unreachable_at_start_then_comes_up(tmp_path: Path) -> None:
    redis_server_or_skip()
    port = free_port()
    keys, data = blocks(2)
    async with running(cfg_for(f"redis://127.0.0.1:{port}/0")) as tier:
        assert not tier.up
        assert await tier.exists_prefix(keys) == 0
        assert await tier.get_into(keys, buffers(2), namespace=NS, layout_fp=LAYOUT_FP) == 0
        assert tier.counters.errors >= 1
        server = start_server(tmp_path / "late", port=port)
        try:
            await eventually(lambda: tier.up)
            await put_all(tier, keys, data)
            assert await tier.exists_prefix(keys) == 2
        finally:
            server.stop()


async def test_corrupt_values_are_misses_counted_and_deleted(
        redis_server: RedisServer) -> None:
    keys, data = blocks(4)
    admin = redis_server.client()
    rkeys = [b"kvtier:" + k.hex().encode() for k in keys]
    async with running(cfg_for(redis_server.url)) as tier:
        await put_all(tier, keys, data)
        good = stored_bytes(admin.get(rkeys[0]))
        admin.set(rkeys[0], os.urandom(BLOCK))                       # garbage
        flipped = bytearray(stored_bytes(admin.get(rkeys[1])))
        flipped[HEADER_SIZE + 100] ^= 0xFF                           # payload bit rot
        admin.set(rkeys[1], bytes(flipped))
        admin.set(rkeys[2], good)                                    # another key's frame
        hdr = make_header(NS, keys[3], LAYOUT_FP, data[3])
        wrong = dataclasses.replace(hdr, checksum=hdr.checksum ^ 1)  # bad checksum field
        admin.set(rkeys[3], FrameHeader.pack(wrong) + data[3])
        for i in range(4):
            out = buffers(1)
            assert await tier.get_into(keys[i:i + 1], out, namespace=NS,
                                       layout_fp=LAYOUT_FP) == 0
            assert bytes(out[0]) == bytes(BLOCK) or i == 2  # never handed out as data
            assert not admin.exists(rkeys[i]), f"corrupt value {i} not deleted"
        assert tier.counters.checksum_failures == 4
        assert tier.counters.evictions["corrupt"] == 4
        assert tier.up and tier.counters.errors == 0


# --- auth, TLS ----------------------------------------------------------------------------

async def test_auth_password(tmp_path: Path) -> None:
    server = start_server(tmp_path / "auth", password="s3cret")
    keys, data = blocks(2)
    try:
        async with running(cfg_for(server.url, password="s3cret")) as tier:
            assert tier.up
            await put_all(tier, keys, data)
            assert await tier.exists_prefix(keys) == 2
        for bad in ("wrong", ""):
            async with running(cfg_for(server.url, password=bad)) as tier:
                assert not tier.up
                assert await tier.exists_prefix(keys) == 0
                tier.submit(NS, keys[0], LAYOUT_FP, memoryview(data[0]))
                assert tier.counters.errors >= 1
                assert "auth" in tier.stats_extra()["last_error"].lower()
    finally:
        server.stop()


async def test_acl_user_limited_to_prefix(redis_server: RedisServer) -> None:
    admin = redis_server.client()
    admin.execute_command("ACL SETUSER", "kvnode", "on", ">nodepw", "~kvtier:*", "+@all")
    keys, data = blocks(2)
    async with running(cfg_for(redis_server.url, username="kvnode", password="nodepw")) as tier:
        assert tier.up
        await put_all(tier, keys, data)
        outs = buffers(2)
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 2
    async with running(cfg_for(redis_server.url, username="kvnode", password="nope")) as tier:
        assert not tier.up and await tier.exists_prefix(keys) == 0
    # a prefix outside the ACL's key pattern: error replies are counted, never raised
    async with running(cfg_for(redis_server.url, username="kvnode", password="nodepw",
                               key_prefix="other:")) as tier:
        assert await tier.exists_prefix(keys) == 0
        assert tier.counters.errors >= 1 and "permission" in tier.stats_extra()["last_error"]


def test_tls_native_server(tmp_path: Path) -> None:
    exe = redis_server_or_skip()
    reason = tls_unsupported_reason(exe)
    if reason:
        pytest.skip(reason)
    certs = make_certs(tmp_path / "certs")
    port = free_port()
    server = start_server(tmp_path / "tls", extra_args=[
        "--tls-port", str(port), "--tls-cert-file", str(certs.server_cert),
        "--tls-key-file", str(certs.server_key), "--tls-ca-cert-file", str(certs.ca_cert)])
    try:
        asyncio.run(_tls_round_trip(f"rediss://127.0.0.1:{port}/0", certs))
    finally:
        server.stop()


async def test_tls_through_terminating_proxy(redis_server: RedisServer, tmp_path: Path) -> None:
    """TLS from the tier's side (CA verification, client certificate) against a real TLS
    endpoint that forwards to the real server: covers the rediss:// path even where the
    bundled redis-server was built without TLS."""
    certs = make_certs(tmp_path / "certs")
    async with tls_terminator(certs, redis_server.port) as port:
        await _tls_round_trip(f"rediss://127.0.0.1:{port}/0", certs)
        untrusted = cfg_for(f"rediss://127.0.0.1:{port}/0")  # system CAs: must not trust it
        async with running(untrusted) as tier:
            assert not tier.up and "certificate" in tier.stats_extra()["last_error"].lower()


async def _tls_round_trip(url: str, certs: TlsCerts) -> None:
    keys, data = blocks(3)
    cfg = cfg_for(url, tls_ca=str(certs.ca_cert), tls_cert=str(certs.client_cert),
                  tls_key=str(certs.client_key))
    async with running(cfg) as tier:
        assert tier.up, tier.stats_extra()["last_error"]
        await put_all(tier, keys, data)
        outs = buffers(3)
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 3
        assert [bytes(o) for o in outs] == data


# --- zero-copy writes, unix socket --------------------------------------------------------

async def test_borrowed_submit_is_sent_in_place_and_released_once(
        redis_server: RedisServer) -> None:
    """A borrowed payload is not copied: it is framed and sent where it lies, and its
    release callback runs exactly once, after the SET (or when the write is dropped)."""
    keys, data = blocks(6)
    released: list[int] = []
    slots = [bytearray(d) for d in data]
    async with running(cfg_for(redis_server.url, write_queue_blocks=4)) as tier:
        for i in range(2):
            tier.submit(NS, keys[i], LAYOUT_FP, memoryview(slots[i]),
                        release=partial(released.append, i))
        assert released == []           # still queued: the caller's slots stay pinned
        assert await tier.flush(timeout=10)
        assert sorted(released) == [0, 1]
        outs = buffers(2)
        assert await tier.get_into(keys[:2], outs, namespace=NS, layout_fp=LAYOUT_FP) == 2
        assert [bytes(o) for o in outs] == data[:2]
        # a full queue drops its oldest borrowed write and releases it at once
        released.clear()
        for i in range(2, 6):
            tier.submit(NS, keys[i], LAYOUT_FP, memoryview(slots[i]),
                        release=partial(released.append, i))
        tier.submit(NS, keys[0], LAYOUT_FP, memoryview(slots[0]),
                    release=lambda: released.append(0))
        assert released == [2] and tier.counters.dropped_writes == 1
        assert await tier.flush(timeout=10)
        assert sorted(released) == [0, 2, 3, 4, 5]
    assert redis_server.client().dbsize() == 5


async def test_submit_many_borrows_each_block_and_releases_it_once(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A batch handed over at once is sent in place, each block released once after its
    SET; while the tier is down the same call copies and releases at once (``submit``)."""
    keys, data = blocks(3)
    released: list[int] = []
    slots = [bytearray(d) for d in data]

    def batch(idx: range) -> list[Borrowed]:
        return [Borrowed(NS, keys[i], LAYOUT_FP, memoryview(slots[i]), 0,
                         partial(released.append, i)) for i in idx]

    async with running(cfg_for(redis_server.url)) as tier:
        tier.submit_many(batch(range(3)))
        assert released == []
        assert await tier.flush(timeout=10)
        assert sorted(released) == [0, 1, 2]
        outs = buffers(3)
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 3
        assert [bytes(o) for o in outs] == data
    released.clear()
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with running(cfg_for(dead)) as tier:
        assert not tier.up
        tier.submit_many(batch(range(2)))
        assert released == [0, 1]              # copied: the slots are free at once


async def test_a_write_outcome_is_told_before_its_buffer_is_given_back(
        redis_server: RedisServer) -> None:
    """A synchronous commit waiting on its SETs (``written``) resumes before the batch's
    buffers are given back (the per-block release work follows it); ``flush`` still returns
    only after every release ran."""
    keys, data = blocks(4)
    released: list[int] = []
    seen: list[list[int]] = []
    async with running(cfg_for(redis_server.url)) as tier:
        since = time.monotonic()
        for i in range(4):
            tier.submit(NS, keys[i], LAYOUT_FP, memoryview(bytearray(data[i])),
                        release=partial(released.append, i))

        async def waiter() -> None:
            assert await tier.written(keys, since) == [True] * 4
            seen.append(list(released))

        task = asyncio.ensure_future(waiter())
        assert await tier.flush(timeout=10)
        await task
        assert seen == [[]]                    # told while all four were still held
        assert sorted(released) == [0, 1, 2, 3]


async def test_borrowed_submit_while_down_is_copied_and_released(tmp_path: Path) -> None:
    redis_server_or_skip()
    port = free_port()
    keys, data = blocks(1)
    released: list[bool] = []
    slot = bytearray(data[0])
    async with running(cfg_for(f"redis://127.0.0.1:{port}/0")) as tier:
        assert not tier.up
        tier.submit(NS, keys[0], LAYOUT_FP, memoryview(slot), release=lambda: released.append(True))
        assert released == [True]       # a dead Redis never pins the caller's memory
        slot[:] = bytes(len(slot))      # the slot is reused; the queued copy is intact
        server = start_server(tmp_path / "late", port=port)
        try:
            await eventually(lambda: tier.up)
            assert await tier.flush(timeout=10)
            out = buffers(1)
            assert await tier.get_into(keys, out, namespace=NS, layout_fp=LAYOUT_FP) == 1
            assert bytes(out[0]) == data[0]
        finally:
            server.stop()


async def test_unix_socket_with_db(tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    server = start_server(tmp_path / "unix", extra_args=["--unixsocket", str(sock),
                                                          "--unixsocketperm", "700"])
    keys, data = blocks(3)
    try:
        async with running(cfg_for(f"unix://{sock}?db=2")) as tier:
            assert tier.up, tier.stats_extra()["last_error"]
            await put_all(tier, keys, data)
            outs = buffers(3)
            assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 3
            assert [bytes(o) for o in outs] == data
        assert server.client().dbsize() == 0
        with contextlib.closing(redis.Redis(host="127.0.0.1", port=server.port, db=2)) as db2:
            assert db2.dbsize() == 3
    finally:
        server.stop()


async def test_a_delete_waits_for_every_write_of_its_keys_being_sent(
        redis_server: RedisServer) -> None:
    """``forget_writes`` (a delete's first step) waited only for a key's newest write: with
    a newer write of the key queued, cancelling it hid the older one in flight, whose SET
    landed after the DEL and brought the block back (found by review)."""
    async with running(cfg_for(redis_server.url)) as tier:
        send = tier._send_sets

        async def slow(sets: Any) -> Any:        # a SET pipeline that takes a while
            await asyncio.sleep(0.5)
            return await send(sets)

        tier._send_sets = slow  # type: ignore[method-assign]
        (key,), (data,) = blocks(1)
        tier.submit(NS, key, LAYOUT_FP, memoryview(data))    # in flight ...
        await asyncio.sleep(0.05)
        tier.submit(NS, key, LAYOUT_FP, memoryview(data))    # ... and a newer one queued
        assert await tier.forget_writes([key], namespace=NS) == 1
        assert await tier.delete([key], namespace=NS) == 1
        await asyncio.sleep(0.7)
        assert redis_server.client().dbsize() == 0
