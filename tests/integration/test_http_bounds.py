"""The daemon's HTTP port is open to every local user: a real daemon closes connections that
do not deliver a request in time, makes room beyond its bound by closing idle connections
(engines keep connecting over the control socket), refuses a declared body beyond the limit before
reading it, answers every error in JSON, and shows no secret on the admin endpoint."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.client import connect
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.protocol import LENGTH, pack, unpack_body
from tests.support.daemon import DaemonProcess
from tests.support.http_raw import closed_within, http_addr, raw_http
from tests.support.pinger import ping_forever

TOKEN = "s3cr3t-admin-token"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("http") / "d", cpu_bytes="32MiB",
                       nvme_bytes="0",
                       env={"KVTIER_DAEMON_READ_TIMEOUT_S": "1", "KVTIER_HTTP_MAX_CONNECTIONS": "8",
                            "KVTIER_HTTP_ADMIN_TOKEN": TOKEN,
                            "KVTIER_REDIS_URL": "redis://kv:hunter2@127.0.0.1:1/0"}) as d:
        yield d


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
    silent = raw_http(daemon)
    head = raw_http(daemon, b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n")   # no end of head
    body = raw_http(daemon, b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 1000\r\n\r\n{")
    t0 = time.monotonic()
    for s in (silent, head):
        assert closed_within(s, 5) == b""
    assert b"408" in closed_within(body, 5)    # the body's own deadline: a JSON 408
    assert time.monotonic() - t0 < 4
    assert daemon.stats()["http"]["timed_out"] >= 2
    assert _get(daemon, "/healthz") == (200, {"status": "ok"})


def test_connections_beyond_the_bound_make_room_and_engines_still_connect(
        daemon: DaemonProcess) -> None:
    """8 silent connections held the bound: a new one was refused (503) until they timed
    out, so a client re-arming idle keep-alives kept everyone out (found by review). The
    one idle the longest is closed for the new one now; a 503 only when all are busy
    (tests/integration/test_http_fairness.py)."""
    held = [raw_http(daemon) for _ in range(8)]
    extra = raw_http(daemon, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reply = closed_within(extra, 5)
    assert reply.startswith(b"HTTP/1.1 200") and b'"ok"' in reply
    assert closed_within(held[0], 5) == b""
    with connect(daemon.socket) as c:   # the control socket is not affected
        assert c.stats()["http"]["connections"] <= 8
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
    s = raw_http(daemon, b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 99999999999\r\n\r\n")
    reply = closed_within(s, 5)
    assert reply.startswith(b"HTTP/1.1 413") and b'"error"' in reply
    assert daemon.stats()["http"]["body_bytes"] == 0


def test_a_client_that_writes_a_refused_body_before_reading_gets_the_refusal(
        daemon: DaemonProcess) -> None:
    """urllib writes its whole body, then reads. A refused body left unread made the daemon
    close with bytes in its receive queue: an RST, and urllib raised "connection reset"
    instead of returning the 413 (found by review; it made a test of the prefix endpoint
    flaky). A refused body of up to 4 MiB is now read and dropped first; a larger one is
    still closed unread (above)."""
    ns = connect(daemon.socket).register_layout(
        KVLayout(2, 2, 16, "float16", tokens_per_block=16), "drain-model")
    url = f"{daemon.http_url}/v1/prefix?namespace={ns.digest.hex()}"
    body = b"\x00" * (3 << 20)   # over the u4 limit of 128k tokens (512 KiB)
    for _ in range(20):
        req = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 413 and "error" in json.loads(err.value.read())
    assert daemon.stats()["http"]["body_bytes"] == 0


def test_refused_bodies_that_never_come_do_not_keep_probes_out(daemon: DaemonProcess) -> None:
    """A refusal drains its declared body (above) as an idle connection: a new one may
    close it for room. Drained as busy, connections declaring 4 MiB to a refused route and
    sending nothing held every slot for the body's deadline, and probes got 503 (found by
    review). A body that timed out (408) is not waited for a second time."""
    held = [raw_http(daemon, b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/octet-stream\r\nContent-Length: 4000000\r\n\r\n")
            for _ in range(8)]            # the daemon's max_connections
    try:
        time.sleep(0.3)                   # each refused, its body being waited for
        t0 = time.monotonic()
        assert _get(daemon, "/healthz") == (200, {"status": "ok"})
        assert time.monotonic() - t0 < 1.0
    finally:
        for s in held:
            s.close()
    s = raw_http(daemon, b"POST /v1/prefix HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100000\r\n\r\n{")
    t0 = time.monotonic()
    reply = closed_within(s, 5)
    took = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408") and took < 1.0 + 0.1 + 0.6, took   # its deadline


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
    with connect(daemon.socket) as c:
        c.register_layout(ns.layout, "m")
        t0 = time.monotonic()
        status, doc = _post(daemon, b"k" * 16 * 600_000, "application/octet-stream",
                            "?input=keys&model_id=m")
        assert status == 413 and doc["code"] == "limit"
        assert time.monotonic() - t0 < 2


def _slowest_pings(d: DaemonProcess, requests: list[Any], tail_s: float = 0.03) -> list[float]:
    """Runs each of ``requests`` (callables) while another process pings the daemon; the
    slowest ping that overlapped each request or the ``tail_s`` after it (work a request
    leaves behind its reply stalls the loop too). A refused request takes a few ms, less
    than the pinger's gap on a loaded 2-core machine: the tail is what makes every window
    see a ping, and the 50 ms between requests keeps windows apart."""
    ctx = multiprocessing.get_context("spawn")
    stop, (recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
    pinger = ctx.Process(target=ping_forever, args=(str(d.socket), stop, send))
    pinger.start()
    windows = []
    try:
        time.sleep(1.5)   # the child starts and pings a while
        for fn in requests:
            start = time.perf_counter()
            fn()
            windows.append((start, time.perf_counter()))
            time.sleep(0.05)
    finally:
        stop.set()
        samples = recv.recv() if recv.poll(20) else []
        pinger.join(10)
    slowest = []
    for start, end in windows:
        during = [lat for t0, lat in samples if t0 + lat >= start and t0 <= end + tail_s]
        if during:
            slowest.append(max(during))
    assert len(slowest) >= len(windows) // 2, "too few pings overlapped the requests"
    return slowest


def _post(d: DaemonProcess, body: bytes, content_type: str = "application/json",
          query: str = "") -> tuple[int, dict[str, Any]]:
    """POST ``body``, reading an early reply (a 413 from the head) as soon as it comes, as
    curl does: the daemon closes a connection whose body it will not read instead of
    draining it (lingering_time=0), so a client that writes a refused body to its end
    before reading (urllib) may see the connection reset instead of the 413."""
    head = (f"POST /v1/prefix{query} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n")
    s = socket.create_connection(http_addr(d), timeout=30)
    with s:
        s.sendall(head.encode())
        sent, view = 0, memoryview(body)
        with contextlib.suppress(OSError):   # refused early: the rest is not read
            while sent < len(body) and not select.select([s], [], [], 0)[0]:
                select.select([s], [s], [], 30)
                sent += s.send(view[sent:sent + 65536])
        reply = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                reply += chunk
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.partition(b"\r\n\r\n")[2])


def test_trickled_bodies_do_not_hold_the_body_budget(daemon_factory) -> None:
    """8 connections declare 16 MiB bodies for /v1/prefix and trickle them: the shared body
    budget (4 x 16 MiB) was taken at the declared length, so a router's small probe waited
    read_timeout_s and got a 503. Body bytes are counted as they arrive now, and the first
    64 KiB of a body never wait: the router is answered well within the attack's hold."""
    d = daemon_factory(nvme_bytes="0", env={"KVTIER_DAEMON_READ_TIMEOUT_S": "6"}).start()
    layout = KVLayout(2, 2, 32, "float16", 16)
    engine = connect(d.socket)
    engine.register_layout(layout, "pub")
    head = (b"POST /v1/prefix?model_id=pub HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/octet-stream\r\nContent-Length: 16777216\r\n\r\n")
    stop = threading.Event()
    started = threading.Semaphore(0)

    def trickle() -> None:
        s = socket.create_connection(http_addr(d), timeout=10)
        try:
            s.sendall(head + b"\0")
            started.release()
            while not stop.wait(0.2):
                s.sendall(b"\0")
        except OSError:
            pass
        finally:
            s.close()

    attackers = [threading.Thread(target=trickle, daemon=True) for _ in range(8)]
    for t in attackers:
        t.start()
    try:
        for _ in attackers:
            assert started.acquire(timeout=10)
        time.sleep(0.3)
        body = json.dumps({"model_id": "pub", "token_ids": list(range(64))}).encode()
        t0 = time.monotonic()
        slowest = 0.0
        for _ in range(10):
            t1 = time.monotonic()
            status, doc = _post(d, body)
            slowest = max(slowest, time.monotonic() - t1)
            assert status == 200 and doc["prompt_blocks"] == 4, (status, doc)
        elapsed = time.monotonic() - t0
        held = d.stats()["http"]["body_bytes"]
        print(f"\nunder 8 trickled 16 MiB bodies: 10 probes in {elapsed * 1e3:.0f} ms, "
              f"slowest {slowest * 1e3:.0f} ms; {held} body bytes held")
        assert elapsed < 2.0            # the attack holds its bodies for 6 s
        assert held < 2**20
    finally:
        stop.set()
        for t in attackers:
            t.join(10)
        engine.close()


