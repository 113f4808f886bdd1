"""HTTP endpoints (aiohttp): /metrics, /v1/stats, /v1/lookups/recent, /healthz, and
token-guarded admin."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.daemon.metrics import Metrics


class HttpServer:
    """Binds to 127.0.0.1 by default; port 0 picks a free port (see ``port``)."""

    def __init__(self, host: str, port: int, metrics: Metrics,
                 stats: Callable[[], dict[str, Any]], config: Callable[[], dict[str, Any]],
                 admin_token: str = "",
                 recent: Callable[[int, bool], list[dict[str, Any]]] | None = None) -> None:
        self.host, self._port = host, port
        self.metrics, self.stats, self.config = metrics, stats, config
        self.admin_token = admin_token
        self.recent = recent
        self._runner: web.AppRunner | None = None
        self.port = port

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/stats", self._stats)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/v1/lookups/recent", self._recent)
        app.router.add_get("/v1/admin/config", self._config)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._port)
        await site.start()
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats(), dumps=lambda o: json.dumps(o, default=str))

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
        rows = self.recent(limit, misses) if self.recent is not None else []
        return web.json_response({"lookups": rows})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _config(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not self.admin_token or not hmac.compare_digest(token, self.admin_token):
            return web.json_response({"error": "admin endpoints need http.admin_token and "
                                      "'Authorization: Bearer <token>'"}, status=403)
        return web.json_response(self.config(), dumps=lambda o: json.dumps(o, default=str))
