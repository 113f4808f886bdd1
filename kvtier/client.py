"""The connector API that engines call: sync (``connect``) and asyncio (``connect_async``).

KV bytes move through the daemon's shared-memory arena; the socket carries only small
msgpack control frames. Every operation is written once, as a sans-I/O generator that
yields requests and receives replies; the sync client drives it with a blocking socket
and the async client with asyncio streams, so the two can never drift apart.

Two-phase under the hood: ``prepare_put`` hands out write-locked arena slots (a lease
with a TTL) that the caller fills and then commits; ``prepare_get`` hands out read-locked
slots that the caller releases. A crashed client's leases expire; a closed connection's
leases are released at once. A lease that expired before its release or commit raises
``LeaseExpired`` there: ``get`` never returns bytes read under an expired lease, a put
stores nothing. See docs/client-api.md ("Leases and their TTL").

Device placement (GPU engines, daemons with an HBM pool): a client made with
``connect(..., device=True)``, or a ``prepare_get(..., prefer_device=True)`` call, maps the
daemon's HBM pool (CUDA IPC handle from the handshake) the first time it needs it, and its
get leases may hand out device views (``GetLease.devices[i] == "hbm"``) that the engine
copies device-to-device. Other clients never import cupy and see no change.
UNTESTED ON HARDWARE: the device path runs on the CPU tests only through a fake mapping.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
from collections.abc import Collection, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config import default_socket_path, trusted_daemon_uids
from kvtier.errors import (
    BufferSizeError,
    DaemonUnavailable,
    HandshakeError,
    KVTierError,
    ProtocolError,
    RequestTimeout,
    UnknownNamespace,
    error_from_code,
)
from kvtier.handshake import Hello, handshake, hello_request, open_verified
from kvtier.keys import BlockKey, Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.prefix import PrefixLocality
from kvtier.protocol import LENGTH, PROTOCOL_VERSION, pack, unpack_body
from kvtier.tiers.arena import ArenaMapping

__all__ = [
    "AsyncKVTierClient", "GetLease", "KVTierClient", "LookupResult", "PrefixLocality",
    "PutLease", "connect", "connect_async",
]

_MAX_REPLY = 64 * 2**20
PUT_BATCH = 64
"""Blocks per put round trip in ``put``: amortises the control round trip without pinning
a large share of the arena at once."""
Op = Generator[dict[str, Any], dict[str, Any], Any]
log = logging.getLogger("kvtier.client")


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``hits`` leading blocks are present; ``tiers[i]`` says where block i was found.

    ``bandwidth``: bytes/s at which a block of each tier reached clients recently, as
    measured by the daemon (empty from daemons that do not report it, and for tiers not
    yet measured).
    """

    hits: int
    tiers: list[str]
    bandwidth: dict[str, float] = field(default_factory=dict)


