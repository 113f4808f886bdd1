"""The arena journal: what each cpu-arena slot held, kept beside the arena so that a daemon
restarted after a crash (kill -9, OOM) can adopt the arena's blocks instead of losing them.

File: ``<arena name>.journal`` in the arena's shm directory, mode 0600, a memory-mapped array
of fixed 128-byte records. Record 0 is a header (magic, format version, arena size and slab
size: a daemon whose arena geometry differs starts cold). Then, in event-loop order:

- ``ALLOC(offset, nbytes)``: a slot was handed out for writing (a put lease or a promotion);
  from now on someone may write into it.
- ``COMMIT(offset, key, namespace, layout_fp, nbytes, parent, depth, seq, checksum)``: the
  slot holds a complete block whose payload has that xxh3-64. Written only once the checksum
  is known (computed off the event loop after a put commit; taken from the frame on a
  promotion from nvme), so a crash before it leaves the block uncommitted.
- ``FREE(offset)``: the slot went back to the allocator.

Each record carries its own xxh3-64, so the one record a crash can tear is detected; replay
stops at the first record that does not check (records are appended by one thread, in order).
Records are plain stores into shared memory: they survive the process (not the machine), cost
no system call, and are visible before the slot offset is handed to a client.

Compaction: when the records outnumber ``4 * live slots + COMPACT_MIN`` (or fill three
quarters of the file, as they do while the arena fills up), a new file holding
one record per live slot (COMMIT when committed, else ALLOC) is written beside by a worker
thread from a snapshot of those records, while appends go on into the old file; the next
append after it is written copies the records appended meanwhile into it and renames it over
the journal. A crash sees either the old or the new file whole. (At 188k live slots writing
the new file on the event loop stopped it for 54 ms; now the loop only lists the records.)
Only a file that fills up before its compaction is written waits for it.

Replay (``read_journal``) turns the records into ``JournalState``: committed blocks (to be
verified against the arena bytes) and slots still being written at the crash (the store
quarantines them for one lease TTL: a stalled client of the dead daemon may still write).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import stat
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import xxhash

MAGIC = b"KVTJOURNAL\0\0\0\0\0\1"
VERSION = 1
RECORD = 128
COMPACT_MIN = 4096            # records appended beyond 4x the live slots before compacting
MIN_RECORDS = 1 << 14         # smallest file (sparse: untouched records cost no memory)

log = logging.getLogger("kvtier.tiers.arena")

# type u8 | flags u8 | pad u16 | depth u32 | offset u64 | nbytes u64 | key 16s | namespace 16s
# | parent 16s | layout_fp u64 | seq u64 | checksum u64 | generation u64 | pad, then xxh3-64
_BODY = struct.Struct("<BBHIQQ16s16s16sQQQQ")
_PAD = RECORD - 8 - _BODY.size
_CHECK = struct.Struct("<Q")
_HAS_PARENT = 1
_ZERO16 = bytes(16)


class RecordType(IntEnum):
    HEADER = 1
    ALLOC = 2
    COMMIT = 3
    FREE = 4


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """What a COMMIT record says about the block in a slot."""

    key: bytes
    namespace: bytes
    layout_fp: int
    nbytes: int
    parent: bytes | None
    depth: int
    seq: int


@dataclass(frozen=True, slots=True)
class CommittedSlot:
    offset: int
    info: CommitInfo
    checksum: int
    order: int = 0             # position of its COMMIT record (replay keeps commit order)


@dataclass(slots=True)
class JournalState:
    """A replayed journal: the arena geometry and what every live slot held at the end."""

    arena_size: int
    slab_bytes: int
    committed: list[CommittedSlot] = field(default_factory=list)   # in commit order
    writing: list[tuple[int, int]] = field(default_factory=list)   # (offset, nbytes)
    records: int = 0
    torn: int = 0              # a last record that did not check (the crash tore it)
    inconsistent: int = 0      # records contradicting the ones before (counted, ignored)


@dataclass(slots=True)
class _Live:
    generation: int
    nbytes: int
    commit: CommittedSlot | None = None
    record: bytes = b""        # the slot's latest record (compaction copies it as is)


def _pack(rtype: RecordType, *, offset: int = 0, nbytes: int = 0, key: bytes = _ZERO16,
          namespace: bytes = _ZERO16, parent: bytes | None = None, layout_fp: int = 0,
          seq: int = 0, checksum: int = 0, depth: int = 0, generation: int = 0) -> bytes:
    body = _BODY.pack(int(rtype), _HAS_PARENT if parent is not None else 0, 0, depth, offset,
                      nbytes, key, namespace, parent or _ZERO16, layout_fp, seq, checksum,
                      generation) + bytes(_PAD)
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def _header(arena_size: int, slab_bytes: int) -> bytes:
    return _pack(RecordType.HEADER, offset=arena_size, nbytes=slab_bytes, key=MAGIC,
                 layout_fp=VERSION)


def _commit_record(slot: CommittedSlot, generation: int) -> bytes:
    i = slot.info
    return _pack(RecordType.COMMIT, offset=slot.offset, nbytes=i.nbytes, key=i.key,
                 namespace=i.namespace, parent=i.parent, layout_fp=i.layout_fp, seq=i.seq,
                 checksum=slot.checksum, depth=i.depth, generation=generation)


def open_private(path: Path, flags: int) -> int:
    """Open ``path`` without following a symlink and check it is ours: a regular file of this
    uid with no group/other permission bits (another local user may pre-create names in a
    shared /dev/shm). Raises PermissionError when it is not, OSError when it cannot open."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"{path} is not a private file of uid {os.getuid()}")
    return fd


