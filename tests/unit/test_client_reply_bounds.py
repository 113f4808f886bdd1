"""What a daemon's replies may cost a client (found by review): a call and a hello end by
one deadline however slowly the reply trickles in; a reply decodes within a bound sized by
the request (a frame of 1-byte empty arrays cost 0.6 GB and 7 s per 8 MiB); the asyncio
client ends the connection at a reply no request awaits instead of decoding and dropping
such frames forever, and still skips the late reply of a request it gave up on. A same-uid
daemon in a thread of the test process (tests.support.fake_daemon.HostileSocketDaemon)
says what each test wants."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvtier.client import connect, connect_async
from kvtier.errors import DaemonUnavailable, ProtocolError, RequestTimeout
from kvtier.keys import KEY_BYTES
from kvtier.layout import KVLayout
from kvtier.protocol import LENGTH, pack
from tests.support.fake_daemon import HostileSocketDaemon

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=16)
NB = LAYOUT.block_bytes
TIMEOUT = 0.4
GAP = 0.25   # under the timeout: each receive alone would wait in time


def _trickling(conn: socket.socket, req: dict[str, Any]) -> None:
    threading.Thread(target=HostileSocketDaemon.trickle, daemon=True, args=(
        conn, pack({"id": req["id"], "ok": True, "stats": {}}), GAP)).start()


def test_a_sync_call_ends_by_its_deadline_however_the_reply_trickles(tmp_path: Path) -> None:
    with HostileSocketDaemon(tmp_path, NB, handler=_trickling) as d:
        c = connect(d.path, timeout=TIMEOUT)
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            c.stats()
        assert time.monotonic() - t0 < TIMEOUT + 0.3
        c.close()


def _trickled_hello(d: HostileSocketDaemon) -> Any:
    def hello(conn: socket.socket, req: dict[str, Any]) -> None:
        HostileSocketDaemon.trickle(conn, pack({"id": req["id"], "ok": True, "version": 1,
                                                "arena": {"path": "/x", "size": 1}}), GAP)
    return hello


def test_a_hello_ends_by_its_deadline_however_the_reply_trickles(tmp_path: Path) -> None:
    d = HostileSocketDaemon(tmp_path, NB)
    d.hello = _trickled_hello(d)
    with d:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            connect(d.path, timeout=TIMEOUT)
        assert time.monotonic() - t0 < TIMEOUT + 0.3

        async def run() -> None:
            with pytest.raises(RequestTimeout):
                await connect_async(d.path, timeout=TIMEOUT)

        t0 = time.monotonic()
        asyncio.run(run())
        assert time.monotonic() - t0 < TIMEOUT + 0.5


def _empty_arrays(n: int) -> bytes:
    """``{"x": [[], [], ...]}``: n one-byte arrays, the id and ok added by the frame."""
    return b"\xdd" + struct.pack(">I", n) + b"\x90" * n


def _raw_reply(rid: int, x: bytes) -> bytes:
    """A reply frame ``{"id": rid, "ok": True, "x": <x, packed>}``."""
    body = b"\x83" + b"".join(msgpack.packb(v) for v in ("id", rid, "ok", True, "x")) + x
    return LENGTH.pack(len(body)) + body


def _bomb(conn: socket.socket, req: dict[str, Any]) -> None:
    conn.sendall(_raw_reply(req["id"], _empty_arrays(50_000)))


def test_a_reply_decodes_within_the_bound_of_its_request(tmp_path: Path) -> None:
    with HostileSocketDaemon(tmp_path, NB, handler=_bomb) as d:
        c = connect(d.path, timeout=2)
        with pytest.raises(ProtocolError, match="refused"):
            c.stats()
        c.close()

        async def run() -> None:
            a = await connect_async(d.path, timeout=2)
            with pytest.raises(DaemonUnavailable, match="refused"):
                await a.stats()
            await a.close()

        asyncio.run(run())


def test_a_hello_decodes_within_a_bound(tmp_path: Path) -> None:
    def hello(conn: socket.socket, req: dict[str, Any]) -> None:
        conn.sendall(_raw_reply(req["id"], _empty_arrays(50_000)))

    with HostileSocketDaemon(tmp_path, NB, hello=hello) as d, \
            pytest.raises(ProtocolError, match=r"malformed|entries"):
        connect(d.path, timeout=2)


def test_the_bound_fits_the_largest_reply_the_request_allows() -> None:
    """A lookup or get of 2**17 keys (128k tokens in blocks of one token, the daemon's
    default bound) is answered with one tier, or one offset and one device, per key."""
    from kvtier.client.replies import SMALL_REQUEST, ReplyBound, decode_reply

    n = 2**17
    bound = ReplyBound.of({"op": "get_prepare", "keys": b"k" * KEY_BYTES * n})
    reply = {"id": 2, "ok": True, "lease": 1, "offsets": [4096 * i for i in range(n)],
             "devices": ["cpu"] * n, "ttl_s": 30.0}
    assert len(decode_reply(pack(reply)[4:], bound)["offsets"]) == n
    with pytest.raises(ProtocolError):   # not within the bound of a small request
        decode_reply(pack(reply)[4:], SMALL_REQUEST)


def test_an_async_reply_no_request_awaits_ends_the_connection(tmp_path: Path) -> None:
    def hello(conn: socket.socket, req: dict[str, Any]) -> None:
        d.greet(conn, req)
        conn.sendall(pack({"id": 999, "ok": True}))   # asked by nobody

    with HostileSocketDaemon(tmp_path, NB, hello=hello) as d:
        async def run() -> None:
            a = await connect_async(d.path, timeout=2)
            await asyncio.sleep(0.2)
            with pytest.raises(DaemonUnavailable, match="999"):
                await a.report_engine(running=1)
            await a.close()

        asyncio.run(run())


def test_the_late_reply_of_a_request_given_up_on_is_still_skipped(tmp_path: Path) -> None:
    """(A guard of the change above: replies of timed-out requests are expected.)"""
    def handler(conn: socket.socket, req: dict[str, Any]) -> None:
        if req.get("running") == 1:   # the first report: answered late
            threading.Timer(0.5, HostileSocketDaemon.send,
                            (conn, {"id": req["id"], "ok": True})).start()
            return
        HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True})

    with HostileSocketDaemon(tmp_path, NB, handler=handler) as d:
        async def run() -> None:
            a = await connect_async(d.path, timeout=0.3)
            with pytest.raises(RequestTimeout):
                await a.report_engine(running=1)
            await asyncio.sleep(0.4)   # its reply came meanwhile
            await a.report_engine(running=2)
            await a.close()

        asyncio.run(run())
