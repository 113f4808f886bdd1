"""A Redis server that misbehaves, scripted (tests/support/resp_peer.py): replies that
announce more than a reply may hold, CLUSTER SLOTS of the wrong shape or range, and
replies beyond those asked for. Each costs one exchange or one connection: never an
allocation of the size announced, an exception out of the tier or its router, or a stale
reply read as the next exchange's. (Hostile values in a real redis-server:
tests/integration/test_redis_hostile.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.frame import FrameHeader, payload_checksum
from kvtier.tiers import redis_link, redis_reads, redis_route
from kvtier.tiers.redis_mux import GetJob, read_jobs
from kvtier.tiers.redis_reads import RedisReads
from kvtier.tiers.redis_resp import ConnOptions, ErrorReply, NodeAddr, ProtocolError, command
from kvtier.tiers.redis_route import Reach, Router, _member_addrs, _slot_ranges
from kvtier.tiers.redis_wire import Conn
from tests.support.memory import peak_bytes
from tests.support.redis_tier import LAYOUT_FP, NS, cfg_for, eventually, running
from tests.support.resp_peer import answering, bulk, peer

OPTS = ConnOptions(connect_timeout_s=1.0, op_timeout_s=1.0)
BOUND = 1 << 20    # what a refused reply may have cost at most (48 MiB announced)


def until_hangup(sent: bytes) -> Callable[[socket.socket], None]:
    """A script that sends ``sent`` whatever it is asked, then waits for the hang-up."""
    def script(sock: socket.socket) -> None:
        sock.sendall(sent)
        while sock.recv(1 << 16):
            pass
    return script


def resp(value: Any) -> bytes:
    """``value`` in RESP: ints, bytes (bulk), None (nil) and lists of those."""
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, bytes):
        return bulk(value)
    return b"*%d\r\n" % len(value) + b"".join(resp(v) for v in value)


def rkey(key: bytes) -> bytes:
    return b"kvtier:" + key.hex().encode()


def frame(key: bytes, payload: bytes, namespace: bytes = NS) -> bytes:
    return FrameHeader(namespace, key, LAYOUT_FP, len(payload), len(payload),
                       payload_checksum(payload)).pack() + payload


# --- replies larger or deeper than a reply may be (redis_wire.Conn.read_reply) -----------

@pytest.mark.parametrize("sent", [
    b"$%d\r\n" % (48 << 20),          # a 48 MiB value announced for a PING, then nothing
    b"*%d\r\n" % (1 << 28),           # an array of 2**28 elements, then nothing
    b"*1\r\n" * 5000,                 # arrays nested 5000 deep (RecursionError before)
    b":12x\r\n",                      # not a number (ValueError before)
], ids=["huge-bulk", "huge-array", "deep-arrays", "bad-number"])
def test_a_reply_beyond_its_bounds_is_refused_before_it_is_allocated(
        tmp_path: Path, sent: bytes) -> None:
    with peer(tmp_path, until_hangup(sent)) as addr:
        conn = Conn(addr, OPTS)
        try:
            t0 = time.monotonic()
            with peak_bytes() as peak, pytest.raises(ProtocolError):
                conn.simple_many([command(b"PING")])
            assert time.monotonic() - t0 < 0.5   # refused at once, not at the deadline
        finally:
            conn.close()
    assert peak[0] < BOUND


async def test_a_ping_answered_with_a_huge_value_leaves_the_tier_down_cheaply(
        tmp_path: Path) -> None:
    with peer(tmp_path, until_hangup(b"$%d\r\n" % (48 << 20))) as addr:
        t0 = time.monotonic()
        with peak_bytes() as peak:
            # a deadline far beyond the start's own cost, so a loaded machine cannot blur
            # "refused at once" and "waited for the deadline" (0.8 s against 1 s did)
            async with running(cfg_for(f"unix://{addr.host}", op_timeout_s=6.0)) as tier:
                assert not tier.up
                assert "ProtocolError" in tier.last_error
                assert time.monotonic() - t0 < 3.0   # not op_timeout_s (6 s) waiting
    assert peak[0] < BOUND


# --- CLUSTER SLOTS of the wrong shape (redis_route.Router.refresh) ------------------------

def cluster_peer(tmp_path: Path, slots: Callable[[], Any], nodes: Callable[[], bytes],
                 name: str) -> Any:
    def answer(cmd: list[bytes]) -> bytes:
        if cmd == [b"CLUSTER", b"SLOTS"]:
            return resp(slots())
        if cmd == [b"CLUSTER", b"NODES"]:
            return bulk(nodes())
        return b"+PONG\r\n"
    return peer(tmp_path, answering(answer), name=name, tcp=True, read_first=False)


def nodes_line(addr: NodeAddr) -> bytes:
    return b"%s %s:%d@%d master - 0 0 1 connected\n" % (
        os.urandom(20).hex().encode(), addr.host.encode(), addr.port, addr.port + 10000)


LOCAL = b"127.0.0.1"


@pytest.mark.parametrize("slots", [
    [[0, 20000, [LOCAL, 7000]]],                      # past the last slot: a longer map
    [[9, 3, [LOCAL, 7000]]],                          # backwards
    [[-1, 16383, [LOCAL, 7000]]],                     # below the first slot
    [[0, 16383]],                                     # no master (IndexError before)
    [[0, 16383, [LOCAL, 70000]]],                     # no such port
    [[0, 16383, [LOCAL, 0]]],
    [[0, 16383, [7, 7000]]],                          # a host that is not a string
    [[0, 16383, [b"\xff\xfe", 7000]]],                # nor UTF-8
    [[0, 16383, [LOCAL, 7000], [LOCAL]]],             # a replica without a port
    [b"0-16383"],                                     # an entry that is not an array
    None, 7, b"0-16383",                              # a reply that is not an array (a
    #   proxy, a broken server): TypeError out of refresh, the next member never asked
], ids=["past-end", "backwards", "negative", "no-master", "port-70000", "port-0",
        "host-int", "host-binary", "bad-replica", "not-an-entry", "reply-nil",
        "reply-integer", "reply-bulk"])
def test_a_malformed_cluster_slots_reply_is_refused_and_the_next_member_asked(
        tmp_path: Path, slots: list[Any]) -> None:
    """A master whose CLUSTER SLOTS turns malformed (its replica is the other member
    known): refresh raises nothing, installs none of it, says why in ``last_error`` and
    routes by the next member's map."""
    addrs: dict[str, NodeAddr] = {}
    calls: list[int] = []

    def bad_slots() -> Any:
        calls.append(1)
        if len(calls) == 1:   # sound at first: it serves every slot, the other replicates
            return [[0, 16383, [LOCAL, addrs["bad"].port], [LOCAL, addrs["good"].port]]]
        return slots

    with cluster_peer(tmp_path, lambda: [[0, 16383, [LOCAL, addrs["good"].port]]],
                      lambda: nodes_line(addrs["good"]), "good.sock") as good, \
            cluster_peer(tmp_path, bad_slots, lambda: nodes_line(addrs["bad"]),
                         "bad.sock") as bad:
        addrs.update(good=good, bad=bad)
        router = Router(bad, OPTS, cluster=True, pool_size=1)
        try:
            assert router.refresh() is Reach.HEALED and router.masters() == [bad]
            assert router.refresh() is Reach.HEALED
            assert ("malformed CLUSTER SLOTS" if isinstance(slots, list)
                    else "answered CLUSTER SLOTS with") in router.last_error
            assert router.masters() == [good]
            assert router.node_for(rkey(os.urandom(16))) == good
        finally:
            router.close()


