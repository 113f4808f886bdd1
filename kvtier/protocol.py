"""Control-plane framing shared by the client and the daemon.

A frame is a 4-byte big-endian length followed by a msgpack map. Requests carry
``id`` (per-connection request id, echoed back) and ``op``; replies carry ``id`` and
``ok``, plus either results or ``code``/``error``. The first request on a connection
must be ``hello`` with the client's protocol ``version``: the daemon answers with the
version it will speak and where the shared-memory arena is (and, on GPU hosts with an hbm
tier, the pool's CUDA IPC handle under ``hbm``; a ``get_prepare`` with ``device: true``
may then answer with hbm offsets). Optional fields are additions, not a new version.
KV bytes never appear here.
msgpack only (``raw=False``, bytes stay bytes, no ext types): nothing is ever unpickled.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from kvtier.errors import ProtocolError, brief

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})
LENGTH = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 2**20
REQUEST_MAX_ITEMS = 4096
"""Most entries of one array or map in a request: a 16 MiB frame of one-byte items would
otherwise decode into millions of Python objects (the daemon's bound, not the client's)."""
REQUEST_MAX_ENTRIES = 16384
"""Most entries of all arrays and maps of one request together (each container counts one
more). Requests are flat (keys travel as one bytes value; the largest list, ``lengths``,
has at most 256 entries), but 4000 arrays of 4096 entries each, nested in one 16 MiB
frame, are within ``REQUEST_MAX_ITEMS`` and decoded into 16 million objects: the event
loop stopped for about 1.2 s per frame, every other client waiting (found by review)."""

OPS = frozenset({
    "hello", "register_layout", "lookup", "put_prepare", "put_commit", "put_abort",
    "get_prepare", "get_release", "delete", "stats", "report_engine", "ping",
    "prefix_locality",
})


def pack(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def unpack_body(body: bytes | bytearray, max_frame: int = DEFAULT_MAX_FRAME,
                max_items: int | None = None,
                max_entries: int | None = None) -> dict[str, Any]:
    """Decode one frame body from an untrusted peer; malformed input -> ProtocolError.

    ``max_items`` bounds every array and map, ``max_entries`` all of them together (the
    daemon passes ``REQUEST_MAX_ITEMS`` and ``REQUEST_MAX_ENTRIES``). The decoder hands
    each container to its hook once it is complete, innermost first, so a frame over the
    budget is refused after at most ``max_entries + max_items`` objects.
    """
    bounds: dict[str, int] = {}
    if max_items is not None:
        bounds = {"max_array_len": max_items, "max_map_len": max_items}
    hooks = _Hooks(max_entries)
    try:
        if len(body) > max_frame:
            raise ProtocolError(f"frame of {len(body)} bytes exceeds the limit of {max_frame}")
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext,
                              object_hook=hooks.values, list_hook=hooks.items, **bounds)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed frame: {exc.__class__.__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a frame must be a map")
    return msg


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


class _Hooks:
    """The decoder's container hooks for one frame. msgpack decodes ext type -1
    (timestamp) itself, without calling ext_hook; the hooks see every container once, so
    a Timestamp anywhere below the top-level map is refused. With a budget, they also
    count the entries of every container (and the container itself)."""

    __slots__ = ("budget", "left")

    def __init__(self, budget: int | None) -> None:
        self.budget = self.left = budget

    def _spend(self, n: int) -> None:
        if self.left is not None:
            self.left -= n + 1
            if self.left < 0:
                raise ProtocolError(f"a request may hold at most {self.budget} array and "
                                    "map entries in all")

    def values(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._spend(len(obj))
        if any(isinstance(v, msgpack.Timestamp) for v in obj.values()):
            raise ProtocolError("msgpack ext type -1 (timestamp) is not allowed")
        return obj

    def items(self, obj: list[Any]) -> list[Any]:
        self._spend(len(obj))
        if any(isinstance(v, msgpack.Timestamp) for v in obj):
            raise ProtocolError("msgpack ext type -1 (timestamp) is not allowed")
        return obj


def check_length(n: int, max_frame: int) -> None:
    if n > max_frame:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_frame}")
    if n == 0:
        raise ProtocolError("empty frame")


def request_id(msg: dict[str, Any]) -> int:
    """The request's ``id`` to echo back (0 when it is absent or not an int)."""
    rid = msg.get("id", 0)
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def optional_int(msg: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    """An optional int field within [lo, hi] (ProtocolError names what was wrong)."""
    value = msg.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"field {name!r} must be an int in [{lo}, {hi}], got "
                            f"{type(value).__name__} {brief(value)}")
    return value


def field(msg: dict[str, Any], name: str, typ: type | tuple[type, ...]) -> Any:
    """A required, typed request field (ProtocolError names what was wrong)."""
    if name not in msg:
        raise ProtocolError(f"missing field {name!r}")
    value = msg[name]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} has type {type(value).__name__}")
    return value
