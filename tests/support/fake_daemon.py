"""Fake daemons for the trust tests: what an attacker would put on a client's socket path.

- ``LISTENER_SOURCE``: a stdlib-only program run as another user; it listens, accepts one
  connection and reports how many bytes the client sent before closing (the client must
  send none).
- ``FakeDaemon``: a thread of the test process (same uid) that answers the hello like a
  daemon and names (or passes, with SCM_RIGHTS) an arena file the test chose.
"""

from __future__ import annotations

import array
import contextlib
import socket
import threading
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