def test_large_json_bodies_are_refused_before_they_are_parsed(daemon: DaemonProcess) -> None:
    """A 4 MiB JSON body of 2M ints cost 150-250 ms of event loop (json.loads, np.asarray)
    before any check, even for a model nobody serves. A JSON body now has its own bounds
    from max_context_tokens (bytes, from the declared length, before a byte of it is read;
    values, counted before it is parsed), and the 413 says where large batches go."""
    ints = (4 * 2**20 - 64) // 2
    huge = ('{"model_id":"nobody","token_ids":[' + ",".join(["0"] * ints) + "]}").encode()
    dense = ('{"model_id":"nobody","token_ids":[' + ",".join(["0"] * (ints // 3))
             + "]}").encode()                       # 1.3 MiB: under the bytes, not values
    answers: list[tuple[int, dict[str, Any]]] = []
    slowest = _slowest_pings(daemon, [lambda b=b: answers.append(_post(daemon, b))
                                      for b in [huge, dense] * 6])
    print(f"\nslowest ping per 4 MiB / 1.3 MiB JSON body: "
          f"{', '.join(f'{x * 1e3:.0f}' for x in slowest)} ms")
    for status, doc in answers:
        assert status == 413 and doc["code"] == "limit", (status, doc)
        assert "application/octet-stream" in doc["error"]
    assert sorted(slowest)[len(slowest) // 2] < 0.05
    assert max(slowest) < 0.5


def test_a_key_batch_over_its_budget_costs_no_split(daemon: DaemonProcess) -> None:
    """255 prompts of 4096 keys (each within max_keys, the batch 32x over its budget): the
    keys were split into a million objects (~130 ms of event loop) before the batch budget
    refused them. The budget is now checked from the lengths (and the blob's size) first,
    on HTTP and on the control socket."""
    layout = KVLayout(2, 2, 32, "float16", 16)
    ns = Namespace("keys-model", layout)
    lengths = [4096] * 255
    blob = os.urandom(16 * 4096 * 255)
    query = f"?model_id=keys-model&input=keys&lengths={','.join(map(str, lengths))}"
    answers: list[Any] = []
    with connect(daemon.socket) as engine:
        engine.register_layout(layout, "keys-model")
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(30)
        s.connect(str(daemon.socket))
        s.sendall(pack({"id": 1, "op": "hello", "version": 1}))

        def reply() -> dict[str, Any]:
            (n,) = LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))
            return unpack_body(s.recv(n, socket.MSG_WAITALL))

        assert reply()["ok"]
        frame = pack({"id": 2, "op": "prefix_locality", "model_id": ns.model_id,
                      "layout": layout.to_dict(), "keys": blob, "lengths": lengths})

        def over_control() -> None:
            s.sendall(frame)
            answers.append(reply())

        slowest = _slowest_pings(daemon, [lambda: answers.append(
            _post(daemon, blob, "application/octet-stream", query)), over_control] * 5)
        s.close()
    print(f"\nslowest ping per over-budget key batch: "
          f"{', '.join(f'{x * 1e3:.0f}' for x in slowest)} ms")
    for a in answers:
        status, doc = a if isinstance(a, tuple) else (413, a)
        assert status == 413 and doc["code"] == "limit", (status, doc)
        assert "split it" in doc["error"]
    assert sorted(slowest)[len(slowest) // 2] < 0.05
    assert max(slowest) < 0.5
