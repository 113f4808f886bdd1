"""The arena journal's writer and replay (``kvtier.tiers.arena_journal``,
``journal_replay``), pinned where the mutation review of warm restarts found no test: a
slot's allocation is committed once, and the same state comes back before and after a
compaction."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.tiers.arena_journal import ArenaJournal
from kvtier.tiers.journal_format import (
    CommitInfo,
    CommittedSlot,
    RecordType,
    commit_record,
    header_record,
    pack_record,
)
from kvtier.tiers.journal_replay import JournalState, read_journal
from kvtier.tiers.slab import PAGE

SLAB = 16 * 1024
RUN = bytes(range(16))


def info(i: int) -> CommitInfo:
    return CommitInfo(bytes([i]) * 16, b"n" * 16, 7, PAGE, None, 0, i)


def replay(j: ArenaJournal) -> JournalState:
    state = read_journal(j.path)
    assert state is not None
    return state


def test_a_slot_is_committed_once_per_allocation(shm_dir: Path) -> None:
    """A second commit of the same allocation (another checksum for the slot) is refused
    and writes nothing: replay keeps the first, and so does the file a compaction writes
    from the live records (a second record there changed the adopted block's checksum
    across a compaction, and counted an inconsistency before it)."""
    j = ArenaJournal(shm_dir / "j.journal", 8 * SLAB, SLAB, run=RUN)
    try:
        j.alloc(0, PAGE)
        gen = j.generation(0)
        assert gen is not None
        assert j.commit(0, gen, info(1), 11)
        written = j.records
        assert not j.commit(0, gen, info(2), 22)
        assert j.records == written
        before = replay(j)
        assert [(c.info, c.checksum) for c in before.committed] == [(info(1), 11)]
        assert before.inconsistent == 0
        j._rewrite()                      # what a compaction installs
        after = replay(j)
        assert [(c.info, c.checksum) for c in after.committed] == [(info(1), 11)]
    finally:
        j.close(unlink=True)


def test_replay_keeps_the_first_commit_of_an_allocation(shm_dir: Path) -> None:
    """A journal holding two COMMITs of one allocation (a writer that let the second
    through): replay keeps the first, counts the second inconsistent, and does not let
    it replace the checksum the arena's bytes are verified against."""
    i1, i2 = info(1), info(2)
    path = shm_dir / "j.journal"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"".join([
            header_record(8 * SLAB, SLAB, RUN),
            pack_record(RecordType.ALLOC, offset=0, nbytes=PAGE, generation=1),
            commit_record(CommittedSlot(0, i1, 11), 1),
            commit_record(CommittedSlot(0, i2, 22), 1),
        ]))
    finally:
        os.close(fd)
    state = read_journal(path)
    assert state is not None
    assert [(c.info, c.checksum) for c in state.committed] == [(i1, 11)]
    assert state.inconsistent == 1 and state.writing == []


def test_a_new_allocation_of_a_committed_slot_replaces_its_commit(shm_dir: Path) -> None:
    """ALLOC of generation 2 after generation 1's COMMIT (its FREE missing): the slot is
    being written again, so it is in flight (quarantined), not the old block (whose
    bytes a stalled writer may be overwriting), and the record counts inconsistent."""
    path = shm_dir / "j.journal"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"".join([
            header_record(8 * SLAB, SLAB, RUN),
            pack_record(RecordType.ALLOC, offset=0, nbytes=PAGE, generation=1),
            commit_record(CommittedSlot(0, info(1), 11), 1),
            pack_record(RecordType.ALLOC, offset=0, nbytes=PAGE, generation=2),
        ]))
    finally:
        os.close(fd)
    state = read_journal(path)
    assert state is not None
    assert state.committed == [] and state.writing == [(0, PAGE)]
    assert state.inconsistent == 1