def read_journal(path: Path) -> JournalState | None:
    """Replay the journal at ``path``; None when there is none or it is not a valid one."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = _read_all(fd)
    finally:
        os.close(fd)
    if len(data) < RECORD or not _valid(data, 0):
        return None
    head = _BODY.unpack_from(data, 0)
    if head[0] != RecordType.HEADER or head[6] != MAGIC or head[9] != VERSION:
        return None
    state = JournalState(arena_size=head[4], slab_bytes=head[5])
    live: dict[int, _Live] = {}
    pos = RECORD
    while pos + RECORD <= len(data):
        if data[pos] == 0:
            break
        if not _valid(data, pos):
            state.torn += 1
            break
        _apply(state, live, _BODY.unpack_from(data, pos))
        state.records += 1
        pos += RECORD
    committed = [lv.commit for lv in live.values() if lv.commit is not None]
    state.committed = sorted(committed, key=lambda c: c.order)
    state.writing = [(off, lv.nbytes) for off, lv in live.items() if lv.commit is None]
    return state


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks = []
    pos = 0
    while pos < size:
        chunk = os.pread(fd, min(8 << 20, size - pos), pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    return b"".join(chunks)


def _valid(data: bytes, pos: int) -> bool:
    body = data[pos: pos + RECORD - 8]
    (check,) = _CHECK.unpack_from(data, pos + RECORD - 8)
    return xxhash.xxh3_64_intdigest(body) == check


def _apply(state: JournalState, live: dict[int, _Live], rec: tuple[Any, ...]) -> None:
    rtype, flags, _, depth, offset, nbytes, key, ns, parent, layout_fp, seq, checksum, gen = rec
    if rtype == RecordType.ALLOC:
        if offset in live:
            state.inconsistent += 1
        live[offset] = _Live(gen, nbytes)
    elif rtype == RecordType.FREE:
        if live.pop(offset, None) is None:
            state.inconsistent += 1
    elif rtype == RecordType.COMMIT:
        lv = live.get(offset)
        if lv is None:   # a compacted file: a committed slot's one record stands for its ALLOC
            lv = live[offset] = _Live(gen, nbytes)
        elif lv.generation != gen or lv.commit is not None:
            state.inconsistent += 1
            return
        info = CommitInfo(key, ns, layout_fp, nbytes,
                          parent if flags & _HAS_PARENT else None, depth, seq)
        lv.commit = CommittedSlot(offset, info, checksum, state.records)
    else:
        state.inconsistent += 1


class ArenaJournal:
    """Writer side: appends records as the arena's slots change state (event loop only).

    ``alloc``/``free`` are called by the arena for every slot it hands out or takes back;
    ``commit`` by the store once a ready block's checksum is known. ``generation(offset)``
    names one allocation of a slot, so a checksum computed while the slot was freed and
    handed out again is recognised as stale and not recorded.
    """

    def __init__(self, path: Path, arena_size: int, slab_bytes: int, *,
                 live: Sequence[tuple[int, int, CommittedSlot | None]] = ()) -> None:
        self.path = path
        self.arena_size = arena_size
        self.slab_bytes = slab_bytes
        self._live: dict[int, _Live] = {}
        self._gen = 0
        self.records = 0          # appended since start (compactions included)
        self.compactions = 0
        self._mm: mmap.mmap | None = None
        self._fd = -1
        self._tail = 0
        self._capacity = 0
        self._writer: ThreadPoolExecutor | None = None   # writes compacted files
        self._next: _NextFile | None = None   # a compaction being written
        for offset, nbytes, commit in live:
            self._gen += 1
            rec = (_commit_record(commit, self._gen) if commit is not None else
                   _pack(RecordType.ALLOC, offset=offset, nbytes=nbytes, generation=self._gen))
            self._live[offset] = _Live(self._gen, nbytes, commit, rec)
        self._rewrite()

    # -- recording -------------------------------------------------------------------------
    def alloc(self, offset: int, nbytes: int) -> None:
        """Slot ``offset`` was handed out for writing ``nbytes``."""
        self._gen += 1
        rec = _pack(RecordType.ALLOC, offset=offset, nbytes=nbytes, generation=self._gen)
        self._live[offset] = _Live(self._gen, nbytes, None, rec)
        self._append(rec)

    def free(self, offset: int) -> None:
        """Slot ``offset`` went back to the allocator."""
        if self._live.pop(offset, None) is not None:
            self._append(_pack(RecordType.FREE, offset=offset))

    def generation(self, offset: int) -> int | None:
        """Which allocation of ``offset`` is live now (None: the slot is free)."""
        lv = self._live.get(offset)
        return None if lv is None else lv.generation

    def commit(self, offset: int, generation: int, info: CommitInfo, checksum: int) -> bool:
        """Record that the slot holds ``info``'s block with payload ``checksum``; False (and
        nothing written) when that allocation of the slot is gone or already committed."""
        lv = self._live.get(offset)
        if lv is None or lv.generation != generation or lv.commit is not None:
            return False
        lv.commit = CommittedSlot(offset, info, checksum)
        lv.record = _commit_record(lv.commit, generation)
        self._append(lv.record)
        return True

    @property
    def live_slots(self) -> int:
        return len(self._live)

    def close(self, *, unlink: bool) -> None:
        """Unmap; ``unlink`` also removes the file (a graceful stop: nothing to adopt). A
        compaction still being written is dropped (the journal is whole without it)."""
        nxt, self._next = self._next, None
        if nxt is not None:
            nxt.discard()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._mm is not None:
            with contextlib.suppress(BufferError, ValueError):
                self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink:
            self.path.unlink(missing_ok=True)

    # -- file ------------------------------------------------------------------------------
    def _append(self, record: bytes) -> None:
        """Write ``record``, whose change ``_live`` already shows (so a compaction started
        or finished here holds it in its snapshot, never twice)."""
        nxt = self._next
        if nxt is not None and (nxt.done.done() or self._tail >= self._capacity):
            self._switch(nxt)   # (waits only when the old file is full)
        if self._tail >= self._capacity:
            self._rewrite()
            return
        assert self._mm is not None
        self._mm[self._tail * RECORD: (self._tail + 1) * RECORD] = record
        self._tail += 1
        self.records += 1
        if self._next is not None:
            self._next.since.append(record)
        elif (self._tail > 4 * len(self._live) + COMPACT_MIN      # mostly dead records, or
              or 4 * self._tail > 3 * self._capacity):            # a growing arena's file
            self._compact_aside()                                 # filling up

    def settle(self) -> None:
        """Finish a compaction being written aside now, waiting for it (tests, tools)."""
        while self._next is not None:
            self._switch(self._next)

    def _snapshot(self) -> tuple[list[bytes], int]:
        """The compacted file's records (header, one per live slot) and its capacity."""
        parts = [_header(self.arena_size, self.slab_bytes)]
        parts += [lv.record for lv in self._live.values()]   # O(live) references, no copy
        return parts, max(MIN_RECORDS, 2 * (4 * len(parts) + COMPACT_MIN))

    def _compact_aside(self) -> None:
        """Start writing the compacted file in the worker thread (see the module doc)."""
        parts, capacity = self._snapshot()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-journal")
        tmp = self._tmp_path()
        self._next = _NextFile(tmp, capacity, len(parts),
                               self._writer.submit(_write_file, tmp, parts, capacity))

    def _switch(self, nxt: _NextFile) -> None:
        """Finish a compaction written aside: append what came meanwhile, rename, swap."""
        self._next = None
        try:
            fd = nxt.done.result()
        except Exception as exc:   # (the old file is whole: compact again later)
            log.warning("arena journal compaction failed: %s", exc)
            return
        if nxt.records + len(nxt.since) >= nxt.capacity:   # outgrown while written
            os.close(fd)
            nxt.tmp.unlink(missing_ok=True)
            self._rewrite()
            return
        self._install(fd, nxt.tmp, nxt.capacity, nxt.records, nxt.since)

    def _tmp_path(self) -> Path:
        return self.path.with_name(f"{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")

    def _rewrite(self) -> None:
        """Write one record per live slot to a new file and rename it over the journal, on
        this thread (at start, and when a full file cannot wait)."""
        parts, capacity = self._snapshot()
        tmp = self._tmp_path()
        self._install(_write_file(tmp, parts, capacity), tmp, capacity, len(parts), [])

    def _install(self, fd: int, tmp: Path, capacity: int, written: int,
                 since: list[bytes]) -> None:
        """Make the compacted file ``tmp`` (``fd``, ``written`` records in it) the journal:
        append ``since`` (records that came after its snapshot), rename it over the old
        one, and write on in it."""
        try:
            mm = mmap.mmap(fd, capacity * RECORD, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
            blob = b"".join(since)
            mm[written * RECORD: written * RECORD + len(blob)] = blob
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        self.records += written
        old_mm, old_fd = self._mm, self._fd
        self._mm, self._fd = mm, fd
        self._tail = written + len(since)
        self._capacity = capacity
        if old_mm is not None:
            self.compactions += 1
            with contextlib.suppress(BufferError, ValueError):
                old_mm.close()
        if old_fd >= 0:
            os.close(old_fd)


@dataclass(slots=True)
class _NextFile:
    """A compacted journal being written aside, and the records appended since its snapshot."""

    tmp: Path
    capacity: int
    records: int                    # the snapshot's (header included)
    done: Future[int]               # its descriptor, once written
    since: list[bytes] = field(default_factory=list)

    def discard(self) -> None:
        with contextlib.suppress(Exception):
            os.close(self.done.result())
        self.tmp.unlink(missing_ok=True)


def _write_file(tmp: Path, parts: list[bytes], capacity: int) -> int:
    """A new journal file at ``tmp`` holding ``parts``, ``capacity`` records long; its open
    descriptor (a worker thread's job: ``os.pwrite`` runs without the GIL)."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, capacity * RECORD)
        blob = b"".join(parts)
        written = 0
        while written < len(blob):
            written += os.pwrite(fd, memoryview(blob)[written:], written)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd
