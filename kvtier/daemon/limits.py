"""Bounded work per request and per connection: the control server's limits.

Every request a client can send costs the daemon a bounded amount of memory and event-loop
time: a frame is at most ``max_frame`` bytes; the request bytes held (read, decoded and not
yet answered) are bounded per connection, per client process and across connections, and
counted as they arrive (a frame announced large and trickled holds only what was sent);
a request names at most
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
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import DaemonConfig
from kvtier.errors import Overloaded, ProtocolError
from kvtier.protocol import (
    DEFAULT_MAX_FRAME,
    LENGTH,
    REQUEST_MAX_ENTRIES,
    REQUEST_MAX_ITEMS,
    check_length,
    unpack_body,
)

log = logging.getLogger("kvtier.control")

DEFAULT_MAX_CONTEXT_TOKENS = 2**17
STREAM_LIMIT = 64 * 2**10
"""asyncio reads ahead at most 2x this much beyond what a frame read asked for, so request
bytes the daemon holds are bounded by the byte budgets below, not by the socket buffers.
A frame of at most this many bytes never waits for the shared budgets."""
PROCESS_PENDING_SHARE = 0.5
"""The part of ``total_pending_bytes`` one client process (all its connections) may hold:
one process cannot take the shared budget from the others (never less than one frame)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request, one connection and all connections together may cost."""

    max_frame: int = DEFAULT_MAX_FRAME
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS
    conn_pending_bytes: int = DEFAULT_MAX_FRAME
    total_pending_bytes: int = 4 * DEFAULT_MAX_FRAME
    process_pending_bytes: int = 2 * DEFAULT_MAX_FRAME   # one process's share of the total
    idle_timeout_s: float = 600.0
    read_timeout_s: float = 10.0
    max_connections: int = 1024
    max_connections_per_client: int = 64   # open by one client process (by pid)
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
        total = max(frame, d.max_total_pending_bytes or 4 * frame)
        return cls(
            client_put_bytes=int(put * arena_bytes) if 0 < put < 1 else 0,
            client_get_bytes=int(get * arena_bytes) if 0 < get < 1 else 0,
            dropped_writer_hold_s=d.dropped_writer_hold_s,
            max_leases_per_client=d.max_leases_per_client,
            max_frame=frame, max_context_tokens=d.max_context_tokens,
            conn_pending_bytes=max(frame, d.max_conn_pending_bytes or frame),
            total_pending_bytes=total,
            process_pending_bytes=max(frame, int(total * PROCESS_PENDING_SHARE)),
            idle_timeout_s=d.idle_timeout_s, read_timeout_s=d.read_timeout_s,
            max_connections=d.max_connections,
            max_connections_per_client=d.max_connections_per_client,
            listen_backlog=d.listen_backlog)

    def max_keys(self, tokens_per_block: int) -> int:
        """Keys one request may name in a namespace with this block size."""
        return -(-self.max_context_tokens // max(1, tokens_per_block))


class ByteBudget:
    """Bytes held by requests in flight; a reader waits (bounded) for room, first come
    first served.

    Waiters are granted in arrival order: one that does not fit yet keeps its place, and
    nobody behind it overtakes it (a large frame is not starved by a stream of small
    ones). A holder named by ``owner`` (a frame being read in pieces) is tracked while it
    holds bytes: the oldest such holder is never kept waiting, so frames that each hold
    part of their bytes cannot all wait for each other (the budget is then exceeded by at
    most what that one frame still needs, bounded by ``max_frame``). No Python object is
    kept per byte or per request beyond the waiters and the holders' counts.
    """

    __slots__ = ("_holders", "_waiters", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, object, asyncio.Future[None]]] = deque()
        self._holders: dict[object, int] = {}   # owner -> bytes held, oldest first

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.limit or self.used == 0

    def _oldest(self) -> object:
        """The oldest holder by its ``seq`` (a ``Charge``'s, from one counter for every
        budget): the same frame is the oldest in every budget it holds bytes of, so frames
        that each hold part of two budgets cannot wait for each other in a cycle (the
        order in which budgets granted them may differ)."""
        return min(self._holders, key=_age, default=None)

    def _first(self, owner: object) -> bool:
        return owner is not None and self._oldest() is owner

    def _grant(self, n: int, owner: object) -> None:
        self.used += n
        if owner is not None:
            self._holders[owner] = self._holders.get(owner, 0) + n

    def take(self, n: int, owner: object = None) -> None:
        """Count ``n`` bytes at once, room or not (bytes bounded elsewhere)."""
        self._grant(n, owner)

    async def acquire(self, n: int, owner: object = None) -> None:
        """Take ``n`` bytes, waiting for releases in turn; cancel (e.g. a timeout) to give
        up: a cancelled wait takes nothing."""
        if self._first(owner) or (not self._waiters and self._fits(n)):
            self._grant(n, owner)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, owner, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():   # granted, then cancelled: give back
                self.release(n, owner)
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()   # the head may have changed
            raise

    def release(self, n: int, owner: object = None) -> None:
        self.used -= n
        if owner is not None and owner in self._holders:
            left = self._holders[owner] - n
            if left > 0:
                self._holders[owner] = left
            else:
                del self._holders[owner]
        self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            n, owner, fut = waiters[0]
            if fut.done():
                waiters.popleft()
                continue
            if not self._fits(n):
                break
            waiters.popleft()
            self._grant(n, owner)
            fut.set_result(None)
        first = self._oldest()
        if first is not None and waiters:   # the oldest holder goes ahead of the queue
            for entry in waiters:
                if entry[1] is first and not entry[2].done():
                    waiters.remove(entry)
                    self._grant(entry[0], first)
                    entry[2].set_result(None)
                    break


@dataclass(slots=True)
class ProcessShare:
    """What one client process may hold over all its connections: request bytes, and
    requests in flight (64 connections of one process pipelining 64 requests each made
    another client's ping wait a second; found by review)."""

    budget: ByteBudget
    inflight: asyncio.Semaphore
    users: int = 0


class ProcessShares:
    """One ``ProcessShare`` per client process (by pid), so that one process cannot hold the
    whole shared request-byte budget nor fill the event loop with its requests; counted by
    the connections that use it."""

    __slots__ = ("_shares", "inflight", "limit")

    def __init__(self, limit: int, inflight: int) -> None:
        self.limit = limit
        self.inflight = inflight
        self._shares: dict[int, ProcessShare] = {}

    def open(self, process: int) -> ProcessShare:
        share = self._shares.get(process)
        if share is None:
            share = self._shares[process] = ProcessShare(
                ByteBudget(self.limit), asyncio.Semaphore(self.inflight))
        share.users += 1
        return share

    def users(self, process: int) -> int:
        """Connections of ``process`` open now."""
        share = self._shares.get(process)
        return share.users if share is not None else 0

    def close(self, process: int) -> None:
        share = self._shares.get(process)
        if share is None:
            return
        share.users -= 1
        if share.users <= 0:
            del self._shares[process]


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


_SEQ = itertools.count()


def _age(owner: object) -> int:
    seq = getattr(owner, "seq", None)
    return seq if isinstance(seq, int) else -1


@dataclass(slots=True, eq=False)
class Charge:
    """The bytes one request holds in the byte budgets until it is answered: taken as its
    frame's bytes arrive, given back at once by ``release``. ``seq`` orders charges by
    age across all budgets."""

    nbytes: int = 0                   # the frame's length
    seq: int = field(default_factory=lambda: next(_SEQ))
    held: dict[ByteBudget, int] = field(default_factory=dict)
    waiting: ByteBudget | None = None   # the budget it waits for room in, if it does

    async def acquire(self, budget: ByteBudget, n: int, *, owner: bool = True) -> None:
        self.waiting = budget
        await budget.acquire(n, self if owner else None)
        self.waiting = None
        self.held[budget] = self.held.get(budget, 0) + n

    def take(self, budget: ByteBudget, n: int) -> None:
        budget.take(n, self)
        self.held[budget] = self.held.get(budget, 0) + n

    def release(self) -> None:
        held, self.held = self.held, {}
        for budget, n in held.items():
            budget.release(n, self)


async def read_request(reader: asyncio.StreamReader, lim: Limits, pending: ByteBudget,
                       counters: LimitCounters, held: ByteBudget | None = None,
                       busy: Callable[[], bool] = lambda: False,
                       process: ByteBudget | None = None,
                       ) -> tuple[dict[str, Any], Charge] | None:
    """The next request on a connection and the bytes it holds (``Charge``): counted in
    ``held`` (this connection's budget, taken for the whole frame once its length is
    read: only the connection's own requests can be in the way), and in ``process`` (its
    process's share) and ``pending`` (all connections') as its bytes arrive, until the
    caller releases them.

    A frame of at most ``STREAM_LIMIT`` bytes never waits for the shared budgets (the
    stream's buffer bounds it anyway): pings, commits, releases and lookups are not held up
    by large frames. A larger frame waits for room piece by piece (first come, first
    served), so a client that announces a large frame and trickles it holds only what it
    sent, and is dropped once ``read_timeout_s`` passes.

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
    charge = Charge()
    shared = [b for b in (process, pending) if b is not None]

    async def arrived(k: int) -> None:
        for budget in shared:
            await charge.acquire(budget, k)

    try:
        async with asyncio.timeout_at(deadline):
            (n,) = LENGTH.unpack(first + await reader.readexactly(LENGTH.size - 1))
            check_length(n, lim.max_frame)
            charge.nbytes = n
            if held is not None:
                await charge.acquire(held, n, owner=False)
            if n <= STREAM_LIMIT:
                body = await reader.readexactly(n)
                for budget in shared:
                    charge.take(budget, n)
            else:
                body = await read_exactly(reader, n, arrived)
        return unpack_body(body, lim.max_frame, REQUEST_MAX_ITEMS, REQUEST_MAX_ENTRIES), charge
    except BaseException as exc:
        waited, charge.waiting = charge.waiting, None
        charge.release()
        if isinstance(exc, asyncio.IncompleteReadError):
            raise ProtocolError("connection closed inside a frame") from None
        if not isinstance(exc, TimeoutError):
            raise
        if waited is not None and waited is held:
            raise Overloaded(f"this connection's requests in flight hold its limit of "
                             f"request bytes ({held.limit}, daemon.max_conn_pending_bytes): "
                             "retry later") from None
        if waited is not None and waited is process:
            raise Overloaded(f"this client process holds its share of the request bytes "
                             f"in flight ({waited.limit}, half of "
                             "daemon.max_total_pending_bytes): retry later") from None
        if waited is not None:
            raise Overloaded(f"the daemon holds its limit of request bytes in flight "
                             f"({lim.total_pending_bytes}): retry later") from None
        counters.dropped_slow += 1
        raise ProtocolError(f"frame not complete within {lim.read_timeout_s}s: "
                            "closing the connection") from None


async def read_exactly(reader: asyncio.StreamReader, n: int,
                       arrived: Callable[[int], Awaitable[None]] | None = None) -> bytes:
    """``n`` bytes, read in pieces as they arrive: the stream's own buffer stays small
    (its readexactly regrows and copies one bytearray many times for a 16 MiB frame, and
    that memory stays with the daemon). ``arrived(k)`` is awaited after each piece of
    ``k`` bytes, before the next is read (the byte budgets: reading pauses while it
    waits, and the stream's buffer then pauses the socket)."""
    if n <= STREAM_LIMIT and arrived is None:
        return await reader.readexactly(n)
    parts: list[bytes] = []
    left = n
    while left:
        part = await reader.read(min(left, 2**20))
        if not part:
            raise asyncio.IncompleteReadError(b"".join(parts), n)
        parts.append(part)
        left -= len(part)
        if arrived is not None:
            await arrived(len(part))
    return b"".join(parts)
