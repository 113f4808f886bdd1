"""Typed errors with stable codes.

Every error that crosses the control socket carries its ``code`` so a client can
re-raise the same class on its side. A user-facing message says what was wrong and
what to do about it.
"""

from __future__ import annotations

_BY_CODE: dict[str, type[KVTierError]] = {}
_BRIEF = 64


def brief(value: object, limit: int = _BRIEF) -> str:
    """A client-sent value for an error message or a log line: at most ``limit`` characters,
    made without rendering the whole value first (the repr of a 16 MiB byte string is 48 MB,
    built on the event loop, then sent back and logged; found by review). Containers and
    long ints are described, not shown."""
    if isinstance(value, (str, bytes, bytearray)):
        text = repr(value[:limit])
        if len(value) > limit:
            text = text[:limit - 3] + "..."
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        text = f"a {type(value).__name__} of {len(value)} items"
    elif isinstance(value, int) and value.bit_length() > 64:
        text = f"an int of {value.bit_length()} bits"
    elif value is None or isinstance(value, (bool, int, float)):
        text = repr(value)
    else:
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class KVTierError(Exception):
    """Base class of all kvtier errors; ``code`` is stable across versions.

    A subclass that sets its own ``code`` is registered for ``error_from_code`` wherever it
    is defined (e.g. ``NvmeIOError`` in the nvme tier), the first class to claim a code wins.
    """

    code: str = "internal"
    reported: bool = False
    """True for an error the daemon answered (``error_from_code``): the daemon is there and
    its connection stands; False for one raised on this side (a malformed reply, a
    timeout), after which the connection is suspect."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            _BY_CODE.setdefault(cls.code, cls)


class ConfigError(KVTierError):
    """The configuration (file, env or flags) is invalid."""

    code = "config"


class ProtocolError(KVTierError):
    """A control-plane frame was malformed, oversized or out of order."""

    code = "protocol"


class HandshakeError(ProtocolError):
    """Client and daemon do not speak a common protocol version."""

    code = "handshake"


class LayoutMismatch(KVTierError):
    """A layout or buffer does not match the namespace it was used with."""

    code = "layout_mismatch"


class UnknownNamespace(KVTierError):
    """The namespace was never registered on this connection's daemon."""

    code = "unknown_namespace"


class BufferSizeError(KVTierError):
    """A buffer's size differs from the layout's block size."""

    code = "buffer_size"


class LeaseError(KVTierError):
    """A commit or release named a lease never handed out, already used, or expired."""

    code = "lease"


class LeaseExpired(LeaseError):
    """A lease outlived its TTL before it was released or committed.

    For a get, the bytes read under it may have been overwritten by another client and must
    be discarded; for a put, nothing was stored. Finish leases sooner, or raise
    ``daemon.lease_ttl_s``.
    """

    code = "lease_expired"


class CapacityError(KVTierError):
    """No tier could take the block (hard capacity reached, nothing evictable)."""

    code = "capacity"


class FrameError(KVTierError):
    """A stored frame failed a check (magic, version, checksum, key, layout)."""

    code = "frame"


class ChecksumError(FrameError):
    """A frame's payload checksum did not match."""

    code = "checksum"


class DaemonUnavailable(KVTierError):
    """No daemon answered at the socket path (not running, or died)."""

    code = "unavailable"


class ClientForked(DaemonUnavailable):
    """A client used in a process forked after it connected: parent and child would share
    one connection and one request-id sequence, and read each other's replies (leases,
    arena offsets: each other's KV). Connect again in the child."""

    code = "forked"


class RequestTimeout(KVTierError):
    """The daemon did not answer within the client's timeout."""

    code = "timeout"


class Overloaded(KVTierError):
    """The daemon's bounded queue for this connection is full: retry later."""

    code = "overloaded"


class TrustError(KVTierError):
    """A peer or a file failed a trust check (owner, mode, uid): nothing was sent to it."""

    code = "untrusted"


class UntrustedDaemon(TrustError):
    """The process listening on the socket runs as a uid this client does not trust."""

    code = "untrusted_daemon"


class UntrustedArena(TrustError):
    """The arena the daemon named is not a private regular file of the daemon's user."""

    code = "untrusted_arena"


class StartupError(KVTierError):
    """The daemon cannot start here (a path, port or resource); the message names the fix."""

    code = "startup"
class LimitExceeded(KVTierError):
    """A request exceeds a configured bound (keys per request, ...): split it or raise the
    daemon's limit (docs/operations.md, "Limits")."""

    code = "limit"


_BY_CODE.setdefault(KVTierError.code, KVTierError)


def error_from_code(code: str, message: str) -> KVTierError:
    """Rebuild the typed error a daemon reported (unknown codes become KVTierError)."""
    cls = _BY_CODE.get(code, KVTierError)
    err = cls(message)
    err.reported = True
    return err
