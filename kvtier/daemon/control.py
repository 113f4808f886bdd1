"""The control socket: a Unix socket (mode 0600, peer uid checked) speaking msgpack frames.

Each connection gets a bounded number of requests in flight; when the bound is reached
the daemon stops reading from that connection (backpressure through the socket buffer)
instead of queueing without limit. A malformed or oversized frame gets a typed error
reply and the connection is closed (a stream cannot be resynchronised after a bad
length); every other client keeps being served, and a closed connection's leases are
released at once. Work per request, per connection and in total is bounded
(``kvtier.daemon.limits``): every request gets an answer, a typed error when it broke a
limit or failed in any way (even when its reply cannot be encoded), and each error is
counted by code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.daemon.engines import EngineReports
from kvtier.daemon.exits import ExitWatcher
from kvtier.daemon.greeting import Greeter
from kvtier.daemon.heap import HeapTrim
from kvtier.daemon.inflight import InFlight
from kvtier.daemon.limits import (
    STREAM_LIMIT,
    ByteBudget,
    Charge,
    LimitCounters,
    Limits,
    ProcessShare,
    ProcessShares,
    read_request,
)
from kvtier.daemon.ops import Connection, ControlOps
from kvtier.daemon.prefix import PrefixProbe
from kvtier.daemon.redis_sync import RedisSync
from kvtier.daemon.replies import refuse, send_error
from kvtier.errors import (
    KVTierError,
    Overloaded,
    ProtocolError,
    StartupError,
    TrustError,
    brief,
)
from kvtier.lograte import LogRate
from kvtier.protocol import pack, request_id
from kvtier.store import TieredStore

log = logging.getLogger("kvtier.control")
_PEERCRED = struct.Struct("3i")


class ControlServer(ControlOps):
    """Serves the connector API of one daemon."""

    def __init__(self, store: TieredStore, socket_path: Path, *, max_frame: int,
                 max_inflight: int, arena_path: str, arena_size: int,
                 observe: Callable[[str, float], None] | None = None,
                 hbm: dict[str, Any] | None = None,
                 open_arena: Callable[[], int] | None = None,
                 limits: Limits | None = None) -> None:
        """``hbm``: the HBM pool's ``HbmTier.handshake_info()`` (handle, size, device,
        pci_bus_id) when the daemon has one; every hello reply then carries it, and clients
        that want device placement map the pool with it. ``open_arena``: a new descriptor of
        the arena for a client that asks for it (``Arena.open_for_client``; default: open
        ``arena_path``). ``limits``: see ``kvtier.daemon.limits`` (defaults with
        ``max_frame`` when not given)."""
        self.store = store
        self.socket_path = socket_path
        self.limits = limits if limits is not None else Limits(
            max_frame=max_frame, conn_pending_bytes=max_frame, total_pending_bytes=4 * max_frame,
            process_pending_bytes=2 * max_frame)
        self.max_frame = self.limits.max_frame
        self.pending = ByteBudget(self.limits.total_pending_bytes)
        self.heap = HeapTrim()   # large frames' memory back to the system once answered
        # per client process: its request bytes, and its requests in flight over all its
        # connections (as many as one connection may have)
        self.shares = ProcessShares(self.limits.process_pending_bytes, max_inflight)
        self.max_inflight = max_inflight
        # put_bytes: the most arena bytes one process may hold in open puts (its share):
        # a producer cuts a long prompt's save into pieces that fit it
        self.greeter = Greeter({"path": arena_path, "size": arena_size,
                                "put_bytes": self.limits.client_put_bytes or arena_size},
                               hbm, open_arena,
                               reply_timeout_s=self.limits.read_timeout_s)
        self.observe = observe
        self.warn = LogRate(log)   # peers' events, at most one line per kind per 10 s
        self.last_request = 0.0     # time.monotonic() of the last request (GcGuard)
        self.connections: dict[int, Connection] = {}
        self.orphans: dict[int, int] = {}
        self.exits = ExitWatcher(self.limits.dropped_writer_hold_s)
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._requests: set[asyncio.Task[None]] = set()   # every connection's, in flight
        self.rejected_peers = 0
        self.protocol_errors = 0
        self.counters = LimitCounters()
        self.engines = EngineReports()
        self.in_flight = InFlight()
        self._ops = self.op_table()
        self.prefix = PrefixProbe(store, self.limits)   # also serves POST /v1/prefix
        self.redis_sync = RedisSync(store)              # put_commit with redis_sync_s
        self.stats_provider: Callable[[], dict[str, Any]] = store.stats

    @property
    def hbm(self) -> dict[str, Any] | None:
        """The HBM pool's handshake info every hello reply carries (None: no pool)."""
        return self.greeter.hbm

    async def start(self) -> None:
        """Listen on the socket. Its directory was prepared and verified before (the
        daemon's preflight, kvtier.socket_path.prepare_socket_dir): nothing is created here."""
        old = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=str(self.socket_path), limit=STREAM_LIMIT,
                backlog=self.limits.listen_backlog)
        except OSError as exc:   # asyncio's errors do not name the path
            raise StartupError(f"cannot listen on the socket {self.socket_path}: "
                               f"{exc.strerror or exc}; pass --socket PATH in a directory "
                               "of yours") from exc
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)

    async def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 0.5)

    async def close_connections(self, timeout: float) -> None:
        """Let in-flight requests finish, and clients holding leases commit or release
        them (bounded by ``timeout``), then drop every connection: an idle client does
        not hold the stop for the whole bound."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while loop.time() < until and (self._requests or any(
                self.store.leases.count(c.id) for c in self.connections.values())):
            await asyncio.sleep(0.02)
        handlers = list(self._handlers)
        for t in handlers:
            t.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=1.0)
        self.exits.close()
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
        try:
            if uid != os.getuid():
                self.rejected_peers += 1
                self.warn.warning("other-uid", "rejected connection from uid %s (pid %s): "
                                  "not the daemon's user", uid, pid)
                await self._refuse_peer(reader, writer, uid)
                return
            if len(self.connections) >= self.limits.max_connections:
                await self._refuse(reader, writer)
                return
            conn = Connection(next(self._ids), pid, uid)
            if self.shares.users(conn.process) >= self.limits.max_connections_per_client:
                await self._refuse(reader, writer, pid)
                return
            self.connections[conn.id] = conn
            share = self.shares.open(conn.process)
            try:
                await self._converse(conn, reader, writer, share)
            except asyncio.CancelledError:
                # the daemon is stopping (close_connections): not this connection's error,
                # and asyncio's stream callback would log a cancelled handler as one
                pass
            finally:
                self.shares.close(conn.process)
                self._release(conn)
        finally:
            writer.close()
            if task is not None:
                self._handlers.discard(task)

    def _release(self, conn: Connection) -> None:
        """Take back a closed connection's leases. When the daemon closed it, the client
        may still be writing into its put slots: they stay quarantined until its process
        exits (kvtier.daemon.exits), counted against that process meanwhile. A request of
        the connection still running (past the bounded wait for them) voids any lease it
        opens later."""
        conn.released = True
        released = self.store.release_owner(conn.id, may_write=conn.dropped)
        if released:
            log.info("client %s (pid %s) left with %d open leases: released", conn.id,
                     conn.pid, released)
        self.connections.pop(conn.id, None)
        if conn.dropped and self.store.held_put_bytes(conn.id):
            log.info("client %s (pid %s) was dropped while it held slots for writing: they "
                     "stay quarantined until its process exits", conn.id, conn.pid)
            self.orphans[conn.id] = conn.process

            def exited(owner: int = conn.id) -> None:
                self.orphans.pop(owner, None)
                self.store.free_quarantine(owner)

            self.exits.watch(conn.pid, exited)

    async def _converse(self, conn: Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, share: ProcessShare) -> None:
        """Hello, then requests until the client leaves, breaks the protocol or idles out.
        ``share``: the request bytes its process may hold (``Limits.process_pending_bytes``)
        and its requests in flight over all its connections."""
        write_lock = asyncio.Lock()
        inflight = asyncio.Semaphore(self.max_inflight)
        held = ByteBudget(self.limits.conn_pending_bytes)
        tasks: set[asyncio.Task[None]] = set()

        def done(t: asyncio.Task[None], charge: Charge) -> None:
            tasks.discard(t)
            self._requests.discard(t)
            inflight.release()
            share.inflight.release()
            charge.release()
            self.heap.after(charge.nbytes)

        try:
            await self.greeter.greet(conn, functools.partial(self._read, reader, share.budget),
                                     writer)
            while True:
                # not idle while it holds slots for writing: dropping it would not stop it
                frame = await read_request(
                    reader, self.limits, self.pending, self.counters, held,
                    busy=lambda: bool(tasks) or self.store.held_put_bytes(conn.id) > 0,
                    process=share.budget)
                if frame is None:
                    break
                msg, charge = frame
                try:
                    await inflight.acquire()
                    try:
                        await share.inflight.acquire()
                    except BaseException:
                        inflight.release()
                        raise
                except BaseException:
                    charge.release()
                    raise
                t = asyncio.ensure_future(self._dispatch(conn, msg, writer, write_lock))
                del frame, msg   # (held here until the next frame, a 16 MB one outlived
                #                  its answer and every heap trim)
                tasks.add(t)
                self._requests.add(t)
                t.add_done_callback(functools.partial(done, charge=charge))
        except KVTierError as exc:  # a bad frame, a broken limit: answer, then close
            conn.dropped = True
            if isinstance(exc, ProtocolError):
                self.protocol_errors += 1
            self._count(exc.code)
            self.warn.warning("client-error", "client %s (pid %s): %s; closing its connection",
                              conn.id, conn.pid, exc)
            await send_error(writer, write_lock, exc.code, str(exc), self.limits.read_timeout_s)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except TimeoutError:   # the hello's reply left unread (Greeter.reply_timeout_s)
            self.counters.dropped_slow += 1
            conn.dropped = True
            self.warn.warning("slow-hello", "client %s leaves its hello reply unread", conn.id)
            writer.transport.abort()
        except Exception as exc:  # a bug here must not leave the client waiting for nothing
            conn.dropped = True
            log.exception("connection of client %s failed", conn.id)
            self._count("internal")
            await send_error(writer, write_lock, "internal",
                             f"internal error: {exc.__class__.__name__}",
                             self.limits.read_timeout_s)
        finally:
            if tasks:
                await asyncio.wait(list(tasks), timeout=5.0)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      pid: int | None = None) -> None:
        """Beyond max_connections (or, with ``pid``, beyond the connections one process may
        hold): a typed refusal, read what the client sent, then close."""
        refused = self.counters.refused_connections = self.counters.refused_connections + 1
        self._count(Overloaded.code)
        if pid is None:
            limit, setting = self.limits.max_connections, "daemon.max_connections"
            error = (f"the daemon already serves its limit of {limit} connections "
                     f"({setting}): retry later")
        else:
            limit, setting = (self.limits.max_connections_per_client,
                              "daemon.max_connections_per_client")
            error = (f"process {pid} already holds its limit of {limit} connections to the "
                     f"daemon ({setting}): close the ones it does not use")
        if refused in (1, 10, 100) or refused % 1000 == 0:
            log.warning("refused %d connections so far: %d open is the limit (%s)", refused,
                        limit, setting)
        await refuse(reader, writer, Overloaded.code, error, self.limits.read_timeout_s)

    async def _refuse_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           uid: int) -> None:
        """Another user's process: told why in one typed reply (it got "connection dropped
        during the hello" before), nothing else, then closed."""
        await refuse(reader, writer, TrustError.code,
                     f"the kvtier daemon at {self.socket_path} runs as uid {os.getuid()} and "
                     f"serves only that user's processes, not uid {uid}: run the engine as "
                     f"uid {os.getuid()}, or start a daemon of your own (`kvtier serve "
                     "--socket PATH`)", self.limits.read_timeout_s)

    def _count(self, code: str) -> None:
        self.counters.errors[code] = self.counters.errors.get(code, 0) + 1

    async def _read(self, reader: asyncio.StreamReader,
                    share: ByteBudget | None = None) -> dict[str, Any] | None:
        """One frame before the hello is answered; its bytes are let go at once."""
        frame = await read_request(reader, self.limits, self.pending, self.counters,
                                   process=share)
        if frame is None:
            return None
        msg, charge = frame
        charge.release()
        return msg

    async def _dispatch(self, conn: Connection, msg: dict[str, Any],
                        writer: asyncio.StreamWriter, lock: asyncio.Lock) -> None:
        rid = request_id(msg)
        op = msg.get("op")
        t0 = time.perf_counter()
        self.last_request = time.monotonic()
        try:
            if rid == 0 and msg.get("id", 0) != 0:
                raise ProtocolError("the request id must be an int")
            handler = self._ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ProtocolError(f"unknown op {brief(op)}")
            reply = await handler(conn, msg)
            reply["id"] = rid
            reply["ok"] = True
        except KVTierError as exc:
            self._count(exc.code)
            reply = {"id": rid, "ok": False, "code": exc.code, "error": str(exc)}
        except Exception as exc:  # a bug must not take the daemon down for everyone
            log.exception("op %s from client %s failed", brief(op), conn.id)
            self._count("internal")
            reply = {"id": rid, "ok": False, "code": "internal",
                     "error": f"internal error: {exc.__class__.__name__}"}
        if self.observe is not None and isinstance(op, str) and op in self._ops:
            self.observe(op, time.perf_counter() - t0)
        try:
            data = pack(reply)
        except Exception as exc:  # e.g. an int beyond 64 bits derived from the request
            log.warning("the reply to %s from client %s cannot be encoded: %s", brief(op),
                        conn.id, exc)
            self._count("internal")
            data = pack({"id": rid, "ok": False, "code": "internal",
                         "error": f"the reply to {brief(op)} cannot be encoded "
                                  f"({exc.__class__.__name__}): a request value is out of "
                                  "range"})
        try:
            async with lock:
                writer.write(data)
                # the write went out at once unless the client leaves replies unread: only
                # then is there something to wait for (a timeout per reply costs a timer)
                if writer.transport.get_write_buffer_size():
                    async with asyncio.timeout(self.limits.read_timeout_s):
                        await writer.drain()
        except TimeoutError:  # replies pile up unread: the client is stuck or hostile
            self.counters.dropped_slow += 1
            self.warn.warning("slow-reader", "client %s does not read its replies: dropping it",
                              conn.id)
            conn.dropped = True
            writer.transport.abort()
        except (ConnectionError, RuntimeError):
            pass

    def limit_stats(self) -> dict[str, Any]:
        """What the limits did: error replies by code, refused and dropped connections."""
        c = self.counters
        return {"errors": dict(c.errors), "refused_connections": c.refused_connections,
                "dropped_idle": c.dropped_idle, "dropped_slow": c.dropped_slow,
                "capped_puts": c.capped_puts, "capped_gets": c.capped_gets,
                "refused_leases": c.refused_leases,
                "dropped_writers": len(self.orphans),
                "pending_request_bytes": self.pending.used,
                "namespaces_evicted": self.store.namespaces_evicted,
                "redis_sync": self.redis_sync.stats()}

