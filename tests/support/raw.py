"""A raw control-socket connection for tests that send what the client never would."""

from __future__ import annotations

import socket
from typing import Any

from kvtier.keys import Namespace
from kvtier.protocol import LENGTH, pack, unpack_body


def reply(s: socket.socket) -> dict[str, Any]:
    """The next reply frame on ``s``."""
    (n,) = LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))
    return unpack_body(s.recv(n, socket.MSG_WAITALL))


def register(s: socket.socket, ns: Namespace, rid: int = 1000) -> None:
    """Register ``ns`` on ``s``: a connection names only namespaces it registered."""
    s.sendall(pack({"id": rid, "op": "register_layout", "layout": ns.layout.to_dict(),
                    "model_id": ns.model_id, "tp_rank": ns.tp_rank, "tp_size": ns.tp_size,
                    "cache_salt": ns.cache_salt}))
    r = reply(s)
    assert r["ok"] and r["ns"] == ns.digest, r
