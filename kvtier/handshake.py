"""The client's side of a connection's start: connect, verify who listens, say hello.

Written once for both clients: ``connect`` calls ``open_verified`` directly and
``connect_async`` in a worker thread, because the hello reply may carry the arena's file
descriptor (SCM_RIGHTS), which only ``recvmsg`` on a plain socket can receive. The daemon's
uid is checked with SO_PEERCRED before a single byte is sent (kvtier.trust).
"""

from __future__ import annotations

import array
import os
import socket
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kvtier.errors import DaemonUnavailable, ProtocolError, RequestTimeout, error_from_code
from kvtier.keys import KEY_SCHEME
from kvtier.protocol import (
    LENGTH,
    PROTOCOL_VERSION,
    REQUEST_MAX_ENTRIES,
    REQUEST_MAX_ITEMS,
    pack,
    unpack_body,
)
from kvtier.trust import PeerCred, check_daemon_peer

MAX_HELLO_REPLY = 64 * 2**20
HELLO_MAX_ITEMS = REQUEST_MAX_ITEMS
HELLO_MAX_ENTRIES = REQUEST_MAX_ENTRIES
"""A hello reply holds a few dozen entries (the arena, presence and hbm maps): decoded
within the bounds the daemon puts on a request, not unbounded (a frame of 1-byte empty
arrays cost 0.6 GB and 7 s per 8 MiB; found by review)."""
_FDS = 2                     # the arena's descriptor, then the presence filter's
_FD_SPACE = socket.CMSG_SPACE(_FDS * array.array("i").itemsize)


def hello_request() -> dict[str, Any]:
    """The first request; ``arena_fd``: pass the arena's descriptor with the reply, and
    ``presence_fd`` the presence filter's after it (kvtier.presence); ``key_scheme``: the
    client's key function version (kvtier.keys.KEY_SCHEME)."""
    return {"op": "hello", "version": PROTOCOL_VERSION, "client": f"python/{os.getpid()}",
            "key_scheme": KEY_SCHEME, "arena_fd": True, "presence_fd": True}


@dataclass(slots=True)
class Hello:
    """What the handshake established: the daemon's credentials, its reply, the arena's
    and the presence filter's descriptors (None when the daemon passed none; whoever takes
    the Hello owns and closes them)."""

    peer: PeerCred
    reply: dict[str, Any]
    arena_fd: int | None
    presence_fd: int | None = None

    def close_fds(self) -> None:
        """Close the descriptors nobody took over."""
        for fd in (self.arena_fd, self.presence_fd):
            if fd is not None:
                os.close(fd)
        self.arena_fd = self.presence_fd = None


def wait_until(sock: socket.socket, deadline: float) -> None:
    """Bound ``sock``'s next wait by ``deadline`` (``time.monotonic()``); TimeoutError
    once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def recv_hello(sock: socket.socket,
               deadline: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """Read exactly the hello reply frame, and the descriptors passed alongside it (the
    arena's, then the presence filter's), if any, whole by ``deadline``
    (``time.monotonic()``; TimeoutError past it; None: each receive bounded by the
    socket's timeout only).

    recvmsg all along (the descriptors ride on the frame's first byte), with
    MSG_CMSG_CLOEXEC so they never leak into a child process; room for two descriptors only
    (the kernel closes any more). An error reply raises its typed error.
    """
    fds: list[int] = []
    data = bytearray()
    need = LENGTH.size
    try:
        while len(data) < need:
            if deadline is not None:   # one deadline for the frame, not one per receive:
                wait_until(sock, deadline)   # a byte per almost-timeout held a 1 s hello
                #                              40 s (found by review)
            chunk, ancdata, _flags, _ = sock.recvmsg(need - len(data), _FD_SPACE,
                                                     socket.MSG_CMSG_CLOEXEC)
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
                    fds.extend(got)
            if not chunk:
                raise ConnectionError("daemon closed the connection during the hello")
            data += chunk
            if need == LENGTH.size and len(data) == LENGTH.size:
                (n,) = LENGTH.unpack(data)
                if n > MAX_HELLO_REPLY:
                    raise ProtocolError(f"hello reply of {n} bytes is too large")
                need += n
        reply = unpack_body(bytes(data[LENGTH.size:]), MAX_HELLO_REPLY, HELLO_MAX_ITEMS,
                            HELLO_MAX_ENTRIES)
        if not reply.get("ok"):
            raise error_from_code(str(reply.get("code", "internal")),
                                  str(reply.get("error", "daemon refused the hello")))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    for fd in fds[_FDS:]:
        os.close(fd)
    return reply, fds[:_FDS]


def handshake(sock: socket.socket, path: str, trusted_uids: Collection[int],
              timeout: float, deadline: float | None = None) -> Hello:
    """Check who listens (SO_PEERCRED, before sending a byte), then say hello, all of it
    by ``deadline`` (``time.monotonic()``; default: ``timeout`` from now).

    UntrustedDaemon when the daemon's uid is neither ours nor trusted; RequestTimeout or
    DaemonUnavailable when it does not answer.
    """
    if deadline is None:
        deadline = time.monotonic() + timeout
    peer = check_daemon_peer(sock, path, trusted_uids)
    try:
        wait_until(sock, deadline)
        sock.sendall(pack({**hello_request(), "id": 1}))
        reply, fds = recv_hello(sock, deadline)
    except TimeoutError:
        raise RequestTimeout(f"no reply to hello from the daemon at {path} within "
                             f"{timeout}s") from None
    except OSError as exc:
        raise DaemonUnavailable(f"daemon at {path} dropped the connection during the hello: "
                                f"{exc}") from None
    return Hello(peer, reply, fds[0] if fds else None, fds[1] if len(fds) > 1 else None)


def open_verified(path: str, timeout: float,
                  trusted_uids: Collection[int]) -> tuple[socket.socket, Hello]:
    """A connected blocking socket (timeout ``timeout``) to a verified daemon, and its
    hello, the connect and the hello within ``timeout`` in all; DaemonUnavailable when
    nothing listens at ``path``."""
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except PermissionError:
        sock.close()
        raise DaemonUnavailable(
            f"cannot connect to the daemon at {path}: permission denied (the socket is "
            "another user's: a kvtier daemon serves only its own user's processes); start "
            "your own with `kvtier serve --socket PATH`") from None
    except OSError as exc:
        sock.close()
        raise DaemonUnavailable(f"no kvtier daemon at {path} ({exc.__class__.__name__}): "
                                "start one with `kvtier serve`") from None
    try:
        hello = handshake(sock, path, trusted_uids, timeout, deadline)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(timeout)
    return sock, hello
