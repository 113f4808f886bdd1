"""Small exchanges on the event loop (kvtier.tiers.redis_loopio), the behaviour no other
test pinned (mutation review): a connection whose exchange failed or was cancelled goes
back to no pool, every exchange gets a fresh deadline, the loop's watchers are removed,
and only a bulk string up to MAX_BULK bytes and nil's -1 are read."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from contextlib import closing
from pathlib import Path
from typing import Any, cast

import pytest

from kvtier.tiers import redis_loopio as loopio
from kvtier.tiers.redis_pool import NodePool
from kvtier.tiers.redis_resp import ConnOptions, ErrorReply, NodeAddr, ProtocolError, command
from kvtier.tiers.redis_wire import Conn
from tests.support.resp_peer import bulk, peer

CMD = command(b"GETRANGE", b"k", b"8", b"23")


def connect(addr: NodeAddr, timeout_s: float = 2.0) -> Conn:
    return Conn(addr, ConnOptions(connect_timeout_s=1.0, op_timeout_s=timeout_s))


def sends(reply: bytes, hold: float = 0.5) -> Callable[[socket.socket], None]:
    """A peer script that answers ``reply`` and keeps the connection open ``hold`` s."""
    def script(sock: socket.socket) -> None:
        sock.sendall(reply)
        time.sleep(hold)
    return script


class Pool:
    """The two NodePool calls ``exchange_taken`` makes, recorded."""

    def __init__(self) -> None:
        self.given: list[Conn] = []
        self.discarded: list[Conn] = []

    def give(self, conn: Conn) -> None:
        self.given.append(conn)

    def discard(self, conn: Conn) -> None:
        self.discarded.append(conn)
        conn.close()


def taken(pool: Pool, conn: Conn) -> Coroutine[Any, Any, list[Any]]:
    """``exchange_taken`` of one GETRANGE on ``conn`` from the recording ``pool``."""
    return loopio.exchange_taken(cast(NodePool, pool), conn, lambda idx: [CMD for _ in idx],
                                 [0])


def test_a_failed_exchange_discards_its_connection(tmp_path: Path) -> None:
    """A protocol error mid-exchange: the connection is discarded, never given back (the
    rest of the broken reply would be read by the next exchange as its own)."""
    pool = Pool()
    with peer(tmp_path, sends(b":twelve\r\n")) as addr:
        conn = connect(addr)
        with pytest.raises(ProtocolError):
            asyncio.run(taken(pool, conn))
    assert pool.discarded == [conn] and pool.given == []


def test_a_cancelled_exchange_discards_its_connection(tmp_path: Path) -> None:
    """A caller cancelled while its reply is due (CancelledError is no Exception): the
    reply still arrives later, so the connection must not be reused."""
    pool = Pool()
    with peer(tmp_path, sends(b"", hold=1.0)) as addr:
        conn = connect(addr)

        async def main() -> None:
            task = asyncio.create_task(taken(pool, conn))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
    assert pool.discarded == [conn] and pool.given == []


def test_a_clean_exchange_gives_its_connection_back(tmp_path: Path) -> None:
    pool = Pool()
    with peer(tmp_path, sends(b":1\r\n")) as addr, closing(connect(addr)) as conn:
        got = asyncio.run(taken(pool, conn))
    assert got == [1] and pool.given == [conn] and pool.discarded == []


def test_each_exchange_starts_its_own_deadline(tmp_path: Path) -> None:
    """An idle connection older than op_timeout_s still exchanges: the deadline runs from
    ``begin`` (else every pooled connection idle for a while fails its first probe)."""
    def script(sock: socket.socket) -> None:
        time.sleep(0.05)   # the reply is waited for on the loop, against the deadline
        sock.sendall(b":1\r\n")
        time.sleep(0.5)

    with peer(tmp_path, script) as addr, closing(connect(addr, timeout_s=0.2)) as conn:
        time.sleep(0.3)
        assert asyncio.run(loopio.exchange(conn, [CMD])) == [1]


def test_the_loop_watches_the_socket_no_longer_after_an_exchange(tmp_path: Path) -> None:
    """The reader and writer watchers go with the exchange: left on the loop, a worker
    thread's later traffic on the connection would wake a finished future (and a
    descriptor reused by another socket would be watched for the wrong owner)."""
    def script(sock: socket.socket) -> None:
        time.sleep(0.05)   # the reply comes after the loop started to watch
        sock.sendall(b":1\r\n")
        time.sleep(0.5)

    with peer(tmp_path, script) as addr:
        conn = connect(addr)

        async def main() -> tuple[bool, bool]:
            assert await loopio.exchange(conn, [CMD]) == [1]
            loop = asyncio.get_running_loop()
            return loop.remove_reader(conn.fileno()), loop.remove_writer(conn.fileno())

        try:
            assert asyncio.run(main()) == (False, False)
        finally:
            conn.close()


@pytest.mark.parametrize(("size", "ok"), [(loopio.MAX_BULK, True),
                                          (loopio.MAX_BULK + 1, False)])
def test_a_bulk_string_up_to_max_bulk_is_read(tmp_path: Path, size: int, ok: bool) -> None:
    """The bound is MAX_BULK bytes exactly: one past it is refused unread."""
    with peer(tmp_path, sends(bulk(b"v" * size))) as addr, closing(connect(addr)) as conn:
        if ok:
            assert asyncio.run(loopio.exchange(conn, [CMD])) == [b"v" * size]
        else:
            with pytest.raises(ProtocolError):
                asyncio.run(loopio.exchange(conn, [CMD]))


def test_only_minus_one_is_nil(tmp_path: Path) -> None:
    """``$-2`` is not RESP: a ProtocolError, not a nil read as a missing key."""
    with (peer(tmp_path, sends(b"$-2\r\n")) as addr, closing(connect(addr)) as conn,
          pytest.raises(ProtocolError)):
        asyncio.run(loopio.exchange(conn, [CMD]))


def test_a_large_pipeline_is_sent_whole_while_the_peer_reads_slowly(tmp_path: Path) -> None:
    """A pipeline larger than the socket buffer waits for room on the loop and goes out
    whole, each command once."""
    cmds = [command(b"EXISTS", b"k%06d" % i + b"x" * 200) for i in range(4000)]
    got = bytearray()
    done = threading.Event()

    def script(sock: socket.socket) -> None:
        want = sum(len(c) for c in cmds)
        while len(got) < want:
            time.sleep(0.001)
            data = sock.recv(1 << 14)
            if not data:
                return
            got.extend(data)
        sock.sendall(b":0\r\n" * len(cmds))
        done.wait(2)

    with peer(tmp_path, script, read_first=False) as addr:
        conn = connect(addr, timeout_s=10.0)
        try:
            assert asyncio.run(loopio.exchange(conn, cmds)) == [0] * len(cmds)
        finally:
            done.set()
            conn.close()
    assert bytes(got) == b"".join(cmds)


def test_an_error_reply_is_an_error_reply_not_a_status(tmp_path: Path) -> None:
    """``-ERR`` comes back as an ErrorReply (equal as text to a status, so compare the
    type): read as a status, a probe's WRONGTYPE would never delete the key."""
    with (peer(tmp_path, sends(b"-WRONGTYPE wrong kind\r\n+OK\r\n")) as addr,
          closing(connect(addr)) as conn):
        got = asyncio.run(loopio.exchange(conn, [CMD, CMD]))
    assert [type(r) for r in got] == [ErrorReply, str]
    assert isinstance(got[0], ErrorReply) and got[0].kind == "WRONGTYPE"
