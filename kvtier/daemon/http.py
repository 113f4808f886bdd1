"""HTTP endpoints (aiohttp): /metrics, /v1/stats, /v1/lookups/recent, /healthz, POST
/v1/prefix (prefix locality for routers, docs/prefix-locality.md), and token-guarded admin."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.daemon.http_guard import HttpGuard
from kvtier.daemon.http_pace import Pacer, RenderCache
from kvtier.daemon.limits import ByteBudget
from kvtier.daemon.metrics import Metrics
from kvtier.daemon.prefix import PrefixProbe
from kvtier.errors import (
    KVTierError,
    LimitExceeded,
    Overloaded,
    StartupError,
    UnknownNamespace,
)

_BACKLOG = 128
PREFIX_RUNNING = 2   # /v1/prefix probes worked on at once (each takes ~1 ms turns)
PREFIX_WAITING = 8   # probes whose bodies are read waiting for a turn; more: 503
RETRY_AFTER_S = 1
PREFIX_STATUS = {UnknownNamespace.code: 404, LimitExceeded.code: 413, Overloaded.code: 503}
"""HTTP status of a refused probe per error code (400 for every other KVTierError)."""


def http_error(exc: KVTierError) -> tuple[int, dict[str, str]]:
    """Status and JSON body for a refused probe."""
    return PREFIX_STATUS.get(exc.code, 400), {"error": str(exc), "code": exc.code}


def bind_http(host: str, port: int) -> list[socket.socket]:
    """Bind (and listen on) every address of ``host`` now, before the daemon builds its
    tiers, so a busy port fails the start at once with one line (StartupError)."""
    where = f"{host}:{port}"
    socks: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        for family, kind, proto, _name, addr in dict.fromkeys(infos):
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(_BACKLOG)
            s.setblocking(False)
    except (OSError, UnicodeError) as exc:
        for s in socks:
            s.close()
        reason = getattr(exc, "strerror", None) or str(exc)
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            fix = (f"stop the process that listens there (`ss -ltnp 'sport = :{port}'`) or "
                   "pass --http-port PORT (0 picks a free one)")
        elif isinstance(exc, OSError) and exc.errno == errno.EACCES:
            fix = "ports below 1024 need privileges: pass --http-port 1024 or higher"
        else:
            fix = "pass another --http-host or --http-port"
        raise StartupError(f"cannot listen for HTTP on {where}: {reason}; {fix}") from exc
    return socks


def bearer_token_matches(header: str, expected: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <expected>``, in constant time.

    Compared as UTF-8 bytes (surrogates passed through), so any header, ASCII or not, is
    just a wrong token: ``hmac.compare_digest`` on str raises TypeError for non-ASCII text.
    """
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not expected:
        return False
    given = token.strip().encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given, expected.encode("utf-8", "surrogatepass"))


