"""The arena journal and what warm restart builds on: replay, torn records, compaction, slot
generations, slab re-reservation, stable arena names (adopt, lock, stale removal), the
frame's chain fields, and the store's commit log writing checksums off the event loop."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvtier.errors import ConfigError
from kvtier.frame import FLAG_CHAIN, FrameHeader, make_header, parent_tag
from kvtier.index import BlockMeta
from kvtier.store import TieredStore
from kvtier.store.recovery import RecoveryCounters, _merge
from kvtier.tiers import arena_journal as aj
from kvtier.tiers.arena import Arena, journal_path, remove_stale_arenas, stable_arena_name
from kvtier.tiers.arena_journal import ArenaJournal
from kvtier.tiers.journal_format import (
    MAGIC,
    RECORD,
    VERSION,
    CommitInfo,
    CommittedSlot,
    RecordType,
    header_record,
    open_private,
    pack_record,
)
from kvtier.tiers.journal_replay import read_journal
from kvtier.tiers.slab import PAGE, SlabAllocator
from tests.support.arena import kill_arena
from tests.support.store import BLOCK, DIGEST, FP, chain

SLAB = 16 * 1024
RUN = bytes(range(16))   # a daemon run's id, as kvtier.tiers.journal_run makes one


def info(i: int, parent: bytes | None = None) -> CommitInfo:
    return CommitInfo(bytes([i]) * 16, b"n" * 16, 7, PAGE, parent, 0 if parent is None else 1,
                      i)


def live_generation(j: ArenaJournal, offset: int) -> int:
    """The generation of ``offset``'s live allocation (one the test made)."""
    gen = j.generation(offset)
    assert gen is not None
    return gen


# -- journal ---------------------------------------------------------------------------------
def test_replay_keeps_commits_in_order_and_reports_slots_in_flight(shm_dir: Path) -> None:
    path = shm_dir / "j.journal"
    j = ArenaJournal(path, 8 * SLAB, SLAB, run=RUN)
    for off in (0, PAGE, 2 * PAGE, 3 * PAGE):
        j.alloc(off, PAGE)
    g = j.generation
    assert j.commit(PAGE, g(PAGE), info(2, parent=bytes([1]) * 16), 22)   # type: ignore[arg-type]
    assert j.commit(0, g(0), info(1), 11)   # type: ignore[arg-type]
    assert j.commit(3 * PAGE, g(3 * PAGE), info(4), 44)   # type: ignore[arg-type]
    j.free(3 * PAGE)
    state = read_journal(path)
    assert state is not None
    assert (state.arena_size, state.slab_bytes) == (8 * SLAB, SLAB)
    assert [(c.offset, c.checksum) for c in state.committed] == [(PAGE, 22), (0, 11)]
    assert state.committed[0].info == info(2, parent=bytes([1]) * 16)
    assert state.writing == [(2 * PAGE, PAGE)]
    assert (state.torn, state.inconsistent) == (0, 0)
    j.close(unlink=True)
    assert not path.exists() and read_journal(path) is None


def test_a_stale_generation_is_not_committed(shm_dir: Path) -> None:
    j = ArenaJournal(shm_dir / "j.journal", 8 * SLAB, SLAB, run=RUN)
    j.alloc(0, PAGE)
    old = j.generation(0)
    j.free(0)
    assert j.generation(0) is None
    j.alloc(0, PAGE)                      # the slot was handed out again meanwhile
    assert old is not None and not j.commit(0, old, info(1), 11)
    state = read_journal(j.path)
    assert state is not None and state.committed == [] and state.writing == [(0, PAGE)]
    j.close(unlink=True)