def test_ports_in_redirects_and_member_lists_are_ascii_and_in_range() -> None:
    """``str.isdigit`` admits "²", which ``int`` refuses (ValueError on the event loop)."""
    router = Router(NodeAddr("127.0.0.1", 7000), OPTS, cluster=True, pool_size=1)
    for port in ("²", "70000", "0"):
        assert router.redirect(ErrorReply(f"MOVED 12 127.0.0.1:{port}")) is None
        line = f"id 127.0.0.1:{port}@17000 master - 0 0 1 connected\n".encode()
        assert _member_addrs(line, "127.0.0.1") == []
    assert router.redirect(ErrorReply("MOVED 12 127.0.0.1:7000")) == (
        NodeAddr("127.0.0.1", 7000), False)


# --- replies beyond those asked for (redis_pool.NodePool.give, redis_mux reuse) -----------

def test_an_extra_reply_never_reaches_the_next_get(tmp_path: Path) -> None:
    """GET A answered twice: the muxed reader's connection is dropped (counted), so GET B
    reads B's own reply, not A's stale one (which called the sound B corrupt and
    deleted it)."""
    a, b = b"A" * 16, b"B" * 16
    payloads = {a: os.urandom(4096), b: os.urandom(4096)}
    seen: list[list[bytes]] = []

    def answer(cmd: list[bytes]) -> bytes:
        seen.append(cmd)
        if cmd == [b"GET", rkey(a)]:
            return bulk(frame(a, payloads[a])) * 2          # one reply too many
        if cmd == [b"GET", rkey(b)]:
            return bulk(frame(b, payloads[b]))
        return b":1\r\n" if cmd[0] == b"DEL" else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url, max_connections=1, max_inflight=1)) as tier:
            for key in (a, b):
                out = memoryview(bytearray(4096))
                assert await tier.get_into([key], [out], namespace=NS,
                                           layout_fp=LAYOUT_FP) == 1
                assert bytes(out) == payloads[key]
            assert tier.counters.checksum_failures == 0
            assert tier.stats_extra()["protocol_errors"] == 1

    with peer(tmp_path, answering(answer), read_first=False) as addr:
        asyncio.run(main(f"unix://{addr.host}"))
    assert not any(cmd[0] == b"DEL" for cmd in seen)


