"""The Redis tier: KV blocks shared across nodes through Redis or Redis Cluster.

Redis is the tier that lets prefix reuse cross machines, and the one most likely to be
slow or gone. Everything here is built so that Redis trouble costs hits, never requests:

- No method raises because of Redis. Errors are counted (``counters.errors``, with the
  last one in ``stats_extra()``), the tier is marked down after a connection failure (or
  ``DOWN_AFTER_FAILURES`` soft failures in a row), and while down every lookup is a miss.
  A background task reconnects with jittered exponential backoff (capped at 5 s) and the
  tier is up again once a fresh client answers PING.
- Reads walk a prefix: pipelined EXISTS / GET in batches, stopping at the first miss.
  Every value is a frame (kvtier.frame) checked against the expected namespace, key and
  layout fingerprint plus its payload checksum; a frame failing a check is a miss,
  counted in ``counters.checksum_failures`` and deleted from Redis. A sound frame of another
  namespace (a caller with a stolen key) is a miss, counted in ``namespace_mismatches``, and
  is left alone: it is another tenant's block, not a corrupt one.
- ``exists_prefix`` and ``delete`` given the caller's namespace read the namespace field of
  each frame (GETRANGE, as cheap as EXISTS) and treat another namespace's frame as absent.
- Writes are write-behind: ``submit`` copies the payload and returns; writer tasks
  encode (in a thread for real codecs), frame and pipeline SETs, at most
  ``max_inflight`` pipelines at once. The queue is bounded (``write_queue_blocks``);
  when full the oldest pending write is dropped and counted.

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
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from kvtier import codec as codecs
from kvtier.backoff import Backoff, BackoffPolicy
from kvtier.config import RedisConfig
from kvtier.errors import FrameError
from kvtier.frame import HEADER_SIZE, Codec, FrameHeader, decode_frame
from kvtier.tiers.base import EvictionReason, TierCounters, TierName
from kvtier.tiers.redis_client import (
    RedisClient,
    RedisMode,
    close_quietly,
    connect,
    parse_target,
)
from kvtier.tiers.redis_queue import PendingWrite, WriteQueue, frame_pending

log = logging.getLogger(__name__)

EXISTS_BATCH = 64                 # keys per pipelined EXISTS round trip
GET_BATCH_KEYS = 32               # keys per pipelined GET round trip ...
GET_BATCH_BYTES = 4 << 20         # ... and about this many bytes (measured best here)
SET_BATCH_KEYS = 32               # same bounds for one pipelined SET batch
SET_BATCH_BYTES = 4 << 20
INLINE_DECODE_BYTES = 1 << 20     # check/decode/frame smaller batches on the loop, larger
                                  # in a thread (xxh3, memcpy and codecs release the GIL)
DOWN_AFTER_FAILURES = 3           # soft failures (timeouts, error replies) in a row
RECONNECT_BACKOFF = BackoffPolicy(base_s=0.05, cap_s=5.0)   # kvtier.backoff: x2, jitter 0.5
HEALTH_INTERVAL_S = 1.0           # PING while idle, so `up` falls even without traffic
STATS_EVERY = 5                   # health rounds between INFO/DBSIZE refreshes
CLOSE_FLUSH_S = 5.0               # bounded drain at close


DecodeResult = tuple[int, int | None, str]  # (blocks filled, index of a bad frame, why)
NS_OFFSET, NS_END = 8, 23  # the frame header's namespace field (GETRANGE bounds, inclusive)
OTHER_NAMESPACE = "frame holds another namespace"  # a miss, not an error: the frame stays


class RedisTier:
    """Remote tier over Redis / Redis Cluster (see the module docstring for the contract)."""

    name = TierName.REDIS

    def __init__(self, cfg: RedisConfig, *, elem_bytes_hint: int = 2) -> None:
        self.cfg = cfg
        self.counters = TierCounters()
        self._target = parse_target(cfg)
        choice = codecs.from_config(cfg.codec)
        self._codec: Codec | codecs.AutoCodec = codecs.AutoCodec() if choice is None else choice
        self._elem_bytes = elem_bytes_hint
        self._prefix = cfg.key_prefix.encode()
        self._ttl = cfg.ttl_s if cfg.ttl_s > 0 else None
        self._client: RedisClient | None = None
        self._queue = WriteQueue(cfg.write_queue_blocks)
        self._inflight = asyncio.Semaphore(max(1, cfg.max_inflight))
        self._ops = asyncio.Semaphore(max(1, cfg.max_connections))
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
            self._client = await connect(self.cfg, self._target)
            self._set_up()
            log.info("redis tier up: %s", self._target.display)
        except Exception as exc:
            self._note_error(exc)
            log.warning("redis tier down at start (%s): %s; retrying in the background",
                        self._target.display, self.last_error)
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
            await close_quietly(self._client)
            self._client = None
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

    async def exists_prefix(self, keys: Sequence[bytes], *, namespace: bytes | None = None) -> int:
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
            try:
                replies = await self._pipeline(self._probe(rkeys, namespace))
            except Exception as exc:
                self._failed(exc)
                return found
            for reply in replies:
                if isinstance(reply, Exception):
                    self._failed(reply)
                    return found
                if not self._present(reply, namespace):
                    self._succeeded()
                    return found
                found += 1
            self._succeeded()
        return found

    async def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview], *,
                       namespace: bytes, layout_fp: int) -> int:
        """Fill ``outs[i]`` with block ``keys[i]`` for the leading run present in Redis.

        Returns how many leading blocks were filled. A frame that fails a check ends the
        run, is counted in ``checksum_failures`` and is deleted. Never raises for Redis
        trouble (down, timeouts, error replies all end the run early).
        """
        n = min(len(keys), len(outs))
        bounds = _batches([o.nbytes for o in outs[:n]], GET_BATCH_KEYS, GET_BATCH_BYTES)
        filled = 0
        fetch: asyncio.Task[list[Any]] | None = None
        try:
            for i, (lo, hi) in enumerate(bounds):
                if not self._up:
                    break
                rkeys = [self._rkey(k) for k in keys[lo:hi]]
                if fetch is None:
                    fetch = asyncio.ensure_future(self._pipeline([("GET", k) for k in rkeys]))
                try:
                    values = await fetch
                except Exception as exc:
                    self._failed(exc)
                    break
                finally:
                    fetch = None
                self._succeeded()
                if i + 1 < len(bounds):  # read ahead while this batch is checked and copied
                    nlo, nhi = bounds[i + 1]
                    nxt = [("GET", self._rkey(k)) for k in keys[nlo:nhi]]
                    fetch = asyncio.ensure_future(self._pipeline(nxt))
                wire = sum(len(v) for v in values if isinstance(v, bytes))
                self.counters.bytes_read += wire
                args = (values, keys[lo:hi], outs[lo:hi], namespace, layout_fp)
                if wire > INLINE_DECODE_BYTES:
                    got, bad, why = await asyncio.to_thread(_decode_run, *args)
                else:
                    got, bad, why = _decode_run(*args)
                if got < len(values) and isinstance(values[got], Exception):
                    self._failed(values[got])
                elif why == OTHER_NAMESPACE:
                    self.namespace_mismatches += 1
                elif bad is None and why:
                    self._note_error(ValueError(why))
                if bad is not None:
                    await self._drop_corrupt(rkeys[bad], why)
                filled += got
                if got < len(values):
                    break
        finally:
            if fetch is not None:  # a read-ahead past the first miss: not needed
                fetch.cancel()
                with contextlib.suppress(BaseException):
                    await fetch
        self.counters.hit_blocks += filled
        self.counters.miss_blocks += n - filled
        return filled

    # --- writes ---------------------------------------------------------------------------

    def submit(self, namespace: bytes, key: bytes, layout_fp: int, payload: memoryview, *,
               seq: int = 0) -> None:
        """Queue a block for writing (write-behind). Copies ``payload`` before returning.

        Never blocks and never raises for Redis trouble: a full queue drops its oldest
        write (``counters.dropped_writes``); writes queued while down wait for the tier to
        come back (within the same bound).
        """
        if self._closed:
            self.counters.dropped_writes += 1
            return
        item = PendingWrite.copy_of(self._rkey(key), namespace, key, layout_fp, seq, payload)
        if self._queue.push(item) is not None:
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
            try:
                probed = await self._pipeline(self._probe(rkeys, namespace))
            except Exception as exc:
                self._failed(exc)
                return 0
            rkeys = [k for k, r in zip(rkeys, probed, strict=True)
                     if not isinstance(r, Exception) and self._present(r, namespace)]
            if not rkeys:
                self._succeeded()
                return 0
        try:
            replies = await self._pipeline([("DEL", k) for k in rkeys])
        except Exception as exc:
            self._failed(exc)
            return 0
        self._succeeded()
        n = sum(int(r) for r in replies if not isinstance(r, Exception))
        self.counters.evicted(EvictionReason.DELETED, n)
        return n

    def stats_extra(self) -> dict[str, Any]:
        """Redis-specific numbers for /v1/stats (the shared counters are in ``counters``)."""
        auto = self._codec if isinstance(self._codec, codecs.AutoCodec) else None
        return {
            "target": self._target.display,
            "queue_depth": len(self._queue),
            "queue_bytes": self._queue.queued_bytes,
            "writes_in_flight": self._writing,
            "dropped_writes": self.counters.dropped_writes,
            "reconnects": self.reconnects,
            "consecutive_failures": self._consecutive_failures,
            "codec": self.cfg.codec,
            "codec_current": (auto.current if auto else self._codec).name.lower(),
            "codec_ratio": self._frames_raw / self._frames_wire if self._frames_wire else 1.0,
            "last_error": self.last_error,
            "namespace_mismatches": self.namespace_mismatches,
        }

    # --- internals ------------------------------------------------------------------------

    def _rkey(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    @staticmethod
    def _probe(rkeys: Sequence[bytes], namespace: bytes | None) -> list[tuple[Any, ...]]:
        if namespace is None:
            return [("EXISTS", k) for k in rkeys]
        return [("GETRANGE", k, NS_OFFSET, NS_END) for k in rkeys]

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

    async def _pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` on one non-transactional pipeline (one round trip per node).

        Error replies come back in the list as exceptions; connection trouble raises.
        """
        client = self._client
        if client is None:
            raise RedisConnectionError("redis tier has no connection")
        async with self._ops:
            pipe = client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute(raise_on_error=False)

    async def _drop_corrupt(self, rkey: bytes, why: str) -> None:
        self.counters.checksum_failures += 1
        self.counters.evicted(EvictionReason.CORRUPT)
        log.warning("redis tier: corrupt frame at %r deleted (%s)", rkey, why)
        try:
            await self._pipeline([("DEL", rkey)])
        except Exception as exc:
            self._failed(exc)

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
            if self._codec is Codec.NONE and sum(it.raw_len for it in batch) <= INLINE_DECODE_BYTES:
                for item in batch:  # header + checksum only: the payload is already copied
                    frame_pending(item, Codec.NONE, self._elem_bytes)
            else:
                await asyncio.to_thread(_frame_all, batch, self._codec, self._elem_bytes)
            expiry: tuple[Any, ...] = ("EX", self._ttl) if self._ttl else ()
            try:
                replies = await self._pipeline(
                    [("SET", it.redis_key, it.frame, *expiry) for it in batch])
            except Exception as exc:
                self._failed(exc)
                self.counters.dropped_writes += len(batch)
                return
            for item, reply in zip(batch, replies, strict=True):
                if isinstance(reply, Exception):
                    self._failed(reply)
                    self.counters.dropped_writes += 1
                    continue
                wire = len(item.frame or b"")
                self.counters.bytes_written += wire
                self._frames_raw += item.raw_len
                self._frames_wire += wire
            self._succeeded()
        except Exception as exc:  # a bug in framing must not kill the writer
            log.exception("redis tier: write batch failed")
            self._note_error(exc)
            self.counters.dropped_writes += len(batch)
        finally:
            self._writing -= 1
            self._inflight.release()
            self._progress.set()

    async def _monitor_loop(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            if not self._up:
                continue
            try:
                await asyncio.wait_for(self._health(rounds % STATS_EVERY == 0),
                                       self.cfg.op_timeout_s)
                self._succeeded()
            except Exception as exc:
                self._failed(exc)
            rounds += 1

    async def _health(self, refresh_stats: bool) -> None:
        client = self._client
        if client is None:
            raise RedisConnectionError("redis tier has no connection")
        async with self._ops:
            await client.ping()
            if not refresh_stats:
                return
            if self._target.mode is RedisMode.CLUSTER:
                mem = await client.info("memory", target_nodes=client.PRIMARIES)
                keys = await client.dbsize(target_nodes=client.PRIMARIES)
            else:
                mem = await client.info("memory")
                keys = await client.dbsize()
        sections = list(mem.values()) if mem and isinstance(
            next(iter(mem.values())), dict) else [mem]
        self._server_used = sum(int(s.get("used_memory", 0)) for s in sections)
        self._server_max = sum(int(s.get("maxmemory", 0)) for s in sections)
        self._server_keys = int(keys)

    def _start_reconnect(self) -> None:
        if self._closed or (self._reconnector and not self._reconnector.done()):
            return
        self._reconnector = asyncio.create_task(self._reconnect_loop(),
                                                name="kvtier-redis-reconnect")

    async def _reconnect_loop(self) -> None:
        backoff = Backoff(RECONNECT_BACKOFF)
        while not self._closed:
            await asyncio.sleep(backoff.next_delay())
            try:
                client = await connect(self.cfg, self._target)
            except Exception as exc:
                self.last_error = _describe(exc)
                continue
            old, self._client = self._client, client
            self._spawn(close_quietly(old))
            self.reconnects += 1
            self._set_up()
            log.info("redis tier reconnected: %s", self._target.display)
            return

    def _set_up(self) -> None:
        self._up = True
        self._consecutive_failures = 0
        self._wake.set()
        self._progress.set()

    def _succeeded(self) -> None:
        self._consecutive_failures = 0

    def _note_error(self, exc: BaseException) -> None:
        self.counters.errors += 1
        self.last_error = _describe(exc)

    def _failed(self, exc: BaseException) -> None:
        """Count a failure; mark the tier down on a connection failure or a run of them."""
        self._note_error(exc)
        self._consecutive_failures += 1
        hard = isinstance(exc, RedisConnectionError) or (
            isinstance(exc, OSError) and not isinstance(exc, TimeoutError))
        if self._up and (hard or self._consecutive_failures >= DOWN_AFTER_FAILURES):
            self._up = False
            self._progress.set()
            log.warning("redis tier down (%s): %s", self._target.display, self.last_error)
            self._start_reconnect()

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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _frame_all(batch: list[PendingWrite], codec: Codec | codecs.AutoCodec,
               elem_bytes: int) -> None:
    for item in batch:
        frame_pending(item, codec, elem_bytes)


def _decode_run(values: Sequence[Any], keys: Sequence[bytes], outs: Sequence[memoryview],
                namespace: bytes, layout_fp: int) -> DecodeResult:
    """Check and decode the leading present frames into ``outs``; stop at the first miss.

    Pure CPU (runs in a worker thread for large batches): returns how many blocks were
    filled and, when a frame failed a check, its index and the reason. A buffer too small
    for a sound frame is the caller's error: a miss with a reason but no bad index (the
    block stays in Redis).
    """
    for i, value in enumerate(values):
        if not isinstance(value, bytes):  # None: missing; Exception: an error reply
            return i, None, ""
        if len(value) >= HEADER_SIZE:
            try:  # a sound frame of another namespace is someone else's block: keep it
                if FrameHeader.unpack(value[:HEADER_SIZE]).namespace != namespace:
                    return i, None, OTHER_NAMESPACE
            except FrameError:
                pass  # corrupt: decode_frame below reports it
        try:
            header, payload = decode_frame(value, namespace, keys[i], layout_fp)
        except FrameError as exc:
            return i, i, str(exc)
        out = outs[i]
        if header.raw_len != out.nbytes:  # the caller's buffer, not the frame, is wrong
            return i, None, (f"block of {header.raw_len} bytes does not match the "
                             f"{out.nbytes}-byte buffer")
        try:
            codecs.decode(header.codec, payload, header.raw_len, out)
        except FrameError as exc:
            return i, i, str(exc)
    return len(values), None, ""
