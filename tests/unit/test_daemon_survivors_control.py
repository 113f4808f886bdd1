# ruff: noqa: F811  (the fixtures of tests/support/store.py are imported by name)
"""The control server's accounting over a real Unix socket, in-process: connection and
process shares given back, in-flight requests waited for at stop, only known ops timed,
the exit watcher and the socket released (found by a mutation review)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.daemon.control import ControlServer
from kvtier.daemon.ops import Connection
from kvtier.errors import Overloaded
from kvtier.protocol import LENGTH, PROTOCOL_VERSION, pack, unpack_body
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from tests.support.control import server
from tests.support.store import arena, clock, nvme, store  # noqa: F401 - fixtures

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _reply(reader: asyncio.StreamReader) -> dict[str, Any]:
    (n,) = LENGTH.unpack(await asyncio.wait_for(reader.readexactly(LENGTH.size), 5))
    out: dict[str, Any] = unpack_body(await reader.readexactly(n), n)
    return out


async def _ask(stream: Stream, msg: dict[str, Any]) -> dict[str, Any]:
    reader, writer = stream
    writer.write(pack(msg))
    await writer.drain()
    return await _reply(reader)


async def _hello(srv: ControlServer) -> Stream:
    stream = await asyncio.open_unix_connection(str(srv.socket_path))
    reply = await _ask(stream, {"op": "hello", "version": PROTOCOL_VERSION, "id": 1})
    assert reply["ok"] is True, reply
    return stream


@asynccontextmanager
async def serving(srv: ControlServer) -> AsyncIterator[ControlServer]:
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop_accepting()
        await srv.close_connections(1.0)


async def _until(pred: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


async def test_the_last_allowed_connection_is_served_and_the_next_refused(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """``max_connections`` open is the limit, not one fewer nor one more; a closed
    connection gives its place and its process's share back."""
    async with serving(server(store, arena, tmp_path, max_connections=2)) as srv:
        a, b = await _hello(srv), await _hello(srv)
        third = await asyncio.open_unix_connection(str(srv.socket_path))
        refused = await _ask(third, {"op": "hello", "version": PROTOCOL_VERSION, "id": 1})
        assert refused["ok"] is False and refused["code"] == Overloaded.code
        assert srv.counters.refused_connections == 1
        assert srv.shares.users(os.getpid()) == 2
        for _, w in (a, b, third):
            w.close()
        await _until(lambda: not srv.connections and srv.shares.users(os.getpid()) == 0)
        await _until(lambda: not srv._handlers)   # no task kept per connection served
        c = await _hello(srv)                     # room again
        assert (await _ask(c, {"op": "ping", "id": 2}))["ok"] is True
        c[1].close()


async def test_finished_requests_give_their_process_share_back(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """Each answered request returns its slot of the process's in-flight share (a leak
    stalled every connection of the process after ``max_inflight`` requests)."""
    timed: list[str] = []
    srv = server(store, arena, tmp_path)
    srv.observe = lambda op, s: timed.append(op)
    async with serving(srv):
        stream = await _hello(srv)
        for i in range(3 * srv.max_inflight):
            reply = await asyncio.wait_for(_ask(stream, {"op": "ping", "id": i + 2}), 5)
            assert reply["ok"] is True and reply["id"] == i + 2
        assert srv.last_request > 0
        # a client's made-up op is answered, never timed: each would be a new label
        bogus = await _ask(stream, {"op": "no-such-op-1", "id": 99})
        assert bogus["ok"] is False and bogus["code"] == "protocol"
        await asyncio.sleep(0.05)
        assert timed == ["ping"] * (3 * srv.max_inflight)
        stream[1].close()


async def test_stop_waits_for_requests_in_flight_then_releases_watches_and_socket(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """``close_connections`` lets a running request finish (within its bound), then stops
    the exit watches (their descriptors) and removes the socket file."""
    srv = server(store, arena, tmp_path)
    await srv.start()
    srv.exits.watch(os.getpid(), lambda: None)
    assert srv.exits.watches == 1
    finished: list[bool] = []

    async def running() -> None:
        await asyncio.sleep(0.15)
        finished.append(True)

    task = asyncio.ensure_future(running())
    srv._requests.add(task)
    task.add_done_callback(srv._requests.discard)
    await srv.stop_accepting()
    await srv.close_connections(3.0)
    assert finished == [True]
    assert srv.exits.watches == 0
    assert not srv.socket_path.exists()


async def test_a_hello_reply_left_unread_drops_the_connection_counted_slow(
        store: TieredStore, arena: Arena, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The greeter's drain timed out (``Greeter.reply_timeout_s``): counted in
    ``dropped_slow`` (``kvtier_limited{event="dropped_slow"}``) and the connection goes."""
    srv = server(store, arena, tmp_path)

    async def unread(*args: Any) -> None:
        raise TimeoutError

    monkeypatch.setattr(srv, "greeter", SimpleNamespace(greet=unread))
    async with serving(srv):
        reader, writer = await asyncio.open_unix_connection(str(srv.socket_path))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert srv.counters.dropped_slow == 1 and srv.limit_stats()["dropped_slow"] == 1
        writer.close()


def test_dropped_writers_are_reported_by_the_orphans_held(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """``dropped_writers``: connections dropped while holding put slots, until their
    process exits."""
    srv = server(store, arena, tmp_path)
    srv.orphans[7] = Connection(7, os.getpid(), os.getuid()).process
    srv.pending.used = 4096
    stats = srv.limit_stats()
    assert stats["dropped_writers"] == 1 and stats["pending_request_bytes"] == 4096


async def test_close_connections_returns_once_every_connection_is_released(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """The stop goes on (store drain, arena close) only after each connection's handler
    ran its release: its leases are given back before the arena goes."""
    srv = server(store, arena, tmp_path)
    await srv.start()
    stream = await _hello(srv)
    await _until(lambda: len(srv.connections) == 1)
    await srv.stop_accepting()
    await srv.close_connections(0.2)
    assert srv.connections == {} and srv.shares.users(os.getpid()) == 0
    stream[1].close()
