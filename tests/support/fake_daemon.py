"""Fake daemons for the trust tests: what an attacker would put on a client's socket path.

- ``LISTENER_SOURCE``: a stdlib-only program run as another user; it listens, accepts one
  connection and reports how many bytes the client sent before closing (the client must
  send none).
- ``FakeDaemon``: a thread of the test process (same uid) that answers the hello like a
  daemon and names (or passes, with SCM_RIGHTS) an arena file the test chose.
- ``HostileSocketDaemon``: a thread of the test process that greets with a private arena
  and then answers as the test scripts it (malformed, trickled, unsolicited replies).
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.protocol import LENGTH, pack, unpack_body

LISTENER_SOURCE = r"""
import os, socket, sys
path, wait_s = sys.argv[1], float(sys.argv[2])
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
os.chmod(path, 0o777)          # the attacker wants every victim to be able to connect
srv.listen(8)
print("ready", flush=True)
srv.settimeout(wait_s)
conn, _ = srv.accept()
conn.settimeout(wait_s)
got = 0
try:
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            break
        got += len(chunk)
except OSError:
    pass
print(f"received {got}", flush=True)
"""


class FakeDaemon:
    """Answers one hello per connection with ``arena`` (path and size), optionally passing
    ``pass_fd`` (an open descriptor) with the reply, then waits for the client to close."""

    def __init__(self, path: Path, arena: dict[str, Any], pass_fd: int | None = None) -> None:
        self.path = path
        self.arena = arena
        self.pass_fd = pass_fd
        self.hellos: list[dict[str, Any]] = []
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(str(path))
        self._srv.listen(8)
        self._srv.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeDaemon:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(5)
        self._srv.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            (n,) = LENGTH.unpack(_recv_exact(conn, LENGTH.size))
            hello = unpack_body(_recv_exact(conn, n))
        except (OSError, ConnectionError):
            return
        self.hellos.append(hello)
        reply = pack({"id": hello.get("id", 1), "ok": True, "version": 1,
                      "server": "kvtier/fake", "conn": 1, "arena": self.arena})
        if self.pass_fd is not None and hello.get("arena_fd") is True:
            conn.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                    array.array("i", [self.pass_fd]))])
        else:
            conn.sendall(reply)
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


Handler = Callable[[socket.socket, dict[str, Any]], None]


class HostileSocketDaemon:
    """A same-uid daemon in a thread of the test process, for hostile-reply tests: every
    trust check passes (a private arena of ``slots`` blocks of ``block_bytes`` is passed by
    descriptor), then it says what the test wants. ``hello(conn, req)`` replaces the greeting
    (``hello_extra`` is merged into the standard one); ``handler(conn, req)`` answers every
    request after ``register_layout`` (answered as a daemon would; default: ``ok``).
    ``send`` and ``trickle`` write frames; ``close`` ends every connection it accepted."""

    def __init__(self, workdir: Path, block_bytes: int, slots: int = 16,
                 handler: Handler | None = None, *, hello: Handler | None = None,
                 hello_extra: dict[str, Any] | None = None,
                 answer_register: bool = True) -> None:
        from tests.support.arena import shm_root

        self.answer_register = answer_register   # False: ``handler`` answers it too

        self.path = workdir / "hostile.sock"
        self.size = block_bytes * slots
        self.arena = Path(shm_root()) / f"kvtier-hostile-{os.getpid()}-{uuid.uuid4().hex}"
        self.fd = os.open(self.arena, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, self.size)
        self.handler = handler or (lambda conn, req: self.send(conn, {"id": req["id"],
                                                                     "ok": True}))
        self.hello = hello
        self.hello_extra = hello_extra or {}
        self.requests: list[dict[str, Any]] = []
        self.conns: list[socket.socket] = []
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(str(self.path))
        self._srv.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> HostileSocketDaemon:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        self._srv.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            self.arena.unlink()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    @staticmethod
    def send(conn: socket.socket, msg: dict[str, Any]) -> None:
        conn.sendall(pack(msg))

    @staticmethod
    def trickle(conn: socket.socket, data: bytes, gap_s: float) -> None:
        """``data`` one byte every ``gap_s`` (until the client hangs up)."""
        with contextlib.suppress(OSError):
            for b in data:
                conn.sendall(bytes([b]))
                time.sleep(gap_s)

    def greet(self, conn: socket.socket, req: dict[str, Any], **extra: Any) -> None:
        """The standard hello reply, the arena's descriptor attached."""
        reply = {"id": req["id"], "ok": True, "version": 1, "conn": 1,
                 "arena": {"path": str(self.arena), "size": self.size}, **extra}
        conn.sendmsg([pack(reply)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", [self.fd]))])

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from kvtier.keys import Namespace
        from kvtier.layout import KVLayout

        with contextlib.suppress(OSError, ConnectionError):
            (n,) = LENGTH.unpack(_recv_exact(conn, LENGTH.size))
            req = unpack_body(_recv_exact(conn, n))
            if self.hello is not None:
                self.hello(conn, req)
            else:
                self.greet(conn, req, **self.hello_extra)
            while True:
                (n,) = LENGTH.unpack(_recv_exact(conn, LENGTH.size))
                req = unpack_body(_recv_exact(conn, n))
                self.requests.append(req)
                if req["op"] == "register_layout" and self.answer_register:
                    ns = Namespace(req["model_id"], KVLayout.from_dict(req["layout"]),
                                   req["tp_rank"], req["tp_size"], req["cache_salt"])
                    self.send(conn, {"id": req["id"], "ok": True, "ns": ns.digest})
                else:
                    self.handler(conn, req)
