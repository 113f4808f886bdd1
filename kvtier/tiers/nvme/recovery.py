"""The nvme tier's start-up scan: rebuild the slot map from the files' header pages.

Crash safety rests on the frame format: a frame is written with one ``pwritev(header page,
payload)`` and header and payload are both checksummed, so a torn write (or a reused slot
whose old header survived) fails verification instead of returning wrong bytes. The scan
trusts only headers that unpack and fit their slot; payloads are verified on every read.
Evicted slots keep their frame (still correct data that may come back after a restart); a
frame dropped for good (an explicit delete, an orphan, a stale duplicate, a capacity drop at
start) has its header page erased so it cannot.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from kvtier.errors import FrameError
from kvtier.frame import HEADER_SIZE, FrameHeader, parent_tag
from kvtier.tiers.aligned import PAGE, aligned_buffer
from kvtier.tiers.base import EvictionReason, TierCounters
from kvtier.tiers.nvme.buffers import ZERO_PAGE, scratch
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
    checksum failures and their slots freed. Only the slots that fit the capacity are read
    (a file larger than it is cut). When a key is stored twice, only the newest copy is kept.
    When the frames do not fit the capacity (it was lowered), the deepest are dropped first
    (``_fit``: every kept frame's parent stays), counted as capacity evictions. Frames
    dropped here have their header page erased (else they would come back at the next start)
    and the files are trimmed of their free tails; a file left with no frame is removed.
    Files are scanned one at a time, so at most ``table.files.limit`` stay open.
    """
    found: Recovered = []
    for path in sorted(table.root.iterdir()):
        m = FILE_RE.match(path.name)
        if m is None or int(m.group(1)) % PAGE or int(m.group(1)) in table.classes:
            continue
        cls = table.open_class(int(m.group(1)))
        found.extend(_scan(table, cls, pool, counters))
        if cls.high_water == 0:   # (no frame: cut to nothing by ``adopt``)
            table.drop(cls)
    newest: dict[tuple[bytes, bytes], tuple[NvmeSlot, FrameHeader]] = {}
    max_seq = max((header.seq for _, header in found), default=0)
    dropped: list[NvmeSlot] = []
    for slot, header in sorted(found, key=lambda item: item[1].seq):
        old = newest.get((header.namespace, header.key))
        if old is not None:
            dropped.append(old[0])   # a stale copy: superseded by a later write
        newest[(header.namespace, header.key)] = (slot, header)
    # the frames' own footprints must fit (what ``used`` counts); the room between them
    # is given back by punching the free slots (kvtier.tiers.nvme.holes): a frame written
    # into punched room made the files span more than the capacity, and fitting their
    # spans dropped exactly those frames at every start
    kept, over = _fit(list(newest.values()), table.capacity, spans=False)
    for slot in [*dropped, *(slot for slot, _ in over)]:
        table.release(slot)
    for cls in list(table.classes.values()):   # (a class cut to nothing is dropped)
        table.trim(cls, lambda _slot: True)
    _erase(table, pool, counters, [*dropped, *(slot for slot, _ in over)])
    if not table.fit_disk(lambda _slot: True):   # no holes here: the spans must fit
        kept, more = _fit(kept, table.capacity, spans=True)
        for slot, _ in more:
            table.release(slot)
        for cls in list(table.classes.values()):
            table.trim(cls, lambda _slot: True)
        _erase(table, pool, counters, [slot for slot, _ in more])
        over += more
    for _ in over:
        counters.evicted(EvictionReason.CAPACITY)
    kept.sort(key=lambda item: item[1].seq)
    return kept, max_seq


def _fit(frames: Recovered, capacity: int, *, spans: bool) -> tuple[Recovered, Recovered]:
    """(kept, dropped) so that the kept frames' footprints fit ``capacity`` (``spans``:
    so that the slot files, cut after their last kept slot, fit it: where holes cannot be
    punched); all kept when they do already.

    Frames are kept shallowest first (depth along the parent tags of the frames on nvme;
    among equal depths the older first), each only if its parent on nvme was kept and the
    files still fit: so a lowered ``nvme.bytes`` drops the deepest and newest blocks, never a
    chain head its descendants need (dropping oldest first would orphan whole chains).
    O(n log n).
    """
    span: dict[int, int] = {}
    for slot, _ in frames:
        span[slot.slot_bytes] = max(span.get(slot.slot_bytes, 0), slot.index + 1)
    total = (sum(hw * (PAGE + sb) for sb, hw in span.items()) if spans
             else sum(PAGE + slot.slot_bytes for slot, _ in frames))
    if total <= capacity:
        return frames, []
    by_tag = {parent_tag(header.key): i for i, (_, header) in enumerate(frames)}
    parents = [by_tag.get(tag) if (tag := header.chain_parent) is not None else None
               for _, header in frames]
    depths = _depths(parents)
    kept_flags = [False] * len(frames)
    high: dict[int, int] = {}
    disk = 0
    for i in sorted(range(len(frames)), key=lambda i: (depths[i], frames[i][1].seq)):
        slot = frames[i][0]
        parent = parents[i]
        top = high.get(slot.slot_bytes, 0)
        grow = (max(0, slot.index + 1 - top) * (PAGE + slot.slot_bytes) if spans
                else PAGE + slot.slot_bytes)
        if (parent is None or kept_flags[parent]) and disk + grow <= capacity:
            kept_flags[i] = True
            high[slot.slot_bytes] = max(top, slot.index + 1)
            disk += grow
    return ([f for f, k in zip(frames, kept_flags, strict=True) if k],
            [f for f, k in zip(frames, kept_flags, strict=True) if not k])


