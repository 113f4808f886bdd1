"""Survivors of the client mutation round, part five: what only the asyncio client does
(``kvtier.client.aio``: leases asked by calls given up on, its send deadline, its memory
of abandoned requests), against the scripted daemon of the transport tests (a thread of
this process; no process is started)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.client import AsyncKVTierClient, aio, connect_async
from kvtier.errors import ClientForked, DaemonUnavailable, RequestTimeout
from kvtier.keys import KEY_BYTES, block_keys
from tests.support.fake_daemon import HostileSocketDaemon
from tests.unit.test_client_ops import BLOCK, LAYOUT
from tests.unit.test_client_survivors_transport import _ok, _run_async


@pytest.mark.parametrize(("prepare", "end"), [("get_prepare", "get_release"),
                                              ("put_prepare", "put_abort")])
def test_a_lease_asked_by_a_cancelled_call_is_ended_when_granted(
        tmp_path: Path, prepare: str, end: str) -> None:
    """A prepare whose asyncio call was cancelled (a request aborted by the engine) still
    gets its lease ended as soon as the late reply names it: nobody else knows the lease,
    and it would pin its slots until the TTL. Mutants that survived: a cancelled call
    was only forgotten (its late reply skipped); a put lease was never ended."""
    def late(conn: socket.socket, req: dict[str, Any]) -> None:
        if req["op"] != prepare:
            return _ok(conn, req)
        reply = {"id": req["id"], "ok": True, "lease": 11, "offsets": [0], "ttl_s": 30.0}
        threading.Timer(0.2, HostileSocketDaemon.send, (conn, reply)).start()

    async def body(c: Any) -> None:
        ns = await c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, range(LAYOUT.tokens_per_block))
        call = c.prepare_get(ns, keys) if prepare == "get_prepare" else c.prepare_put(ns, keys)
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.4)   # the late reply comes, and the lease's end goes
        await c.stats()            # (answered after the end: it reached the daemon)

    with HostileSocketDaemon(tmp_path, BLOCK, handler=late) as d:
        _run_async(d, body)
        assert [r.get("lease") for r in d.requests if r["op"] == end] == [11]


def test_late_leases_beyond_the_cap_are_left_to_their_ttl(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most ``MAX_LATE_LEASES`` late replies are awaited to end their lease; past the
    cap a late reply is only skipped (the daemon's TTL ends its lease) and the connection
    goes on. Mutant that survived: the cap was ignored (unbounded callbacks)."""
    monkeypatch.setattr(aio, "MAX_LATE_LEASES", 0)

    def late(conn: socket.socket, req: dict[str, Any]) -> None:
        if req["op"] != "get_prepare":
            return _ok(conn, req)
        reply = {"id": req["id"], "ok": True, "lease": 12, "offsets": [0], "ttl_s": 30.0}
        threading.Timer(0.3, HostileSocketDaemon.send, (conn, reply)).start()

    async def body(c: Any) -> None:
        ns = await c.register_layout(LAYOUT, "m")
        with pytest.raises(RequestTimeout):
            await c.prepare_get(ns, block_keys(ns, range(LAYOUT.tokens_per_block)))
        await asyncio.sleep(0.3)
        await c.stats()

    with HostileSocketDaemon(tmp_path, BLOCK, handler=late) as d:
        _run_async(d, body, timeout=0.2)
        assert "get_release" not in [r["op"] for r in d.requests]


def test_an_async_send_the_daemon_does_not_take_ends_the_connection(tmp_path: Path) -> None:
    """A request the daemon does not read in time (it stopped reading) is a RequestTimeout,
    and the connection is unusable from then on, since its frame may be half sent; ``close``
    then drops what is still buffered at once instead of waiting to flush it. Mutants that
    survived: the connection stayed usable (the next frame went after a half one); close
    flushed until its timeout."""
    stalled = threading.Event()

    def stop_reading(conn: socket.socket, req: dict[str, Any]) -> None:
        stalled.wait(5)   # the daemon's reader is stuck: nothing more is read

    async def run() -> None:
        c = await connect_async(d.path, timeout=0.5)
        ns = await c.register_layout(LAYOUT, "m")
        with pytest.raises(RequestTimeout):
            await c.stats()
        keys = [bytes([i % 256]) * KEY_BYTES for i in range(1 << 16)]   # 1 MiB of keys
        with pytest.raises(RequestTimeout, match="could not send"):
            await c.lookup(ns, keys)
        with pytest.raises(DaemonUnavailable, match="unusable"):
            await c.report_engine(running=1)
        t0 = time.monotonic()
        await c.close()
        assert time.monotonic() - t0 < 0.25

    with HostileSocketDaemon(tmp_path, BLOCK, handler=stop_reading) as d:
        try:
            asyncio.run(run())
        finally:
            stalled.set()


