"""A scripted RESP peer on a unix (or loopback TCP) socket, for tests of the tier's readers
that need replies a real redis-server never sends (cut at every boundary, broken, missing,
too many)."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvtier.tiers.redis_resp import NodeAddr


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def cuts(data: bytes, rng: random.Random, most: int) -> list[bytes]:
    """``data`` in pieces of 1..most bytes."""
    out, i = [], 0
    while i < len(data):
        n = rng.randint(1, most)
        out.append(data[i:i + n])
        i += n
    return out


def _command(buf: bytearray) -> tuple[list[bytes], int] | None:
    """The first whole command (an array of bulk strings) in ``buf`` and its length."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    argc, pos, args = int(buf[1:end]), end + 2, []
    for _ in range(argc):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        n = int(buf[pos + 1:end])
        if len(buf) < end + 2 + n + 2:
            return None
        args.append(bytes(buf[end + 2:end + 2 + n]))
        pos = end + 2 + n + 2
    return args, pos


def answering(answer: Callable[[list[bytes]], bytes | list[bytes | float]]
              ) -> Callable[[socket.socket], None]:
    """A script (for ``peer(..., read_first=False)``) that writes ``answer(command)`` for
    each command the client sends (``[b"GET", key]``), until the client hangs up. An answer
    may be a list of byte strings to send and seconds to sleep between them."""
    def script(conn: socket.socket) -> None:
        buf = bytearray()
        while True:
            found = _command(buf)
            if found is None:
                data = conn.recv(1 << 16)
                if not data:
                    return
                buf += data
                continue
            args, used = found
            del buf[:used]
            out = answer(args)
            for piece in [out] if isinstance(out, bytes) else out:
                if isinstance(piece, float):
                    time.sleep(piece)
                else:
                    conn.sendall(piece)

    return script


@contextlib.contextmanager
def peer(tmp_path: Path, script: Callable[[socket.socket], None], *, name: str = "peer.sock",
         tcp: bool = False, read_first: bool = True,
         concurrent: bool = False) -> Iterator[NodeAddr]:
    """A socket (unix ``tmp_path/name``, or loopback TCP) that accepts connections one at
    a time and runs ``script`` on each (after reading whatever the client sent first,
    unless not ``read_first``); ``concurrent``: every connection served at once, each in
    a thread of its own (a pooled idle connection would keep a fresh one waiting)."""
    if tcp:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("127.0.0.1", 0))
        addr = NodeAddr("127.0.0.1", srv.getsockname()[1])
    else:
        path = str(tmp_path / name)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        addr = NodeAddr(path, 0, unix=True)
    srv.listen(16)
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(None)
            with contextlib.suppress(OSError):   # the client hung up
                if read_first:
                    conn.recv(1 << 16)   # the pipeline of GETs
                script(conn)

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if concurrent:
                threading.Thread(target=serve_one, args=(conn,), daemon=True).start()
            else:
                serve_one(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield addr
    finally:
        stop.set()
        srv.close()
        thread.join(5)
