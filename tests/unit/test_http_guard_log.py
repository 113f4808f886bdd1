"""HttpGuard's handler-failure log, in-process (an aiohttp app on loopback, no process):
a request that fails the same way every time logs one traceback, then only counts."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvtier.daemon.http_guard import HttpGuard


async def _hammer(guard: HttpGuard, n: int) -> list[int]:
    async def broken(request: web.Request) -> web.Response:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    async def other(request: web.Request) -> web.Response:
        raise KeyError("elsewhere")

    app = web.Application(middlewares=[guard.middleware])
    app.router.add_get("/broken", broken)
    app.router.add_get("/other", other)
    statuses = []
    async with TestClient(TestServer(app)) as client:
        for _ in range(n):
            r = await client.get("/broken")
            statuses.append(r.status)
        r = await client.get("/other")
        statuses.append(r.status)
    return statuses


def test_a_repeated_failure_logs_one_traceback_then_counts(
        caplog: pytest.LogCaptureFixture) -> None:
    guard = HttpGuard()
    with caplog.at_level(logging.ERROR, logger="kvtier.http"):
        statuses = asyncio.run(_hammer(guard, 120))
    assert set(statuses) == {500}
    records = [r for r in caplog.records if r.name == "kvtier.http"]
    with_traceback = [r for r in records if r.exc_info]
    assert len(with_traceback) == 2   # one per distinct place: /broken, /other
    assert len(records) == 4          # + one line at 10 and at 100 failures of /broken
    assert "100 times" in records[-2].getMessage() or "100 times" in records[-1].getMessage()
    assert guard.stats()["errors"] == 121
