"""What a client maps from the daemon's hello: the arena and the presence filter.

The hello reply announces the arena (path and size) and, when the daemon passed them, the
descriptors of the arena and of its presence filter; the HBM pool's info rides along. This
module checks the announcement and maps them; ``Ops.on_hello`` keeps the result.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier import __version__
from kvtier.client.replies import REPLY_ERRORS
from kvtier.errors import (
    DaemonUnavailable,
    HandshakeError,
    KVTierError,
    ProtocolError,
    brief,
)
from kvtier.handshake import Hello
from kvtier.keys import KEY_SCHEME
from kvtier.presence import PresenceView
from kvtier.protocol import PROTOCOL_VERSION
from kvtier.tiers.arena_mapping import ArenaMapping

if TYPE_CHECKING:
    from kvtier.client.ops import Ops

log = logging.getLogger("kvtier.client")
HELLO_ERRORS: tuple[type[Exception], ...] = (*REPLY_ERRORS, OverflowError)
"""What mapping an unreadable hello raises where a check was missed: a ProtocolError."""


@dataclass(frozen=True, slots=True)
class Mapped:
    """The arena mapped, the presence filter (None when absent or unusable), the arena's
    path (engines share one map) and the HBM pool's info (None without one)."""

    arena: ArenaMapping
    presence: PresenceView | None
    arena_path: str
    hbm_info: dict[str, Any] | None


def mapped(reply: dict[str, Any], arena_fd: int | None = None,
           daemon_uid: int | None = None, presence_fd: int | None = None) -> Mapped:
    """Map the arena the hello announced (``arena_fd`` when the daemon passed one, taken
    over here) as a file of ``daemon_uid`` (default: ours), and the presence filter
    (``presence_fd``, taken over) when the daemon passed one. Both descriptors are closed
    when this raises."""
    try:
        version = reply.get("version")   # (bool is an int: True passed; found by review)
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise HandshakeError(f"daemon speaks protocol {version!r:.20}, client "
                                 f"{PROTOCOL_VERSION}")
        scheme = reply.get("key_scheme")   # (daemons before the scheme was announced: None)
        if scheme is not None and scheme != KEY_SCHEME:
            raise HandshakeError(
                f"the daemon ({brief(reply.get('server'))}) keys blocks with {brief(scheme)}, "
                f"this kvtier ({__version__}) with {KEY_SCHEME}: their blocks never match; "
                f"restart the daemon after upgrading kvtier, or run one version on both sides")
        arena = reply.get("arena")
        if not (isinstance(arena, dict) and isinstance(arena.get("path"), str)
                and "\x00" not in arena["path"] and type(arena.get("size")) is int
                and arena["size"] > 0):   # (a NUL byte, size True: found by review)
            raise ProtocolError(f"hello reply has no valid arena: {arena!r:.200}")
    except BaseException:
        for fd in (arena_fd, presence_fd):
            if fd is not None:
                os.close(fd)
        raise
    try:
        mapping = ArenaMapping(arena["path"], int(arena["size"]), fd=arena_fd,
                               owner_uid=daemon_uid)
    except BaseException:
        if presence_fd is not None:
            os.close(presence_fd)
        raise
    presence = None
    if presence_fd is not None:
        presence = open_presence(presence_fd, reply.get("presence"),
                                 os.getuid() if daemon_uid is None else daemon_uid)
    hbm = reply.get("hbm")
    return Mapped(mapping, presence, str(arena["path"]),
                  hbm if isinstance(hbm, dict) and hbm.get("handle") else None)


def open_presence(fd: int, announced: Any, daemon_uid: int) -> PresenceView | None:
    """The daemon's presence filter as a read-only view, or None (logged) when it is not
    what the daemon announced: the filter only spares round trips, so a client works
    without it (``fd`` is taken over either way)."""
    if not isinstance(announced, dict):
        os.close(fd)
        log.warning("not using the daemon's presence filter: announced as %r", announced)
        return None
    try:
        return PresenceView(fd, announced, daemon_uid)   # closes fd whatever happens
    except (KVTierError, OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("not using the daemon's presence filter: %s", exc)
        return None


def map_arena(ops: Ops, hello: Hello, path: str) -> None:
    """``ops.on_hello`` with the arena owned by the verified daemon uid; OSError (the file
    is gone) becomes DaemonUnavailable, an unreadable hello a ProtocolError (a NUL byte in
    the arena path escaped as ValueError; found by review)."""
    try:
        ops.on_hello(hello.reply, hello.arena_fd, hello.peer.uid, hello.presence_fd)
    except OSError as exc:
        raise DaemonUnavailable(f"cannot map the arena of the daemon at {path}: {exc}") from None
    except HELLO_ERRORS as exc:
        raise ProtocolError(f"cannot read the hello of the daemon at {path} "
                            f"({type(exc).__name__}: {exc!s:.80})") from None
