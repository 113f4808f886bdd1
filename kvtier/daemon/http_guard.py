"""Bounds on the HTTP side of the daemon, as the control socket has them (kvtier.daemon.limits).

The HTTP port is open to every local user (and to routers): without bounds one client could
hold connections until the daemon runs out of descriptors (engines then cannot connect),
send half a request and stop, or park bodies of 16 MiB on many connections. ``HttpGuard``:

- refuses connections beyond ``max_connections`` with a 503 (JSON) and closes them;
- gives every connection ``read_timeout_s`` to deliver each request's head (from its
  connect, or from its previous reply) and each body, else closes it;
- bounds the body bytes held by all requests together (``ByteBudget``), counted as they
  arrive (a body declared large and trickled holds only what was sent; the first
  ``STREAM_LIMIT`` bytes of a body never wait, so small requests are not held up by large
  ones), and refuses a declared ``Content-Length`` beyond the route's limit with a 413
  before reading it;
- turns every HTTP error aiohttp raises itself (404, 405, 413, a parser's 400) into JSON,
  and a handler's bug into a 500 logged once, not a traceback per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvtier.daemon.limits import STREAM_LIMIT, ByteBudget, Charge

log = logging.getLogger("kvtier.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_REFUSED_BODY = b'{"error": "too many HTTP connections: retry later"}'
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(_REFUSED_BODY)
            + _REFUSED_BODY)


@dataclass(slots=True)
class _Conn:
    """One connection's watch: its deadline re-armed by each request it completes."""

    transport: Any
    busy: int = 0                 # requests being handled
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True, eq=False)
class HttpGuard:
    max_connections: int = 256
    read_timeout_s: float = 10.0
    body_budget: ByteBudget = field(default_factory=lambda: ByteBudget(64 * 2**20))
    refused: int = 0              # connections beyond max_connections
    timed_out: int = 0            # connections closed for a request not whole in time
    _conns: dict[int, _Conn] = field(default_factory=dict)

    def install(self, server: Any) -> None:
        """Hook into aiohttp's ``web.Server`` (``AppRunner.server``): its connection
        callbacks count, refuse and arm each connection's deadline."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            if len(self._conns) >= self.max_connections:
                self.refused += 1
                transport.write(_REFUSAL)
                transport.close()
                return
            conn = self._conns[id(handler)] = _Conn(transport)
            self._arm(conn)

        def connection_lost(handler: Any, exc: BaseException | None) -> None:
            conn = self._conns.pop(id(handler), None)
            if conn is not None and conn.timer is not None:
                conn.timer.cancel()
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

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
        after; every error becomes JSON."""
        conn = self._conns.get(id(request.protocol))
        if conn is not None:
            conn.busy += 1
        try:
            return await handler(request)
        except web.HTTPException as exc:   # aiohttp's own: 404, 405, 413, ...
            return web.json_response({"error": exc.reason}, status=exc.status)
        except (ConnectionError, asyncio.IncompleteReadError):   # the client left mid-body
            return web.json_response({"error": "the connection was lost"}, status=400)
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return web.json_response({"error": "internal error"}, status=500)
        finally:
            if conn is not None:
                conn.busy -= 1
                if conn.transport is not None and not conn.transport.is_closing():
                    self._arm(conn)

    async def read_body(self, request: web.Request, limit: int) -> bytes:
        """The request's body, of at most ``limit`` bytes, whole within ``read_timeout_s``
        and within the shared body budget; a web.HTTPException (413, 408, 503) otherwise.

        Its bytes are counted in the budget as they arrive (aiohttp's stream buffer bounds
        what is read ahead); its first ``STREAM_LIMIT`` bytes never wait for room."""
        declared = request.content_length
        if declared is not None and declared > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared)
        charge = Charge()
        parts: list[bytes] = []
        got = 0
        try:
            async with asyncio.timeout(self.read_timeout_s):
                # pieces joined once at the end: appending to one bytes object copied the
                # whole body so far per piece, quadratic in a slowly sent body
                while got <= limit:
                    more = await request.content.read(min(limit + 1 - got, 2**20))
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                    if got <= STREAM_LIMIT:
                        charge.take(self.body_budget, len(more))
                    else:
                        await charge.acquire(self.body_budget, len(more))
                    if request.content.at_eof():
                        break
        except TimeoutError:
            if charge.waiting is not None:
                raise web.HTTPServiceUnavailable(reason="HTTP request bytes at their limit: "
                                                 "retry") from None
            raise web.HTTPRequestTimeout(reason=f"the body did not arrive within "
                                         f"{self.read_timeout_s:g} s") from None
        finally:
            charge.waiting = None
            charge.release()
        if got > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=got)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def stats(self) -> dict[str, int]:
        return {"connections": len(self._conns), "refused": self.refused,
                "timed_out": self.timed_out, "body_bytes": self.body_budget.used}
