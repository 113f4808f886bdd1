"""Large blocks stored in Redis as stripes (``kvtier.frame.FLAG_STRIPED``).

Redis serves values of 32 MiB and more several times slower than smaller ones (bench_redis,
one redis-server 6.2, 64 MiB per round on one connection: 2 x 32 MiB values SET in ~55 ms,
16 x 4 MiB in ~17 ms, 4 x 16 MiB in ~19 ms), and a big value is one server's load however
many masters a cluster has. So a block of ``STRIPED_MIN_BYTES`` or more is stored as
``STRIPE_BYTES`` stripes of its frame's payload: the block's Redis key holds the header and
stripe 0 (so the namespace probes of ``exists_prefix`` and ``delete`` see a frame as for
any block), and stripe i >= 1 lives under the key + ``:i`` (no hash tag: in a cluster the
stripes spread over the masters and are moved in parallel).

Each write draws a tag (``FLAG_STRIPE_TAG``: the header's seq) and names its stripes after
it (key + ``:<tag>:i``), so two versions of a block (a rewrite, two nodes storing the same
key) never share a stripe. Writes: a batch's stripes go first and a head only once every
stripe of its block was stored (``RedisTier._write_batch``), so a head always had its
stripes; once the new head is stored, the stripes of the version it replaced are deleted.
A stripe missing under a head was evicted or expired since: the reader deletes that
version's stripes, and the head too if it still holds the same header (read again right
before; a rewrite's head that lands in between is kept, and its stripes never were at
risk). Reads: the header (GETRANGE), then every stripe in parallel straight into the
caller's buffer (a scratch buffer when compressed), then one checksum over the whole
payload. Frames written before tags (stripes under key + ``:i``) are still read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier import codec as codecs
from kvtier.checksum import verify
from kvtier.errors import FrameError
from kvtier.frame import FLAG_STRIPE_TAG, FLAG_STRIPED, HEADER_SIZE, FrameHeader, stripe_bounds
from kvtier.tiers.base import EvictionReason
from kvtier.tiers.redis_blocks import (
    BlockRead,
    ReadStatus,
    header_range,
    lengths_sound,
    uncompressed,
)
from kvtier.tiers.redis_queue import PendingWrite
from kvtier.tiers.redis_resp import KEY_ERRORS, ErrorReply, ProtocolError, command
from kvtier.tiers.redis_wire import Conn

if TYPE_CHECKING:
    from kvtier.tiers.redis_reads import RedisReads

Parts = tuple[bytes | memoryview, ...]


def part_key(rkey: bytes, i: int, tag: int | None = None) -> bytes:
    """The Redis key of stripe ``i`` (>= 1) of the block at ``rkey`` written with ``tag``
    (None: a frame from before tags)."""
    return rkey + (b":%d" % i if tag is None else b":%016x:%d" % (tag, i))


def stripe_tag(header: FrameHeader) -> int | None:
    """The tag that names a striped frame's stripes (None: a frame from before tags)."""
    return header.seq if header.flags & FLAG_STRIPE_TAG else None


def part_keys(rkey: bytes, header: FrameHeader) -> list[bytes]:
    """The keys of every stripe after the head's."""
    tag = stripe_tag(header)
    return [part_key(rkey, i, tag) for i in range(1, len(stripe_bounds(header.payload_len)))]


def owned_part_keys(rkey: bytes, header: FrameHeader, block_bytes: int | None) -> list[bytes]:
    """The stripe keys that deleting the head at ``rkey`` takes along: those of a striped
    header whose lengths its codec can produce (``lengths_sound``) for a block of
    ``block_bytes`` (its namespace's layout's, when known); none otherwise, the head is
    deleted alone. So a corrupt or planted head costs one DEL, not the 16383 a
    ``payload_len`` of ``MAX_PAYLOAD`` would name; a sound one names at most the stripes
    of the largest block it can hold (``FrameHeader.unpack`` refuses raw_len and
    payload_len above ``MAX_PAYLOAD``)."""
    if not header.flags & FLAG_STRIPED or not lengths_sound(header):
        return []
    if block_bytes is not None and header.raw_len != block_bytes:
        return []
    return part_keys(rkey, header)


def stripe_sets(rkey: bytes, body: bytes | memoryview, tag: int) -> list[tuple[bytes, Parts]]:
    """The SETs of stripes 1.. of the block at ``rkey`` whose frame body is ``body``, written
    with ``tag``. An uncompressed block's body is its payload itself: its stripes can go out
    before it is framed, while the payload is hashed for the head."""
    view = memoryview(body)
    return [(part_key(rkey, i, tag), (view[lo:hi],))
            for i, (lo, hi) in enumerate(stripe_bounds(view.nbytes)) if i]


