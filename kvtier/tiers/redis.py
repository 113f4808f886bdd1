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
wire bytes (frames); ``hit_blocks``/``miss_blocks`` are counted by ``get_into`` (blocks
asked for vs. filled), not by ``exists_prefix``.

Capacity: Redis itself bounds memory (``maxmemory`` + an eviction policy such as
``allkeys-lru``) and the TTL ages blocks out; ``used_bytes``/``blocks`` report the
server's ``used_memory``/``DBSIZE`` (whole database: give kvtier its own db or cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from kvtier import codec as codecs
from kvtier.errors import FrameError
from kvtier.frame import FLAG_STRIPED, HEADER_SIZE, FrameHeader
from kvtier.tiers.base import EvictionReason, TierName
from kvtier.tiers.redis_blocks import WireSet, write_blocks
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
from kvtier.tiers.redis_queue import OnChecksum, PendingWrite, Release, frame_pending
from kvtier.tiers.redis_reads import (
    EXISTS_BATCH,
    GET_BATCH_BYTES,
    GET_BATCH_KEYS,
    NS_END,
    NS_OFFSET,
    RedisReads,
)
from kvtier.tiers.redis_route import Reach
from kvtier.tiers.redis_stripes import part_keys, stripe_sets
from kvtier.tiers.redis_wire import Conn, ErrorReply, command

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

SET_BATCH_KEYS = 512              # keys per pipelined SET round trip, and about this many
SET_BATCH_BYTES = 32 << 20        # bytes: what was queued goes out as one pipeline per
                                  # server. A Redis server ingests SETs fastest from one
                                  # connection at a time (bench_redis: 8 MiB of 256 KiB
                                  # values 2.5 ms on one connection, 3.5-4.6 ms spread over
                                  # 2-8; 24 MiB of 3 MiB ones 6 ms vs 9.6 ms), so writes
                                  # keep ``write_inflight`` (1) batch in flight; the
                                  # op timeout bounds a batch's exchange (32 MiB at 1 GB/s
                                  # is 32 ms)
CLOSE_FLUSH_S = 5.0               # bounded drain at close


