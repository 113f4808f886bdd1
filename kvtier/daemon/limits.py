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
from dataclasses import dataclass

from kvtier.config import DaemonConfig
from kvtier.protocol import DEFAULT_MAX_FRAME

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

    @classmethod
    def from_config(cls, d: DaemonConfig) -> Limits:
        """The daemon's limits; a pending-bytes setting of 0 takes the derived default."""
        frame = d.max_frame_bytes
        return cls(
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