def test_requests_given_up_on_are_remembered_only_up_to_the_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ids of requests the asyncio client gave up on are kept (to skip their late
    replies) only up to ``MAX_ABANDONED``, the oldest dropped first: a daemon that never
    answers must not grow the client's memory forever. Mutant that survived: no cap."""
    monkeypatch.setattr(aio, "MAX_ABANDONED", 2)
    client: Any = SimpleNamespace(_pending={}, _abandoned={},
                                  _end_when_granted=lambda rid, req: False)
    for rid in range(1, 6):
        AsyncKVTierClient._give_up(client, rid, {"op": "stats"})
    assert list(client._abandoned) == [4, 5]


def test_an_async_client_used_after_a_fork_keeps_saying_so(tmp_path: Path) -> None:
    """An asyncio client marked as forked keeps raising ClientForked (connect again in this
    process) when its connection then ends, not a plain DaemonUnavailable that invites a
    retry on the same client. Mutant that survived: the end of the read loop replaced
    the fork's error."""
    async def body(c: Any) -> None:
        c._forked()
        d.conns[0].shutdown(socket.SHUT_RDWR)
        await asyncio.sleep(0.1)   # the read loop sees the end
        with pytest.raises(ClientForked, match="after a fork"):
            await c.stats()

    with HostileSocketDaemon(tmp_path, BLOCK, handler=_ok) as d:
        _run_async(d, body)


def test_a_delete_waits_for_the_end_of_a_late_lease(tmp_path: Path) -> None:
    """The release the asyncio client sends for a lease granted to a call it gave up on is
    owed like any release sent without waiting: a delete first waits for its reply (the
    lease's blocks are pinned until then), and fails with RequestTimeout when it never
    comes. Mutant that survived: that release was not owed, so the delete went ahead and
    skipped blocks still pinned by the client's own lease."""
    def late(conn: socket.socket, req: dict[str, Any]) -> None:
        if req["op"] == "get_prepare":
            reply = {"id": req["id"], "ok": True, "lease": 13, "offsets": [0], "ttl_s": 30.0}
            threading.Timer(0.4, HostileSocketDaemon.send, (conn, reply)).start()
        elif req["op"] != "get_release":   # the release is never answered
            HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True, "deleted": 0})

    async def body(c: Any) -> None:
        ns = await c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, range(LAYOUT.tokens_per_block))
        with pytest.raises(RequestTimeout):
            await c.prepare_get(ns, keys)
        await asyncio.sleep(0.3)   # the late grant came; its release went
        with pytest.raises(RequestTimeout, match="sent without waiting"):
            await c.delete(ns, keys)

    with HostileSocketDaemon(tmp_path, BLOCK, handler=late) as d:
        _run_async(d, body, timeout=0.3)
        assert [r["op"] for r in d.requests][-1] == "get_release"


def test_an_async_call_answered_leaves_nothing_pending(tmp_path: Path) -> None:
    """A call that got its reply leaves no entry in the client's pending requests: an
    engine's client makes millions of calls. Mutant that survived: the entry stayed
    (memory grew by a future per call, forever)."""
    async def body(c: Any) -> None:
        for _ in range(3):
            await c.stats()
        assert c._pending == {}

    with HostileSocketDaemon(tmp_path, BLOCK, handler=_ok) as d:
        _run_async(d, body)


def test_an_async_reply_whose_id_is_not_an_int_ends_the_connection(tmp_path: Path) -> None:
    """A reply's id must be an int: ``2.0`` or ``true`` equal a pending request's id as
    dict keys and would be taken as its answer (another request's lease and offsets).
    Such a reply ends the connection, as in the sync client. Mutant that survived: the
    type check dropped, so a float id answered the request of that number."""
    def float_id(conn: socket.socket, req: dict[str, Any]) -> None:
        HostileSocketDaemon.send(conn, {"id": float(req["id"]), "ok": True, "stats": {}})

    async def body(c: Any) -> None:
        with pytest.raises(DaemonUnavailable, match="id"):
            await c.stats()

    with HostileSocketDaemon(tmp_path, BLOCK, handler=float_id) as d:
        _run_async(d, body)
