"""RESP values and command encoding for the Redis tier.

The reply and error types, server addresses, connection options and the encoding of small
commands, shared by the connection (kvtier.tiers.redis_wire), the router and the tier
layers, so that those can use them without the connection's socket code.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass

CRLF = b"\r\n"


class ErrorReply(str):
    """A RESP error reply (``-ERR ...``, ``-MOVED ...``) returned as a value, not raised."""

    @property
    def kind(self) -> str:
        return self.split(" ", 1)[0]


# Redis Cluster replies that name the server to ask instead (the tier follows them)
REDIRECTS = ("MOVED", "ASK")
# errors about one key's value (not a string: someone else's data under the key prefix),
# not about the server: a miss for that key, never a reason to take the tier down
KEY_ERRORS = ("WRONGTYPE",)


class ReplyError(Exception):
    """An error reply seen as a failure (for counting and ``last_error``)."""


class ProtocolError(ConnectionError):
    """The byte stream is not the RESP we expect: the connection is unusable."""


@dataclass(frozen=True, slots=True)
class NodeAddr:
    """A server to connect to: TCP host/port, or a unix socket path (host, port 0)."""

    host: str
    port: int
    unix: bool = False

    def __str__(self) -> str:
        return self.host if self.unix else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ConnOptions:
    """How to open and authenticate a connection (shared by every node of a target)."""

    connect_timeout_s: float
    op_timeout_s: float
    username: str = ""
    password: str = ""
    db: int = 0
    tls: ssl.SSLContext | None = None
    tls_hostname: str | None = None


# Called with (index, first bytes of the value (up to ``head`` bytes), value length); returns
# where the rest of the value goes (a buffer of exactly length - len(head) bytes) or None
# to read and discard it.
Placer = Callable[[int, bytes, int], memoryview | None]


def _bulk(arg: bytes | bytearray | memoryview) -> bytes:
    return b"$%d\r\n" % len(arg)


def command(*args: bytes) -> bytes:
    """One small command in RESP (all arguments as one buffer)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts += (_bulk(arg), arg, CRLF)
    return b"".join(parts)
