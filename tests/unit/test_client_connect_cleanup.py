"""What a failed or cancelled ``connect_async`` opened is closed (the client review's A19
and A20 survivors: an engine retrying its connect would leak a socket, or the arena's
descriptor, per try)."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from kvtier.client import aio
from kvtier.errors import DaemonUnavailable


class _Hello:
    """What ``open_verified`` hands over, reduced to what the cleanup touches."""

    def __init__(self) -> None:
        self.closed = False

    def close_fds(self) -> None:
        self.closed = True


async def test_a_client_whose_start_fails_closes_its_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ours, daemons = socket.socketpair()
    hello = _Hello()
    monkeypatch.setattr(aio, "open_verified", lambda *_: (ours, hello))

    async def refused(self: Any, *_: Any) -> None:
        raise DaemonUnavailable("the arena is gone")

    monkeypatch.setattr(aio.AsyncKVTierClient, "_start", refused)
    with pytest.raises(DaemonUnavailable):
        await aio.connect_async("/nowhere.sock", 2.0, trusted_uids=())
    daemons.settimeout(2.0)
    assert daemons.recv(1) == b""          # our end was closed: the daemon sees EOF
    daemons.close()


async def test_a_connect_cancelled_during_its_hello_closes_what_the_hello_opened(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ours, daemons = socket.socketpair()
    hello = _Hello()
    go = threading.Event()

    def slow_open(*_: Any) -> tuple[socket.socket, _Hello]:
        go.wait(5.0)
        return ours, hello

    monkeypatch.setattr(aio, "open_verified", slow_open)
    task = asyncio.create_task(aio.connect_async("/nowhere.sock", 2.0, trusted_uids=()))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go.set()                               # the hello completes after the cancel
    for _ in range(200):
        if hello.closed:
            break
        await asyncio.sleep(0.01)
    assert hello.closed and ours.fileno() == -1
    daemons.close()