def _as_bytes(buf: Any) -> np.ndarray:
    """A flat uint8 view of any C-contiguous buffer (bytes, numpy, memoryview)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


class _Ops:
    """Sans-I/O request logic shared by both clients."""

    def __init__(self, device: bool = False) -> None:
        self._registered: set[bytes] = set()
        self.arena: ArenaMapping | None = None
        self.arena_path: str | None = None        # from the hello (engines share one map)
        self.device = device                      # default of prepare_get's prefer_device
        self.hbm_info: dict[str, Any] | None = None   # the daemon's pool, from the hello
        self.hbm: Any = None                      # HbmMapping, opened at first device get
        self.hbm_error: str | None = None         # why the pool could not be mapped here

    def _device_mapping(self, prefer_device: bool | None) -> Any:
        """The HBM mapping to read device views through, or None for a cpu-only get.

        Opened lazily, once, and only for a get that asked for device placement on a daemon
        that has a pool, so cpu-only clients never import cupy. A pool this process cannot
        map (no GPU visible, CUDA refuses the handle) is logged once and the client falls
        back to cpu views for good.
        """
        if not (self.device if prefer_device is None else prefer_device):
            return None
        if self.hbm is not None or self.hbm_info is None or self.hbm_error is not None:
            return self.hbm
        from kvtier.tiers import hbm as hbm_mod

        info = self.hbm_info
        try:
            self.hbm = hbm_mod.HbmMapping.open(
                info["handle"], int(info["size"]), int(info.get("device", 0)),
                pci_bus_id=str(info.get("pci_bus_id", "")) or None)
        except Exception as exc:  # ImportError (no cupy), ConfigError, CUDARuntimeError
            self.hbm_error = f"{type(exc).__name__}: {exc}"
            log.warning("cannot map the daemon's HBM pool (%s); reading from cpu instead",
                        self.hbm_error)
        return self.hbm

    def close(self) -> None:
        """Unmap the arena and drop this client's reference to the HBM mapping."""
        if self.arena is not None:
            self.arena.close()
        if self.hbm is not None:
            hbm, self.hbm = self.hbm, None
            with contextlib.suppress(Exception):
                hbm.close()

    def _ensure(self, ns: Namespace) -> Op:
        if ns.digest not in self._registered:
            yield from self._register(ns)

    def _ask(self, ns: Namespace, req: dict[str, Any]) -> Op:
        """Send a request about ``ns``; a daemon that does not know the namespace (it
        restarted, or forgot it as the least recently used) gets it registered again and
        the request once more, so callers never see that."""
        yield from self._ensure(ns)
        try:
            return (yield req)
        except UnknownNamespace:
            self._registered.discard(ns.digest)
            yield from self._register(ns)
            return (yield req)

    def _register(self, ns: Namespace) -> Op:
        reply = yield {"op": "register_layout", "layout": ns.layout.to_dict(),
                       "model_id": ns.model_id, "tp_rank": ns.tp_rank, "tp_size": ns.tp_size,
                       "cache_salt": ns.cache_salt}
        if reply["ns"] != ns.digest:
            raise HandshakeError("daemon computed another namespace digest: client and daemon "
                                 "run incompatible kvtier versions")
        self._registered.add(ns.digest)
        return ns

    @staticmethod
    def _target(op: str, ns: Namespace, keys: Sequence[BlockKey]) -> dict[str, Any]:
        return {"op": op, "ns": ns.digest, "layout_fp": ns.layout.fingerprint,
                "keys": b"".join(keys)}

    def op_register(self, layout: KVLayout, model_id: str, tp_rank: int, tp_size: int,
                    cache_salt: str | None) -> Op:
        ns = Namespace(model_id, layout, tp_rank, tp_size, cache_salt)
        return (yield from self._register(ns))

    def op_lookup(self, ns: Namespace, keys: Sequence[BlockKey], prefetch: bool) -> Op:
        if not keys:
            return LookupResult(0, [])
        req = self._target("lookup", ns, keys)
        req["prefetch"] = prefetch
        reply = yield from self._ask(ns, req)
        bandwidth = reply.get("bandwidth")
        rates = ({str(k): float(v) for k, v in bandwidth.items()
                  if isinstance(v, (int, float)) and v > 0}
                 if isinstance(bandwidth, dict) else {})
        return LookupResult(int(reply["hits"]), list(reply["tiers"]), rates)

    def op_prepare_put(self, ns: Namespace, keys: Sequence[BlockKey],
                       parent: BlockKey | None, start_depth: int) -> Op:
        req = self._target("put_prepare", ns, keys)
        if parent is not None or start_depth:
            req["parent"], req["depth"] = parent, start_depth
        reply = yield from self._ask(ns, req)
        assert self.arena is not None
        nbytes = ns.layout.block_bytes
        views = [None if off is None else self.arena.view(off, nbytes, writable=True)
                 for off in reply["offsets"]]
        return reply["lease"], views

    def op_commit(self, lease: int, durable: bool, output_tokens: int | None) -> Op:
        reply = yield {"op": "put_commit", "lease": lease, "durable": durable,
                       "output_tokens": output_tokens}
        return int(reply["stored"])

    @staticmethod
    def op_commit_sync(lease: int, durable: bool, output_tokens: int | None,
                       redis_sync_s: float) -> Op:
        """A commit answered once the put's chain is in Redis (or ``redis_sync_s`` passed):
        (stored, leading blocks confirmed in Redis, whether that is the whole chain)."""
        reply = yield {"op": "put_commit", "lease": lease, "durable": durable,
                       "output_tokens": output_tokens, "redis_sync_s": redis_sync_s}
        return (int(reply["stored"]), int(reply.get("redis_visible", 0)),
                bool(reply.get("redis_synced", False)))

    def op_abort(self, lease: int) -> Op:
        yield {"op": "put_abort", "lease": lease}

    def op_prepare_get(self, ns: Namespace, keys: Sequence[BlockKey],
                       prefer_device: bool | None = None) -> Op:
        mapping = self._device_mapping(prefer_device)
        req = self._target("get_prepare", ns, keys)
        if mapping is not None:
            req["device"] = True
        reply = yield from self._ask(ns, req)
        assert self.arena is not None
        nbytes = ns.layout.block_bytes
        offsets = reply["offsets"]
        devices = list(reply.get("devices") or ["cpu"] * len(offsets))
        try:
            if len(devices) != len(offsets) or any(d not in ("cpu", "hbm") for d in devices):
                raise ProtocolError(f"get_prepare reply has devices {devices!r} for "
                                    f"{len(offsets)} offsets")
            if "hbm" in devices and mapping is None:
                raise ProtocolError("daemon handed out hbm slots to a client that did not "
                                    "ask for them")
            views = [self.arena.view(off, nbytes, writable=False) if dev == "cpu"
                     else mapping.view(off, nbytes)
                     for off, dev in zip(offsets, devices, strict=True)]
        except BaseException:
            yield {"op": "get_release", "lease": reply["lease"]}
            raise
        return reply["lease"], views, devices

    def op_release(self, lease: int, copy_s: float | None = None) -> Op:
        req: dict[str, Any] = {"op": "get_release", "lease": lease}
        if copy_s is not None:
            req["copy_s"] = float(copy_s)
        yield req

    def op_delete(self, ns: Namespace, keys: Sequence[BlockKey]) -> Op:
        reply = yield from self._ask(ns, self._target("delete", ns, keys))
        return int(reply["deleted"])

    @staticmethod
    def op_prefix(ns: Namespace, prompts: Sequence[Sequence[int] | np.ndarray], redis: bool,
                  batch: bool) -> Op:
        """Keys are hashed here, so the daemon only walks them; the namespace is spelled
        out, so nothing is registered for a probe."""
        chains = [block_keys(ns, p) for p in prompts]
        req: dict[str, Any] = {
            "op": "prefix_locality", "model_id": ns.model_id, "layout": ns.layout.to_dict(),
            "tp_rank": ns.tp_rank, "tp_size": ns.tp_size, "cache_salt": ns.cache_salt,
            "keys": b"".join(k for chain in chains for k in chain), "redis": redis}
        if batch:
            req["lengths"] = [len(chain) for chain in chains]
        reply = yield req
        return [PrefixLocality.from_dict(d) for d in reply["results"]]

    def op_stats(self) -> Op:
        reply = yield {"op": "stats"}
        return reply["stats"]

    def op_report(self, values: dict[str, float]) -> Op:
        yield {"op": "report_engine", **values}

    @staticmethod
    def check_reply(reply: dict[str, Any]) -> dict[str, Any]:
        if not reply.get("ok"):
            raise error_from_code(str(reply.get("code", "internal")),
                                  str(reply.get("error", "daemon reported an error")))
        return reply

    @staticmethod
    def hello() -> dict[str, Any]:
        """The first request (kvtier.handshake.hello_request)."""
        return hello_request()

    def on_hello(self, reply: dict[str, Any], arena_fd: int | None = None,
                 daemon_uid: int | None = None) -> None:
        """Map the arena the hello announced (``arena_fd`` when the daemon passed one, taken
        over here) as a file of ``daemon_uid`` (default: ours); keep the HBM pool info."""
        try:
            if reply.get("version") != PROTOCOL_VERSION:
                raise HandshakeError(f"daemon speaks protocol {reply.get('version')}, client "
                                     f"{PROTOCOL_VERSION}")
            arena = reply.get("arena")
            if not (isinstance(arena, dict) and isinstance(arena.get("path"), str)
                    and isinstance(arena.get("size"), int)):
                raise ProtocolError(f"hello reply has no valid arena: {arena!r}")
        except BaseException:
            if arena_fd is not None:
                os.close(arena_fd)
            raise
        self.arena = ArenaMapping(arena["path"], int(arena["size"]), fd=arena_fd,
                                  owner_uid=daemon_uid)
        self.arena_path = str(arena["path"])
        hbm = reply.get("hbm")
        self.hbm_info = hbm if isinstance(hbm, dict) and hbm.get("handle") else None