def test_a_torn_last_record_is_dropped(shm_dir: Path) -> None:
    j = ArenaJournal(shm_dir / "j.journal", 8 * SLAB, SLAB, run=RUN)
    j.alloc(0, PAGE)
    gen = j.generation(0)
    assert gen is not None and j.commit(0, gen, info(1), 11)
    tail = j._tail   # the crash tears the COMMIT record (the one written last)
    with open(j.path, "r+b") as f:
        f.seek((tail - 1) * RECORD + 40)
        f.write(b"\xff")
    state = read_journal(j.path)
    assert state is not None and state.torn == 1
    assert state.committed == [] and state.writing == [(0, PAGE)]
    j.close(unlink=True)


def _journal_of(path: Path, *records: bytes, mode: int = 0o600) -> Path:
    """A journal file holding ``records`` as written, of ``mode``."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"".join(records))
    finally:
        os.close(fd)
    os.chmod(path, mode)
    return path


def _alloc(offset: int, generation: int) -> bytes:
    return pack_record(RecordType.ALLOC, offset=offset, nbytes=PAGE, generation=generation)


def _commit(offset: int, generation: int) -> bytes:
    return pack_record(RecordType.COMMIT, offset=offset, nbytes=PAGE, key=b"k" * 16,
                       namespace=b"n" * 16, layout_fp=7, checksum=11, generation=generation)


@pytest.mark.parametrize(("magic", "version"), [(b"NOTAJOURNAL\0\0\0\0\1", VERSION),
                                                (MAGIC, VERSION + 1)],
                         ids=["magic", "version"])
def test_a_journal_of_another_format_is_not_read(shm_dir: Path, magic: bytes,
                                                 version: int) -> None:
    """A header with another magic or format version (a later kvtier's journal, or another
    file under the name) is not replayed: its records would be read in a layout they were
    not written in, so a warm restart starts cold instead of adopting slots from them."""
    good = header_record(8 * SLAB, SLAB, RUN)
    assert read_journal(_journal_of(shm_dir / "ok.journal", good, _alloc(0, 1))) is not None
    other = pack_record(RecordType.HEADER, offset=8 * SLAB, nbytes=SLAB, key=magic,
                        namespace=RUN, layout_fp=version)
    assert read_journal(_journal_of(shm_dir / "j.journal", other, _alloc(0, 1))) is None


def test_a_header_that_fails_its_own_check_is_not_read(shm_dir: Path) -> None:
    """The header record carries its own xxh3 like every record: one whose check fails (a
    torn or tampered write: here a bit of the arena size flipped) gives no geometry to trust,
    so the journal is not replayed at all (not one with a wrong arena size)."""
    head = bytearray(header_record(8 * SLAB, SLAB, RUN))
    head[9] ^= 1   # the arena size (offset field), under the record's check
    assert read_journal(_journal_of(shm_dir / "j.journal", bytes(head), _alloc(0, 1))) is None


def test_a_commit_of_another_generation_of_its_slot_is_not_adopted(shm_dir: Path) -> None:
    """A COMMIT names the generation of the ALLOC it completes: one of another generation
    (a commit of the slot's previous tenant, after the slot was handed out again) says
    nothing about what the slot holds now, so it is counted inconsistent and the slot stays
    one being written (quarantined), not a block adopted under the old key."""
    head = header_record(8 * SLAB, SLAB, RUN)
    same = read_journal(_journal_of(shm_dir / "ok.journal", head, _alloc(0, 1), _commit(0, 1)))
    assert same is not None and [c.offset for c in same.committed] == [0]
    state = read_journal(_journal_of(shm_dir / "j.journal", head, _alloc(0, 1), _commit(0, 2)))
    assert state is not None and state.committed == [] and state.inconsistent == 1
    assert state.writing == [(0, PAGE)]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o602], ids=lambda m: f"{m:04o}")
def test_a_journal_others_may_read_or_write_is_refused(shm_dir: Path, mode: int) -> None:
    """A journal in a shared /dev/shm is only ours when no group/other bit is set: another
    user who can write it can forge COMMITs (so blocks adopted under any key), one who can
    read it learns every key. open_private refuses it and replay reads nothing from it."""
    path = _journal_of(shm_dir / "j.journal", header_record(8 * SLAB, SLAB, RUN),
                       _alloc(0, 1), _commit(0, 1), mode=mode)
    with pytest.raises(PermissionError):
        os.close(open_private(path, os.O_RDONLY))
    assert read_journal(path) is None
    path.chmod(0o600)
    assert read_journal(path) is not None   # the same bytes, private: read


def test_compaction_keeps_the_live_state(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aj, "COMPACT_MIN", 16)
    j = ArenaJournal(shm_dir / "j.journal", 64 * SLAB, SLAB, run=RUN)
    for round_ in range(50):                 # churn: far more records than live slots
        for off in range(0, 8 * PAGE, PAGE):
            j.alloc(off, PAGE)
            gen = j.generation(off)
            assert gen is not None
            if off != 5 * PAGE:
                j.commit(off, gen, info(off // PAGE), round_)
            if round_ < 49:
                j.free(off)
    j.settle()                                # (compactions are written aside)
    assert j.compactions >= 1
    assert os.stat(j.path).st_mode & 0o777 == 0o600
    state = read_journal(j.path)
    assert state is not None
    assert sorted(c.offset for c in state.committed) == [o * PAGE for o in (0, 1, 2, 3, 4, 6, 7)]
    assert {c.checksum for c in state.committed} == {49}
    assert state.writing == [(5 * PAGE, PAGE)]
    assert (state.inconsistent, state.torn) == (0, 0)
    j.close(unlink=True)


def test_a_committed_slot_outlives_a_compaction(shm_dir: Path) -> None:
    """A compacted file keeps a committed slot as its COMMIT record alone: replay adopts it
    (it used to count it inconsistent and drop it: a second crash lost every block)."""
    j = ArenaJournal(shm_dir / "j.journal", 8 * SLAB, SLAB, run=RUN)
    j.alloc(0, PAGE)
    j.alloc(PAGE, PAGE)
    gen = j.generation(0)
    assert gen is not None and j.commit(0, gen, info(1), 11)
    j._rewrite()
    state = read_journal(j.path)
    assert state is not None and state.inconsistent == 0
    assert [(c.offset, c.checksum, c.info) for c in state.committed] == [(0, 11, info(1))]
    assert state.writing == [(PAGE, PAGE)]
    j.close(unlink=False)
    # adopted by the next daemon, then that one crashes too: still there
    adopted = ArenaJournal(shm_dir / "j.journal", 8 * SLAB, SLAB, run=RUN,
                           live=[(c.offset, c.info.nbytes, c) for c in state.committed])
    again = read_journal(adopted.path)
    assert again is not None and again.inconsistent == 0
    assert [(c.offset, c.checksum) for c in again.committed] == [(0, 11)]
    adopted.close(unlink=True)


def _churn(j: ArenaJournal, rounds: int, base: int) -> None:
    """Records on slots ``base``.. (alloc, commit, free) without changing the live state."""
    for r in range(rounds):
        off = (base + r % 4) * PAGE
        j.alloc(off, PAGE)
        gen = j.generation(off)
        assert gen is not None
        j.commit(off, gen, info(9), r)
        j.free(off)


def test_compaction_is_written_aside_while_appends_go_on(shm_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The compacted file is written by a worker thread; records appended meanwhile reach
    both the old file (a crash then replays it whole) and, at the switch, the new one."""
    monkeypatch.setattr(aj, "COMPACT_MIN", 16)
    j = ArenaJournal(shm_dir / "j.journal", 64 * SLAB, SLAB, run=RUN)
    gate = threading.Event()
    real = aj._write_file

    def slow(tmp: Path, parts: list[bytes], capacity: int) -> int:
        gate.wait(10)
        return real(tmp, parts, capacity)

    monkeypatch.setattr(aj, "_write_file", slow)
    j.alloc(0, PAGE)
    g0 = j.generation(0)
    assert g0 is not None and j.commit(0, g0, info(1), 11)
    _churn(j, 30, 8)                       # past 4 x live + 16: a compaction starts aside
    assert j._next is not None and j.compactions == 0
    j.alloc(PAGE, PAGE)                    # while it is written: a new slot ...
    g1 = j.generation(PAGE)
    assert g1 is not None and j.commit(PAGE, g1, info(2), 22)
    j.free(0)                              # ... and one freed
    crashed = read_journal(j.path)         # a crash now: the old file has everything
    assert crashed is not None and crashed.inconsistent == 0
    assert [c.offset for c in crashed.committed] == [PAGE]
    gate.set()
    j._next.done.result(10)
    _churn(j, 1, 8)                        # the next append switches to the new file
    assert j.compactions >= 1
    j.settle()
    state = read_journal(j.path)
    assert state is not None and (state.inconsistent, state.torn) == (0, 0)
    assert [(c.offset, c.checksum) for c in state.committed] == [(PAGE, 22)]
    assert state.writing == []
    assert not list(shm_dir.glob("*.tmp"))
    j.close(unlink=True)


def test_a_filling_arena_compacts_aside_before_its_file_is_full(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the arena fills up the records never outnumber 4x the live slots, so the file
    itself filling up triggers the compaction: aside, not on the caller's thread."""
    j = ArenaJournal(shm_dir / "j.journal", 1 << 40, SLAB, run=RUN)
    inline: list[int] = []
    real = ArenaJournal._rewrite

    def rewrite(self: ArenaJournal) -> None:
        inline.append(len(self._records))
        real(self)

    monkeypatch.setattr(ArenaJournal, "_rewrite", rewrite)
    slots = aj.MIN_RECORDS // 2 + 100            # two records each: past three quarters
    for i in range(slots):
        j.alloc(i * PAGE, PAGE)
        gen = j.generation(i * PAGE)
        assert gen is not None and j.commit(i * PAGE, gen, info(i % 200), i)
        if j._next is not None:
            j._next.done.result(10)              # (a worker thread that keeps up)
    j.settle()
    assert inline == [] and j.compactions >= 1
    state = read_journal(j.path)
    assert state is not None and (state.inconsistent, state.torn) == (0, 0)
    assert len(state.committed) == slots and state.writing == []
    j.close(unlink=True)


def test_close_drops_a_compaction_still_being_written(shm_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aj, "COMPACT_MIN", 16)
    j = ArenaJournal(shm_dir / "j.journal", 64 * SLAB, SLAB, run=RUN)
    gate = threading.Event()
    real = aj._write_file
    monkeypatch.setattr(aj, "_write_file",
                        lambda tmp, parts, cap: (gate.wait(10), real(tmp, parts, cap))[1])
    j.alloc(0, PAGE)
    g0 = j.generation(0)
    assert g0 is not None and j.commit(0, g0, info(1), 11)
    _churn(j, 30, 8)
    assert j._next is not None
    threading.Timer(0.2, gate.set).start()
    j.close(unlink=False)
    assert not list(shm_dir.glob("*.tmp"))
    state = read_journal(shm_dir / "j.journal")
    assert state is not None and [c.offset for c in state.committed] == [0]
    (shm_dir / "j.journal").unlink()


# -- slab re-reservation ---------------------------------------------------------------------
def test_reserve_takes_exactly_the_named_slots() -> None:
    s = SlabAllocator(4 * SLAB, SLAB)
    assert s.reserve_many([(PAGE, PAGE), (3 * PAGE, PAGE), (SLAB + 8192, 8192)]) == [
        True, True, True]
    assert not s.reserve(PAGE, PAGE)                  # taken
    assert not s.reserve(SLAB + 4096, 8192)           # misaligned for its class
    assert not s.reserve(SLAB, PAGE)                  # the slab serves another class
    assert not s.reserve(4 * SLAB, PAGE)              # beyond the pool
    assert s.reserve(2 * SLAB, 2 * SLAB)              # a two-slab unit, at its start
    assert not s.reserve(3 * SLAB, PAGE)              # inside that unit
    got = {s.alloc(PAGE) for _ in range(2)}
    assert got.isdisjoint({PAGE, 3 * PAGE})
    assert s.used_bytes == 4 * PAGE + 8192 + 2 * SLAB
    for off in (PAGE, 3 * PAGE, SLAB + 8192, 2 * SLAB, *got):
        s.free(off)   # type: ignore[arg-type]
    assert s.used_bytes == 0 and s.could_fit(4 * SLAB)


def test_reserve_refuses_a_slot_that_would_run_past_its_free_slab() -> None:
    """On free slabs, a slot must end inside the unit its class would take there: 3-page
    slots cut a 4-page slab into one slot (pages 0-2); one "at page 3" would reach into the
    next slab, which another class may hand out, so a replayed journal naming it (a
    corrupt or foreign one) must not have it adopted, and the slab stays free."""
    s = SlabAllocator(4 * SLAB, SLAB)
    assert not s.reserve(3 * PAGE, 3 * PAGE)
    assert s.used_bytes == 0 and s.allocated_slots == 0
    assert s.reserve(SLAB, 2 * SLAB)        # slabs 1-2 as one unit: slab 1 is untouched
    assert s.reserve(0, 3 * PAGE)           # and slab 0 still takes the class's real slot


def test_reserve_refuses_a_slot_past_the_last_one_of_its_unit() -> None:
    """Inside a unit that already serves the class, the slot must be one of its slots: 3-page
    slots cut a 4-page slab into one (pages 0-2); page 3 is aligned to the class but would
    overlap the next slab, so the reservation is refused and the unit keeps one slot."""
    s = SlabAllocator(4 * SLAB, SLAB)
    assert s.reserve(0, 3 * PAGE)           # slab 0 now serves 3-page slots
    assert not s.reserve(3 * PAGE, 3 * PAGE)
    assert s.used_bytes == 3 * PAGE
    assert s.reserve(SLAB, PAGE)            # slab 1 is still free for any class


def test_reserve_of_a_multi_slab_slot_refuses_slabs_another_class_holds() -> None:
    """A slot of two slabs at slab 0 needs slabs 0 and 1 free: slab 1 serving 1-page slots
    must not be taken over (its unit would be overwritten and its slot handed out twice)."""
    s = SlabAllocator(4 * SLAB, SLAB)
    assert s.reserve(SLAB, PAGE)            # slab 1 serves 1-page slots
    assert not s.reserve(0, 2 * SLAB)       # slabs 0-1: slab 1 is taken
    assert s.used_bytes == PAGE
    s.free(SLAB)                            # slab 1's unit is intact: its slot frees
    assert s.used_bytes == 0 and s.reserve(0, 2 * SLAB)


# -- stable arenas ---------------------------------------------------------------------------
def test_stable_arena_is_adopted_with_its_bytes_and_locked(shm_dir: Path,
                                                           tmp_path: Path) -> None:
    name = stable_arena_name(tmp_path)
    assert name == stable_arena_name(tmp_path / "." / "")
    a = Arena(4 * SLAB, shm_dir=shm_dir, slab_bytes=SLAB, prefault=False, name=name)
    assert a.path == shm_dir / name and not a.adopted
    a.view(PAGE, 4)[:] = [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="in use by another kvtier daemon"):
        Arena(4 * SLAB, shm_dir=shm_dir, slab_bytes=SLAB, prefault=False, name=name,
              adopt=True)
    assert remove_stale_arenas(shm_dir) == []         # locked: its daemon lives
    kill_arena(a)                                            # the daemon dies (kill -9)
    b = Arena(4 * SLAB, shm_dir=shm_dir, slab_bytes=SLAB, prefault=True, name=name,
              adopt=True)
    assert b.adopted and list(b.view(PAGE, 4)) == [1, 2, 3, 4]
    kill_arena(b)
    c = Arena(8 * SLAB, shm_dir=shm_dir, slab_bytes=SLAB, prefault=False, name=name,
              adopt=True)                              # resized: a new, empty file
    assert not c.adopted and not c.view(PAGE, 4).any()
    c.close()
    assert not (shm_dir / name).exists()


def test_stale_stable_arenas_of_dead_daemons_are_removed(shm_dir: Path,
                                                         tmp_path: Path) -> None:
    dead = shm_dir / stable_arena_name(tmp_path / "dead")
    mine = shm_dir / stable_arena_name(tmp_path / "mine")
    for p in (dead, mine, journal_path(dead)):
        p.write_bytes(b"")
        p.chmod(0o600)
    live = Arena(SLAB, shm_dir=shm_dir, slab_bytes=SLAB, prefault=False,
                 name=stable_arena_name(tmp_path / "live"))
    assert remove_stale_arenas(shm_dir, keep=mine) == [dead]
    assert not dead.exists() and not journal_path(dead).exists()
    assert mine.exists() and live.path.exists()
    live.close()


# -- frame chain fields ----------------------------------------------------------------------
def test_frames_record_their_parent_and_old_frames_read_as_unknown() -> None:
    parent = bytes(range(16))
    h = make_header(b"n" * 16, b"k" * 16, 7, b"payload", seq=3, chain=(parent,))
    back = FrameHeader.unpack(h.pack())
    assert back == h and back.flags & FLAG_CHAIN and back.chain_parent == parent_tag(parent)
    head = FrameHeader.unpack(make_header(b"n" * 16, b"k" * 16, 7, b"x", chain=(None,)).pack())
    assert head.flags == FLAG_CHAIN and head.chain_parent is None
    old = FrameHeader.unpack(make_header(b"n" * 16, b"k" * 16, 7, b"x").pack())
    assert old.flags == 0 and old.chain_parent is None     # version 1 frames as before


# -- the store's commit log ------------------------------------------------------------------
async def test_commit_log_hashes_off_loop_and_skips_freed_slots(shm_dir: Path) -> None:
    from kvtier.store.recovery import CommitLog

    arena = Arena(4 * SLAB, shm_dir=shm_dir, slab_bytes=SLAB, prefault=False, name="x.arena")
    arena.journal = ArenaJournal(shm_dir / "x.journal", arena.size, arena.slab_bytes, run=RUN)
    log = CommitLog(arena)
    metas = []
    for i in range(3):
        off = arena.alloc(PAGE)
        assert off is not None
        arena.view(off, PAGE)[:] = np.full(PAGE, i, np.uint8)
        meta = BlockMeta(bytes([i]) * 16, b"n" * 16, 7, PAGE, None, 0, cpu=off)
        metas.append(meta)
        log.ready(meta)
    arena.free(metas[2].cpu)   # type: ignore[arg-type]  # evicted before its checksum landed
    await log.flush()
    state = read_journal(arena.journal.path)
    assert state is not None
    assert [(c.offset, c.checksum) for c in state.committed] == [
        (m.cpu, xxhash.xxh3_64_intdigest(np.full(PAGE, i, np.uint8).data))
        for i, m in enumerate(metas[:2])]
    arena.close()
    assert not (shm_dir / "x.journal").exists()


# -- config ----------------------------------------------------------------------------------
def test_warm_restart_and_lookup_budget_settings() -> None:
    from kvtier.config import load_config

    cfg = load_config(env={})
    assert cfg.cpu.warm_restart is True and 0 < cfg.redis.lookup_budget_s < cfg.redis.op_timeout_s
    cfg = load_config(env={"KVTIER_CPU_WARM_RESTART": "false",
                           "KVTIER_REDIS_LOOKUP_BUDGET_S": "0.05"})
    assert cfg.cpu.warm_restart is False and cfg.redis.lookup_budget_s == 0.05
    with pytest.raises(ConfigError, match="lookup_budget_s"):
        load_config(env={"KVTIER_REDIS_LOOKUP_BUDGET_S": "0"})


def test_stale_stable_arenas_are_kept_while_shm_has_room(shm_dir: Path, tmp_path: Path) -> None:
    """Another data dir's dead arena is its warm restart in waiting: a starting daemon
    removes it only when it needs the room."""
    dead = shm_dir / stable_arena_name(tmp_path / "dead")
    dead.write_bytes(b"")
    dead.chmod(0o600)
    assert remove_stale_arenas(shm_dir, need_bytes=0) == []
    assert dead.exists()
    assert remove_stale_arenas(shm_dir, need_bytes=2**62) == [dead]   # short of room
    assert not dead.exists()


def test_batched_records_are_the_records_one_at_a_time(shm_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """alloc_many/commit_many write what alloc/commit would, in order, stale commits
    skipped, through compactions too (a batch straddling a switch goes record by record)."""
    monkeypatch.setattr(aj, "COMPACT_MIN", 16)
    one = ArenaJournal(shm_dir / "one.journal", 64 * SLAB, SLAB, run=RUN)
    many = ArenaJournal(shm_dir / "many.journal", 64 * SLAB, SLAB, run=RUN)
    offsets = [i * PAGE for i in range(12)]
    for round_ in range(40):
        for off in offsets:
            one.alloc(off, PAGE)
        many.alloc_many(offsets, PAGE)
        stale = offsets[3]
        one.free(stale)
        many.free(stale)
        assert [one.generation(o) for o in offsets] == [many.generation(o) for o in offsets]
        old = 0 if round_ == 0 else 1   # the freed slot's commit names a gone generation
        commits = [(off, one.generation(off) or old, info(off // PAGE), round_)
                   for off in offsets]
        recorded = sum(one.commit(*c) for c in commits)
        assert many.commit_many(commits) == recorded == len(offsets) - 1
        if round_ < 39:
            for off in offsets:
                one.free(off)
                many.free(off)
    one.settle()
    many.settle()
    a, b = read_journal(one.path), read_journal(many.path)
    assert a is not None and b is not None and many.compactions >= 1
    assert [(c.offset, c.info, c.checksum) for c in a.committed] == \
        [(c.offset, c.info, c.checksum) for c in b.committed]
    assert a.writing == b.writing == [] and (b.torn, b.inconsistent) == (0, 0)
    assert len(b.committed) == len(offsets) - 1
    one.close(unlink=True)
    many.close(unlink=True)


def test_alloc_many_gives_what_single_allocs_would() -> None:
    sizes = [PAGE, 3 * PAGE, PAGE, 5 * PAGE]
    one, many = SlabAllocator(40 * SLAB, SLAB), SlabAllocator(40 * SLAB, SLAB)
    rng = np.random.default_rng(3)
    held: list[int] = []
    for step in range(200):
        nbytes, n = sizes[step % len(sizes)], int(rng.integers(1, 40))
        want = []
        for _ in range(n):
            off = one.alloc(nbytes)
            if off is None:
                break
            want.append(off)
        got = many.alloc_many(nbytes, n)
        assert got == want
        held += got
        assert (one.used_bytes, one.allocated_slots) == (many.used_bytes, many.allocated_slots)
        for off in [held.pop(int(rng.integers(len(held)))) for _ in range(len(held) // 2)]:
            one.free(off)
            many.free(off)
    assert many.alloc_many(PAGE, 0) == []


def test_a_batch_that_straddles_a_switch_and_a_new_compaction_is_written_once(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch arriving while a compaction is written aside goes record by record; when
    the switch to the new file comes mid-batch and that file at once wants compacting
    again, the new snapshot already holds the batch's remaining records (``_records``
    shows the whole batch): they must not reach the next file a second time."""
    monkeypatch.setattr(aj, "COMPACT_MIN", 16)
    gate = threading.Event()
    write = aj._write_file

    def gated(tmp: Path, parts: list[bytes], capacity: int) -> int:
        gate.wait(10)
        return write(tmp, parts, capacity)

    j = ArenaJournal(shm_dir / "j.journal", 64 * SLAB, SLAB, run=RUN)
    monkeypatch.setattr(aj, "_write_file", gated)   # (after the journal's first file)
    offsets = [i * PAGE for i in range(12)]
    j.alloc_many(offsets, PAGE)
    spare = 40 * PAGE
    while j._next is None:            # churn one slot until a compaction starts aside
        j.alloc(spare, PAGE)
        j.free(spare)
    for _ in range(40):               # records that come while it is written: its `since`
        j.alloc(spare, PAGE)
        j.free(spare)
    gate.set()
    assert j._next is not None
    j._next.done.result()
    commits = [(off, live_generation(j, off), info(off // PAGE), 7) for off in offsets]
    assert j.commit_many(commits) == len(offsets)   # switches, then compacts mid-batch
    j.settle()
    state = read_journal(j.path)
    assert state is not None and j.compactions >= 2
    assert (state.torn, state.inconsistent) == (0, 0)
    assert sorted(c.offset for c in state.committed) == offsets
    j.close(unlink=True)


def test_a_record_beyond_the_format_is_skipped_not_the_batch(shm_dir: Path) -> None:
    """One commit whose fields do not fit the record (a depth of 2**32) must not cost the
    batch's other blocks their records (they would not be adopted after a crash)."""
    j = ArenaJournal(shm_dir / "j.journal", 64 * SLAB, SLAB, run=RUN)
    offsets = [i * PAGE for i in range(4)]
    j.alloc_many(offsets, PAGE)
    bad = CommitInfo(b"b" * 16, b"n" * 16, 7, PAGE, b"p" * 16, 2**32, 9)
    commits = [(off, j.generation(off) or 0, bad if i == 1 else info(i), i)
               for i, off in enumerate(offsets)]
    assert j.commit_many(commits) == 3 and j.unencodable == 1
    j.settle()
    replay = read_journal(j.path)
    assert replay is not None
    assert sorted(c.offset for c in replay.committed) == [offsets[0], offsets[2], offsets[3]]


# -- warm restart: arena commits merged with the nvme frames ---------------------------------
@pytest.mark.parametrize("field", ["same", "namespace", "layout_fp", "nbytes"])
async def test_an_arena_commit_that_disagrees_with_its_keys_nvme_frame_is_not_adopted(
        store: TieredStore, field: str) -> None:
    """A key both in a journal COMMIT and in an nvme frame is one block only when both say
    the same namespace, layout and size: otherwise one of them is another block under the
    same key (another tenant's namespace, an older layout), and adopting the arena slot
    into the frame's entry would serve its bytes as the frame's block. The commit is
    dropped (counted a conflict, its slot freed) and the nvme frame alone is indexed."""
    key = chain(1)[0]
    slot = store.nvme.alloc(BLOCK) if store.nvme is not None else None
    assert slot is not None
    entries = [(slot, make_header(DIGEST, key, FP, bytes(BLOCK)))]
    said: dict[str, Any] = {"namespace": DIGEST, "layout_fp": FP, "nbytes": BLOCK}
    if field != "same":
        said[field] = {"namespace": b"\xee" * 16, "layout_fp": FP + 1,
                       "nbytes": BLOCK // 2}[field]
    committed = [CommittedSlot(0, CommitInfo(key, said["namespace"], said["layout_fp"],
                                                said["nbytes"], None, 0, 1), 11)]
    counters = RecoveryCounters()
    adopted, _ = _merge(store, entries, committed, [], counters)
    meta = store.index[key]
    assert (meta.namespace, meta.nvme) == (DIGEST, slot)
    if field == "same":   # one block in both tiers
        assert [s.offset for s in adopted] == [0] and meta.cpu == 0
        assert counters.dropped_conflict == 0
    else:
        assert adopted == [] and meta.cpu is None and counters.dropped_conflict == 1
        assert store.arena.used_bytes == 0
