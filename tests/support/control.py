"""A daemon's control server over a test store and arena, driven in-process: no socket, no
process (tests/unit/test_control_leases.py, test_daemon_survivors_ops.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtier.daemon.control import ControlServer
from kvtier.daemon.limits import Limits
from kvtier.daemon.ops import Connection
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from tests.support.store import DIGEST, FP


def server(store: TieredStore, arena: Arena, tmp_path: Path, **limits: Any) -> ControlServer:
    """A control server over ``store`` with these ``Limits``."""
    lim = Limits(**limits)
    return ControlServer(store, tmp_path / "kvtier.sock", max_frame=lim.max_frame,
                         max_inflight=8, arena_path=str(arena.path), arena_size=arena.size,
                         limits=lim)


def connection(srv: ControlServer, conn_id: int = 1) -> Connection:
    """A connection of this process, the store's namespace registered on it."""
    conn = Connection(conn_id, os.getpid(), os.getuid())
    conn.registered(DIGEST)
    srv.connections[conn.id] = conn
    return conn


def request(keys: list[bytes]) -> dict[str, Any]:
    """The body of a request naming ``keys`` of the store's namespace."""
    return {"ns": DIGEST, "layout_fp": FP, "keys": b"".join(keys)}
