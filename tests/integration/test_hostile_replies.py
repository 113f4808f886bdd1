"""The client never acts on a daemon reply it did not check: a fake daemon of our own uid,
passing a real private arena (so every trust check passes, as a buggy daemon's would),
answers with offsets outside the arena, overlapping or off slot boundaries, more slots or
hits than keys, and reply ids that are not ints. Each is a ProtocolError before any view
exists, or a connection marked broken at once; never bytes of another slot."""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import connect, connect_async
from kvtier.errors import DaemonUnavailable, ProtocolError
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.protocol import LENGTH, pack, unpack_body
from tests.support.arena import shm_root

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=16)   # 8 KiB blocks: two pages
NB = LAYOUT.block_bytes
SLOTS = 16
ARENA = SLOTS * NB

Script = Callable[[dict[str, Any]], "dict[str, Any] | list[dict[str, Any]]"]


def _recv(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError
        data += chunk
    return data


class HostileDaemon:
    """Greets like a daemon (the arena passed by descriptor, each slot holding its number)
    and answers every request with what ``script`` returns (a list: several frames)."""

    def __init__(self, workdir: Path, script: Script) -> None:
        self.path = workdir / "s.sock"
        self.arena = Path(shm_root()) / f"kvtier-hostile-{os.getpid()}-{uuid.uuid4().hex}"
        self.fd = os.open(self.arena, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, ARENA)
        with open(self.arena, "r+b") as f:
            for s in range(SLOTS):
                f.write(bytes([s]) * NB)
        self.script = script
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(str(self.path))
        self.srv.listen(4)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(Exception):
            (n,) = LENGTH.unpack(_recv(conn, 4))
            hello = unpack_body(_recv(conn, n))
            conn.sendmsg([pack({"id": hello["id"], "ok": True, "version": 1, "conn": 1,
                                "arena": {"path": str(self.arena), "size": ARENA}})],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self.fd]))])
            while True:
                (n,) = LENGTH.unpack(_recv(conn, 4))
                req = unpack_body(_recv(conn, n))
                out = self.script(req)
                for rep in out if isinstance(out, list) else [out]:
                    conn.sendall(pack({"id": req["id"], **rep}))

    def close(self) -> None:
        self.srv.close()
        os.close(self.fd)
        self.arena.unlink()


def answering(**replies: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A daemon that registers any namespace and answers ``op`` with ``replies[op]``."""
    def script(req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "register_layout":
            ns = Namespace(req["model_id"], KVLayout.from_dict(req["layout"]), req["tp_rank"],
                           req["tp_size"], req["cache_salt"])
            return {"ok": True, "ns": ns.digest}
        return {"ok": True, **replies.get(op, {})}
    return script


@contextlib.contextmanager
def hostile(tmp_path: Path, script: Script) -> Iterator[HostileDaemon]:
    d = HostileDaemon(tmp_path, script)
    try:
        yield d
    finally:
        d.close()


GETS = [
    ("the last byte of the arena", [ARENA - 1]),
    ("past the arena", [ARENA + 4096]),
    ("negative", [-2 * NB]),
    ("off a slot boundary", [NB + 100]),
    ("the same slot twice", [NB, NB]),
    ("overlapping slots", [NB, NB + 4096]),
    ("a bool", [True]),
    ("a float", [1.5]),
    ("more slots than keys", [0, NB, 2 * NB]),
    ("not a list", 5),
]


@pytest.mark.parametrize("offsets", [o for _, o in GETS], ids=[n for n, _ in GETS])
def test_a_get_naming_wrong_slots_is_refused_before_any_copy(tmp_path: Path,
                                                             offsets: Any) -> None:
    released: list[int] = []

    def script(req: dict[str, Any]) -> dict[str, Any]:
        if req["op"] == "get_release":
            released.append(req["lease"])
        return answering(get_prepare={"lease": 7, "offsets": offsets, "ttl_s": 30.0})(req)

    with hostile(tmp_path, script) as d:
        c = connect(d.path, timeout=5)
        ns = c.register_layout(LAYOUT, "m")
        outs = [np.full(NB, 0x55, np.uint8) for _ in range(2)]
        with pytest.raises(ProtocolError):
            c.get(ns, block_keys(ns, np.arange(2 * 16)), outs)
        assert all((o == 0x55).all() for o in outs)   # nothing was copied into them
        deadline = time.monotonic() + 5
        while released != [7] and time.monotonic() < deadline:   # (sent without a wait)
            c.stats()
        assert released == [7]   # and the lease went back
        c.close()


@pytest.mark.parametrize("offsets", [[-2 * NB, None], [ARENA - 1, None], [0, 4096],
                                     [0, NB, 2 * NB], [0]],
                         ids=["negative", "last byte", "overlapping", "more", "fewer"])
def test_a_put_naming_wrong_slots_writes_nothing_and_aborts(tmp_path: Path,
                                                            offsets: list[Any]) -> None:
    aborted: list[int] = []

    def script(req: dict[str, Any]) -> dict[str, Any]:
        if req["op"] == "put_abort":
            aborted.append(req["lease"])
        return answering(put_prepare={"lease": 9, "offsets": offsets},
                         put_commit={"stored": 2})(req)

    with hostile(tmp_path, script) as d:
        before = d.arena.read_bytes()
        c = connect(d.path, timeout=5)
        ns = c.register_layout(LAYOUT, "m")
        with pytest.raises(ProtocolError):
            c.put(ns, block_keys(ns, np.arange(2 * 16)), [np.full(NB, 0xAB, np.uint8)] * 2)
        assert aborted == [9]
        assert d.arena.read_bytes() == before   # no slot was written
        c.close()


@pytest.mark.parametrize("reply", [{"hits": 10**6, "tiers": ["cpu"]},
                                   {"hits": -5, "tiers": []},
                                   {"hits": 2, "tiers": ["cpu"]},
                                   {"hits": True, "tiers": ["cpu"]}],
                         ids=["too many", "negative", "tiers short", "a bool"])
def test_a_lookup_count_outside_the_keys_asked_is_refused(tmp_path: Path,
                                                          reply: dict[str, Any]) -> None:
    with hostile(tmp_path, answering(lookup=reply)) as d:
        c = connect(d.path, timeout=5)
        ns = c.register_layout(LAYOUT, "m")
        with pytest.raises(ProtocolError):
            c.lookup(ns, block_keys(ns, np.arange(2 * 16)))
        c.close()


def test_replies_out_of_step_break_the_connection_at_once(tmp_path: Path) -> None:
    """A flood of replies to no request is a ProtocolError at the first, not a wait of
    the timeout per reply; an async reply whose id is not an int ends the connection's use
    at once (it used to kill the reader silently: every later call timed out)."""
    flood = [{"id": 10_000 + i, "ok": True, "stats": {}} for i in range(50)]
    with hostile(tmp_path, lambda req: flood if req["op"] == "stats" else
                 answering()(req)) as d:
        c = connect(d.path, timeout=2)
        t0 = time.monotonic()
        with pytest.raises(ProtocolError):
            c.stats()
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(DaemonUnavailable, match="request 10000"):   # and stays broken
            c.stats()
        c.close()

    async def run(d: HostileDaemon) -> None:
        a = await connect_async(d.path, timeout=2)
        with pytest.raises(DaemonUnavailable):
            await a.stats()
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            await a.stats()
        assert time.monotonic() - t0 < 0.5
        await a.close()

    (tmp_path / "async").mkdir()
    with hostile(tmp_path / "async", lambda req: {"id": [1, 2], "ok": True}) as d:
        asyncio.run(run(d))
