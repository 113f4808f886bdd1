"""Survivors of the request-handling mutation round: the daemon's HTTP handlers
(``kvtier.daemon.http``) in-process, over aiohttp's mocked requests (no socket, no
process); the prefix probe behind ``POST /v1/prefix`` is scripted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any
from unittest import mock

import pytest
from aiohttp import StreamReader, web
from aiohttp.test_utils import make_mocked_request

from kvtier.daemon.http import PREFIX_WAITING, HttpServer
from kvtier.daemon.http_guard import BODY_GRACE_S, MIN_BODY_RATE, HttpGuard
from kvtier.daemon.limits import STREAM_LIMIT, ByteBudget, Charge


class ScriptedProbe:
    """``PrefixProbe``'s HTTP face: any body of up to 64 bytes, answered at once."""

    max_body = 64

    def __init__(self) -> None:
        self.probed = 0

    def http_limit(self, content_type: str, query: Mapping[str, str],
                   declared: int | None) -> int:
        return self.max_body

    async def from_http(self, body: bytes, content_type: str,
                        query: Mapping[str, str]) -> dict[str, Any]:
        self.probed += 1
        return {"hit_blocks": 0}


class NoMetrics:
    def observe(self, name: str, seconds: float) -> None:
        pass


def _server(prefix: ScriptedProbe | None = None, admin_token: str = "") -> HttpServer:
    return HttpServer("127.0.0.1", 0, NoMetrics(), dict, dict,  # type: ignore[arg-type]
                      admin_token, prefix=prefix)  # type: ignore[arg-type]


def test_a_probe_whose_body_arrived_while_the_queue_filled_is_refused() -> None:
    """``POST /v1/prefix`` admits a probe twice: before its body is read and again once it
    is whole (a client trickling its body holds no turn meanwhile). When ``PREFIX_WAITING``
    probes took the waiting places while this body arrived, it is a 503 with Retry-After
    and is not probed. Mutant that survived: the second admission dropped, so probes whose
    bodies were read in parallel all queued, past the bound."""
    probe = ScriptedProbe()
    srv = _server(probe)

    class QueueFillsMeanwhile(HttpGuard):
        async def read_body(self, request: web.Request, limit: int) -> bytes:
            srv._waiting = PREFIX_WAITING   # others' bodies came first: they wait now
            return b"{}"

    srv.guard = QueueFillsMeanwhile()
    request = make_mocked_request("POST", "/v1/prefix",
                                  headers={"Content-Type": "application/json"})
    response = asyncio.run(srv._prefix(request))
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    assert probe.probed == 0 and srv.guard.overloaded == 1


def test_admin_endpoints_answer_403_while_no_token_is_configured() -> None:
    """Without ``http.admin_token`` the admin endpoints are off: a 403 saying so, whatever
    the request carries (an empty bearer token included), not the 401 of a wrong token.
    Mutant that survived: the "off" answer dropped, so the daemon asked for a token that
    does not exist."""
    srv = _server()
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer x"}):
        response = asyncio.run(srv._config(make_mocked_request("GET", "/v1/admin/config",
                                                               headers=headers)))
        assert response.status == 403, headers
        assert isinstance(response, web.Response) and response.text is not None
        assert "admin endpoints are off" in json.loads(response.text)["error"]


async def test_a_body_that_ran_out_of_time_waiting_for_room_is_a_503_not_a_408() -> None:
    """A body past ``STREAM_LIMIT`` bytes waits for room in the shared body budget; when
    its deadline passes while it waits (older bodies hold the budget), the daemon is at
    its limit, not the client slow: a 503 (retry), and what it held is given back. Mutant
    that survived (guard-503): the wait's check dropped, so an overloaded daemon answered
    408 and blamed the client's pace."""
    guard = HttpGuard(read_timeout_s=0.2, small_budget=ByteBudget(1 << 20))
    older = Charge()
    older.take(guard.small_budget, guard.small_budget.limit)   # another body holds it all
    body = b"x" * (2 * STREAM_LIMIT)
    stream = StreamReader(mock.Mock(_reading_paused=False), 2**16,
                          loop=asyncio.get_running_loop())
    stream.feed_data(body)
    stream.feed_eof()
    request = make_mocked_request("POST", "/v1/prefix", payload=stream,
                                  headers={"Content-Length": str(len(body))})
    with pytest.raises(web.HTTPServiceUnavailable):
        await guard.read_body(request, len(body))
    assert guard.small_budget.used == guard.small_budget.limit   # only the older body's


def test_a_bodys_deadline_is_never_past_the_read_timeout() -> None:
    """A body may take ``BODY_GRACE_S`` plus its size at ``MIN_BODY_RATE``, but never more
    than ``read_timeout_s``: a client that declares a large body and trickles it holds its
    connection and budget bytes for at most the read timeout. Mutant that survived
    (guard-deadline-cap): the cap dropped, so a 64 MiB body declared could be trickled for
    65 s against a 10 s read timeout."""
    guard = HttpGuard(read_timeout_s=2.0)
    assert guard.body_deadline(64 * 2**20) == 2.0
    assert guard.body_deadline(MIN_BODY_RATE // 2) == BODY_GRACE_S + 0.5


async def test_the_shared_body_budget_is_four_of_the_largest_bodies() -> None:
    """Started, the server sizes the body budget shared by all HTTP requests at four of
    the largest body it takes (the probe's ``max_body``): what HTTP bodies in flight hold
    of the daemon's memory. Mutant that survived (http-budget): sixteen times that."""
    probe = ScriptedProbe()
    srv = _server(probe)
    await srv.start()
    try:
        assert srv.guard.body_budget.limit == 4 * probe.max_body
    finally:
        await srv.stop()