def head_parts(item: PendingWrite) -> Parts:
    """What a framed striped ``item``'s key holds (header and stripe 0): set only once its
    stripes are stored."""
    header, body = item.parts
    view = memoryview(body)
    lo, hi = stripe_bounds(view.nbytes)[0]
    return header, view[lo:hi]


async def fetch_striped(tier: RedisReads, rkey: bytes, header: FrameHeader,
                        out: memoryview) -> BlockRead:
    """The striped block whose (checked) ``header`` was read at ``rkey``, into ``out``: a
    verified BlockRead, MISSING (a stripe is gone: the rest is deleted; or the block was
    rewritten while being read), or CORRUPT (its stripes are deleted; the caller counts it
    and deletes the head, as for any corrupt frame). ``out`` holds nothing unverified
    afterwards."""
    read = await _read_stripes(tier, rkey, header, out)
    if read.status is ReadStatus.CORRUPT and await _header_at(tier, rkey) != header:
        return BlockRead(ReadStatus.MISSING, read.wire, "rewritten while read")
    if read.status is ReadStatus.MISSING:
        # this version's stripes are its own (tagged); its head goes only while it still
        # holds this header: a rewrite's head stored since is a whole block (its stripes
        # came first)
        gone = await _delete(tier, part_keys(rkey, header))
        gone += await _delete_head_if(tier, rkey, header)
        if gone:
            tier.counters.evicted(EvictionReason.EXPIRED)
    elif read.status is ReadStatus.CORRUPT:   # the caller counts it and deletes the head
        await _delete(tier, part_keys(rkey, header))
    return read


async def _read_stripes(tier: RedisReads, rkey: bytes, header: FrameHeader,
                        out: memoryview) -> BlockRead:
    plain = uncompressed(header)
    # a compressed block's scratch (judge_header bounded its length) is made and zeroed
    # in a worker thread: tens of MiB of memset would stall the event loop
    payload = out[:header.raw_len] if plain else await tier._in_thread(
        lambda: memoryview(bytearray(header.payload_len)))

    bounds = stripe_bounds(header.payload_len)
    keys = [rkey, *part_keys(rkey, header)]
    dests = [payload[lo:hi] for lo, hi in bounds]

    def read(conn: Conn, idx: list[int]) -> list[object]:
        # one server's stripes one after another: a server serves big values fastest to
        # few connections (two 32 MiB blocks: 17 ms, vs 39-43 ms with 2-8 stripes of
        # each in flight); in a cluster the servers holding stripes work in parallel
        got: list[object] = []
        for i in idx:
            if conn.stale():   # (found by review) see _stale
                return _stale(conn, len(idx))
            got.append(conn.getrange_into(rkey, HEADER_SIZE, dests[0]) if i == 0
                       else conn.get_exact(keys[i], dests[i]))
            if conn.mid_reply:   # a stripe longer than its own, refused unread: its
                return got + [None] * (len(idx) - len(got))   # connection is closed
        # the peeks see a reply too many only once it arrived; the PING's echo, read after
        # every stripe's reply, sees any that the server sent (one round trip per server)
        return _stale(conn, len(idx)) if conn.stale() or not conn.in_step() else got

    got = await tier._per_server(keys, read, holds_buffers=True)
    wire = HEADER_SIZE + header.payload_len
    status, why, error = _verdict(got, dests)
    if status is ReadStatus.ERROR:   # says nothing of the block
        if plain:
            payload[:] = bytes(payload.nbytes)
        return BlockRead(ReadStatus.ERROR, wire, why=why, error=error)
    decoding = False
    if status is ReadStatus.OK:
        try:
            await tier._in_thread(lambda: verify(header, payload))
            if not plain:
                decoding = True
                await tier._in_thread(lambda: codecs.decode(header.codec, payload,
                                                            header.raw_len, out))
            return BlockRead(ReadStatus.OK, wire,
                             checksum=header.checksum if plain else None)
        except FrameError as exc:
            status, why = ReadStatus.CORRUPT, str(exc)
    if plain or decoding:   # never leave unverified or partly decoded bytes behind
        out[:header.raw_len] = bytes(header.raw_len)
    return BlockRead(status, wire, why)


def _stale(conn: Conn, n: int) -> list[object]:
    """The results of a stripe run whose connection received bytes past an exchange's
    reply (a server that answered twice): ``n`` ProtocolErrors, an error read (a miss,
    nothing deleted), the connection dropped and counted (``out_of_step``). Found by
    review: stripe 0's GETRANGE answered twice was read as stripe 1's value, the
    checksum failed, and the sound block (head and stripes) was deleted."""
    conn.out_of_step = True
    return [ProtocolError(f"redis {conn.addr} sent more than its replies")] * n