def test_an_extra_reply_to_a_probe_on_the_loop_is_not_the_next_probes(
        tmp_path: Path) -> None:
    """A probe run on the event loop (an idle connection) answered twice: the next probe
    does not take the extra namespace field for its own key's (a block it does not have
    would count as present)."""
    present, doubled, absent = os.urandom(16), os.urandom(16), os.urandom(16)

    def answer(cmd: list[bytes]) -> bytes:
        if cmd[0] != b"GETRANGE":
            return b"+PONG\r\n"
        if cmd[1] == rkey(absent):
            return bulk(b"")
        return bulk(NS) * (2 if cmd[1] == rkey(doubled) else 1)

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            # a worker thread (no idle connection yet), then the loop on the idle one
            assert await tier.exists_prefix([present], namespace=NS) == 1
            assert await tier.exists_prefix([doubled], namespace=NS) == 1
            assert await tier.exists_prefix([absent], namespace=NS) == 0
            assert tier.stats_extra()["protocol_errors"] == 1

    with peer(tmp_path, answering(answer), read_first=False) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_a_connection_with_an_extra_reply_does_not_go_on_to_the_next_job(
        tmp_path: Path) -> None:
    """Two jobs for one server, one connection at a time: the first job's connection
    received a reply more than its job asked for, so the second job gets a fresh
    connection (and its own value), not the first's leftover."""
    first, second = os.urandom(70_000), os.urandom(70_000)
    accepted: list[int] = []

    def script(sock: socket.socket) -> None:
        accepted.append(1)
        if len(accepted) == 1:
            sock.sendall(bulk(first) + bulk(b"stale reply"))
            if not sock.recv(1 << 16):   # the next job's GET, were the connection reused
                return
        sock.sendall(bulk(second))
        while sock.recv(1 << 16):
            pass

    got: list[tuple[int, bytes, object]] = []

    def job(first_index: int) -> GetJob:
        buf = memoryview(bytearray(70_000))

        def place(_i: int, head: bytes, n: int) -> memoryview | None:
            return buf[:n - len(head)] if n == 70_000 else None

        def done(i: int, reply: object) -> None:
            got.append((first_index, bytes(buf), reply))

        return GetJob(NodeAddr("", 0), [b"k%d" % first_index], 0, place, done,
                      first_index, large=True)

    with peer(tmp_path, script) as addr:
        jobs = [job(0), job(1)]
        for j in jobs:
            j.node = addr
        router = Router(addr, OPTS, cluster=False, pool_size=2)   # (its pools count)
        try:
            read_jobs(jobs, router.pool, 1, lambda _j: True)
        finally:
            router.close()
    assert [j.error for j in jobs] == [None, None]
    assert got == [(0, first, 70_000), (1, second, 70_000)]
    assert len(accepted) == 2 and router.protocol_errors == 1


# --- round 8: replies of the wrong type, INFO that is not numbers, stray frames ---------

def server(tmp_path: Path, answer: Callable[[list[bytes]], bytes]
           ) -> contextlib.AbstractContextManager[NodeAddr]:
    """A RESP server on a unix socket writing ``answer(command)`` for each command, every
    connection served at once."""
    return peer(tmp_path, answering(answer), name="many.sock", read_first=False,
                concurrent=True)


