"""The arena journal: what each cpu-arena slot held, kept beside the arena so that a daemon
restarted after a crash (kill -9, OOM) can adopt the arena's blocks instead of losing them.

File: ``<arena name>.journal`` in the arena's shm directory, mode 0600, a memory-mapped array
of fixed 128-byte records (``journal_format``): ALLOC when a slot is handed out for writing,
COMMIT once its block's checksum is known (computed off the event loop after a put commit;
taken from the frame on a promotion from nvme), so a crash before it leaves the block
uncommitted, FREE when it goes back. Records are plain stores into shared memory: they
survive the process (not the machine), cost no system call, and are visible before the slot
offset is handed to a client. Replay is ``journal_replay.read_journal``.

Compaction: when the records outnumber ``4 * live slots + COMPACT_MIN`` (or fill three
quarters of the file, as they do while the arena fills up), a new file holding one record per
live slot (its latest: COMMIT when committed, else ALLOC) is written beside by a worker
thread from a snapshot of those records, while appends go on into the old file; the next
append after it is written copies the records appended meanwhile into it and renames it over
the journal. A crash sees either the old or the new file whole. The loop's share is one copy
of a dict's values (3-4 ms at 315k live slots, mostly cache misses; writing the file on the
loop took 54 ms at 188k). Only a file that fills up before its compaction is written waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.tiers.journal_format import (
    GENERATION,
    GENERATION_AT,
    RECORD,
    CommitInfo,
    CommittedSlot,
    RecordType,
    commit_record,
    header_record,
    pack_record,
)

COMPACT_MIN = 4096            # records appended beyond 4x the live slots before compacting
MIN_RECORDS = 1 << 14         # smallest file (sparse: untouched records cost no memory)
_CHUNK = 8192                 # records joined per write: 1 MiB, ~0.2 ms holding the GIL

log = logging.getLogger("kvtier.tiers.arena")


class ArenaJournal:
    """Writer side: appends records as the arena's slots change state (event loop only).

    ``alloc``/``free`` are called by the arena for every slot it hands out or takes back;
    ``commit`` by the store once a ready block's checksum is known. ``generation(offset)``
    names one allocation of a slot, so a checksum computed while the slot was freed and
    handed out again is recognised as stale and not recorded.
    """

    def __init__(self, path: Path, arena_size: int, slab_bytes: int, *, run: bytes,
                 live: Sequence[tuple[int, int, CommittedSlot | None]] = ()) -> None:
        self.path = path
        self.run = run            # this daemon run's id, in every header it writes
        self.arena_size = arena_size
        self.slab_bytes = slab_bytes
        # live slot -> its latest record (which names its allocation's generation); one
        # dict: a snapshot is one copy of its values, and each dict keyed per block resizes
        # (rehashing all of it) at the same block counts as the others
        self._records: dict[int, bytes] = {}
        self._gen = 0
        self.records = 0          # appended since start (compactions included)
        self.compactions = 0
        self.unencodable = 0      # commit records skipped: a field beyond the format
        self._snapshots = 0       # of _records taken (a batch's records after one are in it)
        self._mm: mmap.mmap | None = None
        self._fd = -1
        self._tail = 0
        self._capacity = 0
        self._writer: ThreadPoolExecutor | None = None   # writes compacted files
        self._next: _NextFile | None = None   # a compaction being written
        self.stopped = False   # the file could not be rewritten: removed, nothing recorded
        for offset, nbytes, commit in live:
            self._gen += 1
            self._records[offset] = (
                commit_record(commit, self._gen) if commit is not None else
                pack_record(RecordType.ALLOC, offset=offset, nbytes=nbytes,
                            generation=self._gen))
        self._rewrite()

    # -- recording -------------------------------------------------------------------------
    def alloc(self, offset: int, nbytes: int) -> None:
        """Slot ``offset`` was handed out for writing ``nbytes``."""
        self.alloc_many((offset,), nbytes)

    def alloc_many(self, offsets: Sequence[int], nbytes: int) -> None:
        """``alloc`` of each of ``offsets`` (one write of the records)."""
        recs = []
        for offset in offsets:
            self._gen += 1
            rec = pack_record(RecordType.ALLOC, offset=offset, nbytes=nbytes,
                              generation=self._gen)
            self._records[offset] = rec
            recs.append(rec)
        self._append_many(recs)

    def free(self, offset: int) -> None:
        """Slot ``offset`` went back to the allocator."""
        if self._records.pop(offset, None) is not None:
            self._append(pack_record(RecordType.FREE, offset=offset))

    def generation(self, offset: int) -> int | None:
        """Which allocation of ``offset`` is live now (None: the slot is free)."""
        rec = self._records.get(offset)
        return None if rec is None else GENERATION.unpack_from(rec, GENERATION_AT)[0]

    def commit(self, offset: int, generation: int, info: CommitInfo, checksum: int) -> bool:
        """Record that the slot holds ``info``'s block with payload ``checksum``; False (and
        nothing written) when that allocation of the slot is gone or already committed."""
        return self.commit_many(((offset, generation, info, checksum),)) == 1

    def commit_many(self, commits: Sequence[tuple[int, int, CommitInfo, int]]) -> int:
        """``commit`` of each ``(offset, generation, info, checksum)``, the records written
        at once; how many were recorded. A record that cannot be encoded (a field out of
        the format's range) is skipped and logged: the block is then not adopted after a
        crash, and the batch's other records are written all the same."""
        recs = []
        for offset, generation, info, checksum in commits:
            rec = self._records.get(offset)
            if (rec is None or rec[0] == RecordType.COMMIT
                    or GENERATION.unpack_from(rec, GENERATION_AT)[0] != generation):
                continue
            try:
                new = commit_record(CommittedSlot(offset, info, checksum), generation)
            except (struct.error, OverflowError, ValueError) as exc:
                self.unencodable += 1
                log.warning("arena journal: block %s not journaled (%s)", info.key.hex(), exc)
                continue
            rec = self._records[offset] = new
            recs.append(rec)
        self._append_many(recs)
        return len(recs)

    @property
    def live_slots(self) -> int:
        return len(self._records)

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
        """Write ``record``, whose change ``_records`` already shows (so a compaction started
        or finished here holds it in its snapshot, never twice)."""
        if self.stopped:
            return
        nxt = self._next
        if nxt is not None and (nxt.done.done() or self._tail >= self._capacity):
            taken = self._snapshots
            self._switch(nxt)   # (waits only when the old file is full)
            if self._snapshots != taken:   # an outgrown one was rewritten: it holds record
                return
        if self._tail >= self._capacity:
            self._rewrite_or_stop()
            return
        assert self._mm is not None
        self._mm[self._tail * RECORD: (self._tail + 1) * RECORD] = record
        self._tail += 1
        self.records += 1
        if self._next is not None:
            self._next.since.append(record)
        elif self._should_compact():
            self._compact_aside()

    def _should_compact(self) -> bool:
        """Mostly dead records, or a growing arena's file filling up."""
        return (self._tail > 4 * len(self._records) + COMPACT_MIN
                or 4 * self._tail > 3 * self._capacity)

    def _append_many(self, records: list[bytes]) -> None:
        """``_append`` of each record; one copy into the file when they fit as they are.

        One by one, a snapshot taken on the way (a compaction started aside, or a rewrite)
        already holds the batch's remaining records, as ``_records`` shows all of them: they
        then go only into the file in use while a compaction is written aside (not into its
        ``since``), and nowhere after a rewrite, whose file is that snapshot."""
        n = len(records)
        if self.stopped:
            return
        if n < 2 or self._next is not None or self._tail + n > self._capacity:
            for i, record in enumerate(records):
                taken = self._snapshots
                self._append(record)
                if self._snapshots != taken:
                    self._write_in_snapshot(records[i + 1:])
                    return
            return
        self._write(records)
        if self._should_compact():
            self._compact_aside()

    def _write_in_snapshot(self, rest: list[bytes]) -> None:
        """Write records a compaction written aside already holds into the file in use (so
        it stays whole until the switch), as room allows; none after a rewrite."""
        if self._next is None or not rest:
            return
        self._write(rest[:max(0, self._capacity - self._tail)])

    def _write(self, records: list[bytes]) -> None:
        """Copy ``records`` (which fit) into the file in use at its tail, at once."""
        assert self._mm is not None
        n = len(records)
        self._mm[self._tail * RECORD: (self._tail + n) * RECORD] = b"".join(records)
        self._tail += n
        self.records += n

    def settle(self) -> None:
        """Finish a compaction being written aside now, waiting for it (tests, tools)."""
        while self._next is not None:
            self._switch(self._next)

    def _snapshot(self) -> tuple[list[bytes], int]:
        """The compacted file's records (header, one per live slot) and its capacity."""
        self._snapshots += 1
        parts = [header_record(self.arena_size, self.slab_bytes, self.run)]
        parts += self._records.values()   # one C-level copy of O(live) references
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
            self._rewrite_or_stop()
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

    def _rewrite_or_stop(self) -> None:
        """``_rewrite`` while serving. When the file cannot be written (a full tmpfs) the
        journal stops and its file is removed: a restart then starts the cpu tier cold
        instead of trusting a journal that lacks this change. The request goes on."""
        try:
            self._rewrite()
        except OSError as exc:
            log.warning("cannot rewrite the arena journal %s (%s): warm restart is off "
                        "until the daemon restarts", self.path, exc)
            self.stopped = True
            self.close(unlink=True)

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
    descriptor. A worker thread's job, written 1 MiB at a time: the join holds the GIL, the
    write does not (joining all of 315k records at once held it for 20 ms)."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, capacity * RECORD)
        # its pages now: the file is written through a mapping, where a full tmpfs would
        # be a SIGBUS instead of this ENOSPC
        os.posix_fallocate(fd, 0, capacity * RECORD)
        pos = 0
        for i in range(0, len(parts), _CHUNK):
            blob = memoryview(b"".join(parts[i: i + _CHUNK]))
            while blob:
                done = os.pwrite(fd, blob, pos)
                blob, pos = blob[done:], pos + done
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd
