"""Small exchanges on the event loop (kvtier.tiers.redis_loopio) against a scripted peer:
replies cut at every boundary come back exact, the loop keeps running other work while it
waits, and a silent peer, a hang-up mid-reply or a protocol breach fail the exchange
within its deadline. (Against a real redis-server: tests/integration/test_redis_tier.py.)"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from pathlib import Path

import pytest
import uvloop

from kvtier.tiers import redis_loopio as loopio
from kvtier.tiers.redis_resp import ConnOptions, ErrorReply, NodeAddr, ProtocolError, command
from kvtier.tiers.redis_wire import Conn
from tests.support.resp_peer import bulk, cuts, peer

REPLIES = bulk(b"n" * 16) + bulk(b"") + b":1\r\n" + b"$-1\r\n" + \
    b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n" + b"+OK\r\n"
WANT = [b"n" * 16, b"", 1, None,
        ErrorReply("WRONGTYPE Operation against a key holding the wrong kind of value"), "OK"]
CMDS = [command(b"GETRANGE", b"k%d" % i, b"8", b"23") for i in range(len(WANT))]


def connect(addr: NodeAddr, timeout_s: float = 2.0) -> Conn:
    return Conn(addr, ConnOptions(connect_timeout_s=1.0, op_timeout_s=timeout_s))


async def exchange_once(addr: NodeAddr, timeout_s: float) -> list[object]:
    """One exchange of ``CMDS`` on a new connection, closed after it."""
    conn = connect(addr, timeout_s)
    try:
        return await loopio.exchange(conn, CMDS)
    finally:
        conn.close()


@pytest.mark.parametrize("seed", range(6))
def test_replies_cut_anywhere_come_back_exact(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    pieces = cuts(REPLIES, rng, most=rng.choice([1, 2, 7]))

    def script(sock: socket.socket) -> None:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.0005)

    async def main(addr: NodeAddr) -> tuple[list[object], int]:
        ticks = 0

        async def ticker() -> None:   # the loop is not blocked while the exchange waits
            nonlocal ticks
            while True:
                ticks += 1
                # not sleep(0): a loop spinning on the GIL starves the peer's thread (each
                # piece then waits a switch interval, 5 ms) past the deadline on a busy box
                await asyncio.sleep(0.0002)

        task = asyncio.ensure_future(ticker())
        conn = connect(addr, timeout_s=10.0)
        try:
            return await loopio.exchange(conn, CMDS), ticks
        finally:
            task.cancel()
            conn.close()

    with peer(tmp_path, script) as addr:
        replies, ticks = asyncio.run(main(addr))
    assert replies == WANT
    assert ticks > len(pieces) // 4


def test_a_silent_peer_fails_the_exchange_at_its_deadline(tmp_path: Path) -> None:
    def script(sock: socket.socket) -> None:
        time.sleep(1.5)

    with peer(tmp_path, script) as addr:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            asyncio.run(exchange_once(addr, 0.3))
        assert 0.25 <= time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(("sent", "error"), [
    (REPLIES[:30], ConnectionError),                  # hangs up mid-reply
    (b"*2\r\n" + bulk(b"a") + bulk(b"b"), ProtocolError),   # an array: not a small reply
    (b"$99999\r\n", ProtocolError),                   # a value far too large for a probe
    (b":twelve\r\n", ProtocolError),                  # not a number
    (bulk(b"x" * 16)[:-2] + b"!!", ProtocolError),    # no CRLF after the value
])
def test_a_broken_reply_fails_the_exchange(tmp_path: Path, sent: bytes,
                                          error: type[Exception]) -> None:
    def script(sock: socket.socket) -> None:
        sock.sendall(sent)

    with peer(tmp_path, script) as addr:
        t0 = time.monotonic()
        with pytest.raises(error):
            asyncio.run(exchange_once(addr, 2.0))
        assert time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_connection_stays_blocking_for_the_worker_threads(tmp_path: Path,
                                                             loop: str) -> None:
    """uvloop's watchers leave O_NONBLOCK on a descriptor: the exchange clears it again, so
    the worker thread that takes the connection next still blocks on its reads."""
    def script(sock: socket.socket) -> None:
        sock.sendall(REPLIES)
        sock.recv(1 << 16)    # the next exchange, a blocking one, from a worker thread
        time.sleep(0.05)      # (its read must wait for this, not fail at once)
        sock.sendall(REPLIES)

    async def on_loop(conn: Conn) -> list[object]:
        return await loopio.exchange(conn, CMDS)

    run = uvloop.run if loop == "uvloop" else asyncio.run
    with peer(tmp_path, script) as addr:
        conn = connect(addr)
        try:
            assert run(on_loop(conn)) == WANT
            assert os.get_blocking(conn.fileno())
            assert conn.simple_many(CMDS) == WANT
        finally:
            conn.close()
