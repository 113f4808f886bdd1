"""The daemon's HTTP port is open to every local user: a real daemon closes connections that
do not deliver a request in time, refuses connections beyond its bound (engines keep
connecting over the control socket), refuses a declared body beyond the limit before
reading it, answers every error in JSON, and shows no secret on the admin endpoint."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.client import connect
from tests.support.daemon import DaemonProcess

TOKEN = "s3cr3t-admin-token"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("http") / "d", cpu_bytes="32MiB",
                      nvme_bytes="0",
                      env={"KVTIER_DAEMON_READ_TIMEOUT_S": "1", "KVTIER_HTTP_MAX_CONNECTIONS": "8",
                           "KVTIER_HTTP_ADMIN_TOKEN": TOKEN,
                           "KVTIER_REDIS_URL": "redis://kv:hunter2@127.0.0.1:1/0"}).start()
    yield d
    d.kill()


def _addr(d: DaemonProcess) -> tuple[str, int]:
    host, port = d.http_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _raw(d: DaemonProcess, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(_addr(d), timeout=10)
    if data:
        s.sendall(data)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bytes:
    """What the daemon sent before closing ``s``; fails if it is still open after that."""
    s.settimeout(seconds)
    got = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return got
        got += chunk


def _get(d: DaemonProcess, path: str, headers: dict[str, str] | None = None,
         method: str = "GET") -> tuple[int, Any]:
    req = urllib.request.Request(d.http_url + path, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_connection_that_sends_nothing_or_half_a_request_is_closed(
        daemon: DaemonProcess) -> None:
    silent = _raw(daemon)
    head = _raw(daemon, b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n")   # no end of head
    body = _raw(daemon, b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 1000\r\n\r\n{")
    t0 = time.monotonic()
    for s in (silent, head):
        assert _closed_within(s, 5) == b""
    assert b"408" in _closed_within(body, 5)    # the body's own deadline: a JSON 408
    assert time.monotonic() - t0 < 4
    assert daemon.stats()["http"]["timed_out"] >= 2
    assert _get(daemon, "/healthz") == (200, {"status": "ok"})


def test_connections_beyond_the_bound_are_refused_and_engines_still_connect(
        daemon: DaemonProcess) -> None:
    held = [_raw(daemon) for _ in range(8)]
    time.sleep(0.2)
    extra = _raw(daemon)
    reply = _closed_within(extra, 5)
    assert reply.startswith(b"HTTP/1.1 503") and b"too many HTTP connections" in reply
    with connect(daemon.socket) as c:   # the control socket is not affected
        assert c.stats()["http"]["refused"] >= 1
    for s in held:
        s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert _get(daemon, "/healthz")[0] == 200
            break
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    else:
        pytest.fail("HTTP did not come back once the connections closed")


def test_a_body_declared_too_large_is_refused_before_it_is_sent(daemon: DaemonProcess) -> None:
    s = _raw(daemon, b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 99999999999\r\n\r\n")
    reply = _closed_within(s, 5)
    assert reply.startswith(b"HTTP/1.1 413") and b'"error"' in reply
    assert daemon.stats()["http"]["body_bytes"] == 0


def test_errors_are_json_and_the_admin_config_shows_no_secret(daemon: DaemonProcess) -> None:
    assert _get(daemon, "/nowhere")[0] == 404 and "error" in _get(daemon, "/nowhere")[1]
    status, doc = _get(daemon, "/v1/stats", method="DELETE")
    assert status == 405 and "error" in doc
    status, doc = _get(daemon, "/v1/admin/config", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    text = json.dumps(doc)
    assert TOKEN not in text and "hunter2" not in text
    assert doc["redis"]["url"] == "redis://***@127.0.0.1:1/0"


def test_a_key_body_beyond_the_limit_is_refused_before_it_is_split(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    from kvtier.keys import Namespace
    from kvtier.layout import KVLayout

    ns = Namespace("m", KVLayout(2, 2, 32, "float16", 256))   # 512 keys at most
    req = urllib.request.Request(
        f"{daemon.http_url}/v1/prefix?input=keys&model_id=m", data=b"k" * 16 * 600_000,
        method="POST", headers={"Content-Type": "application/octet-stream"})
    with connect(daemon.socket) as c:
        c.register_layout(ns.layout, "m")
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 413 and json.loads(err.value.read())["code"] == "limit"
        assert time.monotonic() - t0 < 2