def _map_arena(ops: _Ops, hello: Hello, path: str) -> None:
    """``ops.on_hello`` with the arena owned by the verified daemon uid; OSError (the file
    is gone) becomes DaemonUnavailable."""
    try:
        ops.on_hello(hello.reply, hello.arena_fd, hello.peer.uid)
    except OSError as exc:
        raise DaemonUnavailable(f"cannot map the arena of the daemon at {path}: {exc}") from None


def _check_buffers(ns: Namespace, keys: Sequence[BlockKey], buffers: Sequence[Any]) -> None:
    if len(buffers) != len(keys):
        raise BufferSizeError(f"{len(keys)} keys but {len(buffers)} buffers")
    nbytes = ns.layout.block_bytes
    for i, b in enumerate(buffers):
        size = memoryview(b).nbytes
        if size != nbytes:
            raise BufferSizeError(f"buffer {i} has {size} bytes; the layout's block is "
                                  f"{nbytes} bytes")


class PutLease:
    """Write-locked arena slots; ``views[i]`` is None where key i needs no write.

    ``commit`` raises ``LeaseExpired`` (nothing stored) when the lease outlived the daemon's
    TTL; writes made after the expiry land in quarantined slots and harm no one. As a
    context manager: commit on normal exit (its errors propagate), abort on an exception
    (abort errors suppressed, the body's exception propagates).
    """

    def __init__(self, client: KVTierClient, lease: int, views: list[np.ndarray | None]):
        self._client, self.lease, self.views = client, lease, views
        self._open = True
        self.redis_visible: int | None = None   # after a commit with redis_sync_s
        self.redis_synced: bool | None = None

    def commit(self, *, durable: bool = False, output_tokens: int | None = None,
               redis_sync_s: float | None = None) -> int:
        """Publish the written blocks; ``durable`` waits until they are on nvme.

        ``output_tokens``: how many tokens the engine generated after this prompt, when
        known; the daemon's cost policy learns reuse per kind of request from it.
        ``redis_sync_s``: answer only once every block of the put (new or stored before) is
        visible in the shared Redis, or that many seconds passed (at most 90% of the
        client's timeout); ``redis_visible`` and ``redis_synced`` then say how it went.
        """
        self._open = False
        ops = self._client._ops
        if redis_sync_s is None:
            return self._client._run(ops.op_commit(self.lease, durable, output_tokens))
        wait = min(redis_sync_s, 0.9 * self._client._timeout)
        stored, self.redis_visible, self.redis_synced = self._client._run(
            ops.op_commit_sync(self.lease, durable, output_tokens, wait))
        return stored

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._client._run(self._client._ops.op_abort(self.lease))

    def __enter__(self) -> PutLease:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if not self._open:
            return
        if exc_type is None:
            self.commit()
        else:
            with contextlib.suppress(KVTierError):
                self.abort()


