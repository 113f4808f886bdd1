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

Stop and resume: a full file that cannot be rewritten (EMFILE, a full tmpfs) is removed at
once (a crash then starts cold) while ``_records`` follows the slots; a rewrite aside is
retried with ``RETRY_BACKOFF`` by later appends and the daemon's sweep (``tick``), and the
file it installs holds exactly the live slots (docs/operations.md, "Restarts and crashes").
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.backoff import Backoff, BackoffPolicy
from kvtier.tiers.journal_files import NextFile
from kvtier.tiers.journal_files import write_file as _write_file
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
# after a failed rewrite or compaction: the next try waits 2-4 s, then twice as long, ... 60 s
RETRY_BACKOFF = BackoffPolicy(base_s=4.0, cap_s=60.0)

log = logging.getLogger("kvtier.tiers.arena")


class ArenaJournal:
    """Writer side: appends records as the arena's slots change state (event loop only).

    ``alloc``/``free`` are called by the arena for every slot it hands out or takes back;
    ``commit`` by the store once a ready block's checksum is known. ``generation(offset)``
    names one allocation of a slot, so a checksum computed while the slot was freed and
    handed out again is recognised as stale and not recorded. ``clock``: monotonic seconds,
    when the next rewrite may be tried after a failure (tests inject one).
    """

    def __init__(self, path: Path, arena_size: int, slab_bytes: int, *, run: bytes,
                 live: Sequence[tuple[int, int, CommittedSlot | None]] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
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
        self._next: NextFile | None = None   # a compaction being written
        self.stopped = False   # the file could not be rewritten: removed, nothing recorded
        self.stops = 0         # times it stopped, and resumed (a rewrite worked again)
        self.resumes = 0
        self._clock = clock
        self._retry = Backoff(RETRY_BACKOFF)
        self._retry_at = 0.0   # no rewrite or compaction is tried before (clock seconds)
        self._stopped_at = 0.0
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
        self._drop_file(unlink=unlink)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _drop_file(self, *, unlink: bool) -> None:
        """Drop a compaction being written aside, unmap and close the file (``unlink``:
        remove it too)."""
        nxt, self._next = self._next, None
        if nxt is not None:
            nxt.discard()
        if self._mm is not None:
            with contextlib.suppress(BufferError, ValueError):
                self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tail = self._capacity = 0
        if unlink:
            self.path.unlink(missing_ok=True)

    # -- file ------------------------------------------------------------------------------
    def _append(self, record: bytes) -> None:
        """Write ``record``, whose change ``_records`` already shows (so a compaction started
        or finished here holds it in its snapshot, never twice)."""
        if self.stopped:
            self._while_stopped((record,))
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
        """Mostly dead records, or a growing arena's file filling up (and no failed one in
        the last backoff delay)."""
        return ((self._tail > 4 * len(self._records) + COMPACT_MIN
                 or 4 * self._tail > 3 * self._capacity) and self._clock() >= self._retry_at)

    def _append_many(self, records: list[bytes]) -> None:
        """``_append`` of each record; one copy into the file when they fit as they are.

        One by one, a snapshot taken on the way (a compaction started aside, or a rewrite)
        already holds the batch's remaining records, as ``_records`` shows all of them: they
        then go only into the file in use while a compaction is written aside (not into its
        ``since``), and nowhere after a rewrite, whose file is that snapshot."""
        n = len(records)
        if self.stopped:
            self._while_stopped(records)
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

    def tick(self) -> None:
        """The daemon's periodic sweep: a stopped journal retries (once the backoff allows)
        and installs a rewrite done aside without waiting for a change, so an idle daemon
        that crashes after the cause went away restarts warm."""
        if self.stopped:
            self._while_stopped(())

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
        self._next = NextFile(tmp, capacity, len(parts),
                              self._writer.submit(_write_file, tmp, parts, capacity))

    def _switch(self, nxt: NextFile) -> None:
        """Finish a compaction written aside: append what came meanwhile, rename, swap. While
        stopped, the file so installed resumes the journal."""
        self._next = None
        try:
            fd = nxt.done.result()
        except Exception as exc:   # (the old file is whole: compact again later)
            self._failed_aside(exc)
            return
        if nxt.records + len(nxt.since) >= nxt.capacity:   # outgrown while written
            os.close(fd)
            nxt.tmp.unlink(missing_ok=True)
            if self.stopped:   # (rare: far more changes than live slots while written)
                self._retry_later(OSError("the rewrite was outgrown while written"))
            else:
                self._rewrite_or_stop()
            return
        try:
            self._install(fd, nxt.tmp, nxt.capacity, nxt.records, nxt.since)
        except OSError as exc:   # (_install closed and removed it; the old file is whole)
            self._failed_aside(exc)
            return
        self._retry.reset()
        if self.stopped:
            self._resume()

    def _tmp_path(self) -> Path:
        return self.path.with_name(f"{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")

    def _rewrite(self) -> None:
        """Write one record per live slot to a new file and rename it over the journal, on
        this thread (at start, and when a full file cannot wait)."""
        parts, capacity = self._snapshot()
        tmp = self._tmp_path()
        self._install(_write_file(tmp, parts, capacity), tmp, capacity, len(parts), [])

    def _rewrite_or_stop(self) -> None:
        """``_rewrite`` while serving. When the file cannot be written (a full tmpfs, no
        descriptor left) the journal stops and its file is removed: a restart then starts
        the cpu tier cold instead of trusting a journal that lacks this change. The request
        goes on; later appends retry (``_while_stopped``)."""
        try:
            self._rewrite()
        except OSError as exc:
            self._stop(exc)

    def _stop(self, exc: OSError) -> None:
        """Remove the journal's file, record nothing until a rewrite works again."""
        delay = self._retry.next_delay()
        log.warning("cannot rewrite the arena journal %s (%s): it stops and its file is "
                    "removed, so warm restart is off until a rewrite works (tried again in "
                    "%.1f s, then with backoff up to %.0f s)", self.path, exc, delay,
                    RETRY_BACKOFF.cap_s)
        self.stopped = True
        self.stops += 1
        self._stopped_at = self._clock()
        self._retry_at = self._stopped_at + delay
        self._drop_file(unlink=True)

    def _while_stopped(self, records: Sequence[bytes]) -> None:
        """An append while stopped (``records``: its records, which ``_records`` shows
        already): they join the rewrite being written aside, which is installed once done;
        else, once the backoff delay has passed, a rewrite starts aside (its snapshot holds
        them). Nothing is written to the journal's path before that rewrite is whole."""
        nxt = self._next
        if nxt is not None:
            nxt.since.extend(records)
            if nxt.done.done():
                self._switch(nxt)
        elif self._clock() >= self._retry_at:
            self._compact_aside()

    def _failed_aside(self, exc: Exception) -> None:
        """A file written aside could not be installed: the next waits for the backoff."""
        if self.stopped:
            self._retry_later(exc)
            return
        log.warning("arena journal compaction failed: %s", exc)
        self._retry_at = self._clock() + self._retry.next_delay()

    def _retry_later(self, exc: Exception) -> None:
        """A rewrite tried while stopped failed: the next waits for the backoff."""
        delay = self._retry.next_delay()
        self._retry_at = self._clock() + delay
        log.debug("arena journal %s still stopped (%s): next rewrite in %.1f s", self.path,
                  exc, delay)

    def _resume(self) -> None:
        self.stopped = False
        self.resumes += 1
        log.info("arena journal %s resumed after %.1f s stopped: warm restart is on again",
                 self.path, self._clock() - self._stopped_at)

    def _install(self, fd: int, tmp: Path, capacity: int, written: int,
                 since: list[bytes]) -> None:
        """Make the compacted file ``tmp`` (``fd``, ``written`` records in it) the journal:
        append ``since`` (records that came after its snapshot), rename it over the old
        one, and write on in it."""
        mm: mmap.mmap | None = None
        try:
            mm = mmap.mmap(fd, capacity * RECORD, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
            blob = b"".join(since)
            mm[written * RECORD: written * RECORD + len(blob)] = blob
            os.rename(tmp, self.path)
        except BaseException:
            if mm is not None:
                mm.close()
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
