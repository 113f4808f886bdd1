"""Survivors of the trust-boundary mutation round, part 2 of 3: the hello on both sides
(``kvtier.handshake``, ``kvtier.daemon.greeting``), the client's trusted uids and the
daemon's peer check (``kvtier.daemon.control``), on real Unix sockets in this process.
Each test pins a check no test noticed broken; its docstring names the mutant."""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.client import KVTierClient, connect
from kvtier.daemon.greeting import Greeter
from kvtier.daemon.ops import Connection
from kvtier.errors import (
    HandshakeError,
    ProtocolError,
    TrustError,
    UntrustedDaemon,
)
from kvtier.handshake import MAX_HELLO_REPLY, open_verified, recv_hello, wait_until
from kvtier.protocol import (
    LENGTH,
    PROTOCOL_VERSION,
    REQUEST_MAX_ITEMS,
    pack,
    unpack_body,
)
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.trust import (
    PeerCred,
)
from tests.support.control import server

ME = os.getuid()


# -- the client's hello (kvtier.handshake) -----------------------------------------------------
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _send_reply(daemon: socket.socket, reply: dict[str, Any], fds: list[int],
                later_fds: list[int] | None = None) -> None:
    """The hello reply frame, ``fds`` riding on its first byte as a daemon passes them, and
    ``later_fds`` (what no kvtier daemon sends) on the rest of it."""
    data = pack(reply)
    sent = daemon.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", fds))] if fds else [])
    assert sent == 1
    if later_fds:
        sent = daemon.sendmsg([data[1:]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                            array.array("i", later_fds))])
        assert sent == len(data) - 1
    else:
        daemon.sendall(data[1:])


def test_hello_descriptors_are_close_on_exec_and_extra_ones_closed(tmp_path: Path) -> None:
    """The arena's and the presence filter's descriptors arrive close-on-exec (a child the
    engine spawns must not inherit a mapping of the KV), both are handed back, and one
    more, passed with a later part of the frame (no kvtier daemon does), is closed rather
    than leaked. Mutants that survived: recvmsg without MSG_CMSG_CLOEXEC; the extra
    descriptors left open; the presence filter's dropped."""
    files = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(3)]
    client, daemon = socket.socketpair()
    try:
        before = _open_fds()
        _send_reply(daemon, {"id": 1, "ok": True, "version": 1}, files[:2], files[2:])
        reply, got = recv_hello(client, time.monotonic() + 5)
        assert reply["ok"] and len(got) == 2
        assert [os.fstat(fd).st_ino for fd in got] == [os.fstat(fd).st_ino for fd in files[:2]]
        for fd in got:
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert _open_fds() == before + 2                # the third was closed
        for fd in got:
            os.close(fd)
    finally:
        client.close()
        daemon.close()
        for fd in files:
            os.close(fd)


def test_an_error_hello_raises_its_error_and_closes_what_came_with_it(tmp_path: Path) -> None:
    """A hello the daemon refuses raises the typed error it names, and the descriptors
    passed with it are closed. Mutants that survived: an error reply taken for a
    greeting; the descriptors of a failed hello left open."""
    fd = os.open(tmp_path / "arena", os.O_RDWR | os.O_CREAT, 0o600)
    client, daemon = socket.socketpair()
    try:
        before = _open_fds()
        _send_reply(daemon, {"id": 1, "ok": False, "code": HandshakeError.code,
                             "error": "protocol version 9 not supported"}, [fd])
        with pytest.raises(HandshakeError, match="protocol version 9 not supported"):
            recv_hello(client, time.monotonic() + 5)
        assert _open_fds() == before
    finally:
        client.close()
        daemon.close()
        os.close(fd)


def test_a_hello_reply_longer_than_the_bound_is_refused_unread() -> None:
    """A frame header announcing more than MAX_HELLO_REPLY bytes is a ProtocolError at
    once, before any of it is read. Mutant that survived: the bound was 4 GiB."""
    client, daemon = socket.socketpair()
    try:
        daemon.sendall(LENGTH.pack(MAX_HELLO_REPLY + 1))
        daemon.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match="too large"):
            recv_hello(client, time.monotonic() + 5)
    finally:
        client.close()
        daemon.close()