class HttpServer:
    """Binds to 127.0.0.1 by default; port 0 picks a free port (see ``port``).

    ``sockets``: listening sockets from ``bind_http`` (the daemon binds before its setup);
    without them ``start`` binds ``host:port`` itself. ``prefix``: the control server's
    probe, served at POST /v1/prefix (absent: 404); bodies are then bounded by what a
    probe can carry (``PrefixProbe.http_limit``). At most ``PREFIX_RUNNING`` probes are
    worked on at once and ``PREFIX_WAITING`` wait (beyond: a 503 with Retry-After), so
    routers' and other local users' probes cannot take the event loop from the engines.
    /metrics is rendered a few times a second at most (``RenderCache``), /v1/stats and
    /v1/lookups/recent one at a time within a share of the loop (``Pacer``).
    """

    def __init__(self, host: str, port: int, metrics: Metrics,
                 stats: Callable[[], dict[str, Any]], config: Callable[[], dict[str, Any]],
                 admin_token: str = "",
                 recent: Callable[[int, bool], list[dict[str, Any]]] | None = None, *,
                 sockets: list[socket.socket] | None = None,
                 prefix: PrefixProbe | None = None, read_timeout_s: float = 10.0,
                 max_connections: int = 256) -> None:
        self.host, self._port = host, port
        self.metrics, self.stats, self.config = metrics, stats, config
        self.admin_token = admin_token
        self.recent = recent
        self.prefix = prefix
        self.last_request = 0.0     # time.monotonic() of the last prefix probe (routers)
        self._sockets = sockets or []
        self._runner: web.AppRunner | None = None
        self.port = port
        self.guard = HttpGuard(max_connections, read_timeout_s)
        self._slots = asyncio.Semaphore(PREFIX_RUNNING)
        self._waiting = 0
        # (found by review) a flood of GET /metrics (3-5 ms a render) or /v1/stats held the
        # event loop from the engines' control socket: kvtier.daemon.http_pace
        self.metrics_cache = RenderCache()
        self.pacer = Pacer()

    async def start(self) -> None:
        max_body = self.prefix.max_body if self.prefix is not None else 2**20
        self.guard.body_budget = ByteBudget(4 * max_body)
        app = web.Application(client_max_size=max_body, middlewares=[self.guard.middleware])
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/stats", self._stats)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/v1/lookups/recent", self._recent)
        app.router.add_get("/v1/admin/config", self._config)
        app.router.add_post("/v1/prefix", self._prefix)
        # lingering_time=0 (found by review): a body no handler read (a POST to /healthz,
        # a refused probe) is not drained for up to 10 s after the reply: its connection
        # is closed instead
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     lingering_time=0)
        await self._runner.setup()
        assert self._runner.server is not None
        self.guard.install(self._runner.server)
        # aiohttp logs a traceback for each malformed or abandoned request: any client could
        # flood the log; the guard's middleware logs handler failures itself
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
        if not self._sockets:
            self._sockets = bind_http(self.host, self._port)
        for sock in self._sockets:
            await web.SockSite(self._runner, sock).start()
        self.port = self._sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = self.metrics_cache.get(lambda: generate_latest(self.metrics.registry))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _stats(self, request: web.Request) -> web.Response:
        return await self._paced(lambda: json.dumps(self.stats(), default=str))

    async def _paced(self, render: Callable[[], str]) -> web.Response:
        """A JSON reply rendered in the pacer's turn, or a 503 with Retry-After when too
        many such renders wait already."""
        try:
            text = await self.pacer.run(render)
        except Overloaded as exc:
            self.guard.overloaded += 1
            status, doc = http_error(exc)
            return web.json_response(doc, status=status,
                                     headers={"Retry-After": str(RETRY_AFTER_S)})
        return web.Response(text=text, content_type="application/json")

    async def _recent(self, request: web.Request) -> web.Response:
        """Recent lookups and why their first block missed: ?limit=N&misses=1."""
        try:
            limit = int(request.query.get("limit", "50"))
        except ValueError:
            limit = -1
        if not 1 <= limit <= 100_000:
            return web.json_response({"error": "limit must be an integer from 1 to 100000"},
                                     status=400)
        misses = request.query.get("misses", "0").lower() in ("1", "true", "yes")
        recent = self.recent
        if recent is None:
            return web.json_response({"lookups": []})
        # paced as /v1/stats is: up to 100000 rows rendered on the loop (found by review)
        return await self._paced(lambda: json.dumps({"lookups": recent(limit, misses)}))

    async def _prefix(self, request: web.Request) -> web.Response:
        """How many leading tokens of a prompt (or of each in a batch) are cached here, by
        tier, and in Redis: a read-only probe for routers (kvtier.daemon.prefix)."""
        self.last_request = time.monotonic()
        if self.prefix is None:
            return web.json_response({"error": "prefix locality is not served here"},
                                     status=404)
        t0 = time.perf_counter()
        try:   # what the head tells (namespace, batch, declared size) before the body
            self._admit()
            limit = self.prefix.http_limit(request.content_type, request.query,
                                           request.content_length)
            body = await self.guard.read_body(request, limit)
            # a turn is taken once the body is whole: a client that trickles its body
            # (bounded by the guard) holds no turn meanwhile
            self._admit()
            self._waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self._waiting -= 1
            try:
                reply = await self.prefix.from_http(body, request.content_type,
                                                    request.query)
            finally:
                self._slots.release()
        except KVTierError as exc:
            status, doc = http_error(exc)
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
            return web.json_response(doc, status=status, headers=headers)
        self.metrics.observe("http_prefix", time.perf_counter() - t0)
        return web.json_response(reply)

    def _admit(self) -> None:
        """Overloaded (a 503) when ``PREFIX_WAITING`` probes already wait for a turn."""
        if self._waiting >= PREFIX_WAITING:
            self.guard.overloaded += 1
            raise Overloaded(f"{PREFIX_RUNNING + PREFIX_WAITING} prefix probes in progress: "
                             f"retry in {RETRY_AFTER_S} s")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _config(self, request: web.Request) -> web.Response:
        """403 while no admin token is configured (admin is off); 401 for a missing or
        wrong token, whatever bytes it holds."""
        if not self.admin_token:
            return web.json_response({"error": "admin endpoints are off: set "
                                      "http.admin_token (KVTIER_HTTP_ADMIN_TOKEN)"},
                                     status=403)
        if not bearer_token_matches(request.headers.get("Authorization", ""),
                                    self.admin_token):
            return web.json_response({"error": "admin endpoints need 'Authorization: Bearer "
                                      "<http.admin_token>'"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return web.json_response(self.config(), dumps=lambda o: json.dumps(o, default=str))
