"""The asyncio client: drives the sans-I/O ops (kvtier.client.ops) over asyncio streams.

Several coroutines may share one client: replies are matched to requests by id. The
client's ``timeout`` bounds each call whole, the send included: a daemon that stopped
reading (SIGSTOP, a hung loop) fills the socket's buffer, and a send that cannot finish in
time leaves the connection unusable (a frame may be half sent). ``close`` is bounded too.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import select
import socket
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.client import forks
from kvtier.client.hello import map_arena
from kvtier.client.leases import AsyncGetLease, AsyncPutLease
from kvtier.client.ops import (
    HANGUP,
    MAX_REPLY,
    LookupResult,
    NoWait,
    Op,
    Ops,
    Settle,
)
from kvtier.client.replies import SMALL_REQUEST, ReplyBound, decode_reply
from kvtier.config import default_socket_path, trusted_daemon_uids
from kvtier.errors import (
    ClientForked,
    DaemonUnavailable,
    KVTierError,
    ProtocolError,
    RequestTimeout,
)
from kvtier.handshake import Hello, open_verified
from kvtier.keys import BlockKey, Namespace
from kvtier.layout import KVLayout
from kvtier.prefix import PrefixLocality
from kvtier.protocol import LENGTH, pack

# The op that ends the lease each kind of prepare grants.
_LEASE_ENDS = {"get_prepare": "get_release", "put_prepare": "put_abort"}
MAX_LATE_LEASES = 256
MAX_ABANDONED = 4096   # late replies of requests given up on, still known (then: oldest out)


class AsyncKVTierClient:
    """asyncio client; several coroutines may issue requests concurrently."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout: float, *, device: bool = False) -> None:
        self._reader, self._writer, self._timeout = reader, writer, timeout
        self._ids = itertools.count(1)
        self._ops = Ops(device)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader_task: asyncio.Task[None] | None = None
        self._broken: KVTierError | None = None
        self._late = 0   # replies awaited only to end their lease (``_end_when_granted``)
        self._owed: set[asyncio.Future[dict[str, Any]]] = set()   # replies of NoWait sends
        self._abandoned: dict[int, None] = {}   # ids given up on, oldest first
        self._bound = SMALL_REQUEST   # what a reply may hold: the widest request's bound
        self._pid = forks.track(self)   # a forked child must connect again

    def _forked(self) -> None:
        """In a forked child (kvtier.client.forks): every later call raises."""
        self._broken = forks.forked_error(self._pid)

    async def _start(self, hello: Hello, path: str) -> None:
        """Map the arena of the handshake ``connect_async`` did, then start reading."""
        map_arena(self._ops, hello, path)
        self._reader_task = asyncio.ensure_future(self._read_loop())

    # transport
    async def _read_loop(self) -> None:
        """Hand each reply (decoded within ``_bound``) to its request; id 0, an error
        about the whole connection, to all of them, and the connection ends. A reply no
        request awaits, nor a late one given up on (``_abandoned``), is a ProtocolError
        ending the connection, as in the sync client: unsolicited frames were decoded and
        dropped, two of 8 MiB stalling the loop 7.6 s (found by review)."""
        try:
            while True:
                (n,) = LENGTH.unpack(await self._reader.readexactly(LENGTH.size))
                if n > MAX_REPLY:
                    raise ProtocolError(f"reply of {n} bytes is too large")
                reply = decode_reply(await self._reader.readexactly(n), self._bound)
                rid = reply.get("id", 0)
                if type(rid) is not int:
                    raise ProtocolError(f"daemon sent a reply with id {rid!r:.20}")
                if rid == 0:
                    for waiting in list(self._pending.values()):
                        if not waiting.done():
                            waiting.set_result(reply)
                    raise ConnectionError(f"the daemon ended it: {reply.get('code')!r:.40}: "
                                          f"{reply.get('error')!r:.200}")
                fut = self._pending.get(rid)
                if fut is not None:
                    if not fut.done():
                        fut.set_result(reply)
                elif rid in self._abandoned:   # the late reply of a request given up on
                    del self._abandoned[rid]
                else:
                    raise ProtocolError(f"daemon sent a reply to request {rid}, which "
                                        "no request awaits")
        except Exception as exc:   # whatever ends the reading ends the connection's use
            if not isinstance(self._broken, ClientForked):
                self._broken = DaemonUnavailable(f"daemon connection lost: {exc}")
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(self._broken)

    async def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        if self._broken is not None:
            raise self._broken
        rid = next(self._ids)
        req["id"] = rid
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[rid] = fut
        self._bound = self._bound.wider(ReplyBound.of(req))
        deadline = loop.time() + self._timeout   # the send and the reply: one deadline
        try:
            self._writer.write(pack(req))   # sent before the first await: a cancel is later
            await self._drain(req, deadline)
            reply = await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            self._give_up(rid, req)
            raise RequestTimeout(f"no reply to {req.get('op')} within {self._timeout}s") from None
        except asyncio.CancelledError:
            self._give_up(rid, req)
            raise
        except OSError as exc:
            raise DaemonUnavailable(f"daemon connection lost: {exc}") from None
        finally:
            if self._pending.get(rid) is fut:
                del self._pending[rid]
        return Ops.check_reply(reply)

    async def _drain(self, req: dict[str, Any], deadline: float) -> None:
        """Wait until the transport has taken the frame just written, until ``deadline``
        (``loop.time()``). Past it: RequestTimeout, and the connection is unusable from
        then on (``_broken``), since the frame may be half sent and the rest would go
        whenever the daemon reads again."""
        transport = self._writer.transport
        if not transport.get_write_buffer_size():
            await self._writer.drain()   # nothing buffered: returns at once
            return
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            await asyncio.wait_for(self._writer.drain(), remaining)
        except asyncio.TimeoutError:
            self._broken = DaemonUnavailable(
                f"connection unusable: a {req.get('op')} request could not be sent within "
                f"{self._timeout}s (the daemon is not reading); close it and connect again")
            raise RequestTimeout(f"could not send {req.get('op')} within {self._timeout}s: "
                                 "the daemon is not reading") from None

    def _give_up(self, rid: int, req: dict[str, Any]) -> None:
        """Request ``rid`` is no longer awaited: its late reply ends its lease
        (``_end_when_granted``) or is skipped when it comes (``_abandoned``)."""
        fut = self._pending.get(rid)
        if self._end_when_granted(rid, req) or (
                fut is not None and fut.done() and not fut.cancelled()):
            return   # (a reply that came as the wait ended is not awaited again)
        self._abandoned[rid] = None
        if len(self._abandoned) > MAX_ABANDONED:
            del self._abandoned[next(iter(self._abandoned))]

    def _end_when_granted(self, rid: int, req: dict[str, Any]) -> bool:
        """A lease asked for by a call that gave up waiting (cancelled, or past the timeout)
        is ended as soon as its reply comes: its caller never learns the lease, so nobody
        else would release the pins or abort the put before the lease's TTL. At most
        ``MAX_LATE_LEASES`` such replies are awaited at once (past that, the TTL ends them)."""
        end = _LEASE_ENDS.get(req.get("op", ""))
        if end is None or self._broken is not None or self._late >= MAX_LATE_LEASES:
            return False
        late: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._late += 1

        def ended(f: asyncio.Future[dict[str, Any]]) -> None:
            self._late -= 1
            self._pending.pop(rid, None)
            if f.cancelled() or f.exception() is not None or self._broken is not None:
                return   # no lease, or the connection is gone and the daemon ends it
            lease = f.result().get("lease")
            if type(lease) is int:
                end_id = next(self._ids)
                self._owe(end_id)   # nobody awaits its reply; a delete waits for it
                try:
                    self._writer.write(pack({"op": end, "lease": lease, "id": end_id}))
                except Exception:   # not sent (the connection is going): nothing owed
                    self._pending[end_id].cancel()

        late.add_done_callback(ended)
        self._pending[rid] = late
        return True

    async def _send_nowait(self, req: dict[str, Any]) -> dict[str, Any]:
        """``KVTierClient._send_nowait`` over asyncio: the reply, when it comes, matches no
        pending request and is dropped by the read loop."""
        sock = self._writer.get_extra_info("socket")
        if self._broken is not None or sock is None or self._reader.at_eof() or \
                _hung_up(sock.fileno()):
            return await self._call(req)
        rid = req["id"] = next(self._ids)
        self._owe(rid)
        self._bound = self._bound.wider(ReplyBound.of(req))
        deadline = asyncio.get_running_loop().time() + self._timeout
        try:
            self._writer.write(pack(req))
            await self._drain(req, deadline)
        except OSError as exc:
            raise DaemonUnavailable(f"daemon connection lost: {exc}") from None
        return {}

    def _owe(self, rid: int) -> None:
        """Expect the reply of request ``rid``, sent NoWait: nobody awaits it, but
        ``_settle`` waits until it came."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._owed.add(fut)
        fut.add_done_callback(functools.partial(self._paid, rid))

    def _paid(self, rid: int, fut: asyncio.Future[dict[str, Any]]) -> None:
        self._owed.discard(fut)
        if self._pending.get(rid) is fut:
            del self._pending[rid]
        if not fut.cancelled():
            fut.exception()   # retrieved: a lost connection is not an unawaited error

    async def _settle(self) -> dict[str, Any]:
        """Wait for the replies still owed to requests sent NoWait (``Settle``), within
        the timeout (RequestTimeout past it; the connection stays usable)."""
        if self._broken is not None:
            raise self._broken
        if self._owed:
            _, late = await asyncio.wait(list(self._owed), timeout=self._timeout)
            if late:
                raise RequestTimeout(f"no reply to {len(late)} earlier request(s) sent "
                                     f"without waiting within {self._timeout}s")
        return {}

    async def _run(self, op: Op) -> Any:
        """``KVTierClient._run`` over asyncio: the same driving of ``op``, awaiting each
        reply."""
        try:
            req = next(op)
            while True:
                try:
                    if isinstance(req, NoWait):
                        reply = await self._send_nowait(req.req)
                    elif isinstance(req, Settle):
                        reply = await self._settle()
                    else:
                        reply = await self._call(req)
                except KVTierError as exc:
                    req = op.throw(exc)
                else:
                    req = op.send(reply)
        except StopIteration as stop:
            return stop.value

    # API (each method is the KVTierClient method of that name as a coroutine)
    async def register_layout(self, layout: KVLayout, model_id: str, *, tp_rank: int = 0,
                              tp_size: int = 1, cache_salt: str | None = None) -> Namespace:
        return await self._run(self._ops.op_register(layout, model_id, tp_rank, tp_size,
                                                     cache_salt))

    async def lookup(self, ns: Namespace, keys: Sequence[BlockKey], *,
                     prefetch: bool = True) -> LookupResult:
        return await self._run(self._ops.op_lookup(ns, keys, prefetch))

    async def prepare_put(self, ns: Namespace, keys: Sequence[BlockKey], *,
                          parent: BlockKey | None = None,
                          start_depth: int = 0) -> AsyncPutLease:
        return AsyncPutLease(self, *await self._run(self._ops.op_prepare_put(
            ns, keys, parent, start_depth)))

    async def prepare_get(self, ns: Namespace, keys: Sequence[BlockKey], *,
                          prefer_device: bool | None = None) -> AsyncGetLease:
        return AsyncGetLease(self, *await self._run(self._ops.op_prepare_get(ns, keys,
                                                                             prefer_device)))

    @property
    def hbm_info(self) -> dict[str, Any] | None:
        return self._ops.hbm_info

    @property
    def put_bytes(self) -> int:
        return self._ops.put_bytes

    @property
    def hbm_mapped(self) -> bool:
        return self._ops.hbm is not None

    async def put(self, ns: Namespace, keys: Sequence[BlockKey], buffers: Sequence[Any], *,
                  durable: bool = False, output_tokens: int | None = None) -> int:
        return await self._run(self._ops.op_put(ns, keys, buffers, durable, output_tokens))

    async def get(self, ns: Namespace, keys: Sequence[BlockKey],
                  out_buffers: Sequence[Any]) -> int:
        """``KVTierClient.get`` as a coroutine (``LeaseExpired`` rule included)."""
        return await self._run(self._ops.op_get(ns, keys, out_buffers))

    async def delete(self, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        return await self._run(self._ops.op_delete(ns, keys))

    async def prefix_locality(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, *,
                              redis: bool = True) -> PrefixLocality:
        return (await self._run(self._ops.op_prefix(ns, [token_ids], redis, False)))[0]

    async def prefix_locality_batch(self, ns: Namespace,
                                    prompts: Sequence[Sequence[int] | np.ndarray], *,
                                    redis: bool = True) -> list[PrefixLocality]:
        return await self._run(self._ops.op_prefix(ns, prompts, redis, True))

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._ops.op_stats())

    async def report_engine(self, *, engine_id: str | None = None,
                            **values: float) -> None:
        await self._run(self._ops.op_report(values, engine_id))

    async def close(self) -> None:
        """Close the connection (its leases end), within the timeout: a transport with
        data still buffered (a daemon that stopped reading) is aborted, not flushed."""
        if self._reader_task is not None:
            self._reader_task.cancel()
        transport = self._writer.transport
        if transport.get_write_buffer_size():
            transport.abort()
        else:
            self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), self._timeout)
        except asyncio.TimeoutError:
            transport.abort()
        except Exception:   # the connection is gone either way
            pass
        self._ops.close()


async def connect_async(socket_path: str | Path | None = None, timeout: float = 5.0, *,
                        device: bool = False,
                        trusted_uids: Collection[int] | None = None) -> AsyncKVTierClient:
    """Connect an asyncio client; DaemonUnavailable when no daemon answers (``device``,
    ``trusted_uids`` and the trust checks: see ``connect``).

    The connect, the SO_PEERCRED check and the hello (which receives the arena's descriptor
    with recvmsg, something asyncio streams cannot do) run in a worker thread on a blocking
    socket bounded by ``timeout``, the very code ``connect`` runs; the verified socket is
    then handed to asyncio streams.
    """
    path = str(socket_path or default_socket_path())
    trusted = trusted_daemon_uids() if trusted_uids is None else frozenset(trusted_uids)
    loop = asyncio.get_running_loop()
    opening = loop.run_in_executor(None, open_verified, path, timeout, trusted)
    try:
        sock, hello = await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_close_opened)
        raise
    try:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_REPLY + 1024)
    except BaseException:
        sock.close()
        hello.close_fds()
        raise
    client = AsyncKVTierClient(reader, writer, timeout, device=device)
    try:
        await client._start(hello, path)
    except BaseException:
        await client.close()
        raise
    return client


def _close_opened(fut: asyncio.Future[tuple[socket.socket, Hello]]) -> None:
    """Close what a cancelled ``connect_async`` opened after all."""
    if fut.cancelled() or fut.exception() is not None:
        return
    sock, hello = fut.result()
    sock.close()
    hello.close_fds()


def _hung_up(fd: int) -> bool:
    """Whether the daemon's end of connection ``fd`` is gone (pending replies aside)."""
    poller = select.poll()
    poller.register(fd, HANGUP)
    return bool(poller.poll(0))