def test_a_hello_reply_is_decoded_within_a_requests_bounds() -> None:
    """A hello reply holds a few dozen entries: one with more than a request may have
    (4097 in one array) is a ProtocolError, not millions of decoded objects. Mutant that
    survived: the reply was decoded without the item and entry bounds."""
    client, daemon = socket.socketpair()
    try:
        daemon.sendall(pack({"id": 1, "ok": True, "version": 1,
                             "extra": [0] * (REQUEST_MAX_ITEMS + 1)}))
        with pytest.raises(ProtocolError):
            recv_hello(client, time.monotonic() + 5)
    finally:
        client.close()
        daemon.close()


def test_a_hello_deadline_just_passed_is_a_timeout() -> None:
    """``wait_until`` raises TimeoutError as soon as the deadline has passed, not a
    ValueError from a negative socket timeout. Mutant that survived: a deadline passed by
    less than a second went on to ``settimeout`` with a negative value."""
    client, daemon = socket.socketpair()
    try:
        with pytest.raises(TimeoutError):
            wait_until(client, time.monotonic() - 0.5)
        wait_until(client, time.monotonic() + 5)
        left = client.gettimeout()
        assert left is not None and 0 < left <= 5
    finally:
        client.close()
        daemon.close()

@contextlib.contextmanager
def _silent_listener(path: Path) -> Iterator[None]:
    """A listener at ``path`` that accepts and never answers (a fake daemon)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    try:
        yield
    finally:
        srv.close()


@pytest.fixture
def foreign_peer(monkeypatch: pytest.MonkeyPatch) -> int:
    """Every Unix socket peer reports another uid (SO_PEERCRED as a foreign daemon's)."""
    uid = ME + 4242
    monkeypatch.setattr("kvtier.trust.peer_credentials",
                        lambda sock: PeerCred(os.getpid(), uid, uid))
    monkeypatch.delenv("KVTIER_TRUSTED_UIDS", raising=False)
    return uid


def test_every_way_to_connect_refuses_an_untrusted_uid(tmp_path: Path, foreign_peer: int) -> None:
    """``connect`` (trusted uids from the environment or the argument) and a client built
    on a socket the caller connected refuse a daemon of an untrusted uid before the hello,
    not by waiting for its reply. Mutants that survived: a client built on a raw socket
    trusted any uid; so did ``connect`` and ``open_verified`` (the integration tests catch
    those two with a real second user)."""
    path = tmp_path / "kvtier.sock"
    with _silent_listener(path):
        with pytest.raises(UntrustedDaemon, match=f"runs as uid {foreign_peer}"):
            connect(path, timeout=2.0)
        with pytest.raises(UntrustedDaemon, match=f"runs as uid {foreign_peer}"):
            connect(path, timeout=2.0, trusted_uids=[foreign_peer + 1])
        with pytest.raises(UntrustedDaemon, match=f"runs as uid {foreign_peer}"):
            open_verified(str(path), 2.0, frozenset())
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            raw.connect(str(path))
            with pytest.raises(UntrustedDaemon, match=f"runs as uid {foreign_peer}"):
                KVTierClient(raw, 2.0)
        finally:
            raw.close()


# -- the daemon's hello (kvtier.daemon.greeting) -----------------------------------------------
def _arena_file(tmp_path: Path) -> Path:
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    os.chmod(arena, 0o600)
    return arena


def test_the_greeter_never_passes_an_arena_reached_through_a_symlink(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Opening the arena by its path to pass it, the daemon does not follow a symbolic
    link there (whoever put it there chose what every client maps): no descriptor is
    passed, and that is logged. Mutant that survived: the open followed links."""
    link = tmp_path / "arena.link"
    link.symlink_to(_arena_file(tmp_path))
    greeter = Greeter(arena={"path": str(link), "size": 4096})
    with caplog.at_level(logging.WARNING, "kvtier.control"):
        assert greeter._descriptors({"arena_fd": True}, {}) == []
    assert "cannot open the arena" in caplog.text


def test_the_presence_filter_goes_only_to_a_client_that_asks(tmp_path: Path) -> None:
    """The presence filter's descriptor (and its announcement) go only with a hello that
    asks for it, after the arena's: a client that did not ask would take it for nothing,
    or for the arena. Mutant that survived: it was passed to every client."""
    presence = tmp_path / "presence"
    presence.write_bytes(b"")
    announced = {"counters_log2": 12, "hashes": 3, "exact": True}
    greeter = Greeter(arena={"path": str(_arena_file(tmp_path)), "size": 4096},
                      presence=(announced, lambda: os.open(presence, os.O_RDONLY)))
    reply: dict[str, Any] = {}
    fds = greeter._descriptors({"arena_fd": True}, reply)
    try:
        assert len(fds) == 1 and "presence" not in reply
    finally:
        for fd in fds:
            os.close(fd)
    fds = greeter._descriptors({"arena_fd": True, "presence_fd": True}, reply)
    try:
        assert len(fds) == 2 and reply["presence"] == announced
    finally:
        for fd in fds:
            os.close(fd)


def test_a_presence_filter_that_cannot_be_opened_is_not_announced(tmp_path: Path) -> None:
    """When the filter's descriptor cannot be opened, the hello does not announce it (the
    client would take the arena's descriptor for it, or none): it gets the arena alone.
    Mutant that survived: the announcement was made before the open."""
    def broken() -> int:
        raise PermissionError("presence filter was replaced under the daemon")

    greeter = Greeter(arena={"path": str(_arena_file(tmp_path)), "size": 4096},
                      presence=({"counters_log2": 12, "hashes": 3, "exact": True}, broken))
    reply: dict[str, Any] = {}
    fds = greeter._descriptors({"arena_fd": True, "presence_fd": True}, reply)
    try:
        assert len(fds) == 1 and "presence" not in reply
    finally:
        for fd in fds:
            os.close(fd)


def _greet_first(request: dict[str, Any]) -> None:
    """A greeter (arena never opened) given ``request`` as a connection's first."""
    async def read() -> dict[str, Any]:
        return request

    greeter = Greeter(arena={"path": "/nonexistent", "size": 4096})
    asyncio.run(greeter.greet(Connection(1, os.getpid(), ME), read,
                              None))  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [True, 1.0, "1"], ids=["bool", "float", "str"])
def test_a_hello_version_must_be_an_int(version: object) -> None:
    """The hello's version is an int of the supported ones: ``True`` (which equals 1) and
    other look-alikes are refused. Mutant that survived: ``True`` was taken for 1."""
    with pytest.raises(HandshakeError, match="not supported"):
        _greet_first({"op": "hello", "version": version, "id": 1})


def test_the_first_request_must_be_a_hello() -> None:
    """Any other first request is a HandshakeError: nothing is served before the hello.
    Mutant that survived: any op was greeted as a hello."""
    with pytest.raises(HandshakeError, match="first request must be 'hello'"):
        _greet_first({"op": "stats", "version": PROTOCOL_VERSION, "id": 1})


# -- the daemon's peer check (kvtier.daemon.control) -------------------------------------------
class _PeerCredOf:
    """Stands in for control's SO_PEERCRED struct: every peer reports ``uid``, or the
    getsockopt fails (``uid`` None)."""

    size = 12

    def __init__(self, uid: int | None) -> None:
        self.uid = uid

    def unpack(self, raw: bytes) -> tuple[int, int, int]:
        if self.uid is None:
            raise OSError(errno.EOPNOTSUPP, "SO_PEERCRED unavailable")
        return os.getpid(), self.uid, self.uid


@pytest.mark.parametrize("uid", [ME + 4242, None], ids=["other-uid", "unknown-uid"])
async def test_a_peer_not_of_the_daemons_uid_is_told_and_dropped(
        store: TieredStore, arena: Arena, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        uid: int | None) -> None:
    """A connection from another uid, or one whose uid cannot be read, gets one TrustError
    reply and is closed: counted, never registered as a connection, nothing served after.
    Mutants that survived: a peer whose SO_PEERCRED failed was taken for the daemon's own
    user; a refused peer went on to be served after its TrustError; the refusal was not
    counted."""
    monkeypatch.setattr("kvtier.daemon.control._PEERCRED", _PeerCredOf(uid))
    srv = server(store, arena, tmp_path)
    await srv.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(srv.socket_path))
        writer.write(pack({"op": "hello", "version": PROTOCOL_VERSION, "id": 1}))
        await writer.drain()
        (n,) = LENGTH.unpack(await asyncio.wait_for(reader.readexactly(LENGTH.size), 5))
        reply = unpack_body(await reader.readexactly(n), n)
        assert reply["ok"] is False and reply["code"] == TrustError.code
        assert f"not uid {-1 if uid is None else uid}" in reply["error"]
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await asyncio.sleep(0.2)                      # what a served peer would get to
        assert srv.connections == {} and srv.rejected_peers == 1
        writer.close()
    finally:
        await srv.stop_accepting()
        await srv.close_connections(1.0)