class RedisTier(RedisReads):
    """Remote tier over Redis / Redis Cluster (see the module docstring for the contract).

    Layers, each a module: ``RedisLink`` (kvtier.tiers.redis_link: state, threads, routing,
    health, reconnects), ``RedisReads`` (kvtier.tiers.redis_reads: probes and GETs), and
    this class: the Tier protocol, lifecycle, write-behind writes, delete and stats.
    """

    name = TierName.REDIS

    # --- Tier protocol --------------------------------------------------------------------

    @property
    def backend(self) -> str:
        return self._target.mode.value

    @property
    def capacity_bytes(self) -> int:
        return self.cfg.bytes or self._server_max

    @property
    def used_bytes(self) -> int:
        return self._server_used

    @property
    def blocks(self) -> int:
        return self._server_keys

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

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent; False on timeout or while down.

        Returns at once (False) while the tier is down: nothing can drain until it is
        back, and a SIGTERM drain must not hang on a dead Redis.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while len(self._queue) or self._writing:
            if not self._up or self._closed:
                return False
            wait = 0.1 if deadline is None else min(0.1, deadline - loop.time())
            if wait <= 0:
                return False
            self._progress.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._progress.wait(), wait)
        return True

    # --- writes ---------------------------------------------------------------------------

    def submit(self, namespace: bytes, key: bytes, layout_fp: int, payload: memoryview, *,
               seq: int = 0, release: Release | None = None,
               elem_bytes: int | None = None, on_checksum: OnChecksum | None = None) -> None:
        """Queue a block for writing (write-behind).

        With ``release``, ``payload`` is used in place (no copy: the caller keeps it
        unchanged, e.g. an arena slot pinned) and ``release()`` is called exactly once, on
        the event loop, when the write is over (sent, dropped or failed). Without it the
        payload is copied before returning. Never blocks and never raises for Redis
        trouble: a full queue drops its oldest write (``counters.dropped_writes``); writes
        queued while down wait for the tier to come back (within the same bound), as
        copies: going down drops the queued borrowed writes (their buffers are released),
        and a borrowed write submitted while down is copied, so a dead Redis never pins
        the caller's memory. ``elem_bytes`` (the shuffle codecs' element width) defaults
        to the width of ``namespace``'s layout (``use_layouts``), else ``elem_bytes_hint``.
        ``on_checksum`` (borrowed writes only) is called once, on the event loop, just
        before ``release``: with the payload's xxh3-64 (``kvtier.frame.payload_checksum``)
        when its frame was built uncompressed, else None; a caller that needs that number
        too (the arena journal) need not hash the block again.
        """
        if self._closed:
            self.counters.dropped_writes += 1
            if on_checksum is not None:
                on_checksum(None)
            if release is not None:
                release()
            return
        rkey = self._rkey(key)
        if release is not None and not self._up:  # may wait long: do not hold the caller's
            release()                               # buffer (e.g. a pinned arena slot)
            release = None
        if release is None and on_checksum is not None:   # a copy: nobody waits on it
            on_checksum(None)
            on_checksum = None
        width = self._elem_bytes_for(namespace) if elem_bytes is None else elem_bytes
        item = (PendingWrite.copy_of(rkey, namespace, key, layout_fp, seq, payload, width)
                if release is None else
                PendingWrite.borrow(rkey, namespace, key, layout_fp, seq, payload, release,
                                    width, on_checksum))
        self._outcomes.track(item)
        dropped = self._queue.push(item)
        if dropped is not None:
            dropped.done()
            self.counters.dropped_writes += 1
        self._wake.set()

    async def written(self, keys: Sequence[bytes], since: float) -> list[bool | None]:
        """Per key, once its newest queued write is over: True if Redis stored it, False
        if it failed or was dropped; None when no write of the key is pending or ended at
        or after ``since`` (``time.monotonic()``): only Redis can tell (``exists_prefix``)."""
        return await self._outcomes.wait([self._rkey(k) for k in keys], since, up=self._up)

    async def delete(self, keys: Sequence[bytes], *, namespace: bytes | None = None) -> int:
        """Delete blocks from Redis; returns how many existed. 0 while down or on error.

        With ``namespace``, only frames of that namespace are deleted (checked first with
        GETRANGE; another namespace's frame is counted in ``namespace_mismatches`` and kept).
        """
        if not keys or not self._up:
            return 0
        rkeys = [self._rkey(k) for k in keys]
        stripes: list[bytes] = []   # of striped blocks (their headers say how many)
        heads = await self._per_server(rkeys, lambda conn, idx: conn.simple_many(
            [command(b"GETRANGE", rkeys[i], b"0", b"%d" % (HEADER_SIZE - 1)) for i in idx]))
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
                    if header.flags & FLAG_STRIPED:
                        stripes += part_keys(rkey, header)
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
            "last_heal_s": self.last_heal_s,
            "codec": self.cfg.codec,
            "codec_current": current.name.lower(),
            "codec_ratio": self._frames_raw / self._frames_wire if self._frames_wire else 1.0,
            "last_error": self.last_error,
            "namespace_mismatches": self.namespace_mismatches,
        }

    async def _send_sets(self, sets: list[WireSet]) -> list[Any]:
        """One pipeline per server of ``sets``; a reply per entry (see ``_per_server``)."""
        if not sets:
            return []

        def put(conn: Conn, idx: list[int]) -> list[Any]:
            return write_blocks(conn, [sets[i] for i in idx], self._codec, self._ttl)

        return await self._per_server([s[0] for s in sets], put, holds_buffers=True)

    async def _write_loop(self) -> None:
        while True:
            while not (self._queue and self._up):
                self._wake.clear()
                await self._wake.wait()
            await self._inflight.acquire()
            batch = self._queue.take(SET_BATCH_KEYS, SET_BATCH_BYTES)
            if not batch:
                self._inflight.release()
                continue
            self._writing += 1
            self._spawn(self._write_batch(batch))

    async def _write_batch(self, batch: list[PendingWrite]) -> None:
        try:
            striped = [it for it in batch if it.striped]
            sets: list[WireSet] = [(it.redis_key, it, None) for it in batch if not it.striped]
            heads: list[WireSet] = []
            if striped:   # framed first (in parallel, off the loop): stripes need the header
                await asyncio.gather(*(self._in_thread(partial(frame_pending, it, self._codec))
                                       for it in striped))
                for it in striped:
                    parts, (rkey, head) = stripe_sets(it)
                    sets += [(key, it, data) for key, data in parts]
                    heads.append((rkey, it, head))
            replies = await self._send_sets(sets)
            if heads:   # a head only once every stripe of its block is stored
                failed = {id(it) for (_, it, _), r in zip(sets, replies, strict=True)
                          if r != "OK"}
                heads = [h for h in heads if id(h[1]) not in failed]
                sets += heads
                replies += await self._send_sets(heads)
            ok = True
            result: dict[int, Any] = {}   # per block: "OK", or its first other reply
            for (_, item, _), reply in zip(sets, replies, strict=True):
                if result.get(id(item), "OK") == "OK":
                    result[id(item)] = reply
            for item in batch:
                reply = result[id(item)]
                item.ok = reply == "OK"
                if not item.ok:
                    ok = False
                    self.counters.dropped_writes += 1
                    if isinstance(reply, ErrorReply):
                        self._error_reply(reply)
                    continue
                wire = item.wire_len
                self.counters.bytes_written += wire
                self._frames_raw += item.raw_len
                self._frames_wire += wire
            if ok:
                self._succeeded()
        except Exception as exc:  # a bug in framing must not kill the writer
            log.exception("redis tier: write batch failed")
            self._note_error(exc)
            self.counters.dropped_writes += len(batch)
        finally:
            for item in batch:
                item.done()
            self._writing -= 1
            self._inflight.release()
            self._progress.set()
