"""Bounded work per request and per connection: the control server's limits.

Every request a client can send costs the daemon a bounded amount of memory and event-loop
time: a frame is at most ``max_frame`` bytes; the request bytes held (read, decoded and not
yet answered) are bounded per connection and across connections; a request names at most
``ceil(max_context_tokens / tokens_per_block)`` keys of its namespace (checked on the raw
key blob, before it is split into Python objects); a frame must arrive whole within
``read_timeout_s`` and a connection that sends nothing for ``idle_timeout_s`` is dropped;
beyond ``max_connections`` a connection gets a typed refusal frame and is closed.
The defaults come from the longest context a request may carry (2**17 = 128k tokens) and the
frame size; docs/operations.md lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import DaemonConfig
from kvtier.errors import Overloaded, ProtocolError
from kvtier.protocol import (
    DEFAULT_MAX_FRAME,
    LENGTH,
    REQUEST_MAX_ITEMS,
    check_length,
    unpack_body,
)

log = logging.getLogger("kvtier.control")

DEFAULT_MAX_CONTEXT_TOKENS = 2**17
STREAM_LIMIT = 64 * 2**10
"""asyncio reads ahead at most 2x this much beyond what a frame read asked for, so request
bytes the daemon holds are bounded by the byte budgets below, not by the socket buffers."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request, one connection and all connections together may cost."""

    max_frame: int = DEFAULT_MAX_FRAME
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS
    conn_pending_bytes: int = DEFAULT_MAX_FRAME
    total_pending_bytes: int = 4 * DEFAULT_MAX_FRAME
    idle_timeout_s: float = 600.0
    read_timeout_s: float = 10.0
    max_connections: int = 1024
    listen_backlog: int = 4096
    client_put_bytes: int = 0   # arena bytes one client process may hold for writing (0: all)
    client_get_bytes: int = 0   # arena bytes one client process may pin for reading (0: all)
    max_leases_per_client: int = 4096   # leases one client process may hold open at once
    dropped_writer_hold_s: float = 3600.0   # a dropped writer of unknown pid: quarantine time

    @classmethod
    def from_config(cls, d: DaemonConfig, arena_bytes: int = 0) -> Limits:
        """The daemon's limits; a pending-bytes setting of 0 takes the derived default."""
        frame = d.max_frame_bytes
        put, get = d.client_put_share, d.client_get_share
        return cls(
            client_put_bytes=int(put * arena_bytes) if 0 < put < 1 else 0,
            client_get_bytes=int(get * arena_bytes) if 0 < get < 1 else 0,
            dropped_writer_hold_s=d.dropped_writer_hold_s,
            max_leases_per_client=d.max_leases_per_client,
            max_frame=frame, max_context_tokens=d.max_context_tokens,
            conn_pending_bytes=max(frame, d.max_conn_pending_bytes or frame),
            total_pending_bytes=max(frame, d.max_total_pending_bytes or 4 * frame),
            idle_timeout_s=d.idle_timeout_s, read_timeout_s=d.read_timeout_s,
            max_connections=d.max_connections, listen_backlog=d.listen_backlog)

    def max_keys(self, tokens_per_block: int) -> int:
        """Keys one request may name in a namespace with this block size."""
        return -(-self.max_context_tokens // max(1, tokens_per_block))


class ByteBudget:
    """Bytes held by requests in flight; a reader waits (bounded) for room.

    Waiters are woken on every release and re-check in arrival order; no Python object is
    kept per byte or per request beyond the waiter futures themselves.
    """

    __slots__ = ("_waiters", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    async def acquire(self, n: int) -> None:
        """Take ``n`` bytes, waiting for releases; cancel (e.g. a timeout) to give up."""
        while self.used + n > self.limit and self.used > 0:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


@dataclass(slots=True)
class LimitCounters:
    """What the limits did (exported under ``daemon`` in /v1/stats)."""

    errors: dict[str, int] = field(default_factory=dict)  # error replies by code
    refused_connections: int = 0   # beyond max_connections
    dropped_idle: int = 0          # no request within idle_timeout_s
    dropped_slow: int = 0          # a frame (or the hello) not whole within read_timeout_s,
    #                                or replies left unread as long
    capped_puts: int = 0           # put_prepares asking for more than their process's room
    capped_gets: int = 0           # get_prepares asking for more than their process may pin
    refused_leases: int = 0        # prepares refused: their process held max_leases_per_client


async def read_request(reader: asyncio.StreamReader, lim: Limits, pending: ByteBudget,
                       counters: LimitCounters, held: ByteBudget | None = None,
                       busy: Callable[[], bool] = lambda: False,
                       ) -> tuple[dict[str, Any], int] | None:
    """The next request on a connection and its size in bytes, which stay counted in
    ``held`` (this connection's budget) and ``pending`` (all connections') until the
    caller releases them.

    ``held`` None: the hello, which must arrive whole within read_timeout_s of the call.
    Otherwise the wait for a frame's first byte is bounded by idle_timeout_s (while
    ``busy()`` is false: none of the connection's requests is in flight) and the rest of
    the frame by read_timeout_s. None: the client closed (or idled out) between frames.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    wait = lim.read_timeout_s if held is None else (lim.idle_timeout_s or None)
    while True:
        try:
            async with asyncio.timeout(wait):
                first = await reader.readexactly(1)
            break
        except asyncio.IncompleteReadError:
            return None
        except TimeoutError:
            if held is None:
                counters.dropped_slow += 1
                raise ProtocolError(f"no hello within {lim.read_timeout_s}s of the "
                                    "connect: closing the connection") from None
            if busy():  # the client waits for our replies: not idle
                continue
            counters.dropped_idle += 1
            log.info("dropping a connection idle for %.0f s", wait)
            return None
    deadline = (start if held is None else loop.time()) + lim.read_timeout_s
    n = 0
    taken: list[ByteBudget] = []
    try:
        async with asyncio.timeout_at(deadline):
            (n,) = LENGTH.unpack(first + await reader.readexactly(LENGTH.size - 1))
            check_length(n, lim.max_frame)
            for budget in (held, pending):
                if budget is not None:
                    await budget.acquire(n)
                    taken.append(budget)
            body = await read_exactly(reader, n)
        return unpack_body(body, lim.max_frame, REQUEST_MAX_ITEMS), n
    except BaseException as exc:
        for budget in taken:
            budget.release(n)
        if isinstance(exc, asyncio.IncompleteReadError):
            raise ProtocolError("connection closed inside a frame") from None
        if not isinstance(exc, TimeoutError):
            raise
        if n and len(taken) < 2 - (held is None):
            raise Overloaded(f"the daemon holds its limit of request bytes in flight "
                             f"({lim.total_pending_bytes}): retry later") from None
        counters.dropped_slow += 1
        raise ProtocolError(f"frame not complete within {lim.read_timeout_s}s: "
                            "closing the connection") from None


async def read_exactly(reader: asyncio.StreamReader, n: int) -> bytes:
    """``n`` bytes, read in pieces as they arrive: the stream's own buffer stays small
    (its readexactly regrows and copies one bytearray many times for a 16 MiB frame, and
    that memory stays with the daemon)."""
    if n <= STREAM_LIMIT:
        return await reader.readexactly(n)
    parts: list[bytes] = []
    left = n
    while left:
        part = await reader.read(min(left, 2**20))
        if not part:
            raise asyncio.IncompleteReadError(b"".join(parts), n)
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
