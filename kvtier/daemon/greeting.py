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
from kvtier.errors import HandshakeError, KVTierError, brief
from kvtier.keys import KEY_SCHEME
from kvtier.protocol import PROTOCOL_VERSION, SUPPORTED_VERSIONS, pack, request_id

log = logging.getLogger("kvtier.control")


@dataclass(slots=True)
class Greeter:
    """Answers a connection's first request. ``arena``: ``{"path", "size"}`` announced to
    every client; ``hbm``: the HBM pool's handshake info, when the daemon has one;
    ``open_arena``: a new descriptor of the arena per client (default: open the path);
    ``presence``: the presence filter's announcement and a new read-only descriptor of it
    per client (kvtier.presence), passed after the arena's to clients that ask."""

    arena: dict[str, Any]
    hbm: dict[str, Any] | None = None
    open_arena: Callable[[], int] | None = field(default=None)
    presence: tuple[dict[str, Any], Callable[[], int]] | None = None
    # the reply's drain, as every later reply's (daemon.read_timeout_s): a client that never
    # reads it held the connection and the reply forever (found by review)
    reply_timeout_s: float = 10.0

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
            raise HandshakeError(f"protocol version {brief(version)} not supported; this daemon "
                                 f"speaks {sorted(SUPPORTED_VERSIONS)}: upgrade the client")
        conn.client = _label(msg.get("client", ""))
        conn.key_scheme = _label(msg.get("key_scheme", ""))
        # only an int id is echoed (request_id): any other value, say 16 MiB of bytes, would
        # be held in the reply for as long as the client does not read it (found by review)
        reply = {"id": request_id(msg), "ok": True, "version": PROTOCOL_VERSION,
                 "server": f"kvtier/{__version__}", "key_scheme": KEY_SCHEME, "conn": conn.id,
                 "arena": self.arena}
        if self.hbm is not None:
            reply["hbm"] = self.hbm
        fds = self._descriptors(msg, reply)
        try:
            data = pack(reply)
            if fds:
                data = data[self._send_with_fds(writer, data, fds):]
        finally:
            for fd in fds:
                os.close(fd)
        if data:
            writer.write(data)
        async with asyncio.timeout(self.reply_timeout_s):
            await writer.drain()

    def _descriptors(self, msg: dict[str, Any], reply: dict[str, Any]) -> list[int]:
        """The descriptors to pass with the reply: the arena's when asked, then the
        presence filter's when asked too (announced in ``reply``). None that fails to open
        is fatal: the client maps the arena by path, and works without the filter."""
        if msg.get("arena_fd") is not True:
            return []
        try:
            fds = [self.open_arena() if self.open_arena else self._open_by_path()]
        except (OSError, KVTierError) as exc:
            log.warning("cannot open the arena %s to pass it: %s", self.arena["path"], exc)
            return []
        if msg.get("presence_fd") is True and self.presence is not None:
            announced, open_presence = self.presence
            try:
                fds.append(open_presence())
                reply["presence"] = announced
            except OSError as exc:
                log.warning("cannot open the presence filter to pass it: %s", exc)
        return fds

    @staticmethod
    def _send_with_fds(writer: asyncio.StreamWriter, data: bytes, fds: list[int]) -> int:
        """Send the start of the hello reply with the descriptors (SCM_RIGHTS), so the
        client maps the daemon's own files and never a path someone could swap.

        The hello reply is the first thing written on the connection, so the transport's
        buffer is empty and a direct sendmsg keeps the byte order; the rest, if the kernel
        took only part, goes through the transport. Returns the bytes sent (0: nothing was
        sent, the client maps the arena's path with its O_NOFOLLOW and fstat checks instead).
        """
        try:
            raw = writer.get_extra_info("socket")
            with socket.socket(fileno=os.dup(raw.fileno())) as dup:
                return dup.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             array.array("i", fds))])
        except BlockingIOError:
            return 0

    def _open_by_path(self) -> int:
        return os.open(str(self.arena["path"]), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)


def _label(value: object) -> str:
    """A client's self-description (``client``, ``key_scheme``) for logs: 64 characters."""
    return value[:64] if isinstance(value, str) else brief(value)
