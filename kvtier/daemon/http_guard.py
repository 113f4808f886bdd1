"""Bounds on the HTTP side of the daemon, as the control socket has them (kvtier.daemon.limits).

The HTTP port is open to every local user (and to routers): without bounds one client could
hold connections until the daemon runs out of descriptors (engines then cannot connect),
send half a request and stop, or park bodies of 16 MiB on many connections. ``HttpGuard``:

- holds at most ``max_connections`` connections (below);
- gives every connection ``read_timeout_s`` to deliver each request's head (from its
  connect, or from its previous reply), and each body ``BODY_GRACE_S`` plus its size at
  ``MIN_BODY_RATE`` (at most ``read_timeout_s``), else closes it: a body stalled short of
  its end holds the shared budget for a second or two, not ``read_timeout_s``;
- bounds the body bytes held by all requests together (``ByteBudget``), counted as they
  arrive (a body declared large and trickled holds only what was sent; the first
  ``STREAM_LIMIT`` bytes of a body never wait, so small requests are not held up by large
  ones), and refuses a declared ``Content-Length`` beyond the route's limit with a 413
  before reading it;
- when full, makes room for a new connection by closing the one idle the longest (no
  request being handled; counted in ``evicted``), and refuses the new one with a 503
  (JSON) only when every connection is busy (found by review: one client re-arming 256
  idle keep-alives every few seconds kept routers and Prometheus out with 503s forever);
- refuses a request sent with ``Transfer-Encoding`` (chunked) with a 411 before reading
  any of its body, and closes its connection (found by review: aiohttp parses 1-byte
  chunks one callback each, and one connection sending them held the event loop ~0.5 s a
  request); the server runs with ``lingering_time=0``, so a body no handler read is not
  drained after the reply: its connection is closed instead, except that a refusal's
  declared body of at most ``DRAIN_MAX`` bytes is read and dropped before the refusal is
  sent (``_drain``: a client that writes before it reads would see a reset);
- turns the HTTP errors a handler or the router raises (404, 405, 408, 411, 413, 503)
  into JSON, and a handler's bug into a 500: one traceback per distinct place it failed,
  then only a count (``errors``), so no client can flood the log. Not JSON (found by
  review: this said every error was): what aiohttp's parser refuses before any handler or
  middleware runs (a malformed request line or header, a bad ``Content-Length``, too many
  or too long headers, a ``Transfer-Encoding`` other than chunked or with a
  ``Content-Length``) is aiohttp's own text/plain 400, its connection then closed; an
  ``Expect`` other than ``100-continue`` is its text/plain 417 (checked before the
  middleware runs). Their tracebacks are not logged (``HttpServer.start``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import hdrs, web

from kvtier.daemon.limits import STREAM_LIMIT, ByteBudget, Charge

log = logging.getLogger("kvtier.http")

MIN_BODY_RATE = 1 << 20   # bytes/s a body must keep up on average (any network does more)
BODY_GRACE_S = 1.0        # on top of its size at MIN_BODY_RATE: a body's time to arrive
SMALL_BODY = 512 * 2**10  # a body declared this size or less draws on ``small_budget``
DRAIN_MAX = 4 << 20       # a refused body this size or less is read and dropped (``_drain``)
# refusals that end a body which did not arrive in time or found no room: draining it would
# wait for it once more
_NO_DRAIN = frozenset({408, 503})
DRAIN_S = 2.0             # at most this long for a refused body to arrive (4 MiB at ~2 MiB/s)
_MAX_SITES = 64           # distinct failure places remembered (beyond them: one bucket)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_REFUSED_BODY = b'{"error": "too many HTTP connections: retry later"}'
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(_REFUSED_BODY)
            + _REFUSED_BODY)
_CHUNKED = ("a request body must come with Content-Length (Transfer-Encoding is not "
            "accepted here)")


@dataclass(slots=True)
class _Conn:
    """One connection's watch: its deadline re-armed by each request it completes."""

    transport: Any
    busy: int = 0                 # requests being handled
    timer: asyncio.TimerHandle | None = None
    idle_since: float = 0.0       # time.monotonic() when ``busy`` last became 0 (or connect)


