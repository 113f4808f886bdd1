"""A scripted RESP peer on a unix socket, for tests of the tier's readers that need replies
a real redis-server never sends (cut at every boundary, broken, missing)."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def peer(tmp_path: Path, script: Callable[[socket.socket], None]) -> Iterator[NodeAddr]:
    """A unix socket that accepts connections and runs ``script`` on each (after reading
    whatever the client sent first)."""
    path = str(tmp_path / "peer.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.recv(1 << 16)   # the pipeline of GETs
                script(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield NodeAddr(path, 0, unix=True)
    finally:
        stop.set()
        srv.close()
        thread.join(5)