class GetLease:
    """Read-locked slots of the leading available blocks.

    ``views[i]`` is a read-only numpy array over the arena when ``devices[i] == "cpu"`` (always,
    unless the get asked for device placement), and a uint8 cupy array over the daemon's
    HBM pool when ``devices[i] == "hbm"`` (read it, never write it).

    What was read through the views is valid only if ``release`` succeeds: it raises
    ``LeaseExpired`` when the lease outlived the daemon's TTL (the slots may have been
    reused by another client meanwhile, so discard everything read), and any other error
    when the daemon could not confirm the lease. As a context manager: on normal exit it
    releases and lets those errors propagate (a reader must learn that its bytes are not
    valid); on an exception it releases quietly and the body's exception propagates.
    """

    def __init__(self, client: KVTierClient, lease: int, views: list[Any],
                 devices: list[str] | None = None):
        self._client, self.lease, self.views = client, lease, views
        self.devices: list[str] = devices if devices is not None else ["cpu"] * len(views)
        self._open = True

    def release(self, *, copy_s: float | None = None) -> None:
        """Give the slots back; ``LeaseExpired`` when what was read may be wrong.
        ``copy_s``: how long reading them took, when measured (it feeds the daemon's
        reload-bandwidth estimate, see ``LookupResult.bandwidth``)."""
        if self._open:
            self._open = False
            self._client._run(self._client._ops.op_release(self.lease, copy_s))

    def __enter__(self) -> GetLease:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.release()
            return
        with contextlib.suppress(KVTierError):
            self.release()


class KVTierClient:
    """Blocking client. One per thread; cheap to create. ``device``: see ``connect``."""

    def __init__(self, sock: socket.socket, timeout: float, *, device: bool = False,
                 hello: Hello | None = None) -> None:
        """``hello``: the handshake ``connect`` already did on ``sock``; without it the
        daemon is verified and greeted here (trusted uids from the environment)."""
        self._sock = sock
        self._timeout = timeout
        self._ids = itertools.count(2)
        self._ops = _Ops(device)
        self._broken: KVTierError | None = None
        path = str(sock.getpeername())
        if hello is None:
            hello = handshake(sock, path, trusted_daemon_uids(), timeout)
        _map_arena(self._ops, hello, path)

    # transport
    def _recv_exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = self._sock.recv(min(n - got, 1 << 20))
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        if self._broken is not None:
            raise DaemonUnavailable(f"connection unusable after an earlier failure: "
                                    f"{self._broken}")
        rid = next(self._ids)
        req["id"] = rid
        try:
            self._sock.sendall(pack(req))
            while True:
                (n,) = LENGTH.unpack(self._recv_exact(LENGTH.size))
                if n > _MAX_REPLY:
                    raise ProtocolError(f"reply of {n} bytes is too large")
                reply = unpack_body(self._recv_exact(n), _MAX_REPLY)
                if reply.get("id") in (rid, 0):
                    break
        except TimeoutError:
            self._broken = RequestTimeout(f"no reply to {req.get('op')} within "
                                          f"{self._timeout}s")
            raise self._broken from None
        except OSError as exc:
            self._broken = DaemonUnavailable(f"daemon connection lost: {exc}")
            raise self._broken from None
        return _Ops.check_reply(reply)

    def _run(self, op: Op) -> Any:
        try:
            req = next(op)
            while True:
                try:
                    reply = self._call(req)
                except UnknownNamespace as exc:  # the op re-registers (see _Ops._ask)
                    req = op.throw(exc)
                    continue
                req = op.send(reply)
        except StopIteration as stop:
            return stop.value

    # API
    def register_layout(self, layout: KVLayout, model_id: str, *, tp_rank: int = 0,
                        tp_size: int = 1, cache_salt: str | None = None) -> Namespace:
        """Tell the daemon about a layout; returns the Namespace to key blocks with."""
        return self._run(self._ops.op_register(layout, model_id, tp_rank, tp_size, cache_salt))

    def lookup(self, ns: Namespace, keys: Sequence[BlockKey], *,
               prefetch: bool = True) -> LookupResult:
        """Leading keys present in any tier; starts promoting lower-tier hits."""
        return self._run(self._ops.op_lookup(ns, keys, prefetch))

    def prepare_put(self, ns: Namespace, keys: Sequence[BlockKey], *,
                    parent: BlockKey | None = None, start_depth: int = 0) -> PutLease:
        """Write-locked slots for ``keys``, a piece of a prefix chain (``parent`` is the key
        before ``keys[0]``, ``start_depth`` its position; defaults: a whole prompt)."""
        return PutLease(self, *self._run(self._ops.op_prepare_put(ns, keys, parent,
                                                                  start_depth)))

    def prepare_get(self, ns: Namespace, keys: Sequence[BlockKey], *,
                    prefer_device: bool | None = None) -> GetLease:
        """Read-locked views of the leading available blocks (see ``GetLease``).

        ``prefer_device`` (default: the client's ``device``): when the daemon has an HBM
        pool, place the blocks there and hand out device views where it could.
        """
        return GetLease(self, *self._run(self._ops.op_prepare_get(ns, keys, prefer_device)))

    @property
    def hbm_info(self) -> dict[str, Any] | None:
        """The daemon's HBM pool from the handshake (handle, size, device, pci_bus_id), or
        None when it has none."""
        return self._ops.hbm_info

    @property
    def hbm_mapped(self) -> bool:
        """Whether this client has mapped the daemon's HBM pool (after a device get)."""
        return self._ops.hbm is not None

    def put(self, ns: Namespace, keys: Sequence[BlockKey], buffers: Sequence[Any], *,
            durable: bool = False, output_tokens: int | None = None) -> int:
        """Store blocks (one memcpy each into the arena); returns how many were stored."""
        _check_buffers(ns, keys, buffers)
        stored = 0
        for i in range(0, len(keys), PUT_BATCH):  # bounded batches: never pin the whole arena
            lease = self.prepare_put(ns, keys[i: i + PUT_BATCH], parent=keys[i - 1] if i else None,
                                     start_depth=i)
            with lease:
                for view, buf in zip(lease.views, buffers[i: i + PUT_BATCH], strict=True):
                    if view is not None:
                        np.copyto(view, _as_bytes(buf))
                last = i + PUT_BATCH >= len(keys)
                stored += lease.commit(durable=durable,
                                       output_tokens=output_tokens if last else None)
        return stored

    def get(self, ns: Namespace, keys: Sequence[BlockKey], out_buffers: Sequence[Any]) -> int:
        """Copy the leading available blocks into host ``out_buffers``; returns how many.
        Always reads through cpu views (``prefer_device=False``).

        Raises ``LeaseExpired`` when the copy outlived the lease TTL (a stalled client): the
        bytes may belong to another block, so nothing is returned as valid and the contents
        of ``out_buffers`` are unspecified. Retry, or treat it as a miss."""
        _check_buffers(ns, keys, out_buffers)
        with self.prepare_get(ns, keys, prefer_device=False) as lease:
            for view, out in zip(lease.views, out_buffers, strict=False):
                np.copyto(_as_bytes(out), view)
            return len(lease.views)

    def delete(self, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        return self._run(self._ops.op_delete(ns, keys))

    def prefix_locality(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, *,
                        redis: bool = True) -> PrefixLocality:
        """How many leading tokens of a prompt this daemon's node holds (by tier) and the
        shared Redis holds: a read-only probe for routing (nothing is promoted or
        registered). ``hit_blocks`` equals what ``lookup`` would find now."""
        return self._run(self._ops.op_prefix(ns, [token_ids], redis, False))[0]

    def prefix_locality_batch(self, ns: Namespace,
                              prompts: Sequence[Sequence[int] | np.ndarray], *,
                              redis: bool = True) -> list[PrefixLocality]:
        """``prefix_locality`` for several prompts in one round trip."""
        return self._run(self._ops.op_prefix(ns, prompts, redis, True))

    def stats(self) -> dict[str, Any]:
        return self._run(self._ops.op_stats())

    def report_engine(self, **values: float) -> None:
        """Connector-side gauges (running, waiting, preemptions, context_tokens_p50/p99)."""
        self._run(self._ops.op_report(values))

    def ping(self) -> None:
        self._call({"op": "ping"})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        self._ops.close()

    def __enter__(self) -> KVTierClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def connect(socket_path: str | Path | None = None, timeout: float = 5.0, *,
            device: bool = False, trusted_uids: Collection[int] | None = None) -> KVTierClient:
    """Connect to the node's daemon; DaemonUnavailable when none answers.

    The daemon must run as this process's uid or one of ``trusted_uids`` (default: the
    uids in ``KVTIER_TRUSTED_UIDS``), checked with SO_PEERCRED before anything is sent
    (UntrustedDaemon otherwise); its arena is mapped only if it is a private file of that
    uid (UntrustedArena otherwise). See docs/client-api.md, "Trust".

    ``device=True`` (GPU engines): gets prefer device placement, so on a daemon with an HBM
    pool they may hand out device views (the pool is mapped at the first such get).
    """
    path = str(socket_path or default_socket_path())
    trusted = trusted_daemon_uids() if trusted_uids is None else frozenset(trusted_uids)
    sock, hello = open_verified(path, timeout, trusted)
    try:
        return KVTierClient(sock, timeout, device=device, hello=hello)
    except BaseException:
        sock.close()
        raise


class AsyncPutLease:
    """``PutLease`` for the asyncio client (same ``views``, same expiry rules; ``async with``
    commits on normal exit and aborts on an exception)."""

    def __init__(self, client: AsyncKVTierClient, lease: int, views: list[np.ndarray | None]):
        self._client, self.lease, self.views = client, lease, views
        self._open = True
        self.redis_visible: int | None = None
        self.redis_synced: bool | None = None

    async def commit(self, *, durable: bool = False, output_tokens: int | None = None,
                     redis_sync_s: float | None = None) -> int:
        """Publish the written blocks; ``LeaseExpired`` (nothing stored) past the TTL
        (``redis_sync_s``: see ``PutLease.commit``)."""
        self._open = False
        ops = self._client._ops
        if redis_sync_s is None:
            return await self._client._run(ops.op_commit(self.lease, durable, output_tokens))
        wait = min(redis_sync_s, 0.9 * self._client._timeout)
        stored, self.redis_visible, self.redis_synced = await self._client._run(
            ops.op_commit_sync(self.lease, durable, output_tokens, wait))
        return stored

    async def abort(self) -> None:
        if self._open:
            self._open = False
            await self._client._run(self._client._ops.op_abort(self.lease))

    async def __aenter__(self) -> AsyncPutLease:
        return self

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        if not self._open:
            return
        if exc_type is None:
            await self.commit()
        else:
            with contextlib.suppress(KVTierError):
                await self.abort()


class AsyncGetLease:
    """``GetLease`` for the asyncio client (same ``views``, ``devices`` and expiry rules:
    ``release`` raises ``LeaseExpired`` when what was read may be wrong)."""

    def __init__(self, client: AsyncKVTierClient, lease: int, views: list[Any],
                 devices: list[str] | None = None):
        self._client, self.lease, self.views = client, lease, views
        self.devices: list[str] = devices if devices is not None else ["cpu"] * len(views)
        self._open = True

    async def release(self) -> None:
        if self._open:
            self._open = False
            await self._client._run(self._client._ops.op_release(self.lease))

    async def __aenter__(self) -> AsyncGetLease:
        return self

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            await self.release()
            return
        with contextlib.suppress(KVTierError):
            await self.release()


class AsyncKVTierClient:
    """asyncio client; several coroutines may issue requests concurrently."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout: float, *, device: bool = False) -> None:
        self._reader, self._writer, self._timeout = reader, writer, timeout
        self._ids = itertools.count(1)
        self._ops = _Ops(device)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader_task: asyncio.Task[None] | None = None
        self._broken: KVTierError | None = None

    async def _start(self, hello: Hello, path: str) -> None:
        """Map the arena of the handshake ``connect_async`` did, then start reading."""
        _map_arena(self._ops, hello, path)
        self._reader_task = asyncio.ensure_future(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            while True:
                (n,) = LENGTH.unpack(await self._reader.readexactly(LENGTH.size))
                if n > _MAX_REPLY:
                    raise ProtocolError(f"reply of {n} bytes is too large")
                reply = unpack_body(await self._reader.readexactly(n), _MAX_REPLY)
                rid = reply.get("id", 0)
                targets = list(self._pending.values()) if rid == 0 else [
                    self._pending.get(rid)]
                for fut in targets:
                    if fut is not None and not fut.done():
                        fut.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, KVTierError) as exc:
            self._broken = DaemonUnavailable(f"daemon connection lost: {exc}")
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(self._broken)

    async def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        if self._broken is not None:
            raise self._broken
        rid = next(self._ids)
        req["id"] = rid
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            self._writer.write(pack(req))
            await self._writer.drain()
            reply = await asyncio.wait_for(fut, self._timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply to {req.get('op')} within {self._timeout}s") from None
        except OSError as exc:
            raise DaemonUnavailable(f"daemon connection lost: {exc}") from None
        finally:
            self._pending.pop(rid, None)
        return _Ops.check_reply(reply)

    async def _run(self, op: Op) -> Any:
        try:
            req = next(op)
            while True:
                try:
                    reply = await self._call(req)
                except UnknownNamespace as exc:  # the op re-registers (see _Ops._ask)
                    req = op.throw(exc)
                    continue
                req = op.send(reply)
        except StopIteration as stop:
            return stop.value

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
    def hbm_mapped(self) -> bool:
        return self._ops.hbm is not None

    async def put(self, ns: Namespace, keys: Sequence[BlockKey], buffers: Sequence[Any], *,
                  durable: bool = False, output_tokens: int | None = None) -> int:
        _check_buffers(ns, keys, buffers)
        stored = 0
        for i in range(0, len(keys), PUT_BATCH):
            lease = await self.prepare_put(ns, keys[i: i + PUT_BATCH],
                                           parent=keys[i - 1] if i else None, start_depth=i)
            try:
                for view, buf in zip(lease.views, buffers[i: i + PUT_BATCH], strict=True):
                    if view is not None:
                        np.copyto(view, _as_bytes(buf))
            except BaseException:
                with contextlib.suppress(KVTierError):
                    await lease.abort()
                raise
            last = i + PUT_BATCH >= len(keys)
            stored += await lease.commit(durable=durable,
                                         output_tokens=output_tokens if last else None)
        return stored

    async def get(self, ns: Namespace, keys: Sequence[BlockKey],
                  out_buffers: Sequence[Any]) -> int:
        """``KVTierClient.get`` as a coroutine (``LeaseExpired`` rule included)."""
        _check_buffers(ns, keys, out_buffers)
        async with await self.prepare_get(ns, keys, prefer_device=False) as lease:
            for view, out in zip(lease.views, out_buffers, strict=False):
                np.copyto(_as_bytes(out), view)
            return len(lease.views)

    async def delete(self, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        return await self._run(self._ops.op_delete(ns, keys))

    async def prefix_locality(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, *,
                              redis: bool = True) -> PrefixLocality:
        """``KVTierClient.prefix_locality`` as a coroutine."""
        return (await self._run(self._ops.op_prefix(ns, [token_ids], redis, False)))[0]

    async def prefix_locality_batch(self, ns: Namespace,
                                    prompts: Sequence[Sequence[int] | np.ndarray], *,
                                    redis: bool = True) -> list[PrefixLocality]:
        return await self._run(self._ops.op_prefix(ns, prompts, redis, True))

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._ops.op_stats())

    async def report_engine(self, **values: float) -> None:
        await self._run(self._ops.op_report(values))

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
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
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=_MAX_REPLY + 1024)
    except BaseException:
        sock.close()
        if hello.arena_fd is not None:
            os.close(hello.arena_fd)
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
    if hello.arena_fd is not None:
        os.close(hello.arena_fd)