# a GETRANGE / EXISTS answered with what those commands never answer
ODD_REPLIES = [b"+OK\r\n", b":-1\r\n", b":1000000000000000000000\r\n",
               b":%d\r\n" % (64 << 20)]


@pytest.mark.parametrize("reply", ODD_REPLIES, ids=["status", "minus-one", "huge-int",
                                                    "64mib-int"])
def test_a_probe_answered_with_the_wrong_type_is_a_counted_miss(
        tmp_path: Path, reply: bytes) -> None:
    """The lookup probe (GETRANGE of the namespace field) and a synchronous commit's
    header read (GETRANGE 0..95) answered with a status or an integer: before,
    ``bytes(reply)`` raised TypeError/ValueError/OverflowError out of the tier (a client's
    "internal error") or allocated as many bytes as the integer said. Now a miss, counted
    as an error, about nothing allocated; the tier stays up."""
    key = os.urandom(16)

    def answer(cmd: list[bytes]) -> bytes:
        return reply if cmd[0] in (b"GETRANGE", b"EXISTS") else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            with peak_bytes() as peak:
                for _ in range(2):   # a worker thread, then the event loop (idle conn)
                    assert await tier.exists_prefix([key], namespace=NS) == 0
                assert await tier.whole_prefix([key], namespace=NS) == 0
                assert await tier.exists_prefix([key]) == 0   # EXISTS: -1 etc. are not 1
            assert peak[0] < BOUND
            assert tier.counters.errors >= 3 and "ProtocolError" in tier.last_error
            assert tier.up

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_exists_counts_a_key_only_for_the_integer_one(tmp_path: Path) -> None:
    """An EXISTS answered with a bulk string (truthy) counted the block as there."""
    def answer(cmd: list[bytes]) -> bytes:
        return bulk(b"yes") if cmd[0] == b"EXISTS" else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            assert await tier.exists_prefix([os.urandom(16)]) == 0
            assert tier.counters.errors == 1

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


@pytest.mark.parametrize("info", [b"used_memory:abc\r\nmaxmemory:x\r\n",
                                  b"used_memory:%s\r\nmaxmemory:-5\r\n" % (b"9" * 5000),
                                  b"used_memory:\xff\xfe\r\n"],
                         ids=["letters", "huge-and-negative", "binary"])
