"""The arena journal stops when its file cannot be rewritten (EMFILE, a full tmpfs) and
resumes once a rewrite, retried with backoff by later appends, works: while stopped no
journal file exists, and the resumed file holds exactly the live slots, so a warm restart
after it adopts exactly the blocks the arena holds (it stayed off until a restart before)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from kvtier.backoff import BackoffPolicy
from kvtier.store import TieredStore
from kvtier.tiers import arena_journal as aj
from kvtier.tiers.arena import Arena, journal_path, stable_arena_name
from kvtier.tiers.arena_journal import ArenaJournal
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.journal_format import CommitInfo
from kvtier.tiers.journal_replay import read_journal
from kvtier.tiers.slab import PAGE
from tests.support.arena import kill_arena
from tests.support.store import (
    BLOCK,
    DIGEST,
    FP,
    LAYOUT,
    NAMESPACE,
    FakeClock,
    chain,
    get,
    payload,
    put,
)

SLAB = 16 * 1024
RUN = bytes(range(16))
LOGGER = "kvtier.tiers.arena"


@pytest.fixture
def small_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Journal files of 64 records: a few dozen changes fill one."""
    monkeypatch.setattr(aj, "MIN_RECORDS", 64)
    monkeypatch.setattr(aj, "COMPACT_MIN", 4)


class Flaky:
    """``_write_file`` failing with EMFILE while ``failing``; counts its calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = aj._write_file
        self.failing = True
        self.calls = 0
        monkeypatch.setattr(aj, "_write_file", self)

    def __call__(self, tmp: Path, parts: list[bytes], capacity: int) -> int:
        self.calls += 1
        if self.failing:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self.real(tmp, parts, capacity)


def info(i: int) -> CommitInfo:
    return CommitInfo(bytes([i]) * 16, b"n" * 16, 7, PAGE, None, 0, i)


def commit(j: ArenaJournal, off: int, checksum: int) -> None:
    gen = j.generation(off)
    assert gen is not None and j.commit(off, gen, info(off // PAGE % 256), checksum)


def logged(caplog: pytest.LogCaptureFixture, level: int, text: str) -> int:
    return sum(r.levelno == level and text in r.getMessage() for r in caplog.records)


def test_a_stopped_journal_resumes_with_exactly_the_live_slots(
        shm_dir: Path, small_files: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    clock = FakeClock()
    path = shm_dir / "j.journal"
    j = ArenaJournal(path, 1024 * SLAB, SLAB, run=RUN, clock=clock)
    flaky = Flaky(monkeypatch)
    committed: dict[int, int] = {}              # offset -> checksum, as the arena holds them
    for i in range(6):
        j.alloc(i * PAGE, PAGE)
        commit(j, i * PAGE, 100 + i)
        committed[i * PAGE] = 100 + i
    churn = 0
    while not j.stopped:                        # churn until the file is full
        off = (100 + churn % 4) * PAGE
        j.alloc(off, PAGE)
        commit(j, off, churn)
        j.free(off)
        churn += 1
        assert churn < 200, "the journal never filled up"
    # one compaction tried aside (3/4 full), then, its failure waiting for the backoff, one
    # rewrite when the file was full: not a try per append
    assert flaky.calls == 2
    assert j.stops == 1 and not path.exists() and not list(shm_dir.glob("*.tmp"))
    assert logged(caplog, logging.WARNING, "it stops and its file is removed") == 1

    # while stopped: slots change, nothing is written and nothing is retried yet
    j.free(0)
    del committed[0]
    j.alloc(200 * PAGE, PAGE)
    commit(j, 200 * PAGE, 200)
    committed[200 * PAGE] = 200
    j.alloc(201 * PAGE, PAGE)                   # being written: no checksum yet
    for k in range(100):
        j.alloc_many([(300 + k) * PAGE, (400 + k) * PAGE], PAGE)
        j.free((300 + k) * PAGE)
        j.free((400 + k) * PAGE)
    clock.advance(1.0)                          # (the first retry waits 2-4 s)
    j.free(PAGE)
    del committed[PAGE]
    assert flaky.calls == 2 and j.stopped and not path.exists()

    clock.advance(aj.RETRY_BACKOFF.cap_s)
    j.alloc(202 * PAGE, PAGE)                   # due: a rewrite starts aside; it fails
    assert j._next is not None
    j.settle()
    assert flaky.calls == 3 and j.stopped and not path.exists()
    j.free(202 * PAGE)                          # the next waits for the backoff again
    assert flaky.calls == 3 and j._next is None

    flaky.failing = False                       # descriptors are back
    clock.advance(aj.RETRY_BACKOFF.cap_s)
    j.alloc(203 * PAGE, PAGE)                   # starts the rewrite aside ...
    assert j._next is not None
    commit(j, 203 * PAGE, 203)                  # ... these come while it is written
    committed[203 * PAGE] = 203
    j.free(2 * PAGE)
    del committed[2 * PAGE]
    assert not path.exists()                    # nothing at the path before the switch
    j.settle()
    assert not j.stopped and j.resumes == 1 and path.exists() and flaky.calls == 4
    assert logged(caplog, logging.INFO, "resumed") == 1
    assert logged(caplog, logging.WARNING, "it stops") == 1

    state = read_journal(path)
    assert state is not None and (state.torn, state.inconsistent) == (0, 0)
    assert {c.offset: c.checksum for c in state.committed} == committed
    assert state.writing == [(201 * PAGE, PAGE)]
    # journaling goes on in the resumed file
    commit(j, 201 * PAGE, 201)
    committed[201 * PAGE] = 201
    state = read_journal(path)
    assert state is not None and state.writing == []
    assert {c.offset: c.checksum for c in state.committed} == committed
    j.close(unlink=True)
    assert not list(shm_dir.iterdir())


async def test_warm_restart_after_a_resume_adopts_exactly_the_live_blocks(
        shm_dir: Path, tmp_path: Path, small_files: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the store: puts and deletes while the journal stops (EMFILE), stays stopped
    and resumes; then a crash, and the next start adopts exactly what the arena held."""
    monkeypatch.setattr(aj, "RETRY_BACKOFF", BackoffPolicy(base_s=1e-6, cap_s=1e-6),
                        raising=False)
    name = stable_arena_name(tmp_path)
    arena = Arena(16 * BLOCK, shm_dir=shm_dir, slab_bytes=BLOCK, prefault=False, name=name)
    jpath = journal_path(arena.path)
    arena.journal = ArenaJournal(jpath, arena.size, arena.slab_bytes, run=RUN)
    flaky = Flaky(monkeypatch)
    store = TieredStore(arena, eviction="lru", prefetch_wait="wait")
    assert store.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    client = ArenaMapping(str(arena.path), arena.size)
    kept = chain(3, start=0)
    await put(store, client, kept)
    await store.commit_log.flush()
    n = 1
    while not arena.journal.stopped:            # put and delete until the file is full
        keys = chain(2, start=n)
        await put(store, client, keys)
        await store.commit_log.flush()
        await store.delete(DIGEST, FP, keys)
        n += 1
        assert n < 100, "the journal never stopped"
    assert not jpath.exists()
    for start in (n, n + 1):                    # while stopped: kept and deleted blocks
        keys = chain(2, start=start)
        await put(store, client, keys)
        await store.commit_log.flush()
        assert not jpath.exists()
    kept += chain(2, start=n)
    await store.delete(DIGEST, FP, chain(2, start=n + 1))
    flaky.failing = False
    later = chain(2, start=n + 2)
    await put(store, client, later)             # appends: a rewrite starts aside
    await store.commit_log.flush()
    arena.journal.settle()
    assert not arena.journal.stopped and arena.journal.resumes == 1 and jpath.exists()
    kept += later
    newest = chain(1, start=n + 3)
    await put(store, client, newest)            # journaled as usual again
    await store.commit_log.flush()
    kept += newest
    assert {k for k in store.index} == set(kept)
    client.close()
    kill_arena(arena)                                  # kill -9

    again = Arena(16 * BLOCK, shm_dir=shm_dir, slab_bytes=BLOCK, prefault=False, name=name,
                  adopt=True)
    assert again.adopted
    store2 = TieredStore(again, eviction="lru", prefetch_wait="wait")
    rec = await store2.recover(read_journal(jpath), last_run=RUN, begin_run=lambda: RUN[::-1],
                               journal=jpath)
    assert (rec.mode, rec.adopted_blocks) == ("warm", len(kept))
    assert (rec.dropped_checksum, rec.dropped_inflight, rec.dropped_conflict,
            rec.orphans_dropped, rec.quarantined_slots) == (0, 0, 0, 0, 0)
    assert set(store2.index) == set(kept)
    assert store2.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    client2 = ArenaMapping(str(again.path), again.size)
    for keys in (kept[:3], kept[3:5], kept[5:7], kept[7:]):
        assert await get(store2, client2, keys) == [payload(k) for k in keys]
    client2.close()
    again.close()
    assert flaky.calls > 0


