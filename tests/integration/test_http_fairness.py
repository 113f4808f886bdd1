"""The HTTP port shared fairly, on a real daemon (found by review): a chunked body is a 411
before any of it is read, and its connection closed; a body no handler reads is not drained;
idle connections make room for a new client (a 503 only when every one is busy); /metrics
is served from a short cache under a flood; /v1/stats renders take turns (a 503 with
Retry-After beyond the queue)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from kvtier.client import connect
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.http_raw import closed_within, raw_http

MAX_CONNECTIONS = 16
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=16)
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    env = {"KVTIER_DAEMON_READ_TIMEOUT_S": "5",
           "KVTIER_HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    with DaemonProcess(tmp_path_factory.mktemp("fair") / "d", cpu_bytes="32MiB",
                       nvme_bytes="0", env=env) as d:
        with connect(d.socket) as c:
            c.register_layout(LAYOUT, "m")
        yield d


def _reply(s: socket.socket) -> bytes:
    """One whole reply (head and Content-Length body) read from a keep-alive ``s``."""
    s.settimeout(10)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        assert chunk, f"closed after {got!r}"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _json(reply: bytes) -> dict:
    return json.loads(reply.partition(b"\r\n\r\n")[2])


def test_a_chunked_body_is_a_411_before_it_is_read_and_the_connection_closes(
        daemon: DaemonProcess) -> None:
    """1-byte chunks held the event loop ~0.5 s a request (one parser callback each): a
    Transfer-Encoding body is refused from its head now, on every route, and closed."""
    for path in (b"/v1/prefix?model_id=m", b"/healthz"):
        s = raw_http(daemon, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"1\r\n\x01\r\n1\r\n\x01\r\n")   # no last chunk: the body never ends
        reply = closed_within(s, 3)
        assert reply.startswith(b"HTTP/1.1 411"), reply
        assert b"Connection: close" in reply
        assert "Content-Length" in _json(reply)["error"]
        s.close()
    assert daemon.stats()["http"]["length_required"] >= 2


def test_a_body_no_handler_reads_is_not_drained(daemon: DaemonProcess) -> None:
    """aiohttp read and dropped an unread body for up to 10 s after the reply (its lingering
    close); the connection is closed at once now (the guard's deadline here is 5 s)."""
    s = raw_http(daemon, b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
             + b"x" * 1000)
    reply = closed_within(s, 2.5)
    assert reply.startswith(b"HTTP/1.1 405"), reply
    s.close()


def test_an_idle_connection_makes_room_for_a_new_client(daemon: DaemonProcess) -> None:
    """One client held every slot with idle keep-alives re-armed every few seconds: routers
    got 503s for as long as it liked. A new connection now closes the one idle longest."""
    held = []
    for _ in range(MAX_CONNECTIONS):
        s = raw_http(daemon, HEALTHZ)
        assert _reply(s).startswith(b"HTTP/1.1 200")   # then idle, kept alive
        held.append(s)
    with urllib.request.urlopen(daemon.http_url + "/healthz", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    assert closed_within(held[0], 3) == b""      # idle the longest: closed for it
    for s in (held[1], held[-1]):                # the others stay
        s.sendall(HEALTHZ)
        assert _reply(s).startswith(b"HTTP/1.1 200")
    assert daemon.stats()["http"]["evicted"] == 1   # (room enough again for this one)
    for s in held:
        s.close()


def test_when_every_connection_is_busy_a_new_one_is_refused(daemon: DaemonProcess) -> None:
    """Connections whose requests are being handled (bodies arriving) are not evicted: a
    new connection is then refused with a JSON 503, and engines still connect."""
    query = "?redis=0&model_id=m&lengths=" + ",".join(["131072"] * 4)   # 2 MiB: 3 s to come
    head = (f"POST /v1/prefix{query} HTTP/1.1\r\nHost: x\r\nContent-Type: application/"
            f"octet-stream\r\nContent-Length: {4 * 4 * 131072}\r\n\r\n").encode()
    busy = [raw_http(daemon, head + b"\0" * 64) for _ in range(MAX_CONNECTIONS)]
    # Every handler is reading its body (busy) once all 16 bodies' first bytes are counted
    # (on the control socket: an HTTP stats request would take a slot). A fixed 0.3 s was
    # not enough for a daemon a loaded machine held up: a connection whose request was not
    # handled yet counts as idle, and the new one closed it for room instead of a 503.
    deadline = time.monotonic() + 2.5     # within the bodies' own 3 s deadline
    with connect(daemon.socket) as c:
        while c.stats()["http"]["body_bytes"] < MAX_CONNECTIONS * 64:
            assert time.monotonic() < deadline, c.stats()["http"]
            time.sleep(0.02)
    refused = raw_http(daemon)
    reply = closed_within(refused, 5)
    assert reply.startswith(b"HTTP/1.1 503") and b"too many HTTP connections" in reply
    with connect(daemon.socket) as c:     # the control socket is not affected
        http = c.stats()["http"]
    assert http["refused"] >= 1
    for s in busy:
        s.close()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def _scrape(d: DaemonProcess) -> str:
    with urllib.request.urlopen(d.http_url + "/metrics", timeout=10) as r:
        return r.read().decode()


def test_metrics_are_served_from_a_short_cache_under_a_flood(daemon: DaemonProcess) -> None:
    """Each /metrics render held the loop 3-5 ms: 128 connections scraping starved the
    engines (1.4 s a put+get). Beyond 4 renders a second the last body is served again."""
    name = 'kvtier_op_seconds_count{op="lookup"}'
    with connect(daemon.socket) as c:
        ns = c.register_layout(LAYOUT, "m")
        c.lookup(ns, [b"\1" * 16])
        # The cache holds for 1 s from the first of the 4 fresh renders: a loaded machine
        # can stretch these 7 scrapes and a lookup past it, and the last scrape is then
        # rightly fresh. Only an attempt the client saw end within 1 s (so the daemon's
        # renders were within 1 s too) can tell; a slower one is waited out and redone.
        for _ in range(5):
            t0 = time.monotonic()
            texts = [_scrape(daemon) for _ in range(6)]   # a flood: 4 fresh, then cached
            assert len({_metric(t, name) for t in texts}) == 1
            seen = _metric(texts[-1], name)
            c.lookup(ns, [b"\2" * 16])
            again = _metric(_scrape(daemon), name)
            if time.monotonic() - t0 < 1.0:
                break
            time.sleep(1.2)                               # every render ages out: afresh
        else:
            pytest.fail("6 scrapes, a lookup and a scrape never fit in 1 s")
        assert again == seen                              # within the second: cached
        time.sleep(1.2)
        assert _metric(_scrape(daemon), name) == seen + 1   # after it: fresh


def test_stats_renders_take_turns_and_a_flood_gets_503(daemon: DaemonProcess) -> None:
    """64 connections asking for /v1/stats held the loop 93 ms at a time. Renders take
    turns now (each followed by a pause), 8 wait at most, and beyond them a 503.

    The requests are sent while the daemon is stopped, so they reach its loop together:
    sent one by one to a running daemon, each could be answered before the next arrived
    (a fresh-clone CI run saw 15 200s and no 503).

    A render (~0.1 ms) is paused after for only 4x its time, so the 503s need the
    requests to reach the pacer within a few loop turns. Two spreads are removed here: a
    connection the daemon had yet to accept reached the loop turns after the others (it
    is accepted and set up once the daemon runs again), so each connection is answered
    once first; and ``paused()`` sends nothing before every thread of the daemon is
    stopped, so the 15 requests are read in one poll. The handlers still reach the pacer
    over a few loop turns (2-6 of 15 refused in ~50 runs, never none), so a second and a
    third flood are kept in reserve."""
    n = MAX_CONNECTIONS - 1
    for _ in range(3):   # one flood has met the full queue in every run so far: a spare
        conns = [raw_http(daemon, HEALTHZ) for _ in range(n)]
        for s in conns:   # accepted and answered: each waits on the loop for its next request
            assert _reply(s).startswith(b"HTTP/1.1 200")
        with daemon.paused():
            for s in conns:
                s.sendall(b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.1)
        replies = [_reply(s) for s in conns]
        for s in conns:
            s.close()
        ok = [r for r in replies if r.startswith(b"HTTP/1.1 200")]
        refused = [r for r in replies if r.startswith(b"HTTP/1.1 503")]
        assert len(ok) + len(refused) == n and ok, [r[:12] for r in replies]
        if refused:
            break
        time.sleep(1.1)
    assert refused, "no flood of /v1/stats met a full queue in 3 tries"
    for r in refused:
        assert b"Retry-After: 1" in r and _json(r)["code"] == "overloaded"
    assert "tiers" in _json(ok[0])
    assert daemon.stats()["http"]["overloaded"] >= len(refused)