def test_info_fields_that_are_not_numbers_leave_the_monitor_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, info: bytes) -> None:
    """One INFO reply with ``used_memory:abc`` raised ValueError out of the health check
    and ended the monitor task for good: no PING after it, so a server that hung later
    left the tier up. Now the field is ignored (0) and PINGs go on."""
    monkeypatch.setattr(redis_link, "HEALTH_INTERVAL_S", 0.02)
    monkeypatch.setattr(redis_link, "STATS_EVERY", 2)
    pings: list[float] = []

    def answer(cmd: list[bytes]) -> bytes:
        if cmd[0] == b"PING":
            pings.append(time.monotonic())
            return b"+PONG\r\n"
        if cmd[0] == b"INFO":
            return bulk(b"# Memory\r\n" + info)
        return b":7\r\n" if cmd[0] == b"DBSIZE" else b"+OK\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            await asyncio.sleep(0.5)   # ~12 rounds, ~6 of them with INFO
            assert tier._monitor is not None and not tier._monitor.done()
            seen = len(pings)
            await asyncio.sleep(0.2)
            assert len(pings) > seen   # still pinging
            assert tier.used_bytes == 0 and tier.blocks == 7 and tier.up

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_a_health_round_that_raises_is_counted_and_the_monitor_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever one round raises (here a bug in it), the monitor logs it, counts an
    error, waits and runs the next round: it never ends while the tier runs."""
    monkeypatch.setattr(redis_link, "HEALTH_INTERVAL_S", 0.02)
    monkeypatch.setattr(redis_link, "MONITOR_BACKOFF",
                        redis_link.BackoffPolicy(base_s=0.02, cap_s=0.05), raising=False)
    rounds: list[bool] = []

    async def health(refresh_stats: bool) -> None:
        rounds.append(refresh_stats)
        if len(rounds) <= 3:
            raise RuntimeError("a bug in a health round")

    async def main(url: str) -> None:
        async with running(cfg_for(url)) as tier:
            monkeypatch.setattr(tier, "_health", health)
            await eventually(lambda: len(rounds) >= 6, timeout=5)
            assert tier._monitor is not None and not tier._monitor.done()
            assert tier.counters.errors == 3 and "a bug in a health round" in tier.last_error

    with server(tmp_path, lambda _cmd: b"+PONG\r\n") as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def stray_server(keys: list[bytes], payloads: dict[bytes, bytes], *, stored_wrong: bool,
                 seen: list[list[bytes]]) -> Callable[[list[bytes]], bytes]:
    """GET of keys[1] answered with keys[0]'s frame: the first time only (a reply out of
    step; what is stored is sound), or always and in the header read too (stored so)."""
    a, b = keys
    strays: list[int] = []

    def answer(cmd: list[bytes]) -> bytes:
        seen.append(cmd)
        if cmd[0] == b"GET":
            key = a if cmd[1] == rkey(a) else b
            if key == b and (stored_wrong or not strays):
                strays.append(1)
                key = a
            return bulk(frame(key, payloads[key]))
        if cmd[0] == b"GETRANGE":
            key = a if stored_wrong or cmd[1] == rkey(a) else b
            return bulk(frame(key, payloads[key])[:int(cmd[3]) + 1])
        return b":1\r\n" if cmd[0] == b"DEL" else b"+PONG\r\n"
    return answer


StrayCheck = Callable[[Any, list[bytes], dict[bytes, bytes]], Awaitable[None]]


def run_stray(tmp_path: Path, stored_wrong: bool, check: StrayCheck
              ) -> tuple[list[bytes], list[list[bytes]]]:
    """``check(tier, keys, payloads)`` against ``stray_server`` (one connection, one GET
    pipeline in flight); the keys and the commands the server saw."""
    keys = [b"A" * 16, b"B" * 16]
    payloads = {k: os.urandom(4096) for k in keys}
    seen: list[list[bytes]] = []

    async def main(url: str) -> None:
        async with running(cfg_for(url, max_connections=1, max_inflight=1)) as tier:
            await check(tier, keys, payloads)

    with server(tmp_path, stray_server(keys, payloads, stored_wrong=stored_wrong,
                                       seen=seen)) as addr:
        asyncio.run(main(f"unix://{addr.host}"))
    return keys, seen


@pytest.mark.parametrize("muxed", [True, False], ids=["muxed", "per-thread"])
def test_another_keys_frame_in_a_reply_drops_the_connection_not_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, muxed: bool) -> None:
    """A server that sent a GET reply twice: in the pipeline GET A, GET B, B read A's
    frame ("frame holds another key"), and the tier deleted the sound B as corrupt. Now:
    a miss, counted (an error, and the connection dropped: ``stray_frames``, since no byte
    came past the replies: on a sound server, a value copied under B), B read again on a
    fresh connection and found sound, so left alone; the next read gets it."""
    if not muxed:   # the reads a worker thread makes per batch (TLS, large blocks)
        monkeypatch.setattr(redis_reads, "ranged", lambda _n: False)
        monkeypatch.setattr(RedisReads, "_read_muxed", RedisReads._read_windowed)
    async def check(tier: Any, keys: list[bytes], payloads: dict[bytes, bytes]) -> None:
        outs = [memoryview(bytearray(4096)) for _ in keys]
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 1
        assert bytes(outs[0]) == payloads[keys[0]]
        assert tier.counters.checksum_failures == 0
        assert tier.counters.errors == 1 and "another key" in tier.last_error
        extra = tier.stats_extra()
        assert (extra["stray_frames"], extra["protocol_errors"]) == (1, 0)
        outs = [memoryview(bytearray(4096)) for _ in keys]
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 2
        assert [bytes(o) for o in outs] == [payloads[k] for k in keys]
        assert tier.up

    _, seen = run_stray(tmp_path, False, check)
    assert not any(cmd[0] == b"DEL" for cmd in seen)


def test_another_keys_frame_stored_under_a_key_is_still_deleted(tmp_path: Path) -> None:
    """A value that holds another key's frame (read again on a fresh connection: it is
    stored so) can never be valid for its key: corrupt, counted, deleted."""
    async def check(tier: Any, keys: list[bytes], payloads: dict[bytes, bytes]) -> None:
        outs = [memoryview(bytearray(4096)) for _ in keys]
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 1
        assert bytes(outs[1]) == bytes(4096)
        assert tier.counters.checksum_failures == 1 and tier.counters.errors == 0

    keys, seen = run_stray(tmp_path, True, check)
    assert [cmd for cmd in seen if cmd[0] == b"DEL"] == [[b"DEL", rkey(keys[1])]]


def test_another_namespaces_frame_found_when_read_again_is_left_alone(tmp_path: Path) -> None:
    """B's GET answered with A's frame (a reply out of step) has B's header read again on a
    fresh connection: a sound frame of another namespace there is someone else's value (a
    server shared with another tenant or deployment), no evidence that B is corrupt for
    this namespace. A miss, counted as the stray reply, and not deleted: only a frame of
    this namespace that fails its checks for B is."""
    a, b = b"A" * 16, b"B" * 16
    payloads = {k: os.urandom(4096) for k in (a, b)}
    theirs = frame(b, payloads[b], namespace=bytes(reversed(NS)))
    seen: list[list[bytes]] = []

    def answer(cmd: list[bytes]) -> bytes:
        seen.append(cmd)
        if cmd[0] == b"GET":
            return bulk(frame(a, payloads[a]))   # B's too: out of step
        if cmd[0] == b"GETRANGE":
            value = frame(a, payloads[a]) if cmd[1] == rkey(a) else theirs
            return bulk(value[:int(cmd[3]) + 1])
        return b":1\r\n" if cmd[0] == b"DEL" else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url, max_connections=1, max_inflight=1)) as tier:
            outs = [memoryview(bytearray(4096)) for _ in (a, b)]
            assert await tier.get_into([a, b], outs, namespace=NS, layout_fp=LAYOUT_FP) == 1
            assert bytes(outs[0]) == payloads[a] and bytes(outs[1]) == bytes(4096)
            assert tier.counters.checksum_failures == 0
            assert tier.counters.errors == 1 and "another key" in tier.last_error

    with server(tmp_path, answer) as addr:
        asyncio.run(main(f"unix://{addr.host}"))
    assert [cmd for cmd in seen if cmd[0] == b"GETRANGE" and cmd[1] == rkey(b)]   # read again
    assert not any(cmd[0] == b"DEL" for cmd in seen)


# --- round 8: a CLUSTER NODES reply naming tens of thousands of members -------------------

def test_a_flood_of_members_is_bounded_and_refreshed_in_linear_time(tmp_path: Path) -> None:
    """CLUSTER NODES naming 10000 members: each refresh was quadratic (a list scanned per
    member: ~7 s of CPU here; 30000 members took 156 s, other clients' pings waiting up
    to 1.3 s). Now at most MAX_MEMBERS are remembered, seeds and the slot map's servers
    first, and a refresh takes tens of ms."""
    flood = b"".join(b"n%07d 10.%d.%d.%d:6379@16379 master - 0 0 1 connected\n" % (
        i, (i >> 16) & 255, (i >> 8) & 255, i & 255) for i in range(10000))
    addrs: dict[str, NodeAddr] = {}
    seed2 = NodeAddr("10.200.0.1", 7000)   # a second seed named at start

    with cluster_peer(tmp_path, lambda: [[0, 16383, [LOCAL, addrs["me"].port],
                                          [LOCAL, 7001]]],
                      lambda: flood + nodes_line(addrs["me"]), "flood.sock") as me:
        addrs["me"] = me
        router = Router(me, OPTS, cluster=True, pool_size=1, seeds=[seed2])
        try:
            for _ in range(3):
                t0 = time.process_time()
                assert router.refresh() is Reach.HEALED
                assert time.process_time() - t0 < 1.0
            known = list(router._known)
            assert len(known) == redis_route.MAX_MEMBERS
            assert known[:3] == [me, seed2, NodeAddr("127.0.0.1", 7001)]
            assert router.redirect(ErrorReply("MOVED 1 10.0.0.5:6379")) is not None
            assert router.redirect(ErrorReply("MOVED 1 10.0.39.15:6379")) is None  # #9999
        finally:
            router.close()


def test_overlapping_slot_ranges_are_refused() -> None:
    """Entries that cover more than 16384 slots in all (each a full range: 16384 slot
    writes per entry) are a malformed reply, refused before any is installed."""
    with pytest.raises(ValueError, match="overlap"):
        _slot_ranges([[0, 16383, [LOCAL, 7000]]] * 3, "127.0.0.1")
    assert len(_slot_ranges([[0, 8191, [LOCAL, 7000]], [8192, 16383, [LOCAL, 7001]]],
                            "127.0.0.1")) == 2
