"""Replies a sound block must survive (found by review), from an in-process scripted
server (tests/support/resp_peer.py): a stripe's reply sent twice, a negative length that
is not RESP's nil, and a value far longer than its block behind a sound header. Each is a
miss; only the planted value is deleted, at about the cost of the block asked for."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.frame import (
    HEADER_SIZE,
    STRIPE_BYTES,
    STRIPED_MIN_BYTES,
    FrameHeader,
    payload_checksum,
)
from kvtier.tiers import redis_reads, redis_stripes
from kvtier.tiers.redis_blocks import BlockRead, ReadStatus
from kvtier.tiers.redis_reads import RedisReads
from kvtier.tiers.redis_resp import ConnOptions, ProtocolError, command
from kvtier.tiers.redis_wire import Conn
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
from tests.support.resp_peer import answering, bulk, peer

SIZE = STRIPED_MIN_BYTES + STRIPE_BYTES   # a head and two stripes
HUGE = 1 << 40                             # announced, never sent


def rkey(key: bytes) -> bytes:
    return b"kvtier:" + key.hex().encode()


class Store:
    """A dict-backed RESP server's answers (the commands the tier sends), with a hostile
    ``mode`` for stripe reads; every command seen is kept."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.seen: list[list[bytes]] = []
        self.mode = "sane"
        self.lock = threading.Lock()
        self.stripe0 = b""    # the last reply to a GETRANGE of stripe 0
        self.late = 0         # stripe GETs answered in mode "late"

    def answer(self, cmd: list[bytes]) -> bytes | list[bytes | float]:
        with self.lock:
            self.seen.append(cmd[:2])
            return self._answer(cmd)

    def _answer(self, cmd: list[bytes]) -> bytes | list[bytes | float]:
        name, args = cmd[0].upper(), cmd[1:]
        if name == b"SET":
            self.data[args[0]] = args[1]
            return b"+OK\r\n"
        if name == b"GETRANGE":
            value = self.data.get(args[0], b"")
            reply = bulk(value[int(args[1]):int(args[2]) + 1])
            stripe0 = int(args[1]) == HEADER_SIZE
            if stripe0:
                self.stripe0 = reply
            return reply * 2 if stripe0 and self.mode == "twice" else reply
        if name == b"GET":
            stripe = args[0].count(b":") > 1
            if stripe and self.mode == "negbulk":
                return b"$-99999999999999999999\r\n"
            if stripe and self.mode == "giant":
                return b"$%d\r\n" % HUGE + os.urandom(4096)
            stored = self.data.get(args[0])
            reply = b"$-1\r\n" if stored is None else bulk(stored)
            if stripe and self.mode == "late":
                # stripe 0's reply once more, before stripe 1's; each later reply sent
                # after the client looked for bytes past the one before
                self.late += 1
                if self.late == 1:
                    return [self.stripe0, 0.2, reply]
                self.mode = "sane"
                return [0.3, reply]
            return reply
        if name in (b"DEL", b"EXISTS"):
            found = sum(1 for k in args if k in self.data)
            if name == b"DEL":
                for k in args:
                    self.data.pop(k, None)
            return b":%d\r\n" % found
        if name == b"INFO":
            return bulk(b"used_memory:0\r\nmaxmemory:0\r\n")
        if name == b"DBSIZE":
            return b":%d\r\n" % len(self.data)
        if name == b"EXEC":
            return b"*1\r\n:1\r\n"
        if name == b"PING":
            if args and self.mode == "loading":   # only the nonce PING ending a stripe run
                return b"-LOADING Redis is loading the dataset in memory\r\n"
            return bulk(args[0]) if args else b"+PONG\r\n"
        return b"+OK\r\n"

    def deletes(self) -> list[bytes]:
        with self.lock:
            return [c[1] for c in self.seen if c[0].upper() == b"DEL"]


@contextlib.contextmanager
def store_server(tmp_path: Path) -> Iterator[tuple[Store, str]]:
    store = Store()
    with peer(tmp_path, answering(store.answer), name="store.sock", read_first=False,
              concurrent=True) as addr:
        yield store, f"unix://{addr.host}"


@pytest.mark.parametrize("mode", ["twice", "negbulk"])
def test_a_stripe_reply_out_of_step_never_deletes_the_block(tmp_path: Path,
                                                            mode: str) -> None:
    """twice: stripe 0's GETRANGE answered twice; the stale reply was read as stripe 1's
    value on the same connection, the checksum failed and the sound block (head and
    stripes) was deleted. negbulk: a stripe's GET answered ``$-99999999999999999999``,
    taken for nil: a missing stripe, the block deleted. Now both are a miss (the
    connection dropped), nothing deleted, and the block is read once the server is
    sane."""
    keys, data = blocks(1, SIZE, seed=31)

    async def main(store: Store, url: str) -> None:
        async with running(cfg_for(url, op_timeout_s=5.0)) as tier:
            await put_all(tier, keys, data)
            stored = dict(store.data)
            store.mode = mode
            outs = buffers(1, SIZE)
            assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 0
            assert bytes(outs[0]) == bytes(SIZE)
            assert tier.counters.checksum_failures == 0
            assert store.deletes() == [] and store.data == stored
            if mode == "twice":
                assert tier.stats_extra()["protocol_errors"] >= 1 and tier.up
            store.mode = "sane"
            await eventually(lambda: tier.up, timeout=5)
            await read_exact(tier, keys, data, SIZE)

    with store_server(tmp_path) as (store, url):
        asyncio.run(main(store, url))


async def read_in_mode(tier: RedisReads, store: Store, key: bytes, mode: str
                       ) -> tuple[BlockRead, memoryview]:
    """The striped block at ``key`` read by ``_read_stripes`` while ``store`` answers in
    ``mode``; the read and where it went."""
    header = FrameHeader.unpack(store.data[rkey(key)][:HEADER_SIZE])
    store.mode = mode
    out = buffers(1, SIZE)[0]
    return await redis_stripes._read_stripes(tier, rkey(key), header, out), out


def test_a_stripe_reply_sent_twice_later_than_any_peek_is_never_corrupt(
        tmp_path: Path) -> None:
    """Stripe 0's reply sent again just before stripe 1's, every later reply only after the
    client looked for bytes past the last: no peek sees the reply too many, stripe 1 reads
    stripe 0's bytes and the checksum fails. The run was CORRUPT, and the sound block
    deleted unless the header check that follows happened to run on the same connection
    (it reads the reply too many first); under concurrent reads another request takes
    that connection (found by review). Now a PING with a nonce ends each server's stripe
    run: its echo comes back behind the reply too many, and the run is an ERROR (a miss,
    nothing deleted) whichever connection comes next."""
    keys, data = blocks(1, SIZE, seed=33)

    async def main(store: Store, url: str) -> None:
        async with running(cfg_for(url, op_timeout_s=5.0)) as tier:
            await put_all(tier, keys, data)
            stored = dict(store.data)
            read, out = await read_in_mode(tier, store, keys[0], "late")
            assert store.late == 2                       # the script ran as meant
            assert read.status is ReadStatus.ERROR, read
            assert bytes(out) == bytes(SIZE)             # nothing unverified left behind
            assert tier.stats_extra()["protocol_errors"] >= 1
            # and through the tier: a miss, then the block read whole, nothing deleted
            store.mode, store.late = "late", 0
            assert await tier.get_into(keys, [out], namespace=NS, layout_fp=LAYOUT_FP) == 0
            assert store.deletes() == [] and store.data == stored
            await eventually(lambda: tier.up, timeout=5)
            await read_exact(tier, keys, data, SIZE)

    with store_server(tmp_path) as (store, url):
        asyncio.run(main(store, url))


def test_a_giant_stripe_is_corrupt_at_the_cost_of_its_block(tmp_path: Path) -> None:
    """A stripe's GET answered with a value of 1 TiB (announced): refused unread, its
    connection closed, the block corrupt and deleted at once, not drained until the
    deadline."""
    keys, data = blocks(1, SIZE, seed=32)

    async def main(store: Store, url: str) -> None:
        async with running(cfg_for(url, op_timeout_s=3.0)) as tier:
            await put_all(tier, keys, data)
            store.mode = "giant"
            t0 = time.monotonic()
            assert await tier.get_into(keys, buffers(1, SIZE), namespace=NS,
                                       layout_fp=LAYOUT_FP) == 0
            assert time.monotonic() - t0 < 1.5   # not op_timeout_s
            assert tier.counters.checksum_failures == 1 and tier.up
            assert rkey(keys[0]) in store.deletes()

    with store_server(tmp_path) as (store, url):
        asyncio.run(main(store, url))


@pytest.mark.parametrize("sent,nil", [
    (b"$-1\r\n", True), (b"*-1\r\n", True), (b"$-2\r\n", False),
    (b"$-99999999999999999999\r\n", False), (b"*-7\r\n", False)])
def test_only_minus_one_is_nil(tmp_path: Path, sent: bytes, nil: bool) -> None:
    """RESP2's nil is ``$-1`` (``*-1``); any other negative length is not RESP."""
    with peer(tmp_path, answering(lambda _cmd: sent), read_first=False) as addr:
        conn = Conn(addr, ConnOptions(connect_timeout_s=1.0, op_timeout_s=1.0))
        try:
            if nil:
                assert conn.simple_many([command(b"GET", b"k")]) == [None]
            else:
                with pytest.raises(ProtocolError):
                    conn.simple_many([command(b"GET", b"k")])
        finally:
            conn.close()


def giant_server(keys: list[bytes], payloads: dict[bytes, bytes], seen: list[bytes]
                 ) -> Callable[[list[bytes]], bytes]:
    """GET of keys[1]: a sound header announcing 1 TiB, of which 4 KiB come."""
    def answer(cmd: list[bytes]) -> bytes:
        if cmd[0] == b"DEL":
            seen.append(cmd[1])
            return b":1\r\n"
        if cmd[0] != b"GET":
            return b"+PONG\r\n"
        key = next(k for k in keys if rkey(k) == cmd[1])
        payload = payloads[key]
        head = FrameHeader(NS, key, LAYOUT_FP, len(payload), len(payload),
                           payload_checksum(payload)).pack()
        if key == keys[1]:
            return b"$%d\r\n" % HUGE + head + payload
        return bulk(head + payload)
    return answer


@pytest.mark.parametrize("muxed", [True, False], ids=["muxed", "per-thread"])
def test_a_giant_value_behind_a_sound_header_is_refused_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, muxed: bool) -> None:
    """A value far longer than any frame of its block (a planted one) was drained until
    the deadline: a timeout, an error read that deleted nothing, and the blocks of its
    pipeline lost with it. Now its length refuses it: the connection is closed, the
    blocks before it are read, it is corrupt and deleted, at once; the tier stays up."""
    if not muxed:   # the reads a worker thread makes per batch (TLS, large blocks)
        monkeypatch.setattr(redis_reads, "ranged", lambda _n: False)
        monkeypatch.setattr(RedisReads, "_read_muxed", RedisReads._read_windowed)
    keys = [b"A" * 16, b"B" * 16, b"C" * 16]
    payloads = {k: os.urandom(4096) for k in keys}
    seen: list[bytes] = []

    async def main(url: str) -> None:
        async with running(cfg_for(url, op_timeout_s=2.0)) as tier:
            outs = buffers(3, 4096)
            t0 = time.monotonic()
            got = await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP)
            assert time.monotonic() - t0 < 1.0   # not op_timeout_s
            assert got == 1 and bytes(outs[0]) == payloads[keys[0]]
            assert tier.counters.checksum_failures == 1 and tier.counters.errors == 0
            assert tier.up and seen == [rkey(keys[1])]

    with peer(tmp_path, answering(giant_server(keys, payloads, seen)), name="giant.sock",
              read_first=False, concurrent=True) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_a_ping_that_fails_is_no_evidence_of_a_reply_too_many(tmp_path: Path) -> None:
    """The nonce PING answered with an error (a server loading its data): the read is a
    miss and nothing is deleted, and it is told as what it is, not as the server sending
    more than its replies (found by review: every PING failure was logged and counted as
    a reply too many)."""
    keys, data = blocks(1, SIZE, seed=34)

    async def main(store: Store, url: str) -> None:
        async with running(cfg_for(url, op_timeout_s=5.0)) as tier:
            await put_all(tier, keys, data)
            stored = dict(store.data)
            read, out = await read_in_mode(tier, store, keys[0], "loading")
            assert read.status is ReadStatus.ERROR, read
            assert bytes(out) == bytes(SIZE)
            assert "answered PING with an error: LOADING" in tier.last_error
            assert tier.stats_extra()["protocol_errors"] == 0   # no reply too many
            assert store.deletes() == [] and store.data == stored
            store.mode = "sane"
            await eventually(lambda: tier.up, timeout=5)
            await read_exact(tier, keys, data, SIZE)

    with store_server(tmp_path) as (store, url):
        asyncio.run(main(store, url))
