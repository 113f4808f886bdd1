"""Reading one large block from Redis in parallel ranges (GETRANGE on several connections).

Blocks of ``RANGED_MIN_BYTES`` or more are written striped now (kvtier.tiers.redis_stripes,
read from here once the header says so); ranges serve frames stored whole (by an earlier
kvtier).

A Redis server writes a reply to one client at most 64 KiB per turn of its event loop
(``NET_MAX_WRITES_PER_EVENT``, unless ``maxmemory`` is exceeded), so one GET of a 32 MiB
value is paced by the server's loop, however fast the link. The same value read as
several ranges on several connections is served in parallel turns (bench_redis: two
32 MiB blocks ~46 ms as GETs; redis-py's GETRANGEs of 4-8 parts of them: 27-39 ms).

The frame's header is read first (``GETRANGE 0 HEADER_SIZE-1``) and checked as a GET's
header is (namespace, key, layout, sizes); only an uncompressed frame that fits the
caller's buffer is read in ranges, each straight into its slice of the buffer, and the
payload is then verified whole against the header's checksum. Anything else (a missing
key, a compressed frame, a short range, a checksum that does not match) returns None and
the caller reads the block with one GET, which is atomic: a value replaced between two
ranges (another node storing the same key) costs a second read, never a block built of
two versions, and never the deletion of a sound frame. Bytes written by failed ranges are
zeroed before returning.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvtier.checksum import verify
from kvtier.errors import FrameError
from kvtier.frame import FLAG_STRIPED, HEADER_SIZE, STRIPED_MIN_BYTES
from kvtier.tiers.redis_blocks import (
    BlockRead,
    ReadStatus,
    header_range,
    judge_header,
    uncompressed,
)
from kvtier.tiers.redis_stripes import fetch_striped
from kvtier.tiers.redis_wire import Conn

if TYPE_CHECKING:
    from kvtier.tiers.redis_reads import RedisReads

RANGED_MIN_BYTES = STRIPED_MIN_BYTES   # blocks at least this large are read in ranges
RANGE_PART_BYTES = 4 << 20             # ... of about this size each (or as stripes)


def ranged(nbytes: int) -> bool:
    """Whether a block of ``nbytes`` is read in ranges."""
    return nbytes >= RANGED_MIN_BYTES


async def fetch_ranged(tier: RedisReads, key: bytes, rkey: bytes, out: memoryview,
                       namespace: bytes, layout_fp: int) -> BlockRead | None:
    """Block ``key`` into ``out`` by ranges; a verified BlockRead, a FOREIGN/NOFIT
    header verdict, or None to read it with one GET instead (see the module docstring)."""
    head = (await tier._per_server(
        [rkey], lambda c, idx: c.simple_many(
            [header_range(rkey)])))[0]
    if not isinstance(head, bytes) or len(head) < HEADER_SIZE:
        return None                  # missing, an error, no live server: the GET decides
    verdict = judge_header(head, key, out.nbytes, namespace, layout_fp)
    if isinstance(verdict, BlockRead):   # a corrupt or stray one is left to the GET, which
        return None if verdict.status in (ReadStatus.CORRUPT, ReadStatus.STRAY) else verdict
    header = verdict
    if header.flags & FLAG_STRIPED:   # the payload is in stripes, not in this value
        return await fetch_striped(tier, rkey, header, out)
    if not uncompressed(header):
        return None
    payload = out[:header.raw_len]
    parts = [(lo, min(lo + RANGE_PART_BYTES, payload.nbytes))
             for lo in range(0, payload.nbytes, RANGE_PART_BYTES)]

    async def part(lo: int, hi: int) -> bool:
        def read(conn: Conn, idx: list[int]) -> list[object]:
            return [conn.getrange_into(rkey, HEADER_SIZE + lo, payload[lo:hi])]
        (n,) = await tier._per_server([rkey], read, holds_buffers=True)
        return n == hi - lo

    whole = all(await asyncio.gather(*(part(lo, hi) for lo, hi in parts)))
    if whole:
        try:
            await tier._in_thread(lambda: verify(header, payload))
            return BlockRead(ReadStatus.OK, HEADER_SIZE + header.payload_len,
                             checksum=header.checksum)
        except FrameError:
            pass
    payload[:] = bytes(payload.nbytes)   # never leave unverified bytes behind
    return None
