# ruff: noqa: F811  (the ops fixture of tests/unit/test_client_ops.py is imported by name)
"""Survivors of the client mutation round, part two: what the copying ``put`` and ``get``
accept as buffers (``kvtier.client.buffers``), what a hello maps (``kvtier.client.hello``)
and the fork hook (``kvtier.client.forks``).

docs/client-api.md: ``put`` and ``get`` take one C-contiguous buffer per key of exactly
``layout.block_bytes``; "anything else is a ``BufferSizeError`` before a request is sent".
Three of them pin product bugs this round found: objects that are not buffers, object
arrays and read-only get buffers escaped as TypeError or ValueError, the last two only
after the daemon had granted a lease.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import forks
from kvtier.client import hello as hello_mod
from kvtier.client.buffers import check_buffers
from kvtier.client.hello import map_arena, mapped, open_presence
from kvtier.client.ops import Ops
from kvtier.errors import BufferSizeError, ClientForked, DaemonUnavailable
from kvtier.handshake import Hello
from kvtier.trust import PeerCred
from tests.support.arena import temp_arena
from tests.unit.test_client_ops import (
    BLOCK,
    NS,
    AsyncDriver,
    ScriptedDaemon,
    SyncDriver,
    keys,
    ops,  # noqa: F401 - fixture
)


def read_only() -> np.ndarray:
    buf = np.zeros(BLOCK, np.uint8)
    buf.flags.writeable = False
    return buf


NOT_BUFFERS: dict[str, Any] = {"None": None, "a str": "x" * BLOCK, "a list": [0] * BLOCK}


@pytest.mark.parametrize("buf", list(NOT_BUFFERS.values()), ids=list(NOT_BUFFERS))
def test_an_object_that_is_no_buffer_is_a_buffer_size_error(buf: Any) -> None:
    """Something that is not a buffer at all is refused as documented, with a typed error
    naming the buffer, not memoryview's bare TypeError."""
    with pytest.raises(BufferSizeError, match="buffer 0"):
        check_buffers(NS, keys(1), [buf])


DRIVERS = [SyncDriver, AsyncDriver]


@pytest.mark.parametrize("driver", DRIVERS, ids=["sync", "async"])
def test_a_buffer_larger_than_a_block_is_refused(ops: Ops, driver: Any) -> None:
    """A buffer longer than the layout's block is a BufferSizeError before any request,
    like a shorter one (a get would fill only its head and report the block loaded).
    Mutant that survived: only buffers shorter than a block were refused."""
    daemon = ScriptedDaemon()
    for op in (ops.op_put(NS, keys(1), [np.zeros(BLOCK + 1, np.uint8)], False, None),
               ops.op_get(NS, keys(1), [np.zeros(BLOCK + 1, np.uint8)])):
        with pytest.raises(BufferSizeError, match=f"{BLOCK + 1} bytes"):
            driver(daemon).run(op)
    assert daemon.requests == []


@pytest.mark.parametrize("driver", DRIVERS, ids=["sync", "async"])
def test_more_buffers_than_keys_are_refused(ops: Ops, driver: Any) -> None:
    """One buffer per key, exactly: more buffers than keys is a BufferSizeError before any
    request (the caller's buffers and keys are out of step; a get would fill the leading
    buffers and leave the others as they were, a put would fail after its prepare).
    Mutant that survived: only fewer buffers than keys were refused."""
    daemon = ScriptedDaemon()
    three = [np.zeros(BLOCK, np.uint8) for _ in range(3)]
    for op in (ops.op_put(NS, keys(2), three, False, None), ops.op_get(NS, keys(2), three)):
        with pytest.raises(BufferSizeError, match="2 keys but 3 buffers"):
            driver(daemon).run(op)
    assert daemon.requests == []


def test_a_read_only_get_buffer_is_refused_before_any_request(ops: Ops) -> None:
    """A get writes into its buffers: a read-only one (``bytes``, a frozen array) is
    refused as a BufferSizeError before a lease is taken, like a strided one."""
    daemon = ScriptedDaemon()
    with pytest.raises(BufferSizeError):
        SyncDriver(daemon).run(ops.op_get(NS, keys(1), [read_only()]))
    assert daemon.requests == []


def test_an_object_array_is_refused_before_any_request(ops: Ops) -> None:
    """An array of Python objects has the block's size in pointers, not bytes of KV: it
    is refused before a lease is taken, never copied (its pointers) into the arena."""
    daemon = ScriptedDaemon()
    with pytest.raises(BufferSizeError):
        SyncDriver(daemon).run(ops.op_put(NS, keys(1), [np.zeros(BLOCK // 8, object)],
                                          False, None))
    assert daemon.requests == []


def test_bytes_are_a_put_buffer(ops: Ops) -> None:
    """(The guard of the fix above: read-only buffers stay valid for a put.)"""
    daemon = ScriptedDaemon()
    assert SyncDriver(daemon).run(ops.op_put(NS, keys(1), [bytes(BLOCK)], False, None)) == 1
    assert SyncDriver(daemon).run(ops.op_put(NS, keys(1), [read_only()], False, None)) == 1


# -- fork ---------------------------------------------------------------------------------
class Tracked:
    """A client as the fork hook sees it."""

    def __init__(self) -> None:
        self.broken: ClientForked | None = None
        self.pid = forks.track(self)

    def _forked(self) -> None:
        self.broken = forks.forked_error(self.pid)


def test_every_tracked_client_is_marked_in_a_forked_child(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a forked child every client connected before the fork is marked unusable (its
    calls raise ClientForked): parent and child would read each other's replies, leases
    and KV otherwise. Mutant that survived in the unit tests: ``track`` forgot the client,
    so a child used its parent's connection. (Run here without a fork: the hook itself.)"""
    monkeypatch.setattr(forks, "_live", weakref.WeakSet())
    clients = [Tracked(), Tracked()]
    forks._after_fork_in_child()
    for c in clients:
        assert isinstance(c.broken, ClientForked)
        assert f"pid {c.pid}" in str(c.broken) and "connect() again" in str(c.broken)


# -- the hello: what is mapped, what is closed ----------------------------------------------
def _hello(arena_path: str, size: int, **extra: Any) -> dict[str, Any]:
    return {"version": 1, "arena": {"path": arena_path, "size": size}, **extra}


def test_an_hbm_pool_without_a_handle_is_no_pool() -> None:
    """A hello's ``hbm`` is the daemon's pool only with a handle to map it by: without one
    the client has no pool (``hbm_info`` None: no device get is asked). Mutant that
    survived: any dict was kept as the pool."""
    with temp_arena(1 << 20, 1 << 20) as arena:
        o = Ops()
        o.on_hello(_hello(str(arena.path), arena.size, hbm={"size": 1 << 20, "device": 0}))
        assert o.hbm_info is None
        o.close()


def test_the_presence_filter_is_closed_when_the_arena_cannot_be_mapped(
        tmp_path: Path) -> None:
    """When the arena of a hello cannot be mapped, the presence filter's descriptor that
    came with it is closed too: a client retrying such a daemon must not leak one per
    try. Mutant that survived: only the arena's own descriptor was closed."""
    fd = os.open(tmp_path / "presence", os.O_RDWR | os.O_CREAT, 0o600)
    with pytest.raises(OSError):
        mapped(_hello(str(tmp_path / "no-arena"), 1 << 20), presence_fd=fd)
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)


def test_the_presence_filter_must_belong_to_the_daemons_uid(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The presence filter is checked as a file of the verified daemon's uid (which may be
    a trusted uid other than ours), as the arena is. Mutant that survived: it was checked
    against this process's uid, so a trusted daemon of another user never shared it."""
    owners: dict[str, int | None] = {}

    class Arena:
        def __init__(self, path: str, size: int, fd: int | None = None,
                     owner_uid: int | None = None) -> None:
            owners["arena"] = owner_uid

    def presence(fd: int, announced: Any, daemon_uid: int) -> None:
        owners["presence"] = daemon_uid

    monkeypatch.setattr(hello_mod, "ArenaMapping", Arena)
    monkeypatch.setattr(hello_mod, "open_presence", presence)
    mapped(_hello("/dev/shm/x", 1 << 20, presence={}), None, os.getuid() + 4242, 99)
    assert owners == {"arena": os.getuid() + 4242, "presence": os.getuid() + 4242}


def test_a_presence_filter_announced_as_nothing_is_closed(tmp_path: Path) -> None:
    """A presence descriptor whose announcement is not a map is not used, and is closed
    (taken over either way). Mutant that survived: it was left open, one per connect."""
    fd = os.open(tmp_path / "presence", os.O_RDWR | os.O_CREAT, 0o600)
    assert open_presence(fd, None, os.getuid()) is None
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)


def test_an_arena_that_is_gone_is_daemon_unavailable(tmp_path: Path) -> None:
    """An arena the hello names but this process cannot open (the daemon is restarting,
    the file is gone) is DaemonUnavailable (retry later), not a bare OSError out of
    ``connect``. Mutant that survived: only ConnectionError was turned into it."""
    hello = Hello(PeerCred(os.getpid(), os.getuid(), os.getgid()),
                  _hello(str(tmp_path / "gone"), 1 << 20), None)
    with pytest.raises(DaemonUnavailable, match="cannot map the arena"):
        map_arena(Ops(), hello, str(tmp_path / "kvtier.sock"))
