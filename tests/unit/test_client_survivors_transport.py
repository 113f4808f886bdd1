"""Survivors of the client mutation round, part four: the clients' transport
(``kvtier.client.sync``, ``kvtier.client.aio``) against a scripted same-uid daemon in a
thread of this process (tests.support.fake_daemon.HostileSocketDaemon; no process is
started)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.client import KVTierClient, connect, connect_async
from kvtier.errors import (
    ClientForked,
    DaemonUnavailable,
    LimitExceeded,
    ProtocolError,
)
from kvtier.keys import block_keys
from tests.support.fake_daemon import HostileSocketDaemon
from tests.unit.test_client_ops import BLOCK, LAYOUT, NS
from tests.unit.test_daemon_survivors_client import ExactView

TIMEOUT = 1.0


def _ok(conn: socket.socket, req: dict[str, Any]) -> None:
    HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True, "stats": {}})


def test_a_sync_call_whose_deadline_passed_is_a_timeout() -> None:
    """Once a call's deadline has passed its next wait raises TimeoutError at once (the
    call's RequestTimeout): it never waits on, nor hands the socket a negative timeout
    (a ValueError out of the call). Mutant that survived: a deadline up to a second past
    was let through."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        client: Any = SimpleNamespace(_sock=sock, _sock_timeout=TIMEOUT, _slack=0.01)
        with pytest.raises(TimeoutError):
            KVTierClient._until(client, time.monotonic() - 0.5)
        assert sock.gettimeout() is None   # untouched


def test_a_sync_reply_out_of_step_ends_the_connection(tmp_path: Path) -> None:
    """A reply to another request than the one due, with no reply owed to a request sent
    without waiting, is a ProtocolError, and the connection is unusable from then on: the
    client can no longer tell which reply is whose (another request's lease and offsets).
    Mutant that survived: such a reply was skipped like an owed one and the next one
    taken as the answer."""
    def out_of_step(conn: socket.socket, req: dict[str, Any]) -> None:
        HostileSocketDaemon.send(conn, {"id": req["id"] + 40, "ok": True, "stats": {"x": 1}})
        _ok(conn, req)

    with HostileSocketDaemon(tmp_path, BLOCK, handler=out_of_step) as d:
        c = connect(d.path, timeout=TIMEOUT)
        with pytest.raises(ProtocolError, match="was due"):
            c.stats()
        with pytest.raises(DaemonUnavailable, match="unusable"):
            c.ping()
        c.close()


def _run_async(d: HostileSocketDaemon, body: Any, timeout: float = TIMEOUT) -> None:
    async def run() -> None:
        c = await connect_async(d.path, timeout=timeout)
        try:
            await body(c)
        finally:
            await c.close()

    asyncio.run(run())


def test_a_sync_get_from_a_daemon_that_hung_up_waits_for_its_release(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release is sent without waiting only while the connection is up: a daemon that
    closed its end after granting the get may have restarted and handed the slots out
    again, so the release is asked as usual and the get fails (DaemonUnavailable) rather
    than report bytes it cannot vouch for. Mutant that survived: the hang-up was not
    looked at, so the get returned the block as loaded. (The client's copy waits until the
    daemon's thread has closed its end: without that, on a busy machine the release could
    be sent before the hang-up happened, and the test failed.)"""
    closed = threading.Event()

    def half_closing(conn: socket.socket, req: dict[str, Any]) -> None:
        if req["op"] == "get_prepare":
            HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True, "lease": 3,
                                            "offsets": [0], "ttl_s": 30.0})
            conn.shutdown(socket.SHUT_WR)
            closed.set()
        else:
            _ok(conn, req)

    real_copy = np.copyto

    def copy_after_the_hang_up(dst: Any, src: Any) -> None:
        assert closed.wait(TIMEOUT)
        real_copy(dst, src)

    monkeypatch.setattr(np, "copyto", copy_after_the_hang_up)
    with HostileSocketDaemon(tmp_path, BLOCK, handler=half_closing) as d:
        c = connect(d.path, timeout=TIMEOUT)
        ns = c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, range(LAYOUT.tokens_per_block))
        with pytest.raises(DaemonUnavailable):
            c.get(ns, keys, [np.zeros(BLOCK, np.uint8)])
        c.close()


def test_a_sync_delete_raises_the_error_the_daemon_ended_the_connection_with(
        tmp_path: Path) -> None:
    """While a delete waits for the replies owed to releases sent without waiting, an error
    the daemon sent about the whole connection (id 0) is raised there, with its code: the
    daemon closes the connection next, and the delete must not go out as if nothing
    happened. Mutant that survived: the id-0 reply was counted as an owed one paid."""
    def ending(conn: socket.socket, req: dict[str, Any]) -> None:
        if req["op"] == "get_prepare":
            HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True, "lease": 3,
                                            "offsets": [0], "ttl_s": 30.0})
        elif req["op"] == "get_release":
            HostileSocketDaemon.send(conn, {"id": 0, "ok": False, "code": "limit",
                                            "error": "going away"})
        else:
            HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True, "deleted": 0})

    with HostileSocketDaemon(tmp_path, BLOCK, handler=ending) as d:
        c = connect(d.path, timeout=TIMEOUT)
        ns = c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, range(LAYOUT.tokens_per_block))
        assert c.get(ns, keys, [np.zeros(BLOCK, np.uint8)]) == 1   # its release: NoWait
        with pytest.raises(LimitExceeded, match="going away"):
            c.delete(ns, keys)
        assert "delete" not in [r["op"] for r in d.requests]
        c.close()


def test_a_sync_client_used_from_two_threads_at_once_refuses_the_second(
        tmp_path: Path) -> None:
    """A call while another thread is in the middle of one on the same client fails at
    once with a ProtocolError saying the client is not thread-safe (docs: one client per
    thread), never waits for the socket. Mutant that survived: the second call waited for
    the first, hiding the misuse (and deadlocking a thread that re-entered)."""
    errors: list[BaseException] = []

    def second() -> None:
        try:
            c.ping()
        except BaseException as exc:   # (the test inspects it)
            errors.append(exc)

    with HostileSocketDaemon(tmp_path, BLOCK, handler=_ok) as d:
        c = connect(d.path, timeout=TIMEOUT)
        with c._busy:   # another thread is inside a call
            t = threading.Thread(target=second, daemon=True)
            t.start()
            t.join(TIMEOUT)
            stuck = t.is_alive()
        t.join(TIMEOUT)
        assert not stuck
        assert len(errors) == 1 and isinstance(errors[0], ProtocolError)
        assert "two threads" in str(errors[0])
        c.ping()   # the connection itself is fine
        c.close()


def test_the_presence_bound_is_not_given_by_an_unusable_client(tmp_path: Path) -> None:
    """``leading_bound`` is None once the client is unusable (here: used after a fork),
    so the caller asks the daemon and learns the client's error, instead of routing on a
    filter its connection no longer stands behind. Mutant that survived: only the
    socket's state was looked at, which a quiet connection does not change."""
    with HostileSocketDaemon(tmp_path, BLOCK, handler=_ok) as d:
        c = connect(d.path, timeout=TIMEOUT)
        c._ops.presence = ExactView()   # type: ignore[assignment]
        keys = block_keys(NS, range(LAYOUT.tokens_per_block))
        assert c.leading_bound(keys) == 1
        c._forked()
        assert c.leading_bound(keys) is None
        with pytest.raises(ClientForked):
            c.ping()
        c._ops.presence = None
        c.close()


def test_a_sync_call_after_a_short_one_waits_its_whole_timeout() -> None:
    """The socket's timeout follows what each call has left both ways: cut for the end of
    a call, set back up for the next call's whole timeout. Mutant that survived: it was
    only ever cut, so after one call that ended near its deadline every later wait timed
    out early (a RequestTimeout the daemon did not cause)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        client: Any = SimpleNamespace(_sock=sock, _sock_timeout=0.05, _slack=0.01)
        sock.settimeout(0.05)
        KVTierClient._until(client, time.monotonic() + TIMEOUT)
        assert sock.gettimeout() == pytest.approx(TIMEOUT, abs=0.05)
        assert client._sock_timeout == pytest.approx(sock.gettimeout())


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_reply_as_large_as_its_request_allows_is_read(tmp_path: Path,
                                                        is_async: bool) -> None:
    """A reply is decoded within the bound of its own request: a lookup of 5000 keys may
    be answered with 5000 tiers, more than a small request's array limit. Mutants that
    survived: the sync client decoded every reply within the small bound, the asyncio
    client never widened its bound; lookups longer than 4096 blocks failed either way."""
    n = 5000

    def hits(conn: socket.socket, req: dict[str, Any]) -> None:
        HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True, "hits": n,
                                        "tiers": ["cpu"] * n})

    async def body(c: Any) -> None:
        ns = await c.register_layout(LAYOUT, "m")
        assert (await c.lookup(ns, block_keys(ns, range(n * tokens)))).hits == n

    tokens = LAYOUT.tokens_per_block
    with HostileSocketDaemon(tmp_path, BLOCK, handler=hits) as d:
        if is_async:
            _run_async(d, body, timeout=5.0)
            return
        c = connect(d.path, timeout=5.0)
        ns = c.register_layout(LAYOUT, "m")
        assert c.lookup(ns, block_keys(ns, range(n * tokens))).hits == n
        c.close()


class ClosingView(ExactView):
    """A presence filter that records its close."""

    closed = 0

    def close(self) -> None:
        self.closed += 1


def test_closing_either_client_unmaps_what_its_hello_mapped(tmp_path: Path) -> None:
    """``close`` of the sync and of the asyncio client unmaps what the hello mapped (the
    presence filter here, the arena with it). Mutant that survived: the sync client's
    close only closed the socket (a mapping and a descriptor leaked per client)."""
    views = [ClosingView(), ClosingView()]

    async def body(c: Any) -> None:
        c._ops.presence = views[1]

    with HostileSocketDaemon(tmp_path, BLOCK, handler=_ok) as d:
        c = connect(d.path, timeout=TIMEOUT)
        c._ops.presence = views[0]   # type: ignore[assignment]
        c.close()
        _run_async(d, body)
    assert [v.closed for v in views] == [1, 1]
