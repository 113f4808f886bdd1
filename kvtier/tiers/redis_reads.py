"""The Redis tier's reads: prefix probes (EXISTS / GETRANGE) and pipelined GETs into buffers.

``RedisReads`` is the layer of ``RedisTier`` (kvtier.tiers.redis, which states the contract)
that answers ``exists_prefix`` and ``get_into``: batches walk a prefix, several in flight,
and stop at the first miss; a frame failing a check is deleted and counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvtier.errors import FrameError
from kvtier.frame import FrameHeader
from kvtier.tiers.base import EvictionReason
from kvtier.tiers.redis_blocks import (
    MISSING,
    BlockRead,
    ReadStatus,
    header_range,
    judge_header,
    never_valid,
    read_blocks,
    read_blocks_muxed,
)
from kvtier.tiers.redis_link import UNSERVED, RedisLink, _describe
from kvtier.tiers.redis_ranged import fetch_ranged, ranged
from kvtier.tiers.redis_resp import (
    KEY_ERRORS,
    REDIRECTS,
    ErrorReply,
    NodeAddr,
    ProtocolError,
    command,
)
from kvtier.tiers.redis_stripes import owned_part_keys
from kvtier.tiers.redis_wire import Conn

log = logging.getLogger("kvtier.tiers.redis")   # one logger for the whole Redis tier

EXISTS_BATCH = 64                 # keys per pipelined EXISTS round trip
GET_BATCH_KEYS = 32               # keys per pipelined GET round trip ...
GET_BATCH_BYTES = 1 << 20         # ... and about this many bytes, one thread each (TLS)
# Read by one thread (kvtier.tiers.redis_mux), smaller pipelines are faster: a server runs
# all of a pipeline's GETs (copying each value into its output buffers) before it writes
# any, so small ones let it copy the next values while the first are on the wire
# (32 x 256 KiB, 8 in flight: 1.9 ms as one GET each, 4.3-5.6 ms as 4 GETs each).
MUX_BATCH_BYTES = 256 << 10
NS_OFFSET, NS_END = 8, 23         # the frame header's namespace field (GETRANGE, inclusive)


class RedisReads(RedisLink):
    """Reads of the Redis tier: ``exists_prefix`` and ``get_into`` (base of ``RedisTier``)."""

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
            for rkey, reply in zip(rkeys, await self._probe(rkeys, namespace), strict=True):
                if isinstance(reply, ErrorReply):
                    self._error_reply(reply)
                    if reply.kind in KEY_ERRORS:
                        await self._drop_corrupt(rkey, str(reply))
                    return found
                if reply is UNSERVED or isinstance(reply, BaseException) or \
                        not self._present(reply, namespace):
                    return found
                found += 1
            self._succeeded()
        return found

    async def _probe(self, rkeys: list[bytes], namespace: bytes | None) -> list[Any]:
        """EXISTS per key, or GETRANGE of the frame's namespace field when ``namespace``."""
        lo, hi = str(NS_OFFSET).encode(), str(NS_END).encode()

        def cmds(idx: list[int]) -> list[bytes]:
            if namespace is None:
                return [command(b"EXISTS", rkeys[i]) for i in idx]
            return [command(b"GETRANGE", rkeys[i], lo, hi) for i in idx]

        def probe(conn: Conn, idx: list[int]) -> list[Any]:
            return conn.simple_many(cmds(idx))

        return await self._per_server(rkeys, probe, small=cmds)

    async def whole_prefix(self, keys: Sequence[bytes], *, namespace: bytes) -> int:
        """How many leading blocks of ``namespace`` a get would find whole: each head's
        header (one pipelined read), then every stripe of the striped ones. A lookup's
        probe reads the namespace field of heads only; a synchronous commit, which promises
        its consumers the chain, must not count a block whose stripe Redis evicted or
        expired (its head outlives it). 0 while down; on an error, the prefix before it."""
        if not keys or not self._up:
            return 0
        rkeys = [self._rkey(k) for k in keys]
        heads = await self._per_server(rkeys, lambda conn, idx: conn.simple_many(
            [header_range(rkeys[i]) for i in idx]))
        found = len(rkeys)
        owner: list[int] = []   # block index of each stripe key
        stripes: list[bytes] = []
        block_bytes = self._block_bytes_for(namespace)
        for i, (rkey, head) in enumerate(zip(rkeys, heads, strict=True)):
            if isinstance(head, ErrorReply):
                self._error_reply(head)
            elif not (head is UNSERVED or head is None or isinstance(head, (
                    bytes, bytearray, memoryview, BaseException))):
                self._odd_reply("GETRANGE", head)   # never bytes(n) of a server's n
            try:
                if not isinstance(head, (bytes, bytearray, memoryview)):
                    raise FrameError("no header")   # missing, unserved, failed, not one
                header = FrameHeader.unpack(bytes(head))   # (a copy of what was received)
            except FrameError:   # missing, unserved, not a frame
                found = i
                break
            if header.namespace != namespace:
                self.namespace_mismatches += 1
                found = i
                break
            if never_valid(header, block_bytes) is not None:   # a get deletes it
                found = i
                break
            parts = owned_part_keys(rkey, header, block_bytes)
            stripes += parts
            owner += [i] * len(parts)
        if stripes:
            there = await self._per_server(stripes, lambda conn, idx: conn.simple_many(
                [command(b"EXISTS", stripes[j]) for j in idx]))
            found = min([found] + [owner[j] for j, r in enumerate(there) if r != 1])
        return found

    def _present(self, reply: Any, namespace: bytes | None) -> bool:
        """Whether a ``_probe`` reply says the block is there (for ``namespace``). A reply
        of a type the command cannot answer (EXISTS: an integer; GETRANGE: a bulk string)
        is a miss and a server error, counted: never converted (``bytes(n)`` of a
        server's integer allocates n bytes)."""
        if namespace is None:
            if isinstance(reply, int) and not isinstance(reply, bool):
                return reply == 1
            self._odd_reply("EXISTS", reply)
            return False
        if not isinstance(reply, (bytes, bytearray, memoryview)):
            self._odd_reply("GETRANGE", reply)
            return False
        if not reply:  # GETRANGE of a missing key: b""
            return False
        if bytes(reply) != namespace:
            self.namespace_mismatches += 1
            return False
        return True

    def _odd_reply(self, cmd: str, reply: Any) -> None:
        """Count a reply that ``cmd`` cannot answer (a broken or hostile server)."""
        self._note_error(ProtocolError(
            f"redis answered {cmd} with {type(reply).__name__} {reply!r:.60}"))

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
            self.counters.miss_blocks += n
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
        self.counters.hit_blocks += filled
        self.counters.miss_blocks += n - filled
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
        # the value at `key` is sound or unknown: the reply was out of step, the server's
        self._note_error(ProtocolError(f"redis answered GET {rkey!r:.60} with a frame "
                                       f"of another key"))

    async def _drop_corrupt(self, rkey: bytes, why: str) -> None:
        self.counters.checksum_failures += 1
        self.counters.evicted(EvictionReason.CORRUPT)
        log.warning("redis tier: corrupt frame at %r deleted (%s)", rkey, why)
        await self._per_server([rkey], lambda c, idx: c.simple_many([command(b"DEL", rkey)]))


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
