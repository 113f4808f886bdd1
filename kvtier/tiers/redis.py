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
  in flight), stopping at the first miss. Every value is a frame (kvtier.frame) checked
  against the expected namespace, key and layout fingerprint plus its payload checksum; a
  frame failing a check is a miss, counted in ``counters.checksum_failures``, deleted from
  Redis and never left in the caller's buffer. A sound frame of another namespace (a
  caller with a stolen key) is a miss, counted in ``namespace_mismatches``, and is left
  alone: it is another tenant's block, not a corrupt one. Buffers past the returned count
  may have been written (with verified blocks): their contents are unspecified.
- ``exists_prefix`` and ``delete`` given the caller's namespace read the namespace field of
  each frame (GETRANGE, as cheap as EXISTS) and treat another namespace's frame as absent.
- Writes are write-behind: ``submit`` queues the block and returns, either borrowing the
  caller's buffer until a ``release`` callback (zero-copy: one checksum per block) or
  copying it. Writer tasks frame and pipeline SETs, at most ``max_inflight`` pipelines at
  once. The queue is bounded (``write_queue_blocks``); when full the oldest pending
  write is dropped and counted.

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
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier import codec as codecs
from kvtier.backoff import Backoff, BackoffPolicy
from kvtier.config import RedisConfig
from kvtier.frame import Codec
from kvtier.tiers.base import EvictionReason, TierCounters, TierName
from kvtier.tiers.redis_blocks import MISSING, BlockRead, ReadStatus, read_blocks, write_blocks
from kvtier.tiers.redis_client import RedisMode, parse_target
from kvtier.tiers.redis_queue import PendingWrite, Release, WriteQueue
from kvtier.tiers.redis_route import Reach, Router, conn_options
from kvtier.tiers.redis_wire import Conn, ErrorReply, NodeAddr, ReplyError, command

log = logging.getLogger(__name__)

EXISTS_BATCH = 64                 # keys per pipelined EXISTS round trip
GET_BATCH_KEYS = 32               # keys per pipelined GET round trip ...
GET_BATCH_BYTES = 1 << 20         # ... and about this many bytes: small enough that a
SET_BATCH_KEYS = 32               # prompt's blocks spread over max_inflight connections
SET_BATCH_BYTES = 1 << 20         # (bench_redis), large enough to amortize a thread hop
DOWN_AFTER_FAILURES = 3           # soft failures (timeouts, error replies) in a row
RECONNECT_BACKOFF = BackoffPolicy(base_s=0.05, cap_s=5.0)   # kvtier.backoff: x2, jitter 0.5
HEALTH_INTERVAL_S = 1.0           # PING while idle, so `up` falls even without traffic
STATS_EVERY = 5                   # health rounds between INFO/DBSIZE refreshes
CLOSE_FLUSH_S = 5.0               # bounded drain at close
CLUSTER_REDIRECTS = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")  # replies that mean "re-route"

T = TypeVar("T")
UNSERVED = object()               # per-key result: no live server for the key's slot
NS_OFFSET, NS_END = 8, 23         # the frame header's namespace field (GETRANGE, inclusive)


