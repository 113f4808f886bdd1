"""The hello exchange of the control socket: version check, client identity, and the
arena handed over as a descriptor (SCM_RIGHTS) so a client maps the daemon's own file."""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier import __version__
from kvtier.daemon.ops import Connection
from kvtier.errors import HandshakeError, KVTierError
from kvtier.protocol import PROTOCOL_VERSION, SUPPORTED_VERSIONS, pack

log = logging.getLogger("kvtier.control")


@dataclass(slots=True)
class Greeter:
    """Answers a connection's first request. ``arena``: ``{"path", "size"}`` announced to
    every client; ``hbm``: the HBM pool's handshake info, when the daemon has one;
    ``open_arena``: a new descriptor of the arena per client (default: open the path)."""

    arena: dict[str, Any]
    hbm: dict[str, Any] | None = None
    open_arena: Callable[[], int] | None = field(default=None)

    async def greet(self, conn: Connection,
                    read: Callable[[], Awaitable[dict[str, Any] | None]],
                    writer: asyncio.StreamWriter) -> None:
        """Read the hello (``read``: the server's bounded frame reader) and reply to it."""
        msg = await read()
        if msg is None:
            raise ConnectionError("closed before hello")
        if msg.get("op") != "hello":
            raise HandshakeError("the first request must be 'hello'")
        version = msg.get("version")
        if type(version) is not int or version not in SUPPORTED_VERSIONS:
            raise HandshakeError(f"protocol version {version!r} not supported; this daemon "
                                 f"speaks {sorted(SUPPORTED_VERSIONS)}: upgrade the client")
        conn.client = str(msg.get("client", ""))[:64]
        conn.key_scheme = str(msg.get("key_scheme", ""))[:64]
        reply = {"id": msg.get("id", 0), "ok": True, "version": PROTOCOL_VERSION,
                 "server": f"kvtier/{__version__}", "conn": conn.id, "arena": self.arena}
        if self.hbm is not None:
            reply["hbm"] = self.hbm
        data = pack(reply)
        if msg.get("arena_fd") is True:
            data = data[self._send_with_arena_fd(writer, data):]
        if data:
            writer.write(data)
        await writer.drain()

    def _send_with_arena_fd(self, writer: asyncio.StreamWriter, data: bytes) -> int:
        """Send the start of the hello reply with the arena's descriptor (SCM_RIGHTS), so
        the client maps the daemon's own file and never a path someone could swap.

        The hello reply is the first thing written on the connection, so the transport's
        buffer is empty and a direct sendmsg keeps the byte order; the rest, if the kernel
        took only part, goes through the transport. Returns the bytes sent (0: nothing was
        sent, the client maps the path with its O_NOFOLLOW and fstat checks instead).
        """
        try:
            arena_fd = self.open_arena() if self.open_arena else self._open_by_path()
        except (OSError, KVTierError) as exc:
            log.warning("cannot open the arena %s to pass it: %s", self.arena["path"], exc)
            return 0
        try:
            raw = writer.get_extra_info("socket")
            with socket.socket(fileno=os.dup(raw.fileno())) as dup:
                return dup.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             array.array("i", [arena_fd]))])
        except BlockingIOError:
            return 0
        finally:
            os.close(arena_fd)

    def _open_by_path(self) -> int:
        return os.open(str(self.arena["path"]), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
