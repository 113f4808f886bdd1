"""The Redis tier's bounded write-behind queue and the framing of queued blocks.

Writes to Redis are best effort: a block that does not make it is recomputed or read from
another tier later, so the queue never applies backpressure to the caller. When it is
full the OLDEST pending write is dropped (and counted): recent blocks are the ones most
likely to be asked for again, and dropping the oldest keeps the queue's latency bounded.

A queued block owns a private copy of its payload, made at submit time, because the
caller's arena slot may be reused as soon as ``submit`` returns. The copy is laid out with
room for the frame header in front, so a NONE-codec frame is finished in place (header
written into the first 96 bytes) and handed to redis-py without another copy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtier import codec as codecs
from kvtier.frame import HEADER_SIZE, Codec, make_header


@dataclass(slots=True)
class PendingWrite:
    """One block waiting to be written: identity, private payload copy, and its frame."""

    redis_key: bytes
    namespace: bytes
    key: bytes
    layout_fp: int
    seq: int
    buf: bytearray                      # HEADER_SIZE bytes of room + the raw payload
    raw_len: int
    frame: bytes | bytearray | None = None
    codec: Codec = Codec.NONE

    @classmethod
    def copy_of(cls, redis_key: bytes, namespace: bytes, key: bytes, layout_fp: int,
                seq: int, payload: memoryview) -> PendingWrite:
        """Snapshot ``payload`` (one memcpy) into a buffer with room for the header."""
        buf = bytearray(HEADER_SIZE)  # grown by the copy: no zero-fill pass over the payload
        buf += payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
        return cls(redis_key, namespace, key, layout_fp, seq, buf, payload.nbytes)


def frame_pending(item: PendingWrite, codec: Codec | codecs.AutoCodec,
                  elem_bytes: int) -> None:
    """Encode and frame ``item`` in place (sets ``item.frame``); CPU-bound, thread-safe."""
    raw = memoryview(item.buf)[HEADER_SIZE:]
    if isinstance(codec, codecs.AutoCodec):
        chosen, body = codec.encode(raw, elem_bytes)
    elif codec is Codec.NONE:
        chosen, body = Codec.NONE, b""
    else:
        chosen, body = codec, codecs.encode(codec, raw, elem_bytes)
    if chosen is Codec.NONE:
        header = make_header(item.namespace, item.key, item.layout_fp, raw, seq=item.seq)
        item.buf[:HEADER_SIZE] = header.pack()
        item.frame = item.buf
    else:
        header = make_header(item.namespace, item.key, item.layout_fp, body,
                             raw_len=len(raw), codec=chosen, seq=item.seq)
        item.frame = header.pack() + body
        item.buf = bytearray()  # the raw copy is no longer needed: free it early
    item.codec = chosen


class WriteQueue:
    """FIFO of PendingWrite bounded by block count; ``push`` evicts the oldest when full."""

    __slots__ = ("_items", "capacity", "dropped", "queued_bytes")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._items: deque[PendingWrite] = deque()
        self.dropped = 0
        self.queued_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: PendingWrite) -> PendingWrite | None:
        """Append ``item``; returns the dropped oldest write when the queue was full."""
        dropped = None
        if len(self._items) >= self.capacity:
            dropped = self._items.popleft()
            self.queued_bytes -= dropped.raw_len
            self.dropped += 1
        self._items.append(item)
        self.queued_bytes += item.raw_len
        return dropped

    def take(self, max_items: int, max_bytes: int) -> list[PendingWrite]:
        """Pop up to ``max_items`` writes totalling about ``max_bytes`` (at least one)."""
        batch: list[PendingWrite] = []
        size = 0
        while self._items and len(batch) < max_items:
            nxt = self._items[0].raw_len
            if batch and size + nxt > max_bytes:
                break
            item = self._items.popleft()
            self.queued_bytes -= item.raw_len
            size += nxt
            batch.append(item)
        return batch

    def clear(self) -> int:
        """Drop everything still queued; returns how many writes were dropped."""
        n = len(self._items)
        self._items.clear()
        self.queued_bytes = 0
        self.dropped += n
        return n