class RedisTier:
    """Remote tier over Redis / Redis Cluster (see the module docstring for the contract)."""

    name = TierName.REDIS

    def __init__(self, cfg: RedisConfig, *, elem_bytes_hint: int = 2) -> None:
        self.cfg = cfg
        self.counters = TierCounters()
        self._target = parse_target(cfg)
        seed, opts = conn_options(cfg, self._target)
        self._cluster = self._target.mode is RedisMode.CLUSTER
        self._router = Router(seed, opts, cluster=self._cluster,
                              pool_size=max(1, cfg.max_connections))
        self._exec = ThreadPoolExecutor(max_workers=max(2, cfg.max_connections),
                                        thread_name_prefix="kvtier-redis")
        choice = codecs.from_config(cfg.codec)
        self._codec: Codec | codecs.AutoCodec = codecs.AutoCodec() if choice is None else choice
        self._elem_bytes = elem_bytes_hint
        self._prefix = cfg.key_prefix.encode()
        self._ttl = cfg.ttl_s if cfg.ttl_s > 0 else None
        self._queue = WriteQueue(cfg.write_queue_blocks)
        self._inflight = asyncio.Semaphore(max(1, cfg.max_inflight))
        self._writing = 0                      # SET batches in flight
        self._wake = asyncio.Event()           # queue non-empty, or the tier came up
        self._progress = asyncio.Event()       # a batch finished or `up` changed
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writer: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._reconnector: asyncio.Task[None] | None = None
        self._closed = False
        self._up = False
        self._consecutive_failures = 0
        self.reconnects = 0
        self.last_error = ""
        self._unserved_since: float | None = None
        self.last_heal_s = 0.0                 # last time from a failed server to healed
        self._frames_raw = 0                   # raw bytes of frames written (codec ratio)
        self._frames_wire = 0
        self._server_used = 0
        self._server_max = 0
        self._server_keys = 0
        self.namespace_mismatches = 0          # frames found under another namespace

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

    # --- reads ----------------------------------------------------------------------------

    async def exists_prefix(self, keys: Sequence[bytes], *,
                            namespace: bytes | None = None) -> int:
        """How many leading ``keys`` are in Redis (pipelined EXISTS, stops at the first miss).

        With ``namespace``, a key counts only when its frame's namespace field is
        ``namespace`` (pipelined GETRANGE of that field instead of EXISTS): a frame of
        another namespace is a miss, counted in ``namespace_mismatches``.
        0 while down; on an error, the prefix confirmed before it (the error is counted).
        """
        found = 0
        if not keys or not self._up:
            return 0
        for start in range(0, len(keys), EXISTS_BATCH):
            rkeys = [self._rkey(k) for k in keys[start:start + EXISTS_BATCH]]
            for reply in await self._probe(rkeys, namespace):
                if isinstance(reply, ErrorReply):
                    self._error_reply(reply)
                    return found
                if reply is UNSERVED or isinstance(reply, BaseException) or \
                        not self._present(reply, namespace):
                    return found
                found += 1
            self._succeeded()
        return found

    async def _probe(self, rkeys: list[bytes], namespace: bytes | None) -> list[Any]:
        """EXISTS per key, or GETRANGE of the frame's namespace field when ``namespace``."""
        def probe(conn: Conn, idx: list[int]) -> list[Any]:
            if namespace is None:
                return conn.simple_many([command(b"EXISTS", rkeys[i]) for i in idx])
            lo, hi = str(NS_OFFSET).encode(), str(NS_END).encode()
            return conn.simple_many([command(b"GETRANGE", rkeys[i], lo, hi) for i in idx])

        return await self._per_server(rkeys, probe)

    def _present(self, reply: Any, namespace: bytes | None) -> bool:
        """Whether a ``_probe`` reply says the block is there (for ``namespace``)."""
        if namespace is None:
            return bool(reply)
        if not reply:  # GETRANGE of a missing key: b""
            return False
        if bytes(reply) != namespace:
            self.namespace_mismatches += 1
            return False
        return True

    async def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview], *,
                       namespace: bytes, layout_fp: int) -> int:
        """Fill ``outs[i]`` with block ``keys[i]`` for the leading run present in Redis.

        Returns how many leading blocks were filled. A frame that fails a check ends the
        run, is counted in ``checksum_failures`` and is deleted. Never raises for Redis
        trouble (down, timeouts, error replies all end the run early). Up to
        ``max_inflight`` batches are fetched at once; all of them have finished writing
        into ``outs`` before this returns.
        """
        n = min(len(keys), len(outs))
        bounds = _batches([o.nbytes for o in outs[:n]], GET_BATCH_KEYS, GET_BATCH_BYTES)
        window = max(1, self.cfg.max_inflight)
        pending: deque[tuple[asyncio.Task[list[BlockRead]], int]] = deque()
        filled = 0
        stop = False
        launched = 0
        try:
            while True:
                while not stop and launched < len(bounds) and len(pending) < window \
                        and self._up:
                    lo, hi = bounds[launched]
                    launched += 1
                    pending.append((asyncio.ensure_future(self._fetch(
                        keys[lo:hi], outs[lo:hi], namespace, layout_fp)), lo))
                if not pending:
                    break
                task, lo = pending.popleft()
                reads = await task
                if stop:
                    continue
                for j, read in enumerate(reads):
                    if read.status is ReadStatus.OK:
                        filled += 1
                        self.counters.bytes_read += read.wire
                        continue
                    stop = True
                    await self._settle_read(read, self._rkey(keys[lo + j]))
                    break
        finally:  # every fetch launched writes into `outs`: wait for all of them
            if pending:
                await asyncio.gather(*(t for t, _ in pending), return_exceptions=True)
        self.counters.hit_blocks += filled
        self.counters.miss_blocks += n - filled
        return filled

    async def _fetch(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                     namespace: bytes, layout_fp: int) -> list[BlockRead]:
        rkeys = [self._rkey(k) for k in keys]

        def get(conn: Conn, idx: list[int]) -> list[BlockRead]:
            return read_blocks(conn, [rkeys[i] for i in idx], [keys[i] for i in idx],
                               [outs[i] for i in idx], namespace, layout_fp)

        reads: list[BlockRead] = []
        for result in await self._per_server(rkeys, get, holds_buffers=True):
            if isinstance(result, BlockRead):
                reads.append(result)
            elif isinstance(result, BaseException):
                reads.append(BlockRead(ReadStatus.ERROR, why=_describe(result)))
            else:
                reads.append(MISSING)
        if all(r.status is not ReadStatus.ERROR for r in reads):
            self._succeeded()
        return reads

    async def _settle_read(self, read: BlockRead, rkey: bytes) -> None:
        """Account for the block that ended a read run."""
        if read.status is ReadStatus.FOREIGN:
            self.namespace_mismatches += 1
        elif read.status is ReadStatus.CORRUPT:
            await self._drop_corrupt(rkey, read.why)
        elif read.status is ReadStatus.NOFIT:
            self._note_error(ValueError(read.why))
        elif read.error is not None:
            self._error_reply(read.error)

    # --- writes ---------------------------------------------------------------------------

    def submit(self, namespace: bytes, key: bytes, layout_fp: int, payload: memoryview, *,
               seq: int = 0, release: Release | None = None) -> None:
        """Queue a block for writing (write-behind).

        With ``release``, ``payload`` is used in place (no copy: the caller keeps it
        unchanged, e.g. an arena slot pinned) and ``release()`` is called exactly once, on
        the event loop, when the write is over (sent, dropped or failed). Without it the
        payload is copied before returning. Never blocks and never raises for Redis
        trouble: a full queue drops its oldest write (``counters.dropped_writes``); writes
        queued while down wait for the tier to come back (within the same bound), as
        copies: going down drops the queued borrowed writes (their buffers are released),
        and a borrowed write submitted while down is copied, so a dead Redis never pins
        the caller's memory.
        """
        if self._closed:
            self.counters.dropped_writes += 1
            if release is not None:
                release()
            return
        rkey = self._rkey(key)
        if release is not None and not self._up:  # may wait long: do not hold the caller's
            release()                               # buffer (e.g. a pinned arena slot)
            release = None
        item = (PendingWrite.copy_of(rkey, namespace, key, layout_fp, seq, payload)
                if release is None else
                PendingWrite.borrow(rkey, namespace, key, layout_fp, seq, payload, release))
        dropped = self._queue.push(item)
        if dropped is not None:
            dropped.done()
            self.counters.dropped_writes += 1
        self._wake.set()

    async def delete(self, keys: Sequence[bytes], *, namespace: bytes | None = None) -> int:
        """Delete blocks from Redis; returns how many existed. 0 while down or on error.

        With ``namespace``, only frames of that namespace are deleted (checked first with
        GETRANGE; another namespace's frame is counted in ``namespace_mismatches`` and kept).
        """
        if not keys or not self._up:
            return 0
        rkeys = [self._rkey(k) for k in keys]
        if namespace is not None:
            probed = await self._probe(rkeys, namespace)
            if any(isinstance(r, ErrorReply) for r in probed):
                self._error_reply(next(r for r in probed if isinstance(r, ErrorReply)))
            rkeys = [k for k, r in zip(rkeys, probed, strict=True)
                     if isinstance(r, bytes) and self._present(r, namespace)]
            if not rkeys:
                return 0

        def delete(conn: Conn, idx: list[int]) -> list[Any]:
            return conn.simple_many([command(b"DEL", rkeys[i]) for i in idx])

        replies = await self._per_server(rkeys, delete)
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

    # --- internals ------------------------------------------------------------------------

    def _rkey(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    async def _in_thread(self, fn: Callable[[], T], *, holds_buffers: bool = False) -> T:
        """Run blocking ``fn`` in the tier's worker threads. When ``fn`` uses the caller's
        buffers (``holds_buffers``) and the caller is cancelled, wait for ``fn`` to end
        first (bounded by op_timeout_s); otherwise a cancelled caller returns at once (a
        lookup budget cuts a probe) and the thread ends on its own."""
        fut = asyncio.get_running_loop().run_in_executor(self._exec, fn)
        if not holds_buffers:
            return await fut
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await asyncio.shield(fut)
            raise

    async def _per_server(self, rkeys: Sequence[bytes],
                          fn: Callable[[Conn, list[int]], Sequence[Any]], *,
                          holds_buffers: bool = False) -> list[Any]:
        """Run ``fn(conn, indexes)`` once per server holding some of ``rkeys`` (in parallel,
        in worker threads); returns one result per key: ``fn``'s, the exception that failed
        its server (already counted), or UNSERVED."""
        results: list[Any] = [UNSERVED] * len(rkeys)

        async def one(node: NodeAddr | None, idx: list[int]) -> None:
            if node is None:
                return
            pool = self._router.pool(node)
            try:
                replies = await self._in_thread(lambda: pool.run(lambda c: fn(c, idx)),
                                                holds_buffers=holds_buffers)
            except Exception as exc:
                self._failed(exc, node)
                for i in idx:
                    results[i] = exc
                return
            for i, reply in zip(idx, replies, strict=True):
                results[i] = reply

        groups = self._router.group(rkeys)
        await asyncio.gather(*(one(node, idx) for node, idx in groups.items()))
        return results

    async def _drop_corrupt(self, rkey: bytes, why: str) -> None:
        self.counters.checksum_failures += 1
        self.counters.evicted(EvictionReason.CORRUPT)
        log.warning("redis tier: corrupt frame at %r deleted (%s)", rkey, why)
        await self._per_server([rkey], lambda c, idx: c.simple_many([command(b"DEL", rkey)]))

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
            rkeys = [it.redis_key for it in batch]

            def put(conn: Conn, idx: list[int]) -> list[Any]:
                return write_blocks(conn, [batch[i] for i in idx], self._codec,
                                    self._elem_bytes, self._ttl)

            ok = True
            replies = await self._per_server(rkeys, put, holds_buffers=True)
            for item, reply in zip(batch, replies, strict=True):
                if reply != "OK":
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

    async def _monitor_loop(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            if not self._up:
                continue
            await self._health(rounds % STATS_EVERY == 0)
            rounds += 1

    async def _health(self, refresh_stats: bool) -> None:
        """PING every live master (INFO memory and DBSIZE too when ``refresh_stats``)."""
        cmds = [command(b"PING")]
        if refresh_stats:
            cmds += [command(b"INFO", b"memory"), command(b"DBSIZE")]
        masters = [m for m in self._router.masters() if m not in self._router.failed]

        async def ask(node: NodeAddr) -> list[Any] | None:
            pool = self._router.pool(node)
            try:
                return await self._in_thread(lambda: pool.run(lambda c: c.simple_many(cmds)))
            except Exception as exc:
                self._failed(exc, node)
                return None

        answers = await asyncio.gather(*(ask(m) for m in masters))
        good = [a for a in answers if a is not None]
        for answer in good:
            if isinstance(answer[0], ErrorReply):
                self._error_reply(answer[0])
                return
        if len(good) == len(answers):
            self._succeeded()
        if refresh_stats and good and len(good) == len(answers):
            used = limit = keys = 0
            for answer in good:
                info = _info_fields(answer[1])
                used += int(info.get("used_memory", 0))
                limit += int(info.get("maxmemory", 0))
                keys += answer[2] if isinstance(answer[2], int) else 0
            self._server_used, self._server_max, self._server_keys = used, limit, keys

    def _start_reconnect(self) -> None:
        if self._closed or (self._reconnector and not self._reconnector.done()):
            return
        self._reconnector = asyncio.create_task(self._reconnect_loop(),
                                                name="kvtier-redis-reconnect")

    async def _reconnect_loop(self) -> None:
        """Reload routing with backoff until every slot has a live server (the one server
        answers PING, or a cluster's failed masters were replaced or came back)."""
        backoff = Backoff(RECONNECT_BACKOFF)
        while not self._closed:
            await asyncio.sleep(backoff.next_delay())
            try:
                reach = await self._in_thread(self._router.refresh)
            except Exception as exc:
                self.last_error = _describe(exc)
                continue
            if reach is Reach.UNREACHABLE:
                self.last_error = self._router.last_error or self.last_error
                if self._up:
                    self._mark_down()
                continue
            if not self._up:
                self.reconnects += 1
                self._set_up()
                log.info("redis tier reconnected: %s", self._target.display)
            if reach is Reach.HEALED:
                if self._unserved_since is not None:
                    self.last_heal_s = time.monotonic() - self._unserved_since
                    self._unserved_since = None
                    log.info("redis tier: every slot served again after %.2f s",
                             self.last_heal_s)
                return

    def _set_up(self) -> None:
        self._up = True
        self._consecutive_failures = 0
        self._wake.set()
        self._progress.set()

    def _mark_down(self) -> None:
        self._up = False
        self._progress.set()
        self.counters.dropped_writes += self._queue.drop_borrowed()
        self._router.drop_pools()
        log.warning("redis tier down (%s): %s", self._target.display, self.last_error)
        self._start_reconnect()

    def _succeeded(self) -> None:
        self._consecutive_failures = 0

    def _note_error(self, exc: BaseException) -> None:
        self.counters.errors += 1
        self.last_error = _describe(exc)

    def _error_reply(self, reply: ErrorReply) -> None:
        """An error reply: in a cluster a redirect means "reload the slot map"."""
        if self._cluster and reply.kind in CLUSTER_REDIRECTS:
            self._note_error(ReplyError(str(reply)))
            self._unserved_since = self._unserved_since or time.monotonic()
            self._start_reconnect()
            return
        self._failed(ReplyError(str(reply)))

    def _failed(self, exc: BaseException, node: NodeAddr | None = None) -> None:
        """Count a failure. One server: down on a connection failure or a run of them.
        Cluster: the failed server leaves the routing and the slot map is reloaded."""
        self._note_error(exc)
        if self._cluster and node is not None:
            if node not in self._router.failed:
                log.warning("redis tier: server %s failed (%s); its slots miss until "
                            "the slot map heals", node, self.last_error)
            self._router.mark_failed(node)
            self._unserved_since = self._unserved_since or time.monotonic()
            self._start_reconnect()
            return
        self._consecutive_failures += 1
        hard = isinstance(exc, OSError) and not isinstance(exc, TimeoutError)
        if self._up and (hard or self._consecutive_failures >= DOWN_AFTER_FAILURES):
            self._mark_down()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _batches(sizes: Sequence[int], max_keys: int, max_bytes: int) -> list[tuple[int, int]]:
    """Split consecutive items into [lo, hi) runs of at most ``max_keys`` items and about
    ``max_bytes`` bytes (a run always holds at least one item)."""
    bounds: list[tuple[int, int]] = []
    lo = 0
    while lo < len(sizes):
        hi, total = lo, 0
        while hi < len(sizes) and hi - lo < max_keys and (
                hi == lo or total + sizes[hi] <= max_bytes):
            total += sizes[hi]
            hi += 1
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _info_fields(reply: Any) -> dict[str, str]:
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else ""
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
