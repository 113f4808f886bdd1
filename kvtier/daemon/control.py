"""The control socket: a Unix socket (mode 0600, peer uid checked) speaking msgpack frames.

Each connection gets a bounded number of requests in flight; when the bound is reached
the daemon stops reading from that connection (backpressure through the socket buffer)
instead of queueing without limit. A malformed or oversized frame gets a typed error
reply and the connection is closed (a stream cannot be resynchronised after a bad
length); every other client keeps being served, and a closed connection's leases are
released at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier import __version__
from kvtier.errors import HandshakeError, KVTierError, ProtocolError
from kvtier.layout import KVLayout
from kvtier.protocol import (
    LENGTH,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    check_length,
    pack,
    unpack_body,
)
from kvtier.protocol import (
    field as req_field,
)
from kvtier.store import TieredStore

log = logging.getLogger("kvtier.control")
CONNECTOR_COUNTERS = ("skipped_slower_than_recompute", "skipped_tokens_slower_than_recompute",
                      "dropped_saves", "dropped_save_bytes", "saves_in_flight_bytes",
                      "loaded_blocks", "saved_blocks", "prefill_tokens_per_s")
"""Counters the vLLM connector reports through ``report_engine`` (issue 11)."""
_PEERCRED = struct.Struct("3i")


@dataclass(slots=True)
class Connection:
    id: int
    pid: int
    uid: int
    client: str = ""
    engine: dict[str, float] = field(default_factory=dict)


class ControlServer:
    """Serves the connector API of one daemon."""

    def __init__(self, store: TieredStore, socket_path: Path, *, max_frame: int,
                 max_inflight: int, arena_path: str, arena_size: int,
                 observe: Callable[[str, float], None] | None = None,
                 hbm: dict[str, Any] | None = None) -> None:
        """``hbm``: the HBM pool's ``HbmTier.handshake_info()`` (handle, size, device,
        pci_bus_id) when the daemon has one; every hello reply then carries it, and clients
        that want device placement map the pool with it."""
        self.store = store
        self.socket_path = socket_path
        self.max_frame = max_frame
        self.max_inflight = max_inflight
        self.arena = {"path": arena_path, "size": arena_size}
        self.hbm = hbm
        self.observe = observe
        self.connections: dict[int, Connection] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self.rejected_peers = 0
        self.protocol_errors = 0
        self._ops: dict[str, Callable[[Connection, dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "ping": self._ping,
            "register_layout": self._register_layout,
            "lookup": self._lookup,
            "put_prepare": self._put_prepare,
            "put_commit": self._put_commit,
            "put_abort": self._put_abort,
            "get_prepare": self._get_prepare,
            "get_release": self._get_release,
            "delete": self._delete,
            "stats": self._stats,
            "report_engine": self._report_engine,
        }
        self.stats_provider: Callable[[], dict[str, Any]] = store.stats

    async def start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        old = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=str(self.socket_path), limit=self.max_frame + 1024)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)

    async def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 0.5)

    async def close_connections(self, timeout: float) -> None:
        """Let in-flight requests finish (bounded), then drop connections."""
        if self._handlers:
            _done, pending = await asyncio.wait(list(self._handlers), timeout=timeout)
            for t in pending:
                t.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    # -- connection loop -----------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        sock: socket.socket = writer.get_extra_info("socket")
        try:
            pid, uid, _gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            pid, uid = -1, -1
        if uid != os.getuid():
            self.rejected_peers += 1
            log.warning("rejected connection from uid %s (pid %s): not the daemon's user",
                        uid, pid)
            writer.close()
            if task is not None:
                self._handlers.discard(task)
            return
        conn = Connection(next(self._ids), pid, uid)
        self.connections[conn.id] = conn
        write_lock = asyncio.Lock()
        inflight = asyncio.Semaphore(self.max_inflight)
        tasks: set[asyncio.Task[None]] = set()
        try:
            await self._handshake(conn, reader, writer)
            while True:
                msg = await self._read(reader)
                if msg is None:
                    break
                await inflight.acquire()
                t = asyncio.ensure_future(self._dispatch(conn, msg, writer, write_lock))
                tasks.add(t)
                t.add_done_callback(lambda t: (tasks.discard(t), inflight.release()))
        except ProtocolError as exc:
            self.protocol_errors += 1
            log.warning("client %s (pid %s): %s; closing its connection", conn.id, conn.pid,
                        exc)
            with contextlib.suppress(Exception):
                async with write_lock:
                    writer.write(pack({"id": 0, "ok": False, "code": exc.code,
                                       "error": str(exc)}))
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if tasks:
                await asyncio.wait(list(tasks), timeout=5.0)
            released = self.store.release_owner(conn.id)
            if released:
                log.info("client %s (pid %s) left with %d open leases: released", conn.id,
                         conn.pid, released)
            self.connections.pop(conn.id, None)
            writer.close()
            if task is not None:
                self._handlers.discard(task)

    async def _read(self, reader: asyncio.StreamReader) -> dict[str, Any] | None:
        try:
            head = await reader.readexactly(LENGTH.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ProtocolError("connection closed inside a frame header") from None
            return None
        (n,) = LENGTH.unpack(head)
        check_length(n, self.max_frame)
        try:
            body = await reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise ProtocolError("connection closed inside a frame") from None
        return unpack_body(body, self.max_frame)

    async def _handshake(self, conn: Connection, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        msg = await self._read(reader)
        if msg is None:
            raise ConnectionError("closed before hello")
        if msg.get("op") != "hello":
            raise HandshakeError("the first request must be 'hello'")
        version = msg.get("version")
        if version not in SUPPORTED_VERSIONS:
            raise HandshakeError(f"protocol version {version!r} not supported; this daemon "
                                 f"speaks {sorted(SUPPORTED_VERSIONS)}: upgrade the client")
        conn.client = str(msg.get("client", ""))[:64]
        reply = {"id": msg.get("id", 0), "ok": True, "version": PROTOCOL_VERSION,
                 "server": f"kvtier/{__version__}", "conn": conn.id, "arena": self.arena}
        if self.hbm is not None:
            reply["hbm"] = self.hbm
        writer.write(pack(reply))
        await writer.drain()

    async def _dispatch(self, conn: Connection, msg: dict[str, Any],
                        writer: asyncio.StreamWriter, lock: asyncio.Lock) -> None:
        rid = msg.get("id", 0)
        op = msg.get("op")
        t0 = time.perf_counter()
        try:
            handler = self._ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ProtocolError(f"unknown op {op!r}")
            reply = await handler(conn, msg)
            reply["id"] = rid
            reply["ok"] = True
        except KVTierError as exc:
            reply = {"id": rid, "ok": False, "code": exc.code, "error": str(exc)}
        except Exception as exc:  # a bug must not take the daemon down for everyone
            log.exception("op %s from client %s failed", op, conn.id)
            reply = {"id": rid, "ok": False, "code": "internal",
                     "error": f"internal error: {exc.__class__.__name__}"}
        if self.observe is not None and isinstance(op, str) and op in self._ops:
            self.observe(op, time.perf_counter() - t0)
        try:
            async with lock:
                writer.write(pack(reply))
                await writer.drain()
        except (ConnectionError, RuntimeError):
            pass

    # -- ops -----------------------------------------------------------------------------
    async def _ping(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        return {}

    def _target(self, msg: dict[str, Any]) -> tuple[bytes, int, list[bytes]]:
        ns = req_field(msg, "ns", bytes)
        fp = req_field(msg, "layout_fp", int)
        keys = self.store.split_keys(req_field(msg, "keys", bytes))
        return ns, fp, keys

    async def _register_layout(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        layout = KVLayout.from_dict(req_field(msg, "layout", dict))
        salt = msg.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ProtocolError("cache_salt must be a string or nil")
        ns = self.store.register_namespace(
            layout, req_field(msg, "model_id", str), int(msg.get("tp_rank", 0)),
            int(msg.get("tp_size", 1)), salt)
        return {"ns": ns.digest, "layout_fp": layout.fingerprint,
                "block_bytes": layout.block_bytes}

    async def _lookup(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        ns, fp, keys = self._target(msg)
        res = await self.store.lookup(ns, fp, keys, prefetch=bool(msg.get("prefetch", True)))
        reply: dict[str, Any] = {"hits": res.hits, "tiers": res.tiers}
        bandwidth = getattr(self.store, "bandwidth", None)
        if bandwidth is not None:   # additive: reload bytes/s per tier, for "never slower
            reply["bandwidth"] = bandwidth.reload_bandwidth()  # than recompute" (issue 11)
        return reply

    async def _put_prepare(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        ns, fp, keys = self._target(msg)
        parent = msg.get("parent")
        if parent is not None and not (isinstance(parent, bytes) and len(parent) == 16):
            raise ProtocolError("parent must be a 16-byte key or nil")
        depth = msg.get("depth", 0)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ProtocolError("depth must be a non-negative int")
        lease, offsets = await self.store.prepare_put(conn.id, ns, fp, keys, parent=parent,
                                                      depth=depth)
        return {"lease": lease, "offsets": offsets}

    async def _put_commit(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        out = msg.get("output_tokens")
        if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 0):
            raise ProtocolError("output_tokens must be a non-negative int or nil")
        stored = await self.store.commit_put(conn.id, req_field(msg, "lease", int),
                                             durable=bool(msg.get("durable", False)),
                                             output_tokens=out)
        return {"stored": stored}

    async def _put_abort(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        self.store.abort_put(conn.id, req_field(msg, "lease", int))
        return {}

    async def _get_prepare(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        """Read-locked slots; with ``device: true`` (a client that mapped the HBM pool) the
        reply adds ``devices``, "hbm" or "cpu" per offset."""
        ns, fp, keys = self._target(msg)
        if msg.get("device") is True:
            lease, offsets, devices = await self.store.prepare_get_device(conn.id, ns, fp, keys)
            return {"lease": lease, "offsets": offsets, "devices": devices}
        lease, offsets = await self.store.prepare_get(conn.id, ns, fp, keys)
        return {"lease": lease, "offsets": offsets}

    async def _get_release(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        copy_s = msg.get("copy_s")   # optional: the client's own copy time (issue 11)
        if not isinstance(copy_s, (int, float)) or isinstance(copy_s, bool) or copy_s < 0:
            copy_s = None
        self.store.release_get(conn.id, req_field(msg, "lease", int), copy_s=copy_s)
        return {}

    async def _delete(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        ns, fp, keys = self._target(msg)
        return {"deleted": await self.store.delete(ns, fp, keys)}

    async def _stats(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        return {"stats": self.stats_provider()}

    async def _report_engine(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        allowed = ("running", "waiting", "preemptions", "context_tokens_p50",
                   "context_tokens_p99", "requests_finished", "load_errors",
                   *CONNECTOR_COUNTERS)
        for name in allowed:
            value = msg.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                conn.engine[name] = float(value)
        return {}

    def engine_summary(self) -> dict[str, float]:
        """Connector-side gauges summed over connected engines."""
        out: dict[str, float] = {"engines": 0}
        for conn in self.connections.values():
            if not conn.engine:
                continue
            out["engines"] += 1
            for k, v in conn.engine.items():
                if k.startswith("context_tokens"):
                    out[k] = max(out.get(k, 0.0), v)
                else:
                    out[k] = out.get(k, 0.0) + v
        return out