@dataclass(slots=True, eq=False)
class HttpGuard:
    max_connections: int = 256
    read_timeout_s: float = 10.0
    body_budget: ByteBudget = field(default_factory=lambda: ByteBudget(64 * 2**20))
    # bodies declared at most SMALL_BODY (a router's probe of one long prompt) have their own
    # budget: large bodies stalled short of their end cannot keep them waiting
    small_budget: ByteBudget = field(default_factory=lambda: ByteBudget(16 * 2**20))
    refused: int = 0              # connections beyond max_connections, every one busy
    evicted: int = 0              # idle connections closed to make room for a new one
    length_required: int = 0      # requests refused for Transfer-Encoding (411)
    timed_out: int = 0            # connections closed for a request not whole in time
    errors: int = 0               # handler failures (500s)
    overloaded: int = 0           # requests answered 503: too many of their kind at once
    _conns: dict[int, _Conn] = field(default_factory=dict)
    _sites: dict[tuple[str, str, int], int] = field(default_factory=dict)

    def install(self, server: Any) -> None:
        """Hook into aiohttp's ``web.Server`` (``AppRunner.server``): its connection
        callbacks count, refuse and arm each connection's deadline."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            if len(self._conns) >= self.max_connections and not self._evict_idle():
                self.refused += 1
                transport.write(_REFUSAL)
                transport.close()
                return
            conn = self._conns[id(handler)] = _Conn(transport, idle_since=time.monotonic())
            self._arm(conn)

        def connection_lost(handler: Any, exc: BaseException | None) -> None:
            conn = self._conns.pop(id(handler), None)
            if conn is not None and conn.timer is not None:
                conn.timer.cancel()
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def _evict_idle(self) -> bool:
        """Close the connection idle the longest, to make room for a new one (found by
        review: idle keep-alives re-armed every few seconds held every slot, so routers got
        503s forever); False when every connection is handling a request."""
        idle = [(c.idle_since, key) for key, c in self._conns.items() if not c.busy]
        if not idle:
            return False
        _, key = min(idle)
        conn = self._conns.pop(key)
        if conn.timer is not None:
            conn.timer.cancel()
        self.evicted += 1
        conn.transport.close()
        return True

    def _arm(self, conn: _Conn) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = asyncio.get_running_loop().call_later(self.read_timeout_s,
                                                           self._expire, conn)

    def _expire(self, conn: _Conn) -> None:
        conn.timer = None
        if conn.busy:   # a handler runs: its own bounds apply (the body read below)
            return
        self.timed_out += 1
        conn.transport.abort()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Marks the connection busy while its request is handled, re-arms its deadline
        after; refuses a body sent with Transfer-Encoding (411) before a byte of it is read;
        the handlers' and router's errors become JSON."""
        if hdrs.TRANSFER_ENCODING in request.headers:
            # (found by review) 1-byte chunks cost a parser callback each: ~0.5 s of event
            # loop per request; closed, so that nothing more of the body is parsed
            self.length_required += 1
            refusal = web.json_response({"error": _CHUNKED}, status=411)
            refusal.force_close()
            return refusal
        conn = self._conns.get(id(request.protocol))
        if conn is not None:
            conn.busy += 1
        try:
            response = await handler(request)
        except web.HTTPException as exc:   # aiohttp's own: 404, 405, 413, ...
            response = web.json_response({"error": exc.reason}, status=exc.status)
        except (ConnectionError, asyncio.IncompleteReadError):   # the client left mid-body
            return web.json_response({"error": "the connection was lost"}, status=400)
        except Exception as exc:
            self._failed(request, exc)
            return web.json_response({"error": "internal error"}, status=500)
        finally:
            if conn is not None:
                conn.busy -= 1
                if not conn.busy:
                    conn.idle_since = time.monotonic()
                if conn.transport is not None and not conn.transport.is_closing():
                    self._arm(conn)
        if response.status >= 400 and response.status not in _NO_DRAIN:
            # a refusal, maybe sent before its body was read: the connection counts as
            # idle meanwhile, so a new one may close it for room (found by review: drained
            # as busy, slow bodies to refused routes kept routers out)
            await self._drain(request)
        return response

    async def _drain(self, request: web.Request) -> None:
        """Read and drop the rest of a refused request's declared body when it is at most
        ``DRAIN_MAX`` bytes and arrives within its body deadline, so that a client that
        writes its whole body before it reads (urllib, requests) gets the refusal instead of
        a reset (found by review: closing with its bytes unread sent an RST, and the 413 was
        lost). A larger or slower body is left unread and its connection closed, as before.
        What it costs the loop is what an accepted body of that size costs; the wait is
        bounded by the body's deadline and by ``DRAIN_S``, and the connection is idle (may
        be closed for room) meanwhile."""
        declared = request.content_length
        if not declared or declared > DRAIN_MAX or request.content.at_eof():
            return
        with contextlib.suppress(Exception):   # best effort: the refusal is sent either way
            async with asyncio.timeout(min(DRAIN_S, self.body_deadline(declared))):
                while await request.content.readany():
                    pass

    def _failed(self, request: web.Request, exc: Exception) -> None:
        """Log a handler's failure: its traceback the first time it fails at this place
        (exception type and innermost frame), then one line at 10, 100, 1000... failures
        there: a request that fails the same way every time cannot flood the log."""
        self.errors += 1
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        site = (type(exc).__name__, tb.tb_frame.f_code.co_filename if tb else "",
                tb.tb_lineno if tb else 0)
        if site not in self._sites and len(self._sites) >= _MAX_SITES:
            site = ("*", "", 0)
        n = self._sites[site] = self._sites.get(site, 0) + 1
        if n == 1:
            log.error("HTTP %s %s failed", request.method, request.path, exc_info=exc)
        elif n in (10, 100, 1000) or n % 10_000 == 0:
            log.error("HTTP %s %s failed: %s at %s:%d, %d times so far (traceback logged "
                      "once)", request.method, request.path, site[0], site[1], site[2], n)

    def body_deadline(self, size: int) -> float:
        """Seconds a body of ``size`` bytes may take to arrive: ``BODY_GRACE_S`` plus its
        size at ``MIN_BODY_RATE``, at most ``read_timeout_s``."""
        return min(self.read_timeout_s, BODY_GRACE_S + size / MIN_BODY_RATE)

    async def read_body(self, request: web.Request, limit: int) -> bytes:
        """The request's body, of at most ``limit`` bytes, whole within ``body_deadline``
        of its declared size (of ``limit`` when undeclared) and within the shared body
        budget; a web.HTTPException (413, 408, 503) otherwise.

        Its bytes are counted in the budget as they arrive (aiohttp's stream buffer bounds
        what is read ahead); its first ``STREAM_LIMIT`` bytes never wait for room."""
        declared = request.content_length
        if declared is not None and declared > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared)
        budget = self.small_budget if declared is not None and declared <= SMALL_BODY \
            else self.body_budget
        charge = Charge()
        parts: list[bytes] = []
        got = 0
        allowed = self.body_deadline(limit if declared is None else declared)
        try:
            async with asyncio.timeout(allowed):
                # pieces joined once at the end: appending to one bytes object copied the
                # whole body so far per piece, quadratic in a slowly sent body
                while got <= limit:
                    more = await request.content.read(min(limit + 1 - got, 2**20))
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                    if got <= STREAM_LIMIT:
                        charge.take(budget, len(more))
                    else:
                        await charge.acquire(budget, len(more))
                    if request.content.at_eof():
                        break
        except TimeoutError:
            if charge.waiting is not None:
                raise web.HTTPServiceUnavailable(reason="HTTP request bytes at their limit: "
                                                 "retry") from None
            raise web.HTTPRequestTimeout(reason=f"the body did not arrive within "
                                         f"{allowed:.3g} s (at least {MIN_BODY_RATE} "
                                         "bytes/s)") from None
        finally:
            charge.waiting = None
            charge.release()
        if got > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=got)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def stats(self) -> dict[str, int]:
        return {"connections": len(self._conns), "refused": self.refused,
                "evicted": self.evicted, "length_required": self.length_required,
                "timed_out": self.timed_out,
                "body_bytes": self.body_budget.used + self.small_budget.used,
                "errors": self.errors, "overloaded": self.overloaded}
