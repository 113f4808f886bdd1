"""The Redis tier's reads through one thread polling several connections
(kvtier.tiers.redis_mux), against real redis-server processes: replies of every kind in one
read, no pipeline started past a miss, a server that stalls or drops the connection
mid-value costs a bounded wait and never leaves a stale reply on a reused connection."""

from __future__ import annotations

import asyncio
import errno
import signal
import socket
import time

import pytest

from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_wire import Conn
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import (
    LAYOUT_FP,
    NS,
    blocks,
    buffers,
    cfg_for,
    eventually,
    put_all,
    read_exact,
    running,
)

KiB, MiB = 1 << 10, 1 << 20


def rkey(key: bytes) -> bytes:
    return b"kvtier:" + key.hex().encode()


def connections_made(server: RedisServer) -> int:
    """Connections the server has accepted since it started (INFO stats)."""
    return int(server.client().info("stats")["total_connections_received"])


def gets_served(server: RedisServer) -> int:
    """GET commands the server has run (INFO commandstats)."""
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


async def read(tier: RedisTier, keys: list[bytes], size: int) -> tuple[int, list[memoryview]]:
    outs = buffers(len(keys), size)
    return await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP), outs


async def test_every_kind_of_reply_in_one_read(redis_server: RedisServer) -> None:
    """Frames, a value of the wrong type (an error reply), a value shorter than a frame
    header and a missing key, each in its own place of one read: the leading run is exact,
    the read ends at the first bad one, and the connections are reused cleanly after."""
    keys, data = blocks(12, size=256 * KiB)
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        await put_all(tier, keys, data)
        admin.delete(rkey(keys[9]))
        admin.rpush(rkey(keys[9]), b"not a string")        # GET: -WRONGTYPE
        admin.set(rkey(keys[10]), b"short")                  # shorter than a header
        admin.delete(rkey(keys[11]))                         # missing
        got, outs = await read(tier, keys, 256 * KiB)
        assert got == 9
        assert [bytes(o) for o in outs[:9]] == data[:9]
        assert tier.counters.errors == 1 and "WRONGTYPE" in tier.stats_extra()["last_error"]
        assert tier.up
        for bad, why in ((10, "short value"), (11, "missing key")):
            got, _ = await read(tier, keys[bad:bad + 1], 256 * KiB)
            assert got == 0, why
        assert not admin.exists(rkey(keys[10]))              # corrupt: deleted
        assert tier.counters.checksum_failures == 1
        for _ in range(3):                                   # pooled connections stay in step
            got, outs = await read(tier, keys[:9], 256 * KiB)
            assert got == 9 and [bytes(o) for o in outs] == data[:9]


@pytest.mark.parametrize("window", [1, 8])
async def test_no_pipeline_starts_past_a_miss(redis_server: RedisServer, window: int) -> None:
    """A miss at block 2 of 40: with one pipeline in flight the server runs 3 GETs; with
    eight, the ones in flight when the miss was seen and those started as the pipelines
    before it ended (at most a window more): far from all 40."""
    keys, data = blocks(40, size=256 * KiB)
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0,
                               max_inflight=window)) as tier:
        await put_all(tier, keys, data)
        redis_server.client().delete(rkey(keys[2]))
        before = gets_served(redis_server)
        got, outs = await read(tier, keys, 256 * KiB)
        served = gets_served(redis_server) - before
        assert got == 2 and [bytes(o) for o in outs[:2]] == data[:2]
        assert served == 3 if window == 1 else 3 <= served <= 3 + 2 * window
        assert tier.counters.errors == 0


async def test_stalled_server_costs_the_timeout_and_no_stale_reply(
        redis_server: RedisServer) -> None:
    """SIGSTOP mid-read: get_into returns within the op timeout (nothing filled that was
    not verified); after SIGCONT the replies the stalled connections still had coming are
    never read as another read's blocks."""
    keys, data = blocks(16, size=MiB, seed=1)
    other, other_data = blocks(16, size=MiB, seed=2)
    async with running(cfg_for(redis_server.url, op_timeout_s=0.5)) as tier:
        await put_all(tier, keys, data)
        await put_all(tier, other, other_data)
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got, outs = await read(tier, keys, MiB)
            assert time.monotonic() - t0 < 0.5 + 1.0
            assert got == 0
            assert "timeout" in tier.stats_extra()["last_error"].lower()
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await eventually(lambda: tier.up)
        got, outs = await read(tier, other, MiB)
        assert got == 16 and [bytes(o) for o in outs] == other_data