def _depths(parents: list[int | None]) -> list[int]:
    """Each frame's depth below the first ancestor that is not on nvme (0: a head, or its
    parent lives elsewhere). Iterative; a cycle of tags (corrupt) ends a walk."""
    depth = [-1] * len(parents)
    for start in range(len(parents)):
        if depth[start] != -1:
            continue
        walk = []
        j: int | None = start
        while j is not None and depth[j] == -1:
            depth[j] = -2            # on this walk: meeting it again is a cycle
            walk.append(j)
            j = parents[j]
        base = depth[j] if j is not None and depth[j] >= 0 else -1
        for k in reversed(walk):
            base += 1
            depth[k] = base
    return depth


def _erase(table: SlotTable, pool: ThreadPoolExecutor, counters: TierCounters,
           slots: list[NvmeSlot]) -> None:
    """Zero the header page of each dropped slot still inside its file (the trim cut the
    rest, or dropped the file), on the pool, so the frame cannot come back at the next
    start. One file at a time, its descriptor held meanwhile."""
    by_class: dict[int, list[NvmeSlot]] = {}
    for s in slots:
        cls = table.classes.get(s.slot_bytes)
        if cls is not None and s.index < cls.high_water:
            by_class.setdefault(s.slot_bytes, []).append(s)
    for slot_bytes, todo in by_class.items():
        cls = table.classes[slot_bytes]
        try:
            with table.files.held(cls.file) as fd:
                errors = list(pool.map(_erase_page, [fd] * len(todo),
                                       [s.offset for s in todo]))
        except OSError as exc:   # (it could not be reopened)
            errors = [exc.strerror or str(exc)] * len(todo)
        for slot, err in zip(todo, errors, strict=True):
            if err is not None:
                counters.errors += 1
                log.warning("nvme tier: cannot erase %s slot %d (%s): its frame may come "
                            "back at the next start", cls.path, slot.index, err)


def _erase_page(fd: int, offset: int) -> str | None:
    """Zero one header page; the OS error's text, or None."""
    try:
        os.pwritev(fd, [ZERO_PAGE], offset)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _scan(table: SlotTable, cls: SizeClass, pool: ThreadPoolExecutor,
          counters: TierCounters) -> Recovered:
    """Classify the slots of a file that fit the capacity from their header pages; adopt
    and return the valid ones (``adopt`` cuts the file after the last)."""
    with table.files.held(cls.file) as fd:
        return _scan_fd(table, cls, fd, pool, counters)


def _scan_fd(table: SlotTable, cls: SizeClass, fd: int, pool: ThreadPoolExecutor,
             counters: TierCounters) -> Recovered:
    size = os.fstat(fd).st_size
    spans = -(-size // cls.stride)
    high_water = min(spans, table.capacity // cls.stride)
    if high_water < spans:
        log.warning("nvme tier: %s holds %d bytes, more than nvme.bytes (%d): the slots "
                    "past %d are dropped unread", cls.path, size, table.capacity, high_water)
    valid: Recovered = []
    for index, raw in _read_headers(fd, cls.stride, size, high_water, pool):
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
    table.adopt(cls, [slot.index for slot, _ in valid])
    return valid


def _read_headers(fd: int, stride: int, size: int, high_water: int,
                  pool: ThreadPoolExecutor) -> Iterator[tuple[int, bytes]]:
    """Each slot's first HEADER_SIZE bytes (fewer at a torn tail), in index order.

    Small slots: whole-file reads of ``SCAN_CHUNK`` bytes (few syscalls, sequential).
    Large slots: one header-page read per slot, spread over the pool, so a start does not
    read every payload off the disk.
    """
    if stride > SEQ_SCAN_MAX_STRIDE:
        offsets = [i * stride for i in range(high_water)]
        pages = pool.map(_read_page_sync, [fd] * len(offsets), offsets)
        yield from enumerate(pages)
        return
    per_chunk = max(1, min(SCAN_CHUNK // stride, high_water))
    buf = aligned_buffer(per_chunk * stride)
    for first in range(0, high_water, per_chunk):
        count = min(per_chunk, high_water - first)   # never past high_water
        got = os.preadv(fd, [buf[: count * stride]], first * stride)
        for j in range(count):
            start = j * stride
            yield first + j, bytes(buf[start: min(start + HEADER_SIZE, max(got, start))])


def _read_page_sync(fd: int, offset: int) -> bytes:
    page = scratch.rpage
    got = os.preadv(fd, [page], offset)
    return bytes(page[: min(max(got, 0), HEADER_SIZE)])
