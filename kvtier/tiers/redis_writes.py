"""The Redis tier's writes: the write-behind queue's writer, and the waits on it.

``RedisWrites`` is the layer of ``RedisTier`` (kvtier.tiers.redis, which states the
contract) that queues blocks (``submit``), sends them (one SET pipeline per server, a batch
at a time; large blocks as stripes, kvtier.tiers.redis_stripes), and answers ``flush`` and
``written``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from kvtier.frame import Codec, FrameHeader
from kvtier.tiers.redis_blocks import WireSet, write_blocks
from kvtier.tiers.redis_link import log
from kvtier.tiers.redis_queue import Borrowed, OnChecksum, PendingWrite, Release, frame_pending
from kvtier.tiers.redis_reads import RedisReads
from kvtier.tiers.redis_resp import ErrorReply, command
from kvtier.tiers.redis_stripes import head_parts, headers_at, replaced_parts, stripe_sets
from kvtier.tiers.redis_wire import Conn

SET_BATCH_KEYS = 512              # keys per pipelined SET round trip, and about this many
SET_BATCH_BYTES = 32 << 20        # bytes: what was queued goes out as one pipeline per
                                  # server. A Redis server ingests SETs fastest from one
                                  # connection at a time (bench_redis: 8 MiB of 256 KiB
                                  # values 2.5 ms on one connection, 3.5-4.6 ms spread over
                                  # 2-8; 24 MiB of 3 MiB ones 6 ms vs 9.6 ms), so writes
                                  # keep ``write_inflight`` (1) batch in flight; the
                                  # op timeout bounds a batch's exchange (32 MiB at 1 GB/s
                                  # is 32 ms)


PROGRESS_POLL_S = 0.1   # longest wait between looks at the write queue's state


class RedisWrites(RedisReads):
    """Writes of the Redis tier: ``submit``, ``written``, ``flush`` (base of ``RedisTier``)."""

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent; False on timeout or while down.

        Returns at once (False) while the tier is down: nothing can drain until it is
        back, and a SIGTERM drain must not hang on a dead Redis.
        """
        return await self._until(lambda: not (len(self._queue) or self._writing), timeout)

    async def forget_writes(self, keys: Sequence[bytes], *, namespace: bytes) -> int:
        """Before a delete of ``keys``: their writes still queued are dropped (borrowed
        blocks released, so the store can delete them too), and those being sent are
        waited for (up to ``op_timeout_s``), so that the DEL comes after their SETs: a SET
        landing after it would bring a deleted block back, for every node reading Redis.
        Returns how many queued writes were dropped."""
        rkeys = [self._rkey(k) for k in keys]
        dropped = self._queue.cancel(set(rkeys), namespace)
        # every write being sent counts, not only a key's newest (a queued newer write of
        # the key, just cancelled, would hide an older one in flight: its SET landed after
        # the DEL)
        await self._until(lambda: not any(k in self._sending for k in rkeys),
                          self.cfg.op_timeout_s)
        return dropped

    async def room(self, n: int, timeout: float) -> int:
        """Wait until the write queue has room for ``n`` more writes (at most its capacity)
        without pushing out a queued one, or ``timeout`` seconds passed; the room it has
        then (0 while the tier is down or closed). A synchronous write-through queues a
        chain no faster than this, so that a chain longer than the queue does not push
        its own head out of it."""
        queue = self._queue
        want = min(n, queue.capacity)
        await self._until(lambda: queue.capacity - len(queue) >= want, max(0.0, timeout))
        if not self._up or self._closed:
            return 0
        return max(0, queue.capacity - len(queue))

    async def _until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``done()``, woken by ``_progress`` (set when a batch is taken off the
        queue, and when it is over) or every ``PROGRESS_POLL_S``; False when the tier is
        down or closed, or ``timeout`` passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not done():
            if not self._up or self._closed:
                return False
            wait = PROGRESS_POLL_S if deadline is None else min(PROGRESS_POLL_S,
                                                                 deadline - loop.time())
            if wait <= 0:
                return False
            self._progress.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._progress.wait(), wait)
        return True

    def submit(self, namespace: bytes, key: bytes, layout_fp: int, payload: memoryview, *,
               seq: int = 0, release: Release | None = None,
               elem_bytes: int | None = None, on_checksum: OnChecksum | None = None,
               owned: bool = False) -> None:
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
        ``owned`` (without ``release``): ``payload`` is a private copy the caller hands
        over, queued without another copy (and counted in ``write_queue_copy_bytes``).
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
        item = (PendingWrite.copy_of(rkey, namespace, key, layout_fp, seq, payload, width,
                                     copy=not owned)
                if release is None else
                PendingWrite.borrow(rkey, namespace, key, layout_fp, seq, payload, release,
                                    width, on_checksum))
        self._enqueue(item)
        self._wake.set()

    def submit_many(self, blocks: Sequence[Borrowed]) -> None:
        """``submit`` of borrowed blocks (each with its ``release``), in order, waking the
        writer once: a put's write-through hands over its whole batch (per block: its Redis
        key and a queue entry, the element width looked up once per namespace)."""
        if self._closed or not self._up:   # copied or dropped one by one (see ``submit``)
            for b in blocks:
                self.submit(b.namespace, b.key, b.layout_fp, b.payload, seq=b.seq,
                            release=b.release, on_checksum=b.on_checksum)
            return
        widths: dict[bytes, int] = {}
        for b in blocks:
            width = widths.get(b.namespace)
            if width is None:
                width = widths[b.namespace] = self._elem_bytes_for(b.namespace)
            self._enqueue(PendingWrite.borrow(self._rkey(b.key), b.namespace, b.key,
                                              b.layout_fp, b.seq, b.payload, b.release, width,
                                              b.on_checksum))
        self._wake.set()

    def _enqueue(self, item: PendingWrite) -> None:
        self._outcomes.track(item)
        for dropped in self._queue.push(item):
            dropped.done()
            self.counters.dropped_writes += 1

    async def written(self, keys: Sequence[bytes], since: float) -> list[bool | None]:
        """Per key, once its newest queued write is over: True if Redis stored it, False
        if it failed or was dropped; None when no write of the key is pending or ended at
        or after ``since`` (``time.monotonic()``): only Redis can tell (``exists_prefix``)."""
        return await self._outcomes.wait([self._rkey(k) for k in keys], since, up=self._up)

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
            if not self._up:   # went down while a batch in flight held the slot: what is
                self._inflight.release()   # queued waits for the tier (found by review)
                continue
            batch = self._queue.take(SET_BATCH_KEYS, SET_BATCH_BYTES)
            if not batch:
                self._inflight.release()
                continue
            self._progress.set()   # room in the queue (``room``)
            self._writing += 1
            for item in batch:
                self._sending[item.redis_key] = self._sending.get(item.redis_key, 0) + 1
            self._spawn(self._write_batch(batch))

    async def _write_batch(self, batch: list[PendingWrite]) -> None:
        early: asyncio.Future[list[Any]] | None = None
        replaced: asyncio.Future[list[FrameHeader | None]] | None = None
        try:
            striped = [it for it in batch if it.striped]
            sets: list[WireSet] = [(it.redis_key, it, None) for it in batch if not it.striped]
            heads: list[WireSet] = []
            stripes: list[WireSet] = []
            # the versions the heads replace: their stripes go once the new heads are in
            if striped:
                replaced = asyncio.ensure_future(
                    headers_at(self, [it.redis_key for it in striped]))
            if striped:   # framed in parallel, off the loop: a head holds its frame's header
                framing = asyncio.gather(*(self._in_thread(partial(frame_pending, it,
                                                                   self._codec))
                                           for it in striped))
                if self._codec is Codec.NONE:
                    # uncompressed, stripes 1.. are the payload's own bytes: they go out
                    # while the payload is hashed for the head (2 ms per 32 MiB here)
                    stripes = [(key, it, data) for it in striped
                               for key, data in stripe_sets(it.redis_key, it.payload, it.tag)]
                    early = asyncio.ensure_future(self._send_sets(stripes))
                await framing
                if early is None:   # encoded: the stripes are of the framed body
                    sets += [(key, it, data) for it in striped
                             for key, data in stripe_sets(it.redis_key, it.parts[1], it.tag)]
                heads = [(it.redis_key, it, head_parts(it)) for it in striped]
            result = _first_failures(sets, await self._send_sets(sets))
            if early is not None:
                result.update(_first_failures(stripes, await early))
            # a head only once every stripe of its block is stored (it may have none)
            heads = [h for h in heads if result.get(id(h[1]), "OK") == "OK"]
            olds = await replaced if replaced is not None else []
            result.update(_first_failures(heads, await self._send_sets(heads)))
            await self._drop_parts([key for key, it, _ in (*sets, *stripes)
                                    if it.striped and key != it.redis_key
                                    and result.get(id(it), "OK") != "OK"]
                                   + [key for it, old in zip(striped, olds, strict=True)
                                      if result.get(id(it)) == "OK"
                                      for key in replaced_parts(it.redis_key, old, it.tag,
                                                                it.raw_len)])
            ok = True
            refused: dict[str, ErrorReply] = {}   # one of each kind (-OOM, -LOADING...)
            for item in batch:
                reply = result[id(item)]
                item.ok = reply == "OK"
                if not item.ok:
                    ok = False
                    self.counters.dropped_writes += 1
                    if isinstance(reply, ErrorReply):
                        refused.setdefault(reply.kind, reply)
                    continue
                wire = item.wire_len
                self.counters.bytes_written += wire
                self._frames_raw += item.raw_len
                self._frames_wire += wire
            for reply in refused.values():   # one verdict per kind, not one failure per key
                self._error_reply(reply)
            if ok:
                self._succeeded()
        except Exception as exc:  # a bug in framing must not kill the writer
            log.exception("redis tier: write batch failed")
            self._note_error(exc)
            self.counters.dropped_writes += len(batch)
        finally:
            if early is not None and not early.done():   # it reads the borrowed payloads
                await asyncio.wait([early])
            if replaced is not None and not replaced.done():
                replaced.cancel()
            # outcomes first: a synchronous commit waiting on these SETs answers in the
            # next loop step; the checksum records and slot releases (about 10 us a block)
            # follow in the step after it instead of delaying that answer
            for item in batch:
                item.settle()
                left = self._sending.pop(item.redis_key, 1) - 1
                if left:
                    self._sending[item.redis_key] = left
            self._progress.set()   # (a delete waiting for these SETs: ``forget_writes``)
            asyncio.get_running_loop().call_soon(self._batch_over, batch)

    async def _drop_parts(self, stripes: list[bytes]) -> None:
        """Delete stripes no head names: those of blocks whose write failed (a stripe or the
        head refused: -OOM, a timeout) and those of the versions a batch's heads replaced.
        Without a TTL they would hold the server's memory for good. Best effort: a failure
        here is counted, no more. (Two writers replacing one version at once each leave
        the other's stripes behind: an eviction policy or ``ttl_s`` takes those.)"""
        if stripes and self._up:
            await self._per_server(stripes, lambda conn, idx: conn.simple_many(
                [command(b"DEL", stripes[i]) for i in idx]))

    def _batch_over(self, batch: list[PendingWrite]) -> None:
        """The end of ``_write_batch``: buffers given back, then the batch's slot freed."""
        try:
            for item in batch:
                item.done()
        finally:
            self._writing -= 1
            self._inflight.release()
            self._progress.set()


def _first_failures(sets: list[WireSet], replies: list[Any]) -> dict[int, Any]:
    """Per block (``id`` of its PendingWrite) among ``sets``: "OK" when every SET of it
    was stored, else the first other reply."""
    result: dict[int, Any] = {}
    for (_, item, _), reply in zip(sets, replies, strict=True):
        if result.get(id(item), "OK") == "OK":
            result[id(item)] = reply
    return result
