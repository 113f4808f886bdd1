"""The Redis tier: KV blocks shared across nodes through Redis or Redis Cluster.

Redis is the tier that lets prefix reuse cross machines, and the one most likely to be
slow or gone. Everything here is built so that Redis trouble costs hits, never requests:

- No method raises because of Redis. Errors are counted (``counters.errors``, with the
  last one in ``stats_extra()``), the tier is marked down after a connection failure (or
  ``DOWN_AFTER_FAILURES`` soft failures in a row), and while down every lookup is a miss.
  A background task reconnects with jittered exponential backoff (capped at 5 s) and the
  tier is up again once a fresh connection answers PING.
- Redis Cluster: a server that fails is taken out of the routing at once (its slots are
  misses, answered without waiting) and the slot map is reloaded with the same backoff
  until every slot has a live server again (a promoted replica); the tier stays up while
  any server answers. ``stats_extra()`` shows ``unserved_slots`` and ``last_heal_s``.
  A MOVED or ASK reply (a reshard) is followed once to the member it names, behind an
  ASKING for an ASK; ``redirects`` counts the keys asked again (docs/redis.md).
- Block traffic goes over kvtier's own RESP connections (kvtier.tiers.redis_wire), run in
  worker threads, several in flight: a SET is sent from the caller's buffer, a GET lands
  in the caller's buffer; no Python copy of a payload either way. Every exchange is
  bounded by ``op_timeout_s``.
- Reads walk a prefix: pipelined EXISTS / GET in batches (up to ``max_inflight`` batches
  in flight, and about ``inflight_bytes_per_server`` per live server: a server buffers
  each GET pipeline's whole reply), stopping at the first miss. Every value is a frame
  (kvtier.frame) checked against the expected namespace, key and layout fingerprint plus
  its payload checksum; a frame failing a check is a miss, counted in
  ``counters.checksum_failures``, deleted from Redis and never left in the caller's buffer.
  A sound frame of another namespace (a caller with a stolen key) is a miss, counted in
  ``namespace_mismatches``, and is left alone: it is another tenant's block, not a
  corrupt one. Buffers past the returned count may have been written (with verified
  blocks): their contents are unspecified.
- ``exists_prefix`` and ``delete`` given the caller's namespace read the namespace field of
  each frame (GETRANGE, as cheap as EXISTS) and treat another namespace's frame as absent.
- Writes are write-behind: ``submit`` queues the block and returns, either borrowing the
  caller's buffer until a ``release`` callback (zero-copy: one checksum per block) or
  copying it. A writer task frames and pipelines SETs, ``write_inflight`` (1) batch at a
  time, each batch one pipeline per server holding its keys. The queue is bounded
  (``write_queue_blocks``); when full the oldest pending write is dropped and counted.

Redis key of a block = ``key_prefix`` + hex of its 16-byte key. Keys carry no hash tag,
so in a cluster they spread over all slots. Counters: ``bytes_read``/``bytes_written`` are
wire bytes (frames); ``hit_blocks``/``miss_blocks`` (and ``_tokens``) are the store's, counted
once per lookup from its probe, as for cpu and nvme (kvtier.store.stats
``count_redis_lookup``); ``get_into`` counts only ``fetched_blocks`` and
``fetch_missed_blocks`` (``stats_extra``).

Capacity: Redis itself bounds memory (``maxmemory`` + an eviction policy such as
``allkeys-lru``) and the TTL ages blocks out; ``used_bytes``/``blocks`` report the
server's ``used_memory``/``DBSIZE`` (whole database: give kvtier its own db or cluster).
``capacity_bytes`` is ``redis.bytes`` when set, else the masters' ``maxmemory`` (every
master's: one without a limit makes the whole unbounded), else 0: no limit, which
``stats_extra`` reports as a null capacity and free space (``capacity_from: none``), never
as a full tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

from kvtier import codec as codecs
from kvtier.errors import FrameError
from kvtier.frame import FrameHeader
from kvtier.tiers.base import EvictionReason, TierName
from kvtier.tiers.redis_blocks import header_range
from kvtier.tiers.redis_link import (
    CLUSTER_REDIRECTS,
    DOWN_AFTER_FAILURES,
    HEALTH_INTERVAL_S,
    RECONNECT_BACKOFF,
    STATS_EVERY,
    UNSERVED,
    _describe,
    log,
)
from kvtier.tiers.redis_probe import EXISTS_BATCH, NS_END, NS_OFFSET
from kvtier.tiers.redis_reads import GET_BATCH_BYTES, GET_BATCH_KEYS
from kvtier.tiers.redis_resp import ErrorReply, command
from kvtier.tiers.redis_route import Reach
from kvtier.tiers.redis_stripes import owned_part_keys
from kvtier.tiers.redis_wire import Conn
from kvtier.tiers.redis_writes import SET_BATCH_BYTES, SET_BATCH_KEYS, RedisWrites

__all__ = [
    "CLOSE_FLUSH_S",
    "CLUSTER_REDIRECTS",
    "DOWN_AFTER_FAILURES",
    "EXISTS_BATCH",
    "GET_BATCH_BYTES",
    "GET_BATCH_KEYS",
    "HEALTH_INTERVAL_S",
    "NS_END",
    "NS_OFFSET",
    "RECONNECT_BACKOFF",
    "SET_BATCH_BYTES",
    "SET_BATCH_KEYS",
    "STATS_EVERY",
    "UNSERVED",
    "RedisTier",
]

CLOSE_FLUSH_S = 5.0               # bounded drain at close
DELETE_CHUNK = 512                # keys per delete round (headers checked, then DEL): the
                                  # event loop's share of a round is ~1.5 ms of Python


class RedisTier(RedisWrites):
    """Remote tier over Redis / Redis Cluster (see the module docstring for the contract).

    Layers, each a module: ``RedisLink`` (kvtier.tiers.redis_link: state, threads, routing,
    health, reconnects), ``RedisReads`` (kvtier.tiers.redis_reads: probes and GETs),
    ``RedisWrites`` (kvtier.tiers.redis_writes: the write-behind queue's writer), and this
    class: the Tier protocol, lifecycle, delete and stats.
    """

    name = TierName.REDIS

    # --- Tier protocol --------------------------------------------------------------------

    @property
    def backend(self) -> str:
        return self._target.mode.value

    @property
    def capacity_bytes(self) -> int:
        """``redis.bytes``, else the masters' ``maxmemory``; 0 when neither bounds it."""
        return self.cfg.bytes or self._server.limit

    def capacity_stats(self) -> dict[str, Any]:
        """Where the capacity comes from (``redis.bytes``, ``maxmemory`` or ``none``); with
        none, ``capacity_bytes`` and ``free_bytes`` are None (no limit; before the first
        INFO round, not known yet), so that no reader takes 0 for a full tier."""
        if self.cfg.bytes:
            return {"capacity_from": "redis.bytes"}
        if self._server.limit:
            return {"capacity_from": "maxmemory"}
        return {"capacity_from": "none", "capacity_bytes": None, "free_bytes": None}

    @property
    def used_bytes(self) -> int:
        return self._server.used

    @property
    def blocks(self) -> int:
        return self._server.keys

    @property
    def up(self) -> bool:
        return self._up

    @property
    def healing_since(self) -> float | None:
        """While up with a server out of the routing or slots no live server serves (a
        master died; its replica is being promoted, or the slot map is being reloaded):
        when that began (``time.monotonic()``, one value per outage); else None."""
        if not self._up or not (self._router.failed or self._router.unserved_slots()):
            return None
        return self._unserved_since or 0.0   # set when a server failed or at a partial start

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, or mark down and keep reconnecting in the background: never raises
        because Redis is unreachable (a bad URL raised ConfigError in the constructor)."""
        try:
            reach = await self._in_thread(self._router.refresh)
        except Exception as exc:  # a bug, not Redis trouble: still never raise here
            self._router.last_error = _describe(exc)
            reach = Reach.UNREACHABLE
        if reach is Reach.UNREACHABLE:
            self._note_error(ConnectionError(self._router.last_error))
            self.last_error = self._router.last_error
            log.warning("redis tier down at start (%s): %s; retrying in the background",
                        self._target.display, self.last_error)
            self._start_reconnect()
        else:
            self._set_up()
            log.info("redis tier up: %s", self._target.display)
            if reach is Reach.PARTIAL:
                self._unserved_since = time.monotonic()
                self._start_reconnect()
        self._writer = asyncio.create_task(self._write_loop(), name="kvtier-redis-writer")
        self._monitor = asyncio.create_task(self._monitor_loop(), name="kvtier-redis-health")

    async def close(self, timeout: float = CLOSE_FLUSH_S) -> None:
        """Drain pending writes for at most ``timeout`` s, then stop tasks and close pools.

        Writes still queued after the bounded wait are dropped and counted. Cleanup runs
        even when the caller cancels the drain (e.g. an outer ``wait_for``).
        """
        if self._closed:
            return
        try:
            await self.flush(timeout=timeout)
        finally:
            self._closed = True
            self.counters.dropped_writes += self._queue.clear()
            tasks = [t for t in (self._writer, self._monitor, self._reconnector) if t]
            tasks += list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._router.close()
            self._exec.shutdown(wait=False, cancel_futures=True)
            self._up = False

    async def delete(self, keys: Sequence[bytes], *, namespace: bytes | None = None) -> int:
        """Delete blocks from Redis; returns how many existed. 0 while down or on error.

        With ``namespace``, only frames of that namespace are deleted (checked first with
        GETRANGE; another namespace's frame is counted in ``namespace_mismatches`` and kept).
        A striped block's stripes go with its head only when the head's header is sound
        (``redis_stripes.owned_part_keys``): a corrupt one never names thousands of keys.
        """
        n = 0
        for lo in range(0, len(keys), DELETE_CHUNK):   # each chunk's work on the loop stays
            if not self._up:                            # short, its exchanges awaited
                break
            n += await self._delete_some(keys[lo: lo + DELETE_CHUNK], namespace)
        return n

    async def _delete_some(self, keys: Sequence[bytes], namespace: bytes | None) -> int:
        rkeys = [self._rkey(k) for k in keys]
        stripes: list[bytes] = []   # of striped blocks (their sound headers say how many)
        heads = await self._per_server(rkeys, lambda conn, idx: conn.simple_many(
            [header_range(rkeys[i]) for i in idx]))
        if any(isinstance(r, ErrorReply) for r in heads):
            self._error_reply(next(r for r in heads if isinstance(r, ErrorReply)))
        mine: list[bytes] = []
        for rkey, head in zip(rkeys, heads, strict=True):
            if namespace is not None and not (
                    isinstance(head, bytes) and self._present(head[NS_OFFSET:NS_END + 1],
                                                              namespace)):
                continue   # absent, or another namespace's frame: kept
            mine.append(rkey)
            with contextlib.suppress(FrameError):
                if isinstance(head, bytes) and head:
                    header = FrameHeader.unpack(head)
                    stripes += owned_part_keys(rkey, header,
                                               self._block_bytes_for(header.namespace))
        if not mine:
            return 0
        rkeys, every = mine, mine + stripes

        def delete(conn: Conn, idx: list[int]) -> list[Any]:
            return conn.simple_many([command(b"DEL", every[i]) for i in idx])

        replies = (await self._per_server(every, delete))[:len(rkeys)]   # blocks: heads
        n = sum(r for r in replies if isinstance(r, int) and not isinstance(r, bool))
        if any(isinstance(r, ErrorReply) for r in replies):
            self._error_reply(next(r for r in replies if isinstance(r, ErrorReply)))
        elif not any(isinstance(r, BaseException) for r in replies):
            self._succeeded()
        self.counters.evicted(EvictionReason.DELETED, n)
        return n

    def stats_extra(self) -> dict[str, Any]:
        """Redis-specific numbers for /v1/stats (the shared counters are in ``counters``)."""
        codec = self._codec
        current = codec.current if isinstance(codec, codecs.AutoCodec) else codec
        return {
            "target": self._target.display,
            "queue_depth": len(self._queue),
            "queue_bytes": self._queue.queued_bytes,
            "writes_in_flight": self._writing,
            "dropped_writes": self.counters.dropped_writes,
            "reconnects": self.reconnects,
            "consecutive_failures": self._consecutive_failures,
            "unserved_slots": self._router.unserved_slots() if self._up else 0,
            "failed_servers": sorted(str(a) for a in self._router.failed),
            "redirects": self.redirects,
            "last_heal_s": self.last_heal_s,
            "codec": self.cfg.codec,
            "codec_current": current.name.lower(),
            "codec_ratio": self._frames_raw / self._frames_wire if self._frames_wire else 1.0,
            "last_error": self.last_error,
            "namespace_mismatches": self.namespace_mismatches,
            "protocol_errors": self._router.protocol_errors,
            "stray_frames": self._router.stray_frames,
            "fetched_blocks": self.fetched_blocks,
            "fetch_missed_blocks": self.fetch_missed_blocks,
            **self.capacity_stats(),
        }
