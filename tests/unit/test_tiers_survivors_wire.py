"""Survivors of the tiers' mutation round: the Redis tier's RESP connection
(kvtier.tiers.redis_wire.Conn) and its pool (kvtier.tiers.redis_pool) against a scripted
peer (a thread in this process, tests/support/resp_peer.py) that sends replies a real
redis-server never does."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.tiers.redis_pool import NodePool
from kvtier.tiers.redis_resp import ConnOptions, ProtocolError, command
from kvtier.tiers.redis_wire import Conn
from tests.support.resp_peer import peer

OPTS = ConnOptions(connect_timeout_s=1.0, op_timeout_s=1.0)


def until_hangup(sent: bytes) -> Callable[[socket.socket], None]:
    """A script that sends ``sent`` whatever it is asked, then waits for the hang-up."""
    def script(sock: socket.socket) -> None:
        sock.sendall(sent)
        while sock.recv(1 << 16):
            pass
    return script


@pytest.mark.parametrize("sent", [
    b"$3\r\nabcXY:1\r\n",                    # a bulk string not followed by CRLF
    b"*1\r\n" * 9 + b":1\r\n",               # arrays nested 9 deep, within the byte bound
], ids=["bulk-without-crlf", "nested-9"])
def test_a_reply_out_of_shape_is_a_protocol_error(tmp_path: Path, sent: bytes) -> None:
    """``read_reply`` refuses a bulk string whose announced length is not followed by
    CRLF (the stream is out of step: the next reply would be read from the middle of a
    value) and arrays nested deeper than ``MAX_REPLY_DEPTH`` even when they are small:
    ProtocolError, and the connection is not used again. Mutants that survived: the
    CRLF test after a bulk string dropped (the value was returned, two bytes of it
    left for the next reply), and the depth test dropped (the existing test nested 5000
    arrays, which the byte bound refused first)."""
    with peer(tmp_path, until_hangup(sent)) as addr:
        conn = Conn(addr, OPTS)
        try:
            with pytest.raises(ProtocolError):
                conn.simple_many([command(b"PING")])
        finally:
            conn.close()


def test_a_get_value_not_followed_by_crlf_is_a_protocol_error(tmp_path: Path) -> None:
    """``read_value`` (a GET received straight into the caller's buffer) checks the CRLF
    after the value: without it the reply was not the value announced (out of step), and
    the bytes placed must not be taken as the block. Mutant that survived: that CRLF test
    dropped (``get_exact`` returned the length as if the stripe were sound)."""
    with peer(tmp_path, until_hangup(b"$4\r\nabcdXY")) as addr:
        conn = Conn(addr, OPTS)
        try:
            with pytest.raises(ProtocolError):
                conn.get_exact(b"kvtier:x:1", memoryview(bytearray(4)))
        finally:
            conn.close()


def test_a_ping_answered_by_another_reply_is_not_in_step(tmp_path: Path) -> None:
    """``in_step`` sends a PING with a fresh nonce; any other reply first (a value the
    server sent once too often) means the connection is out of step: False, so a striped
    read run on it is a miss rather than a block built from a stale reply. Mutant that
    survived: ``in_step`` answering True whatever came back."""
    with peer(tmp_path, until_hangup(b"$5\r\nstale\r\n")) as addr:
        conn = Conn(addr, OPTS)
        try:
            assert conn.in_step() is False
        finally:
            conn.close()


def test_a_connection_left_inside_a_refused_value_is_never_pooled(tmp_path: Path) -> None:
    """A GET answered with a value longer than any frame of the block is refused unread
    (``mid_reply``): the rest of the value is still due on that connection, so
    ``NodePool.give`` closes it even when nothing of the rest has arrived yet (no buffered
    byte to betray it); pooled, the next exchange would read the value's bytes as its
    replies. Mutant that survived: the ``mid_reply`` test dropped from ``give``."""
    head = b"x" * 96
    with peer(tmp_path, until_hangup(b"$100000\r\n" + head)) as addr:
        pool = NodePool(addr, OPTS, 2)
        try:
            conn = pool.take()
            assert conn.get_many([b"kvtier:k"], 96, lambda _i, _h, _n: None, 1000) == [100000]
            assert conn.mid_reply
            pool.give(conn)
            assert pool.take_idle() is None
            assert pool.open == 0
        finally:
            pool.close()


PONG = until_hangup(b"+PONG\r\n")   # answers the first command, then waits


def serving(pool: NodePool) -> None:
    """One PING through ``pool``: the peer's thread is accepting (it closes its socket
    when the test ends, which a thread not started yet would meet)."""
    assert pool.run(lambda conn: conn.simple_many([command(b"PING")])) == ["PONG"]


def test_a_pool_keeps_at_most_its_limit_of_idle_connections(tmp_path: Path) -> None:
    """``NodePool.give`` keeps at most ``limit`` idle connections and closes the rest
    (a burst of concurrent exchanges must not leave a server holding that many idle
    connections for good); ``open`` counts only those kept. Mutant that survived: the
    idle bound dropped."""
    with peer(tmp_path, PONG, concurrent=True) as addr:
        pool = NodePool(addr, OPTS, 2)
        try:
            serving(pool)
            taken = [pool.take() for _ in range(5)]
            assert pool.open == 5
            for conn in taken:
                pool.give(conn)
            assert pool.open == 2
            idle = [pool.take_idle(), pool.take_idle()]
            assert None not in idle and pool.take_idle() is None
            for idle_conn in idle:
                assert idle_conn is not None
                pool.give(idle_conn)
        finally:
            pool.close()


def test_a_pools_fan_out_stops_at_its_limit(tmp_path: Path) -> None:
    """``try_take`` (a read fanning out over more connections) opens a new connection only
    while fewer than ``limit`` are open, and answers None past it; ``take`` (one exchange
    per worker thread) always gets one. Mutant that survived: ``try_take``'s bound
    dropped."""
    with peer(tmp_path, PONG, concurrent=True) as addr:
        pool = NodePool(addr, OPTS, 2)
        try:
            serving(pool)
            first, second = pool.take(), pool.try_take()
            assert second is not None
            assert pool.try_take() is None
            third = pool.take()                  # whatever the limit says
            assert pool.open == 3
            for conn in (first, second, third):
                pool.discard(conn)
            assert pool.open == 0
        finally:
            pool.close()


def test_a_connection_whose_exchange_failed_is_never_reused(tmp_path: Path) -> None:
    """``NodePool.run``: when the exchange raises (a timeout, a broken reply), its
    connection is closed, not given back: it may hold half a reply. Mutant that survived:
    the failed connection given back to the idle list."""
    with peer(tmp_path, PONG, concurrent=True) as addr:
        pool = NodePool(addr, OPTS, 2)

        def fails(conn: Conn) -> None:
            raise TimeoutError("no reply in time")

        try:
            serving(pool)
            with pytest.raises(TimeoutError):
                pool.run(fails)
            assert pool.open == 0
            assert pool.take_idle() is None
        finally:
            pool.close()
