"""Survivors of the request-handling mutation round: the daemon's HTTP handlers
(``kvtier.daemon.http``) in-process, over aiohttp's mocked requests (no socket, no
process); the prefix probe behind ``POST /v1/prefix`` is scripted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvtier.daemon.http import PREFIX_WAITING, HttpServer
from kvtier.daemon.http_guard import HttpGuard


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
