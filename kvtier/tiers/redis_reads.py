"""The Redis tier's reads: pipelined GETs into buffers.

``RedisReads`` is the layer of ``RedisTier`` (kvtier.tiers.redis, which states the contract)
that answers ``get_into``: batches walk a prefix, several in flight, and stop at the first
miss; a frame failing a check is deleted and counted. The prefix probes (EXISTS /
GETRANGE) are its base, ``RedisProbes`` (kvtier.tiers.redis_probe).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

from kvtier.tiers.redis_blocks import (
    MISSING,
    BlockRead,
    ReadStatus,
    header_range,
    judge_header,
    read_blocks,
    read_blocks_muxed,
)
from kvtier.tiers.redis_link import _describe
from kvtier.tiers.redis_probe import RedisProbes
from kvtier.tiers.redis_ranged import fetch_ranged, ranged
from kvtier.tiers.redis_resp import (
    REDIRECTS,
    NodeAddr,
    ProtocolError,
)
from kvtier.tiers.redis_wire import Conn

log = logging.getLogger("kvtier.tiers.redis")   # one logger for the whole Redis tier

GET_BATCH_KEYS = 32               # keys per pipelined GET round trip ...
GET_BATCH_BYTES = 1 << 20         # ... and about this many bytes, one thread each (TLS)
# Read by one thread (kvtier.tiers.redis_mux), smaller pipelines are faster: a server runs
# all of a pipeline's GETs (copying each value into its output buffers) before it writes
# any, so small ones let it copy the next values while the first are on the wire
# (32 x 256 KiB, 8 in flight: 1.9 ms as one GET each, 4.3-5.6 ms as 4 GETs each).
MUX_BATCH_BYTES = 256 << 10


class RedisReads(RedisProbes):
    """Reads of the Redis tier: ``get_into`` (base of ``RedisTier``); the probes of
    ``exists_prefix`` are its base's (kvtier.tiers.redis_probe).

    ``get_into`` counts what it fetched in ``fetched_blocks`` and ``fetch_missed_blocks``
    (blocks asked and not filled), shown in ``stats_extra``: a lookup's probe, not a
    fetch, counts the tier's ``hit_blocks``/``miss_blocks`` (kvtier.store.stats
    ``count_redis_lookup``), so a promotion or a get never counts a lookup again."""

    fetched_blocks: int = 0        # blocks get_into filled (promotions, gets)
    fetch_missed_blocks: int = 0   # blocks get_into was asked for and did not fill

    async def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview], *,
                       namespace: bytes, layout_fp: int,
                       checksums: list[int | None] | None = None) -> int:
        """Fill ``outs[i]`` with block ``keys[i]`` for the leading run present in Redis.

        Returns how many leading blocks were filled. A frame that fails a check ends the
        run, is counted in ``checksum_failures`` and is deleted. Never raises for Redis
        trouble (down, timeouts, error replies all end the run early). Up to
        ``_window()`` batches are fetched at once; all of them have finished writing
        into ``outs`` before this returns. ``checksums`` (a list as long as ``keys``), when
        given, receives each filled block's verified xxh3-64 where the frame was stored
        uncompressed (the same number as ``kvtier.frame.payload_checksum`` of the bytes now
        in ``outs[i]``), None elsewhere: a caller that journals the block need not hash it.
        """
        n = min(len(keys), len(outs))
        if not n or not self._up:
            self.fetch_missed_blocks += n
            return 0
        filled = 0
        routed = False
        while True:
            reads = await self._read_run(keys[filled:n], outs[filled:n], namespace, layout_fp,
                                         routed=routed)
            bad: BlockRead | None = None
            for read in reads:
                if read.status is not ReadStatus.OK:
                    bad = read
                    break
                self._count_read(read, filled, checksums)
                filled += 1
            if bad is not None and not routed and _redirected(bad):
                # a cluster slot moved or is moving: the muxed reader does not follow
                # redirects, the routed reads (a batch per server) do; the rest goes so
                routed = True
                continue
            if bad is not None:
                await self._settle_read(bad, keys[filled], outs[filled].nbytes, namespace,
                                        layout_fp)
            break
        self.fetched_blocks += filled
        self.fetch_missed_blocks += n - filled
        return filled

    def _count_read(self, read: BlockRead, j: int, checksums: list[int | None] | None) -> None:
        if checksums is not None:
            checksums[j] = read.checksum
        self.counters.bytes_read += read.wire

    async def _read_run(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                        namespace: bytes, layout_fp: int, *, routed: bool) -> list[BlockRead]:
        """The leading reads of ``keys``, up to and with the first that is not OK: muxed
        over plain connections, else (TLS, large blocks, or ``routed``) a worker thread
        per batch, through ``_per_server``, which follows cluster redirects."""
        muxed = not routed and self._router.opts.tls is None and \
            not any(ranged(o.nbytes) for o in outs)
        bounds = _batches([o.nbytes for o in outs], GET_BATCH_KEYS,
                          MUX_BATCH_BYTES if muxed else GET_BATCH_BYTES)
        biggest = max(sum(o.nbytes for o in outs[lo:hi]) for lo, hi in bounds)
        window = self._window(biggest)
        reader = self._read_muxed if muxed else self._read_windowed
        return await reader(keys, outs, bounds, window, namespace, layout_fp)

    async def _read_muxed(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                          bounds: list[tuple[int, int]], window: int, namespace: bytes,
                          layout_fp: int) -> list[BlockRead]:
        """Every batch's pipelines read by one worker thread, ``window`` connections at a
        time (kvtier.tiers.redis_mux): one GIL handoff per read, not one per receive."""
        rkeys = [self._rkey(k) for k in keys]
        nodes = [self._router.node_for(k) for k in rkeys]
        unserved = next((i for i, node in enumerate(nodes) if node is None), len(keys))
        batches: list[tuple[NodeAddr, list[int]]] = []
        for lo, hi in bounds:   # each run's keys per server, in order, up to the unserved
            per: dict[NodeAddr, list[int]] = {}
            for i in range(lo, min(hi, unserved)):
                node = nodes[i]
                assert node is not None
                per.setdefault(node, []).append(i)
            batches += per.items()
        try:
            reads, failures = await self._in_thread(
                lambda: read_blocks_muxed(batches, rkeys, keys, outs, namespace, layout_fp,
                                          pool_of=self._router.pool, width=window),
                holds_buffers=True)
        except Exception as exc:   # a bug in the reader must not reach the caller: a miss
            log.exception("redis tier: read failed")
            self._note_error(exc)
            return [BlockRead(ReadStatus.ERROR, why=_describe(exc))]
        for node, error in failures:
            self._failed(error, node)
        leading = next((j for j, r in enumerate(reads) if r.status is not ReadStatus.OK),
                       len(reads))
        if not any(r.status is ReadStatus.ERROR for r in reads[:leading + 1]):
            self._succeeded()
        return reads[:leading + 1]

    async def _read_windowed(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                             bounds: list[tuple[int, int]], window: int, namespace: bytes,
                             layout_fp: int) -> list[BlockRead]:
        """Batches read by a worker thread each, ``window`` at a time (TLS connections and
        large blocks, read in ranges or stripes); the leading reads, up to the first that
        is not OK."""
        pending: deque[asyncio.Task[list[BlockRead]]] = deque()
        reads: list[BlockRead] = []
        stop = False
        launched = 0
        try:
            while True:
                while not stop and launched < len(bounds) and len(pending) < window \
                        and self._up:
                    lo, hi = bounds[launched]
                    launched += 1
                    pending.append(asyncio.ensure_future(self._fetch(
                        keys[lo:hi], outs[lo:hi], namespace, layout_fp)))
                if not pending:
                    break
                batch = await pending.popleft()
                if stop:
                    continue
                for read in batch:
                    reads.append(read)
                    if read.status is not ReadStatus.OK:
                        stop = True
                        break
        finally:  # every fetch launched writes into `outs`: wait for all of them
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        return reads

    async def _fetch(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                     namespace: bytes, layout_fp: int) -> list[BlockRead]:
        """One batch's reads (``_fetch_batch``). A bug or a failed allocation there ends
        the read as an ERROR, as in ``_read_muxed``: it never reaches the caller."""
        try:
            return await self._fetch_batch(keys, outs, namespace, layout_fp)
        except Exception as exc:
            log.exception("redis tier: read failed")
            self._note_error(exc)
            return [BlockRead(ReadStatus.ERROR, why=_describe(exc))]

    async def _fetch_batch(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                           namespace: bytes, layout_fp: int) -> list[BlockRead]:
        rkeys = [self._rkey(k) for k in keys]
        if len(keys) == 1 and ranged(outs[0].nbytes):   # a large block: in parallel ranges
            out = outs[0] if outs[0].format == "B" and outs[0].ndim == 1 else outs[0].cast("B")
            read = await fetch_ranged(self, keys[0], rkeys[0], out, namespace, layout_fp)
            if read is not None:
                if read.status is ReadStatus.OK:
                    self._succeeded()
                return [read]

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

    async def _settle_read(self, read: BlockRead, key: bytes, out_bytes: int,
                           namespace: bytes, layout_fp: int) -> None:
        """Account for the block ``key`` (read into ``out_bytes``) that ended a read run.

        NOFIT: a sound frame of this namespace, key and layout whose ``raw_len`` is not
        the buffer's size. When the buffer has the namespace's block size (its layout is
        known) the frame can never be valid for its key: corrupt, deleted (it would stay a
        lookup hit that every get misses); else the caller's buffer is wrong, an error.
        STRAY: a sound frame of another key (``_settle_stray``)."""
        rkey = self._rkey(key)
        if read.status is ReadStatus.FOREIGN:
            self.namespace_mismatches += 1
        elif read.status is ReadStatus.CORRUPT:
            await self._drop_corrupt(rkey, read.why)
        elif read.status is ReadStatus.NOFIT:
            if self._block_bytes_for(namespace) == out_bytes:
                await self._drop_corrupt(rkey, read.why)
            else:
                self._note_error(ValueError(read.why))
        elif read.status is ReadStatus.STRAY:
            await self._settle_stray(read, key, out_bytes, namespace, layout_fp)
        elif read.error is not None:
            self._error_reply(read.error)

    async def _settle_stray(self, read: BlockRead, key: bytes, out_bytes: int,
                            namespace: bytes, layout_fp: int) -> None:
        """A GET of ``key`` answered with another key's frame: a reply out of step (a
        server that sent one twice: its connection was dropped, ``protocol_errors``) or a
        value copied there. Counted, a miss; not evidence that the value stored at
        ``key`` is corrupt, so it is deleted only when its header, read again on a fresh
        connection (whose first reply is its own), fails its checks for ``key``."""
        rkey = self._rkey(key)
        node = self._router.node_for(rkey)
        head = None
        if node is not None and self._up:
            try:
                replies = await self._in_thread(
                    lambda: self._router.exchange_once(node, [header_range(rkey)]))
            except Exception as exc:   # (it catches connection errors itself)
                self._note_error(exc)
                return
            head = replies[0] if replies else None
        if isinstance(head, bytes) and head:   # else gone, an error, no answer
            verdict = judge_header(head, key, out_bytes, namespace, layout_fp)
            if isinstance(verdict, BlockRead) and verdict.status in (
                    ReadStatus.CORRUPT, ReadStatus.STRAY):   # stored so: a bad frame
                await self._drop_corrupt(rkey, f"{verdict.why} (read again)")
                return
        # the value at `key` is sound or unknown: a reply out of step, or (found by
        # review) a value another writer copied there and replaced since
        self._note_error(ProtocolError(f"redis answered GET {rkey!r:.60} with a frame "
                                       f"of another key (a reply out of step, or a value "
                                       f"copied there)"))


def _redirected(read: BlockRead) -> bool:
    """Whether a read ended on a cluster redirect (MOVED or ASK)."""
    return read.error is not None and read.error.kind in REDIRECTS


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
