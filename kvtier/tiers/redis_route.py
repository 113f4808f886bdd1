"""Which Redis server holds a key: one server, or a Redis Cluster slot map that heals itself.

The tier asks ``Router.group(keys)`` before every batch and talks to each server through a
``NodePool`` (kvtier.tiers.redis_pool). In a cluster a server can die while the others live
on: ``mark_failed`` takes it out of the routing at once (its keys are misses, answered
without a connection attempt) and ``refresh`` reloads the slot map from any server that
answers (CLUSTER SLOTS), so once a replica is promoted its slots are served again. Only the
slots of a failed server miss in between, never the whole tier.
"""

from __future__ import annotations

import logging
import threading
import time
from binascii import crc_hqx
from collections.abc import Sequence
from enum import Enum
from typing import Any
from urllib.parse import unquote, urlsplit

from kvtier.config import RedisConfig
from kvtier.lograte import LogRate
from kvtier.tiers.redis_client import RedisTarget, tls_context
from kvtier.tiers.redis_pool import NodePool
from kvtier.tiers.redis_resp import REDIRECTS, ConnOptions, ErrorReply, NodeAddr, command
from kvtier.tiers.redis_wire import LARGE_REPLY_BYTES, SMALL_REPLY_BYTES, Conn

log = logging.getLogger("kvtier.tiers.redis")   # one logger for the whole Redis tier
_warn = LogRate(log)   # connections dropped out of step: one line per kind per 10 s

CLUSTER_SLOTS = 16384


def key_slot(key: bytes) -> int:
    """The Redis Cluster hash slot of ``key``: CRC16 (XMODEM, ``binascii.crc_hqx``) of the
    key, or of its hash tag (the first non-empty ``{...}``), mod 16384. The tier's only
    need of redis-py was this function: with it here the tier needs no extra package."""
    start = key.find(b"{")
    if start != -1:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return crc_hqx(key, 0) % CLUSTER_SLOTS


LEARN_EVERY_S = 1.0     # CLUSTER NODES asked again for an unknown server at most this often
# Members remembered at most (seeds first, then the slot map's servers, then those CLUSTER
# NODES lists): Redis Cluster documents 1000 masters as its largest size, so a reply
# naming more is planted or broken, and must not make each refresh slower (a list of
# 30000 members took 156 s of CPU per refresh, other clients waiting behind the GIL).
MAX_MEMBERS = 4096


class Reach(str, Enum):
    """What a routing refresh found."""

    UNREACHABLE = "unreachable"  # no server answered: the tier is down
    PARTIAL = "partial"          # serving, but some slots have no live server yet
    HEALED = "healed"            # every slot has a live server


def conn_options(cfg: RedisConfig, target: RedisTarget) -> tuple[NodeAddr, ConnOptions]:
    """The seed server and connection options (credentials, db, TLS) for ``cfg``; the db
    was validated by ``parse_target``."""
    parts = urlsplit(target.url)
    if parts.scheme == "unix":
        addr = NodeAddr(unquote(parts.path), 0, unix=True)
    else:
        addr = NodeAddr(parts.hostname or "127.0.0.1", parts.port or 6379)
    opts = ConnOptions(
        connect_timeout_s=cfg.connect_timeout_s, op_timeout_s=cfg.op_timeout_s,
        username=cfg.username or unquote(parts.username or ""),
        password=cfg.password or unquote(parts.password or ""),
        db=target.db, tls=tls_context(cfg) if target.tls else None)
    return addr, opts


class Router:
    """Key -> server routing and the per-server connection pools (thread-safe reads)."""

    def __init__(self, seed: NodeAddr, opts: ConnOptions, *, cluster: bool,
                 pool_size: int, seeds: Sequence[NodeAddr] = ()) -> None:
        self.cluster = cluster
        self.seed = seed
        self.opts = opts
        self.pool_size = pool_size
        self._pools: dict[NodeAddr, NodePool] = {}
        self._lock = threading.Lock()
        self._slots: list[NodeAddr | None] = [seed] * CLUSTER_SLOTS if cluster else []
        self._seeds: tuple[NodeAddr, ...] = tuple(dict.fromkeys([seed, *seeds]))
        # every member met (an ordered set, at most MAX_MEMBERS): where redirects may go
        # and whom a refresh asks; replaced whole, never changed in place (read by the
        # event loop while a worker thread refreshes)
        self._known: dict[NodeAddr, None] = dict.fromkeys(self._seeds)
        self.failed: set[NodeAddr] = set()
        self.last_error = ""
        self._learned_at = -LEARN_EVERY_S   # when learn_members last asked
        self.protocol_errors = 0   # connections dropped out of step with their server
        self.stray_frames = 0      # ... that read another key's frame (found by review)

    # --- routing --------------------------------------------------------------------------

    def node_for(self, rkey: bytes) -> NodeAddr | None:
        """The server for ``rkey``; None while its slot has no live server."""
        if not self.cluster:
            return None if self.seed in self.failed else self.seed
        node = self._slots[key_slot(rkey)]
        return None if node is None or node in self.failed else node

    def group(self, rkeys: Sequence[bytes]) -> dict[NodeAddr | None, list[int]]:
        """Indexes of ``rkeys`` per server (None: no live server, a miss)."""
        groups: dict[NodeAddr | None, list[int]] = {}
        for i, rkey in enumerate(rkeys):
            groups.setdefault(self.node_for(rkey), []).append(i)
        return groups

    def redirect(self, reply: ErrorReply) -> tuple[NodeAddr, bool] | None:
        """Where a ``MOVED slot host:port`` or ``ASK slot host:port`` reply sends a key, and
        whether it is an ASK (the slot is being migrated: ask there behind an ASKING); None
        for any other reply, or a server not known as a member (CLUSTER SLOTS and NODES)
        or marked failed: a redirect is only followed to a known member, never to wherever
        a reply says (a connection sends the password first)."""
        parts = reply.split()
        if len(parts) != 3 or parts[0] not in REDIRECTS or not parts[1].isdigit():
            return None
        host, sep, port = parts[2].rpartition(":")
        number = _port(port)
        if not (sep and host and number):
            return None
        addr = NodeAddr(host.strip("[]"), number)
        if addr not in self._known or addr in self.failed:
            return None
        return addr, parts[0] == "ASK"

    def masters(self) -> list[NodeAddr]:
        """Servers that own slots (the one server outside a cluster)."""
        if not self.cluster:
            return [self.seed]
        return sorted({n for n in self._slots if n is not None}, key=str)

    def unserved_slots(self) -> int:
        """Slots with no live server (0 outside a cluster while the server is up)."""
        if not self.cluster:
            return CLUSTER_SLOTS if self.seed in self.failed else 0
        return sum(1 for n in self._slots if n is None or n in self.failed)

    def pool(self, addr: NodeAddr) -> NodePool:
        with self._lock:
            pool = self._pools.get(addr)
            if pool is None:
                pool = self._pools[addr] = NodePool(addr, self.opts, self.pool_size,
                                                    self._out_of_step)
            return pool

    def _out_of_step(self, addr: NodeAddr, extra: bool) -> None:
        """A connection to ``addr`` was discarded (any worker thread): it ended an exchange
        with bytes past its replies (``extra``: the server sent more than asked,
        ``protocol_errors``), or a GET of it was answered with another key's frame and
        nothing more came (``stray_frames``): on a sound server, a value another writer
        copied under that key, or else a reply out of step (found by review: hundreds of
        such copies were logged as the server sending more than its replies)."""
        with self._lock:
            if extra:
                self.protocol_errors += 1
            else:
                self.stray_frames += 1
        if extra:
            _warn.warning("extra", "redis tier: %s sent more than its replies; connection "
                          "dropped", addr)
        else:
            _warn.warning("stray", "redis tier: %s answered a GET with another key's frame "
                          "(a value copied under the wrong key, or a reply out of step); "
                          "connection dropped", addr)

    def mark_failed(self, addr: NodeAddr) -> None:
        """Stop routing to ``addr`` until a refresh finds it alive (or gone from the map)."""
        self.failed.add(addr)
        with self._lock:
            pool = self._pools.pop(addr, None)
        if pool is not None:
            pool.close()

    # --- healing (blocking: run in a worker thread) ---------------------------------------

    def drop_pools(self) -> None:
        """Close every pooled connection (after the server went away: they are dead)."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    def _exchange(self, addr: NodeAddr, cmds: list[bytes],
                  max_bytes: int = SMALL_REPLY_BYTES) -> list[Any] | None:
        """``cmds``' replies (each of at most ``max_bytes``) from ``addr`` on a fresh
        connection, closed after; None when it failed (``last_error`` says why)."""
        try:
            conn = Conn(addr, self.opts)
        except OSError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        try:
            conn.begin()
            return conn.simple_many(cmds, max_bytes)
        except OSError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            conn.close()

    def exchange_once(self, addr: NodeAddr, cmds: list[bytes]) -> list[Any] | None:
        """``cmds``' small replies from ``addr`` on a fresh connection (its first reply is
        its own, whatever a pooled one received before); None when it failed."""
        return self._exchange(addr, cmds)

    def probe(self, addr: NodeAddr) -> bool:
        """Whether ``addr`` answers PING on a fresh connection (``last_error`` says why not)."""
        replies = self._exchange(addr, [command(b"PING")])
        if replies is None:
            return False
        if replies[0] != "PONG":
            self.last_error = f"redis {addr} answered PING with {replies[0]}"
        return replies[0] == "PONG"

    def learn_members(self) -> None:
        """Remember every member that CLUSTER NODES of the first live master lists (a
        master just added owns no slot, so only that names it); at most once per
        ``LEARN_EVERY_S``, however many redirects name an unknown or failed server."""
        now = time.monotonic()
        if now - self._learned_at < LEARN_EVERY_S:
            return
        self._learned_at = now
        for addr in [n for n in self.masters() if n not in self.failed]:
            replies = self._exchange(addr, [command(b"CLUSTER", b"NODES")],
                                     LARGE_REPLY_BYTES)
            if replies is not None and isinstance(replies[0], bytes):
                self._learn(_member_addrs(replies[0], addr.host, MAX_MEMBERS))
                return

    def refresh(self) -> Reach:
        """Reload routing and say whether every slot has a live server again.

        Outside a cluster: probe the server. In a cluster: read CLUSTER SLOTS from the first
        server that answers (live masters, then every server seen), then probe the failed
        servers that still own slots; servers that answer are routed to again.
        """
        if not self.cluster:
            if self.probe(self.seed):
                self.failed.discard(self.seed)
                return Reach.HEALED
            return Reach.UNREACHABLE
        candidates = dict.fromkeys(n for n in self.masters() if n not in self.failed)
        candidates.update(self._known)   # (a dict: linear, however many members)
        for addr in candidates:
            slots = self._fetch_slots(addr)
            if slots is not None:
                self._install(slots)
                break
        else:
            return Reach.UNREACHABLE
        owners = set(self._slots)
        for addr in [n for n in list(self.failed) if n in owners]:
            if self.probe(addr):
                self.failed.discard(addr)
        return Reach.HEALED if self.unserved_slots() == 0 else Reach.PARTIAL

    def _fetch_slots(self, addr: NodeAddr) -> list[NodeAddr | None] | None:
        replies = self._exchange(addr, [command(b"CLUSTER", b"SLOTS"),
                                        command(b"CLUSTER", b"NODES")], LARGE_REPLY_BYTES)
        if replies is None:
            return None
        reply, nodes = replies
        # members without slots too: a master being added is where a reshard's ASKs go
        members = (_member_addrs(nodes, addr.host, MAX_MEMBERS) if isinstance(nodes, bytes)
                   else [])
        if isinstance(reply, ErrorReply) or not isinstance(reply, list):
            self.last_error = f"redis {addr} answered CLUSTER SLOTS with {reply}"
            self._learn(members)
            return None
        try:
            ranges = _slot_ranges(reply, addr.host)
        except ValueError as exc:   # the next candidate is asked
            self.last_error = f"redis {addr} sent a malformed CLUSTER SLOTS reply: {exc}"
            self._learn(members)
            return None
        slots: list[NodeAddr | None] = [None] * CLUSTER_SLOTS
        in_map: dict[NodeAddr, None] = {}
        for lo, hi, servers in ranges:
            slots[lo:hi + 1] = [servers[0]] * (hi - lo + 1)
            in_map.update(dict.fromkeys(servers))
        self._learn([*in_map, *members], first=True)
        return slots

    def _learn(self, addrs: Sequence[NodeAddr], *, first: bool = False) -> None:
        """Remember ``addrs`` as members, within ``MAX_MEMBERS``: the seeds are always
        kept; with ``first`` (the servers of a slot map just read, then the members its
        server lists) they go before those remembered earlier, which are kept as room
        allows; else they are added as room allows. Linear in both."""
        with self._lock:
            known = dict.fromkeys(self._seeds)
            for group in ((addrs, self._known) if first else (self._known, addrs)):
                for addr in group:
                    if len(known) >= MAX_MEMBERS:
                        break
                    known[addr] = None
            self._known = known

    def _install(self, slots: list[NodeAddr | None]) -> None:
        self._slots = slots
        live = set(slots)
        self.failed &= live  # a failed server that lost its slots no longer matters
        with self._lock:
            gone = [a for a in self._pools if a not in live]
            pools = [self._pools.pop(a) for a in gone]
        for pool in pools:
            pool.close()

    def close(self) -> None:
        """Close every pooled connection (the tier is closing)."""
        self.drop_pools()


def _member_addrs(nodes: bytes, default_host: str,
                  limit: int | None = None) -> list[NodeAddr]:
    """The addresses of a CLUSTER NODES reply's members (``id host:port@cport[,name]
    flags ...`` per line), but those without an address or still in a handshake; the
    first ``limit`` distinct ones at most (the rest of the reply is not parsed)."""
    out: dict[NodeAddr, None] = {}
    for line in nodes.decode(errors="replace").splitlines():
        if limit is not None and len(out) >= limit:
            break
        fields = line.split()
        if len(fields) < 3 or "noaddr" in fields[2] or "handshake" in fields[2]:
            continue
        host, sep, port = fields[1].split("@", 1)[0].rpartition(":")
        number = _port(port)
        if sep and number:
            out[NodeAddr(host.strip("[]") or default_host, number)] = None
    return list(out)


def _port(text: str) -> int | None:
    """``text`` as a TCP port (1..65535), or None (``isdigit`` alone admits "²")."""
    if not (text.isascii() and text.isdigit()):
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def _slot_ranges(reply: list[Any], default_host: str
                 ) -> list[tuple[int, int, list[NodeAddr]]]:
    """The ``(lo, hi, [master, *replicas])`` entries of a CLUSTER SLOTS reply. ValueError
    for any malformed entry (not a list, slots outside 0..16383 or in the wrong order, a
    node without a string host or a port in 1..65535): such a reply is not used at all,
    and a range is never trusted to size the slot map. Ranges covering more than the 16384
    slots in all (they overlap) are refused too: installing them would cost up to 16384
    slot writes per entry."""
    ranges: list[tuple[int, int, list[NodeAddr]]] = []
    covered = 0
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3:
            raise ValueError(f"entry {entry!r:.80}")
        lo, hi = entry[0], entry[1]
        if not (isinstance(lo, int) and isinstance(hi, int)
                and 0 <= lo <= hi < CLUSTER_SLOTS):
            raise ValueError(f"slot range {lo!r:.40}-{hi!r:.40}")
        covered += hi - lo + 1
        if covered > CLUSTER_SLOTS:
            raise ValueError("slot ranges overlap")
        ranges.append((lo, hi, [_slot_node(item, default_host) for item in entry[2:]]))
    return ranges


def _slot_node(item: Any, default_host: str) -> NodeAddr:
    """A CLUSTER SLOTS node (``[host, port, ...]``; an empty or null host: the server
    asked, as Redis documents it); ValueError when malformed."""
    if not isinstance(item, list) or len(item) < 2:
        raise ValueError(f"node {item!r:.80}")
    host, port = item[0], item[1]
    if not (host is None or isinstance(host, bytes)) or not isinstance(port, int) \
            or not 0 < port < 65536:
        raise ValueError(f"node {item[:2]!r:.80}")
    return NodeAddr(host.decode() if host else default_host, port)
