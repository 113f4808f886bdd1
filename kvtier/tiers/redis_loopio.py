"""Small Redis exchanges run on the event loop itself, without a worker thread.

A lookup's probe (a pipelined EXISTS or GETRANGE of a few bytes per key) moves a few KiB,
yet through the tier's worker threads it pays two thread hand-offs: the loop wakes a
thread, the thread wakes the loop. On a 2-core VM those wake-ups cost more than the
exchange itself (a bare pipeline of 32 GETRANGEs on the loop: ~0.2 ms; docs/redis.md).
Here the pipeline is sent with non-blocking sends and its replies are read as they arrive
(the loop watches the socket), so the loop never blocks and no thread is woken.

Only simple replies are read (status, error, integer, nil and bulk strings up to
``MAX_BULK`` bytes): the callers' commands answer nothing else. The exchange is bounded by
the connection's op deadline (``Conn.begin``). On any failure, or a cancelled caller, the
connection is mid-exchange: the caller discards it (never reuses it).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.tiers.redis_pool import NodePool
from kvtier.tiers.redis_resp import CRLF, ErrorReply, ProtocolError
from kvtier.tiers.redis_wire import Conn

MAX_BULK = 4096   # the largest bulk string a small exchange expects (probes read 16 bytes)
_NOT_YET = object()


async def exchange(conn: Conn, cmds: Sequence[bytes]) -> list[Any]:
    """Send the encoded ``cmds`` as one pipeline on ``conn`` (a plain, idle connection) and
    return one reply each, reading on the running loop within the op deadline."""
    loop = asyncio.get_running_loop()
    fd = conn.fileno()
    blocking = os.get_blocking(fd)
    try:
        conn.begin()
        out = memoryview(b"".join(cmds))
        while out:
            out = out[conn.send_nowait(out):]
            if out:
                await _ready(loop, conn, writable=True)
        replies: list[Any] = []
        reader = _Replies(conn)
        while len(replies) < len(cmds):
            reply = reader.next()
            if reply is _NOT_YET:
                await _ready(loop, conn, writable=False)
            else:
                replies.append(reply)
        return replies
    finally:
        # uvloop's watchers set O_NONBLOCK on the descriptor and leave it: the worker
        # threads' blocking sends would then fail as timeouts (sending while the peer reads)
        if blocking and not os.get_blocking(fd):
            os.set_blocking(fd, True)


async def _ready(loop: asyncio.AbstractEventLoop, conn: Conn, *, writable: bool) -> None:
    """Wait until ``conn`` can be read (or written), at most until its deadline."""
    left = conn.deadline - time.monotonic()
    if left <= 0:
        raise conn.timed_out()
    fd = conn.fileno()
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    if writable:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        async with asyncio.timeout(left):
            await fut
    except TimeoutError:
        raise conn.timed_out() from None
    finally:
        if writable:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


class _Replies:
    """Simple replies taken from ``conn`` as they arrive (a step never blocks)."""

    __slots__ = ("conn", "pos", "value")

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.value: memoryview | None = None   # a bulk string's bytes and CRLF, while partial
        self.pos = 0

    def next(self) -> Any:
        """The next whole reply, or ``_NOT_YET`` when it has not all arrived."""
        conn = self.conn
        while True:
            value = self.value
            if value is not None:
                self.pos = conn.take_into(value, self.pos)
                if self.pos < value.nbytes:
                    if not conn.fill_nowait():
                        return _NOT_YET
                    continue
                self.value = None
                if value[-2:] != CRLF:
                    raise ProtocolError(f"bulk reply from redis {conn.addr} not followed by "
                                        "CRLF")
                return bytes(value[:-2])
            line = conn.take_line()
            if line is None:
                if not conn.fill_nowait():
                    return _NOT_YET
                continue
            kind, rest = line[:1], line[1:]
            if kind == b"$":
                n = _int(rest, conn)
                if n == -1:   # RESP2's nil; any other negative length is not RESP
                    return None   # (found by review)
                if n < 0:
                    raise ProtocolError(f"redis {conn.addr} sent a length of {n}")
                if n > MAX_BULK:
                    raise ProtocolError(f"redis {conn.addr} sent a {n}-byte value where a "
                                        f"small reply was expected")
                self.value, self.pos = memoryview(bytearray(n + 2)), 0
                continue
            if kind == b"+":
                return rest.decode()
            if kind == b"-":
                return ErrorReply(rest.decode(errors="replace"))
            if kind == b":":
                return _int(rest, conn)
            raise ProtocolError(f"unexpected reply from redis {conn.addr}: {kind!r}")


async def exchange_taken(pool: NodePool, conn: Conn, small: Callable[[list[int]], list[bytes]],
                   idx: list[int]) -> list[Any]:
    """``small(idx)`` exchanged on the event loop over ``conn`` (taken from ``pool``): given
    back after a clean exchange (the pool drops one holding bytes past its replies),
    discarded after any failure (building the commands too) or a cancellation. The
    commands are built here, so the thread path never builds them."""
    try:
        replies = await exchange(conn, small(idx))
    except BaseException:
        pool.discard(conn)
        raise
    pool.give(conn)
    return replies


def _int(text: bytes, conn: Conn) -> int:
    try:
        return int(text)
    except ValueError:
        raise ProtocolError(f"redis {conn.addr} sent {text[:40]!r} for a number") from None