async def test_connections_go_back_to_the_pool_waking_on_every_byte(
        redis_server: RedisServer) -> None:
    """A muxed read of large values has each connection wake only once a body's rest (up
    to a chunk) has arrived (SO_RCVLOWAT); the connections it gives back wake on every byte
    again, so the small replies of the exchanges that reuse them come at once, not at the
    op timeout."""
    keys, data = blocks(16, size=3 * MiB, seed=4)
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        await put_all(tier, keys, data)
        for _ in range(2):
            await read_exact(tier, keys, data, 3 * MiB)
            t0 = time.monotonic()
            for _ in range(10):
                assert await tier.exists_prefix(keys) == 16
            assert time.monotonic() - t0 < 2.0
        assert tier.counters.errors == 0


class _NoLowat:
    """A socket whose kernel refuses SO_RCVLOWAT (as some sandboxes' do)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def setsockopt(self, level: int, opt: int, *value: object) -> None:
        if (level, opt) == (socket.SOL_SOCKET, socket.SO_RCVLOWAT):
            raise OSError(errno.ENOPROTOOPT, "Protocol not available")
        self._sock.setsockopt(level, opt, *value)  # type: ignore[call-overload]

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


async def test_reads_are_exact_where_the_kernel_refuses_a_low_water_mark(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SO_RCVLOWAT the muxed reader wakes as data comes, as before."""
    init = Conn.__init__

    def refusing(self: Conn, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        self._sock = _NoLowat(self._sock)  # type: ignore[assignment]

    monkeypatch.setattr(Conn, "__init__", refusing)
    keys, data = blocks(8, size=3 * MiB, seed=5)
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        await put_all(tier, keys, data)
        for _ in range(2):
            await read_exact(tier, keys, data, 3 * MiB)
        assert tier.counters.errors == 0


async def test_connection_dropped_mid_value(redis_server: RedisServer) -> None:
    """The server closes each connection once a reply outgrows its output buffer limit
    (mid-value): the read ends with what was verified, the tier heals on its own, and the
    next read is exact."""
    keys, data = blocks(6, size=2 * MiB)
    admin = redis_server.client()
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0)) as tier:
        await put_all(tier, keys, data)
        admin.config_set("client-output-buffer-limit", "normal 262144 262144 0")
        try:
            got, outs = await read(tier, keys, 2 * MiB)
            assert got == 0
            assert tier.counters.errors >= 1
        finally:
            admin.config_set("client-output-buffer-limit", "normal 0 0 0")
        await eventually(lambda: tier.up)
        got, outs = await read(tier, keys, 2 * MiB)
        assert got == 6 and [bytes(o) for o in outs] == data


async def test_reads_from_many_tasks_at_once(redis_server: RedisServer) -> None:
    """Concurrent get_into calls (as concurrent requests promote) share the pools and each
    gets exactly its own blocks."""
    sets = [blocks(8, size=256 * KiB, seed=s) for s in range(6)]
    async with running(cfg_for(redis_server.url, op_timeout_s=5.0, max_connections=4)) as tier:
        for keys, data in sets:
            await put_all(tier, keys, data)
        results = await asyncio.gather(*(read(tier, keys, 256 * KiB) for keys, _ in sets))
        for (got, outs), (_, data) in zip(results, sets, strict=True):
            assert got == 8 and [bytes(o) for o in outs] == data
        assert tier.counters.errors == 0


async def test_concurrent_reads_share_the_connection_limit(redis_server: RedisServer) -> None:
    """Six reads at once, each of which would use eight pipelines, against
    ``max_connections=4``: beyond each read's first connection they share the server's
    four, so three rounds open at most 4 + 6 x 3 connections (uncapped, the four worker
    threads' reads alone would open 4 x 8 in the first round)."""
    sets = [blocks(8, size=256 * KiB, seed=s) for s in range(6)]
    cfg = cfg_for(redis_server.url, op_timeout_s=5.0, max_connections=4, max_inflight=8)
    async with running(cfg) as tier:
        for keys, data in sets:
            await put_all(tier, keys, data)
        before = connections_made(redis_server)
        for _ in range(3):
            results = await asyncio.gather(*(read(tier, keys, 256 * KiB) for keys, _ in sets))
            for (got, outs), (_, data) in zip(results, sets, strict=True):
                assert got == 8 and [bytes(o) for o in outs] == data
        opened = connections_made(redis_server) - before - 1   # the second INFO's own
        assert 0 < opened <= 4 + 6 * 3, opened
        assert tier.counters.errors == 0