def _verdict(got: list[object], dests: list[memoryview]
             ) -> tuple[ReadStatus, str, ErrorReply | None]:
    """What a striped read's per-stripe results say: ERROR for a failed server or
    connection (an exception) or an error reply about the server (OOM, LOADING: it says
    nothing of the block); CORRUPT for a stripe holding another type (``WRONGTYPE``:
    another writer's value under a stripe's key) or a stripe of another length; MISSING
    for a stripe that is gone; else OK (the checksum decides). Found by review: a stripe
    turned into a list was an ERROR that deleted nothing, so its block stayed a lookup
    hit that every get missed."""
    if any(isinstance(r, BaseException) for r in got):
        failed = next(r for r in got if isinstance(r, BaseException))
        return ReadStatus.ERROR, str(failed), None
    errors = [r for r in got if isinstance(r, ErrorReply)]
    key_error = next((r for r in errors if r.kind in KEY_ERRORS), None)
    if key_error is not None:
        return ReadStatus.CORRUPT, f"a stripe holds another type ({key_error})", None
    if errors:
        return ReadStatus.ERROR, str(errors[0]), errors[0]
    if any(isinstance(n, int) and n != d.nbytes for n, d in zip(got, dests, strict=True)):
        return ReadStatus.CORRUPT, "a stripe of another length", None
    if any(n is None for n in got):
        return ReadStatus.MISSING, "a stripe is missing", None
    return ReadStatus.OK, "", None


async def _header_at(tier: RedisReads, rkey: bytes) -> FrameHeader | None:
    return (await headers_at(tier, [rkey]))[0]


async def headers_at(tier: RedisReads, rkeys: list[bytes]) -> list[FrameHeader | None]:
    """The sound frame header stored at each of ``rkeys`` (None: absent, not a frame, an
    error)."""
    heads = await tier._per_server(
        rkeys, lambda c, idx: c.simple_many([header_range(rkeys[i]) for i in idx]))
    out: list[FrameHeader | None] = []
    for head in heads:
        try:
            out.append(FrameHeader.unpack(head) if isinstance(head, bytes) else None)
        except FrameError:
            out.append(None)
    return out


def replaced_parts(rkey: bytes, old: FrameHeader | None, new_tag: int,
                   block_bytes: int) -> list[bytes]:
    """The stripes of ``old`` (the frame a write of ``rkey`` with ``new_tag`` replaced)
    that no head names any more: to delete once the new head is stored."""
    if old is None or stripe_tag(old) == new_tag:
        return []
    return owned_part_keys(rkey, old, block_bytes)


async def _delete_head_if(tier: RedisReads, rkey: bytes, header: FrameHeader) -> int:
    """Delete the head at ``rkey`` only while it holds ``header``, atomically (WATCH, then
    MULTI/DEL/EXEC: the DEL is dropped when the key changed after the WATCH): a read
    then a DEL would delete a rewrite's head landing in between (6 of 40 such races
    lost the rewrite in the review's test). 1 when deleted; 0 otherwise, and also when
    the server refuses WATCH (an ACL without it): the head then stays until it is
    rewritten, evicted or expires, a lookup hit whose get misses."""
    expected = header.pack()

    def cas(conn: Conn, idx: list[int]) -> list[object]:
        if conn.asking:   # the slot is migrating: every command would go behind an ASKING,
            return [0]    # which MULTI queues (found by review); the head waits for a read
        watched, head = conn.simple_many([command(b"WATCH", rkey), header_range(rkey)])
        if isinstance(watched, ErrorReply):
            return [watched]
        if head != expected:
            conn.simple_many([command(b"UNWATCH")])
            return [0]
        done = conn.simple_many([command(b"MULTI"), command(b"DEL", rkey),
                                 command(b"EXEC")])[2]
        return [done[0] if isinstance(done, list) and done else 0]

    (got,) = await tier._per_server([rkey], cas)
    if isinstance(got, ErrorReply):   # an ACL without WATCH; else a redirect, a failure
        if got.kind == "NOPERM":
            tier.note_refused_watch(got)
        else:
            tier._error_reply(got)
        return 0
    return got if isinstance(got, int) and not isinstance(got, bool) else 0


async def _delete(tier: RedisReads, keys: list[bytes]) -> int:
    """Delete ``keys`` (a head, stripes); how many existed."""
    if not keys:
        return 0
    replies = await tier._per_server(
        keys, lambda c, idx: c.simple_many([command(b"DEL", keys[i]) for i in idx]))
    return sum(r for r in replies if isinstance(r, int) and not isinstance(r, bool))
