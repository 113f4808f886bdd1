"""The control server's error replies outside a request: a connection refused, a connection
closed for a broken rule. Each is one typed frame (``id`` 0), sent within a bound, never
raising: the connection is about to close either way."""

from __future__ import annotations

import asyncio
import contextlib

from kvtier.daemon.limits import STREAM_LIMIT
from kvtier.protocol import pack


async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, code: str,
                 error: str, timeout_s: float) -> None:
    """One typed reply to a connection the daemon will not serve, then the end; what the
    client sent is read first (the hello lands before we close: no EPIPE)."""
    with contextlib.suppress(Exception):
        writer.write(pack({"id": 0, "ok": False, "code": code, "error": error}))
        writer.write_eof()
        async with asyncio.timeout(min(1.0, timeout_s)):
            await writer.drain()
            await reader.read(STREAM_LIMIT)


async def send_error(writer: asyncio.StreamWriter, lock: asyncio.Lock, code: str, error: str,
                     timeout_s: float) -> None:
    """A typed error for the whole connection, written after any reply being written."""
    with contextlib.suppress(Exception):
        async with lock:
            writer.write(pack({"id": 0, "ok": False, "code": code, "error": error}))
            async with asyncio.timeout(timeout_s):
                await writer.drain()
