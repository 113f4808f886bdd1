"""The Redis tier's bounded write-behind queue and the framing of queued blocks.

Writes to Redis are best effort: a block that does not make it is recomputed or read from
another tier later, so the queue never applies backpressure to the caller. When it is
full the OLDEST pending write is dropped (and counted): recent blocks are the ones most
likely to be asked for again, and dropping the oldest keeps the queue's latency bounded.

A queued block either borrows the caller's buffer (``PendingWrite.borrow``: the caller keeps
it unchanged, e.g. an arena slot pinned, until ``release`` is called once the SET is done,
dropped or failed) or owns a private copy (``PendingWrite.copy_of``: one memcpy, for callers
that reuse their buffer at once). Either way the frame goes out as two buffers, header and
payload, so a NONE-codec write costs one checksum and no copy of its own.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvtier import codec as codecs
from kvtier.checksum import header_for
from kvtier.frame import FLAG_STRIPE_TAG, FLAG_STRIPED, STRIPED_MIN_BYTES, Codec

Release = Callable[[], None]
OnChecksum = Callable[[int | None], None]


class Borrowed(NamedTuple):
    """A block handed to Redis in place (``RedisTier.submit_many``): its identity, its
    payload where it lies, and the callbacks of a borrowed write (see ``submit``)."""

    namespace: bytes
    key: bytes
    layout_fp: int
    payload: memoryview
    seq: int
    release: Release
    on_checksum: OnChecksum | None = None
DEFAULT_ELEM_BYTES = 2   # shuffle width when a block's layout is unknown (fp16/bf16)


@dataclass(slots=True)
class PendingWrite:
    """One block waiting to be written: identity, payload (borrowed or copied), its frame."""

    redis_key: bytes
    namespace: bytes
    key: bytes
    layout_fp: int
    seq: int
    payload: memoryview                 # the raw block bytes (flat, unsigned bytes)
    raw_len: int
    release: Release | None = None      # set when borrowed: call once the write is over
    parts: tuple[bytes | memoryview, ...] = ()   # the frame as sent: header, payload
    codec: Codec = Codec.NONE
    elem_bytes: int = DEFAULT_ELEM_BYTES  # byte-shuffle element width (its layout's)
    on_checksum: OnChecksum | None = None  # told the payload's xxh3-64 (or None) at done()
    checksum: int | None = None         # the payload's xxh3-64, once framed uncompressed
    ok: bool = False                    # Redis answered OK to this SET
    on_settled: Callable[[PendingWrite], None] | None = None  # told first in done()
    tag: int = 0   # a striped write's own tag: its header's seq, its stripes' names
    owned: bool = False   # the payload is this write's own copy (``copy_of``)

    def __post_init__(self) -> None:
        if self.striped:   # drawn per write: a rewrite's stripes never share a name
            self.tag = int.from_bytes(os.urandom(8), "little")

    @classmethod
    def copy_of(cls, redis_key: bytes, namespace: bytes, key: bytes, layout_fp: int,
                seq: int, payload: memoryview,
                elem_bytes: int = DEFAULT_ELEM_BYTES, *, copy: bool = True) -> PendingWrite:
        """Snapshot ``payload`` (one memcpy): the caller may reuse its buffer at once.
        ``copy=False``: ``payload`` is already a private copy, handed over as it is."""
        data = memoryview(bytes(_flat(payload))) if copy else _flat(payload)
        return cls(redis_key, namespace, key, layout_fp, seq, data, data.nbytes,
                   elem_bytes=elem_bytes, owned=True)

    @classmethod
    def borrow(cls, redis_key: bytes, namespace: bytes, key: bytes, layout_fp: int,
               seq: int, payload: memoryview, release: Release,
               elem_bytes: int = DEFAULT_ELEM_BYTES,
               on_checksum: OnChecksum | None = None) -> PendingWrite:
        """Use ``payload`` in place; ``release`` is called exactly once when done with it
        (after ``on_checksum``, when given, with the payload's checksum if it was framed
        uncompressed, else None)."""
        view = _flat(payload)
        return cls(redis_key, namespace, key, layout_fp, seq, view, view.nbytes, release,
                   elem_bytes=elem_bytes, on_checksum=on_checksum)

    @property
    def striped(self) -> bool:
        """Whether the frame is stored in stripes (``kvtier.tiers.redis_stripes``)."""
        return self.raw_len >= STRIPED_MIN_BYTES

    @property
    def wire_len(self) -> int:
        return sum(memoryview(p).nbytes for p in self.parts)

    def settle(self) -> None:
        """Tell ``on_settled`` (once) that the write's outcome (``ok``) is known: a
        synchronous commit waiting on it may answer before the rest of ``done``."""
        settled, self.on_settled = self.on_settled, None
        if settled is not None:
            settled(self)

    def done(self) -> None:
        """The write is over (sent, dropped or failed): settle it if not yet, then give a
        borrowed buffer back."""
        self.settle()
        told, self.on_checksum = self.on_checksum, None
        if told is not None:
            told(self.checksum)
        release, self.release = self.release, None
        if release is not None:
            release()


def _flat(view: memoryview) -> memoryview:
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def frame_pending(item: PendingWrite, codec: Codec | codecs.AutoCodec) -> None:
    """Encode and frame ``item`` (sets ``item.parts``) with its own ``elem_bytes``;
    CPU-bound, thread-safe.

    NONE: one checksum over the payload where it lies, no copy. Other codecs: the encoded
    body is a new buffer, so a borrowed payload could be released right after this.
    """
    raw, elem_bytes = item.payload, item.elem_bytes
    flags, seq = (FLAG_STRIPED | FLAG_STRIPE_TAG, item.tag) if item.striped else (0, item.seq)
    if isinstance(codec, codecs.AutoCodec):
        chosen, body = codec.encode(raw, elem_bytes)
    elif codec is Codec.NONE:
        chosen, body = Codec.NONE, b""
    else:
        chosen, body = codec, codecs.encode(codec, raw, elem_bytes)
    if chosen is Codec.NONE:
        header = header_for(item.namespace, item.key, item.layout_fp, raw, seq=seq,
                            flags=flags)
        item.parts = (header.pack(), raw)
        item.checksum = header.checksum     # of the raw payload: its owner may reuse it
    else:
        header = header_for(item.namespace, item.key, item.layout_fp, body,
                            raw_len=len(raw), codec=chosen, seq=seq, flags=flags)
        item.parts = (header.pack(), body)
    item.codec = chosen


class WriteQueue:
    """FIFO of PendingWrite bounded by block count, and by the bytes of the copies it owns
    (``max_copy_bytes``: a borrowed payload is the caller's memory, an arena slot; a copy
    is the daemon's own: 256 copies of 32 MiB blocks demoted to a slow Redis were 8 GiB);
    ``push`` drops the oldest write when full, the oldest copies when they are over."""

    __slots__ = ("_items", "capacity", "copy_bytes", "dropped", "max_copy_bytes",
                 "queued_bytes")

    def __init__(self, capacity: int, max_copy_bytes: int = 0) -> None:
        """``max_copy_bytes`` 0: copies bounded by ``capacity`` alone."""
        self.capacity = max(1, capacity)
        self.max_copy_bytes = max_copy_bytes
        self._items: deque[PendingWrite] = deque()
        self.dropped = 0
        self.queued_bytes = 0
        self.copy_bytes = 0   # of the queued writes that own their payload

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: PendingWrite) -> list[PendingWrite]:
        """Append ``item``; returns the writes dropped for it: the oldest when the queue
        was full, then the oldest copies while copies are over ``max_copy_bytes`` (never
        ``item`` itself: the newest block is the likeliest to be asked for again)."""
        dropped: list[PendingWrite] = []
        if len(self._items) >= self.capacity:
            dropped.append(self._forget(self._items.popleft()))
        self._items.append(item)
        self.queued_bytes += item.raw_len
        if item.owned:
            self.copy_bytes += item.raw_len
            if self.max_copy_bytes and self.copy_bytes > self.max_copy_bytes:
                over = self._oldest_copies(self.copy_bytes - self.max_copy_bytes, item)
                if over:
                    gone = {id(it) for it in over}
                    self._items = deque(it for it in self._items if id(it) not in gone)
                    dropped += [self._forget(it) for it in over]
        return dropped

    def _oldest_copies(self, nbytes: int, keep: PendingWrite) -> list[PendingWrite]:
        """The oldest queued copies (not ``keep``) holding at least ``nbytes``."""
        found: list[PendingWrite] = []
        for it in self._items:
            if nbytes <= 0:
                break
            if it.owned and it is not keep:
                found.append(it)
                nbytes -= it.raw_len
        return found

    def _forget(self, item: PendingWrite) -> PendingWrite:
        """``item`` left the queue unsent (dropped): its bytes no longer count."""
        self._taken(item)
        self.dropped += 1
        return item

    def _taken(self, item: PendingWrite) -> None:
        self.queued_bytes -= item.raw_len
        if item.owned:
            self.copy_bytes -= item.raw_len

    def take(self, max_items: int, max_bytes: int) -> list[PendingWrite]:
        """Pop up to ``max_items`` writes totalling about ``max_bytes`` (at least one)."""
        batch: list[PendingWrite] = []
        size = 0
        while self._items and len(batch) < max_items:
            nxt = self._items[0].raw_len
            if batch and size + nxt > max_bytes:
                break
            item = self._items.popleft()
            self._taken(item)
            size += nxt
            batch.append(item)
        return batch

    def cancel(self, rkeys: set[bytes], namespace: bytes) -> int:
        """Drop the queued writes of ``rkeys`` under ``namespace`` (a delete: sent after
        it, a SET would bring the block back); their buffers are released. How many."""
        gone = [it for it in self._items if it.redis_key in rkeys and it.namespace == namespace]
        if not gone:
            return 0
        dropped = {id(it) for it in gone}
        self._items = deque(it for it in self._items if id(it) not in dropped)
        for item in gone:
            self._taken(item)
            item.done()
        return len(gone)

    def drop_borrowed(self) -> int:
        """Drop the queued writes that borrow a caller's buffer (released); how many."""
        keep = deque(it for it in self._items if it.release is None)
        dropped = [it for it in self._items if it.release is not None]
        for item in dropped:
            item.done()
            self._taken(item)
        self._items = keep
        self.dropped += len(dropped)
        return len(dropped)

    def clear(self) -> int:
        """Drop everything still queued (borrowed buffers released); returns how many."""
        n = len(self._items)
        for item in self._items:
            item.done()
        self._items.clear()
        self.queued_bytes = self.copy_bytes = 0
        self.dropped += n
        return n


RECENT_OUTCOMES = 4096   # finished writes whose result is kept for a later ``wait``


class WriteOutcomes:
    """Which SETs of a key succeeded: a caller that needs its blocks *in* Redis (a
    synchronous commit) waits for exactly its writes instead of draining the whole queue
    and probing Redis afterwards. Per Redis key: the newest write still pending, or the
    result and end time of a recent one (a bounded LRU); anything else is unknown."""

    __slots__ = ("_pending", "_recent", "_waiters")

    def __init__(self) -> None:
        self._pending: dict[bytes, PendingWrite] = {}
        self._recent: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self._waiters: dict[bytes, list[asyncio.Future[bool]]] = {}

    def track(self, item: PendingWrite) -> None:
        """``item`` was queued: it is now the write a ``wait`` on its key waits for."""
        self._pending[item.redis_key] = item
        self._recent.pop(item.redis_key, None)
        item.on_settled = self._settled

    def _settled(self, item: PendingWrite) -> None:
        key = item.redis_key
        if self._pending.get(key) is not item:
            return   # a newer write of the same key is the one that counts
        del self._pending[key]
        self._recent[key] = (item.ok, time.monotonic())
        if len(self._recent) > RECENT_OUTCOMES:
            self._recent.popitem(last=False)
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(item.ok)

    def give_up_waiting(self) -> None:
        """The tier went down: every ``wait`` answers now (False for a write still queued,
        which waits for the tier to come back) instead of hanging until it does."""
        waiters, self._waiters = self._waiters, {}
        for futs in waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(False)

    async def wait(self, rkeys: Sequence[bytes], since: float, *,
                   up: bool = True) -> list[bool | None]:
        """Per key: True once its newest write was stored, False when that write failed
        or was dropped, None when no write of it is pending and none ended at or after
        ``since`` (``time.monotonic()``): an older answer may no longer hold (a TTL, an
        eviction in Redis), so only Redis can tell. While the tier is down (``up`` False)
        a pending write answers False at once."""
        loop = asyncio.get_running_loop()
        waiting: dict[int, asyncio.Future[bool]] = {}
        out: list[bool | None] = []
        for i, key in enumerate(rkeys):
            if key in self._pending:
                if up:
                    waiter: asyncio.Future[bool] = loop.create_future()
                    self._waiters.setdefault(key, []).append(waiter)
                    waiting[i] = waiter
                out.append(False)   # the write's reply replaces it below
            else:
                ok, ended = self._recent.get(key, (False, -1.0))
                out.append(ok if ended >= since else None)
        for i, waiter in waiting.items():
            out[i] = await waiter
        return out
