"""The nvme tier's start-up scan: rebuild the slot map from the files' header pages.

Crash safety rests on the frame format: a frame is written with one ``pwritev(header page,
payload)`` and header and payload are both checksummed, so a torn write (or a reused slot
whose old header survived) fails verification instead of returning wrong bytes. The scan
trusts only headers that unpack and fit their slot; payloads are verified on every read.
Evicted slots keep their frame (still correct data that may come back after a restart); an
explicit delete erases the header page so it cannot.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from kvtier.errors import FrameError
from kvtier.frame import HEADER_SIZE, FrameHeader
from kvtier.tiers.aligned import PAGE, aligned_buffer
from kvtier.tiers.base import EvictionReason, TierCounters
from kvtier.tiers.nvme.buffers import scratch
from kvtier.tiers.nvme.slots import FILE_RE, NvmeSlot, SizeClass, SlotTable

__all__ = ["Recovered", "recover"]

log = logging.getLogger(__name__)

SEQ_SCAN_MAX_STRIDE = 256 * 1024   # up to this slot stride, scan whole files sequentially
SCAN_CHUNK = 8 * 2**20             # bytes per sequential scan read

Recovered = list[tuple[NvmeSlot, FrameHeader]]


def recover(table: SlotTable, pool: ThreadPoolExecutor, counters: TierCounters,
            ) -> tuple[Recovered, int]:
    """Open every slot file under ``table.root``, adopt its valid frames and return them,
    oldest first (by ``header.seq``), so the store can rebuild its index and LRU order, with
    the highest ``seq`` seen on disk (0 when none).

    Torn or corrupt headers, and frames longer than what their file holds, are counted as
    checksum failures and their slots freed. When a key is stored twice, only the newest copy
    is kept. When the stored frames exceed the capacity (it was lowered), the oldest are
    dropped (counted as capacity evictions). Files are trimmed of their free tails.
    """
    found: Recovered = []
    for path in sorted(table.root.iterdir()):
        m = FILE_RE.match(path.name)
        if m is None or int(m.group(1)) <= 0 or int(m.group(1)) % PAGE:
            continue
        found.extend(_scan(table, table.open_class(int(m.group(1))), pool, counters))
    newest: dict[tuple[bytes, bytes], tuple[NvmeSlot, FrameHeader]] = {}
    max_seq = max((header.seq for _, header in found), default=0)
    for slot, header in sorted(found, key=lambda item: item[1].seq):
        old = newest.get((header.namespace, header.key))
        if old is not None:
            table.release(old[0])   # a stale copy: superseded by a later write
        newest[(header.namespace, header.key)] = (slot, header)
    kept = sorted(newest.values(), key=lambda item: item[1].seq)
    while table.used > table.capacity and kept:
        table.release(kept.pop(0)[0])
        counters.evicted(EvictionReason.CAPACITY)
    for cls in table.classes.values():
        table.trim(cls, lambda _slot: True)
    return kept, max_seq


def _scan(table: SlotTable, cls: SizeClass, pool: ThreadPoolExecutor,
          counters: TierCounters) -> Recovered:
    """Classify every slot of a file from its header page; adopt and return the valid ones."""
    size = os.fstat(cls.fd).st_size
    high_water = -(-size // cls.stride)
    valid: Recovered = []
    for index, raw in _read_headers(cls, size, high_water, pool):
        if not raw.strip(b"\0"):
            continue
        try:
            header = FrameHeader.unpack(raw)
            if (header.payload_len > cls.slot_bytes
                    or index * cls.stride + PAGE + header.payload_len > size):
                raise FrameError("frame longer than its slot or file")
        except FrameError as exc:
            counters.checksum_failures += 1
            log.warning("nvme tier: dropping %s slot %d: %s", cls.path, index, exc)
            continue
        valid.append((NvmeSlot(cls.slot_bytes, index), header))
    table.adopt(cls, size, [slot.index for slot, _ in valid])
    return valid


def _read_headers(cls: SizeClass, size: int, high_water: int,
                  pool: ThreadPoolExecutor) -> Iterator[tuple[int, bytes]]:
    """Each slot's first HEADER_SIZE bytes (fewer at a torn tail), in index order.

    Small slots: whole-file reads of ``SCAN_CHUNK`` bytes (few syscalls, sequential).
    Large slots: one header-page read per slot, spread over the pool, so a start does not
    read every payload off the disk.
    """
    stride = cls.stride
    if stride > SEQ_SCAN_MAX_STRIDE:
        offsets = [i * stride for i in range(high_water)]
        pages = pool.map(_read_page_sync, [cls.fd] * len(offsets), offsets)
        yield from enumerate(pages)
        return
    per_chunk = max(1, SCAN_CHUNK // stride)
    buf = aligned_buffer(per_chunk * stride)
    for first in range(0, high_water, per_chunk):
        got = os.preadv(cls.fd, [buf], first * stride)
        for j in range(min(per_chunk, high_water - first)):
            start = j * stride
            yield first + j, bytes(buf[start: min(start + HEADER_SIZE, max(got, start))])


def _read_page_sync(fd: int, offset: int) -> bytes:
    page = scratch.rpage
    got = os.preadv(fd, [page], offset)
    return bytes(page[: min(max(got, 0), HEADER_SIZE)])
