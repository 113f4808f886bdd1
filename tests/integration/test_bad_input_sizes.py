"""Large client values in bad requests: the error names them in a few dozen characters.

Before, several error paths rendered the whole value (the repr of a 16 MiB byte string is
48 MB, built on the event loop), sent it back and logged it, and the hello echoed any
``id`` whole (found by review). A bad request's cost is now the frame the client sent.
"""

from __future__ import annotations

import socket

import numpy as np

from kvtier.client import connect
from kvtier.errors import HandshakeError, LayoutMismatch, ProtocolError
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.protocol import LENGTH, pack, unpack_body
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(2, 2, 32, "float16", 64)
BIG = 4 << 20


def _connect(daemon: DaemonProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(daemon.socket))
    return s


def _reply(s: socket.socket) -> tuple[int, dict]:
    """(the frame's size, the reply)."""
    (n,) = LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))
    return n, unpack_body(s.recv(n, socket.MSG_WAITALL))


def test_large_values_in_bad_requests_are_named_briefly(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(64 * 4))
    bufs = [np.full(LAYOUT.block_bytes, i + 1, np.uint8) for i in range(4)]
    assert c.put(ns, keys, bufs) == 4
    logged = daemon.log_path.stat().st_size

    s = _connect(daemon)   # a hello whose version is 4 MiB of bytes
    s.sendall(pack({"id": 1, "op": "hello", "version": b"v" * BIG}))
    size, r = _reply(s)
    assert r["code"] == HandshakeError.code and "upgrade" in r["error"]
    assert size < 1024 and "..." in r["error"], size
    s.close()

    s = _connect(daemon)   # a good hello with an id of 4 MiB: not echoed
    s.sendall(pack({"id": b"i" * BIG, "op": "hello", "version": 1}))
    size, r = _reply(s)
    assert r["ok"] and r["id"] == 0 and size < 4096, size
    layout = LAYOUT.to_dict()
    for field, value in (("num_layers", b"n" * BIG), ("kv_components", "k" * BIG),
                         ("dtype", "d" * BIG)):
        s.sendall(pack({"id": 2, "op": "register_layout", "model_id": "m",
                        "layout": {**layout, field: value}}))
        size, r = _reply(s)
        assert r["code"] == LayoutMismatch.code and size < 1024, (field, size, r)
    s.sendall(pack({"id": 3, "op": "register_layout", "model_id": "m", "layout": layout,
                    "tp_size": b"t" * BIG}))
    size, r = _reply(s)
    assert r["code"] == ProtocolError.code and "tp_size" in r["error"] and size < 1024, size
    s.close()

    assert daemon.log_path.stat().st_size - logged < 64 << 10   # lines, not megabytes
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
    assert c.get(ns, keys, outs) == 4
    assert all(np.array_equal(a, b) for a, b in zip(outs, bufs, strict=True))
    c.close()
