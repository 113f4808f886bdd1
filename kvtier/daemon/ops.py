"""The control protocol's operations: one handler per op, each validating its request
and calling the store (the socket, framing and limits live in ``kvtier.daemon.control``).

Handlers take the calling connection and the decoded request and return the reply's
fields; a typed KVTierError becomes a typed error reply in ``ControlServer._dispatch``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.daemon.engines import EngineReports
from kvtier.daemon.inflight import InFlight
from kvtier.daemon.limits import LimitCounters, Limits
from kvtier.daemon.prefix import PrefixProbe
from kvtier.daemon.redis_sync import RedisSync
from kvtier.errors import LayoutMismatch, LimitExceeded, ProtocolError, UnknownNamespace
from kvtier.frame import MAX_PAYLOAD
from kvtier.keys import KEY_BYTES, MAX_NAME_CHARS
from kvtier.layout import KVLayout
from kvtier.protocol import field as req_field
from kvtier.protocol import optional_int
from kvtier.store import TieredStore

_MAX_TP = 1 << 16
# namespaces one connection may name at once (an engine uses one per layout and tp rank;
# beyond this the oldest is forgotten and the client registers it again, transparently)
MAX_CONN_NAMESPACES = 256


@dataclass(slots=True)
class Connection:
    id: int
    pid: int
    uid: int
    client: str = ""
    key_scheme: str = ""   # the client's key function version (kvtier.keys.KEY_SCHEME)
    engine: dict[str, float] = field(default_factory=dict)
    # digests this connection registered (with their salts): the only ones it may name
    namespaces: dict[bytes, None] = field(default_factory=dict)
    dropped: bool = False   # the daemon closed it: the client may still be writing
    released: bool = False  # closed and its leases taken back: a lease opened later is void

    @property
    def process(self) -> int:
        """Who holds this connection's puts to account: its pid (or itself when unknown)."""
        return self.pid if self.pid > 0 else -self.id

    def registered(self, digest: bytes) -> None:
        """Remember that this connection registered ``digest`` (bounded, oldest first)."""
        self.namespaces.pop(digest, None)
        self.namespaces[digest] = None
        while len(self.namespaces) > MAX_CONN_NAMESPACES:
            del self.namespaces[next(iter(self.namespaces))]