def test_an_idle_journal_resumes_on_the_sweeps_tick(
        shm_dir: Path, small_files: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped journal resumed only at the arena's next change: an idle daemon that
    crashed after the cause went away started cold. The daemon's sweep calls ``tick``:
    no retry before the backoff, then a rewrite aside, installed at a later tick."""
    clock = FakeClock()
    path = shm_dir / "j.journal"
    j = ArenaJournal(path, 1024 * SLAB, SLAB, run=RUN, clock=clock)
    flaky = Flaky(monkeypatch)
    j.alloc(0, PAGE)
    commit(j, 0, 7)
    churn = 0
    while not j.stopped:
        off = (100 + churn % 4) * PAGE
        j.alloc(off, PAGE)
        j.free(off)
        churn += 1
        assert churn < 200, "the journal never filled up"
    calls = flaky.calls
    flaky.failing = False
    j.tick()                                    # within the backoff: nothing tried
    assert flaky.calls == calls and j.stopped and j._next is None
    clock.advance(aj.RETRY_BACKOFF.cap_s)
    j.tick()                                    # due: written aside, no change needed
    assert j._next is not None
    j._next.done.result(timeout=10)             # (by the journal's thread)
    assert flaky.calls == calls + 1
    j.tick()                                    # done: installed, journaling resumes
    assert not j.stopped and j.resumes == 1 and path.exists()
    state = read_journal(path)
    assert state is not None and {c.offset: c.checksum for c in state.committed} == {0: 7}
    j.close(unlink=True)