Handler = Callable[["Connection", dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlOps:
    """The op handlers of a ``ControlServer`` (which provides these attributes)."""

    store: TieredStore
    limits: Limits
    prefix: PrefixProbe
    redis_sync: RedisSync
    stats_provider: Callable[[], dict[str, Any]]
    connections: dict[int, Connection]
    orphans: dict[int, int]   # closed connection -> its process, while slots stay quarantined
    counters: LimitCounters
    engines: EngineReports
    in_flight: InFlight   # what prepares still running will hold, per process

    def op_table(self) -> dict[str, Handler]:
        """Op name -> handler (the names are ``kvtier.protocol.OPS`` minus ``hello``)."""
        return {
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
            "prefix_locality": self._prefix_locality,
        }

    async def _ping(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        return {}

    def _target(self, conn: Connection, msg: dict[str, Any]
                ) -> tuple[bytes, int, list[bytes]]:
        """Namespace, layout fingerprint and keys of a request; the key count is checked
        against the namespace's limit on the raw blob, before any key object exists.

        A connection names only namespaces it registered itself: a digest is shown in
        places (logs, stats of other tools) and is no proof of knowing the namespace's
        ``cache_salt``; the client registers again on UnknownNamespace, transparently."""
        ns = req_field(msg, "ns", bytes)
        fp = req_field(msg, "layout_fp", int)
        blob = req_field(msg, "keys", bytes)
        layout = self.store.touch_namespace(ns) if ns in conn.namespaces else None
        if layout is None:
            raise UnknownNamespace("namespace not registered with this daemon: call "
                                   "register_layout first (the daemon may have restarted or "
                                   "forgotten a namespace unused for long)")
        limit = self.limits.max_keys(layout.tokens_per_block)
        if len(blob) > limit * KEY_BYTES:
            raise LimitExceeded(
                f"{len(blob) // KEY_BYTES} keys in one request; this namespace allows "
                f"{limit} ({self.limits.max_context_tokens} tokens, daemon.max_context_tokens, "
                f"in blocks of {layout.tokens_per_block}): split the request")
        return ns, fp, self.store.split_keys(blob)

    async def _register_layout(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        layout = KVLayout.from_dict(req_field(msg, "layout", dict))
        if layout.block_bytes > MAX_PAYLOAD:
            raise LayoutMismatch(f"a block of {layout.block_bytes} bytes is beyond any tier "
                                 f"(at most {MAX_PAYLOAD}): check the layout's sizes")
        salt = msg.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ProtocolError("cache_salt must be a string or nil")
        model_id = req_field(msg, "model_id", str)
        if len(model_id) > MAX_NAME_CHARS or (salt is not None
                                              and len(salt) > MAX_NAME_CHARS):
            raise ProtocolError(f"model_id and cache_salt are limited to {MAX_NAME_CHARS} "
                                "characters")
        tp_size = optional_int(msg, "tp_size", 1, 1, _MAX_TP)
        tp_rank = optional_int(msg, "tp_rank", 0, 0, tp_size - 1)
        ns = self.store.register_namespace(layout, model_id, tp_rank, tp_size, salt)
        conn.registered(ns.digest)
        return {"ns": ns.digest, "layout_fp": layout.fingerprint,
                "block_bytes": layout.block_bytes,
                "max_keys": self.limits.max_keys(layout.tokens_per_block)}

    async def _lookup(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        ns, fp, keys = self._target(conn, msg)
        res = await self.store.lookup(ns, fp, keys, prefetch=bool(msg.get("prefetch", True)))
        reply: dict[str, Any] = {"hits": res.hits, "tiers": res.tiers}
        bandwidth = getattr(self.store, "bandwidth", None)
        if bandwidth is not None:   # additive: reload bytes/s per tier, for "never slower
            reply["bandwidth"] = bandwidth.reload_bandwidth()  # than recompute" (issue 11)
        return reply

    async def _put_prepare(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        ns, fp, keys = self._target(conn, msg)
        parent = msg.get("parent")
        if parent is not None and not (isinstance(parent, bytes) and len(parent) == 16):
            raise ProtocolError("parent must be a 16-byte key or nil")
        depth = msg.get("depth", 0)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ProtocolError("depth must be a non-negative int")
        layout = self.store.touch_namespace(ns)
        assert layout is not None   # (checked by _target)
        tpb = layout.tokens_per_block
        if depth + len(keys) > self.limits.max_keys(tpb):   # a position in a context
            raise LimitExceeded(
                f"blocks {depth}..{depth + len(keys) - 1} of a chain: this namespace "
                f"allows {self.limits.max_keys(tpb)} ({self.limits.max_context_tokens} "
                f"tokens, daemon.max_context_tokens, in blocks of {tpb})")
        self._check_lease_count(conn)
        max_new = self._put_room(conn) // layout.block_bytes
        # a slot per key not stored yet: what the prepare may take (a prompt's stored prefix
        # reserved slots too, and pipelined saves of a full arena were capped; by review)
        fresh = (len(self.store.index.new_positions(keys))
                 if self.limits.client_put_bytes > 0 else len(keys))   # (no cap: no count)
        if max_new < fresh:
            self.counters.capped_puts += 1
        take = min(max_new, fresh) * layout.block_bytes
        with self.in_flight.reserve(conn.process, put_bytes=take):
            lease, offsets = await self.store.prepare_put(
                conn.id, ns, fp, keys, parent=parent, depth=depth, max_new=max_new)
        if conn.released:   # closed while this ran: no client will write or commit it
            self.store.abort_put(conn.id, lease)
        return {"lease": lease, "offsets": offsets}

    def _put_room(self, conn: Connection) -> int:
        """Arena bytes ``conn``'s process may still take for writing: one client process
        holds at most ``limits.client_put_bytes`` in open puts and quarantine, so that
        neither a greedy nor a stalled client can take the arena from the others."""
        return self._room(conn, self.limits.client_put_bytes, self.store.held_put_bytes,
                          self.in_flight.of(conn.process).put_bytes)

    def _within_get_room(self, conn: Connection, ns: bytes, keys: list[bytes]) -> list[bytes]:
        """The leading ``keys`` ``conn``'s process may still pin: one client process pins at
        most ``limits.client_get_bytes`` in open get leases, so that a greedy client cannot
        hold the arena against the others' puts and promotions (the rest of its get is a
        miss, which an engine recomputes)."""
        room = self._room(conn, self.limits.client_get_bytes, self.store.held_get_bytes,
                          self.in_flight.of(conn.process).get_bytes)
        layout = self.store.touch_namespace(ns)
        assert layout is not None   # (checked by _target)
        if room // layout.block_bytes >= len(keys):
            return keys
        self.counters.capped_gets += 1
        return keys[:room // layout.block_bytes]

    def _check_lease_count(self, conn: Connection) -> None:
        """``LimitExceeded`` when ``conn``'s process holds ``max_leases_per_client`` leases:
        a lease costs the daemon memory and sweep work even when it holds no block, so a
        client that opens them without end must not grow the table (an engine holds a few
        per request in flight)."""
        cap = self.limits.max_leases_per_client
        held = sum(self.store.leases.count(owner) for owner in self.owners_of(conn.process))
        held += self.in_flight.of(conn.process).leases
        if held >= cap:
            self.counters.refused_leases += 1
            raise LimitExceeded(f"this client process holds {held} open leases, the daemon's "
                                f"limit (daemon.max_leases_per_client {cap}): release or "
                                "commit them first")

    def _room(self, conn: Connection, cap: int, held: Callable[[int], int],
              reserved: int) -> int:
        """What ``conn``'s process may still hold under a per-process ``cap`` (0: none),
        ``held(owner)`` being what each of its connections holds now and ``reserved``
        what its prepares still running may take (``kvtier.daemon.inflight``)."""
        if cap <= 0:
            return 1 << 62
        return max(0, cap - reserved
                   - sum(held(owner) for owner in self.owners_of(conn.process)))

    def owners_of(self, process: int) -> list[int]:
        """The connections (open, or closed with slots still quarantined) of a process."""
        return [c.id for c in self.connections.values() if c.process == process] + \
            [owner for owner, p in self.orphans.items() if p == process]

    async def _put_commit(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        """``redis_sync_s`` (optional): answer only once the put's whole chain is in Redis,
        or that many seconds passed (kvtier.daemon.redis_sync); the reply then says how
        many leading blocks Redis holds (``redis_visible``), whether that is all, and why
        not (``redis_sync_reason``: "off" for a daemon without a Redis tier)."""
        out = msg.get("output_tokens")
        if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 0):
            raise ProtocolError("output_tokens must be a non-negative int or nil")
        lease_id = req_field(msg, "lease", int)
        sync_s = msg.get("redis_sync_s")
        if sync_s is not None and (not isinstance(sync_s, (int, float))
                                   or isinstance(sync_s, bool) or not 0 <= sync_s <= 3600):
            raise ProtocolError("redis_sync_s must be a number of seconds in [0, 3600] or nil")
        lease = self.store.leases.get(lease_id) if sync_s is not None else None
        target = (None if lease is None or lease.owner != conn.id
                  else (lease.namespace, list(lease.chain), list(lease.metas)))
        began = time.monotonic()
        # a synchronous commit waits for room in the Redis write queue (up to its bound)
        wait_s = float(sync_s) if sync_s is not None and target is not None else None
        stored = await self.store.commit_put(conn.id, lease_id,
                                             durable=bool(msg.get("durable", False)),
                                             output_tokens=out, redis_wait_s=wait_s)
        if sync_s is None or target is None:
            return {"stored": stored}
        # the put's own namespace, even when its keys were stored already: a key of another
        # namespace's chain in the index said whose chain to check in Redis and send again
        # (a client that knew another tenant's keys learnt how much of it Redis held)
        digest, chain, fresh = target
        done = await self.redis_sync.sync(digest, chain, fresh, float(sync_s), began)
        return {"stored": stored, "redis_visible": done.visible, "redis_synced": done.complete,
                "redis_sync_reason": done.reason}

    async def _put_abort(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        self.store.abort_put(conn.id, req_field(msg, "lease", int))
        return {}

    async def _get_prepare(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        """Read-locked slots; with ``device: true`` (a client that mapped the HBM pool) the
        reply adds ``devices``, "hbm" or "cpu" per offset. ``ttl_s``: for at least that long
        from now the lease holds the slots while this connection stays open (a client that
        read them well within it need not wait for the release's reply, see
        kvtier.client.ops.op_release)."""
        ns, fp, keys = self._target(conn, msg)
        self._check_lease_count(conn)
        keys = self._within_get_room(conn, ns, keys)
        layout = self.store.touch_namespace(ns)
        assert layout is not None   # (checked by _target)
        reply: dict[str, Any]
        held = (sum(1 for k in keys if k in self.store.index)   # (a miss pins nothing)
                if self.limits.client_get_bytes > 0 else 0)
        with self.in_flight.reserve(conn.process, get_bytes=held * layout.block_bytes):
            if msg.get("device") is True:
                lease, offsets, devices = await self.store.prepare_get_device(
                    conn.id, ns, fp, keys)
                reply = {"lease": lease, "offsets": offsets, "devices": devices}
            else:
                lease, offsets = await self.store.prepare_get(conn.id, ns, fp, keys)
                reply = {"lease": lease, "offsets": offsets}
        if conn.released:   # closed while this ran: nobody will read or release it
            await self.store.release_get(conn.id, lease)
        reply["ttl_s"] = self._held_s()
        return reply

    def _held_s(self) -> float:
        """How long a lease opened now surely holds: its TTL, or less when an idle
        connection is dropped sooner (dropping it releases the connection's leases)."""
        idle = self.limits.idle_timeout_s
        return min(self.store.lease_ttl_s, idle) if idle > 0 else self.store.lease_ttl_s

    async def _get_release(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        copy_s = msg.get("copy_s")   # optional: the client's own copy time (issue 11)
        if not isinstance(copy_s, (int, float)) or isinstance(copy_s, bool) or copy_s < 0:
            copy_s = None
        await self.store.release_get(conn.id, req_field(msg, "lease", int), copy_s=copy_s)
        return {}

    async def _delete(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        ns, fp, keys = self._target(conn, msg)
        return {"deleted": await self.store.delete(ns, fp, keys)}

    async def _stats(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        return {"stats": self.stats_provider()}

    async def _report_engine(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        self.engines.report(conn.engine, msg)
        return {}

    async def _prefix_locality(self, conn: Connection, msg: dict[str, Any]) -> dict[str, Any]:
        """Leading tokens cached here (by tier) and in Redis; read-only (kvtier.prefix)."""
        return await self.prefix.from_control(msg, conn.namespaces)

    def engine_summary(self) -> dict[str, float]:
        """Connected engines' gauges, and their counters' totals (kvtier.daemon.engines)."""
        return self.engines.summary(c.engine for c in self.connections.values())
