"""The shared-memory arena: slab allocator invariants, client mappings, stale-file cleanup."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvtier.errors import CapacityError, ConfigError
from kvtier.tiers.arena import Arena, remove_stale_arenas
from kvtier.tiers.arena_mapping import ArenaMapping, shared_mappings
from kvtier.tiers.slab import PAGE, round_up
from tests.support.arena import shm_root

KiB = 1024
SLAB = 16 * KiB
N_SLABS = 8


@pytest.fixture
def arena(shm_dir: Path) -> Iterator[Arena]:
    a = Arena(N_SLABS * SLAB, shm_dir=shm_dir, slab_bytes=SLAB, prefault=False)
    yield a
    a.close()


def slot_size(nbytes: int) -> int:
    """What the arena reserves for ``nbytes``: whole pages, at least one."""
    return round_up(max(nbytes, 1))


# -- construction ----------------------------------------------------------------------------
def test_geometry_and_file(shm_dir: Path) -> None:
    a = Arena(N_SLABS * SLAB + 100, shm_dir=shm_dir, slab_bytes=SLAB, prefault=True)
    try:
        assert (a.slab_bytes, a.size) == (SLAB, N_SLABS * SLAB)
        assert a.path.parent == shm_dir
        assert a.path.name.startswith(f"kvtier-{os.getuid()}-{os.getpid()}-")
        assert a.path.stat().st_size == a.size
        assert oct(a.path.stat().st_mode & 0o777) == "0o600"
        assert (a.used_bytes, a.allocated_slots) == (0, 0)
    finally:
        a.close()
    assert not a.path.exists()


@pytest.mark.parametrize(("capacity", "size"), [
    (10_000, 8192),               # not a page multiple, smaller than the default slab
    (50_000_000, 49_999_872),     # "50MB", which config turns into slab_bytes=capacity
    (PAGE, PAGE),
])
def test_small_arena_is_one_slab(shm_dir: Path, capacity: int, size: int) -> None:
    a = Arena(capacity, shm_dir=shm_dir, slab_bytes=max(capacity, 4096), prefault=False)
    try:
        assert a.size == size <= capacity
        assert a.alloc(size) is not None
    finally:
        a.close()


def test_arena_below_one_page_is_a_config_error(shm_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"cpu\.bytes of 4095 bytes is smaller than one "
                       r"4096-byte page.*give at least 4096 \(--cpu-bytes"):
        Arena(PAGE - 1, shm_dir=shm_dir, prefault=False)


def test_missing_shm_dir_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Arena(SLAB, shm_dir=tmp_path / "missing", prefault=False)
    (tmp_path / "file").write_text("x")   # was "does not exist" too
    with pytest.raises(ConfigError, match=r"file \(cpu\.shm_dir\) is not a directory"):
        Arena(SLAB, shm_dir=tmp_path / "file", prefault=False)


# -- allocation ------------------------------------------------------------------------------
def test_slots_of_one_class_share_a_slab(arena: Arena) -> None:
    offs = [arena.alloc(PAGE) for _ in range(SLAB // PAGE)]
    assert sorted(o for o in offs if o is not None) == list(range(0, SLAB, PAGE))
    assert arena.used_bytes == SLAB
    nxt = arena.alloc(PAGE)
    assert nxt is not None and nxt >= SLAB  # the first slab is full: a new unit


def test_zero_bytes_takes_one_page(arena: Arena) -> None:
    off = arena.alloc(0)
    assert off is not None
    assert arena.used_bytes == PAGE
    assert arena.could_fit(0)
    arena.free(off)
    assert arena.used_bytes == 0


def test_negative_size_is_refused(arena: Arena) -> None:
    with pytest.raises(ValueError):
        arena.alloc(-1)


def test_large_slot_spans_contiguous_slabs(arena: Arena) -> None:
    big = arena.alloc(3 * SLAB - 100)
    assert big is not None and big % SLAB == 0
    assert arena.used_bytes == 3 * SLAB
    arena.view(big, 3 * SLAB)[:] = 7
    assert int(arena.view(big, 3 * SLAB).sum()) == 7 * 3 * SLAB


def test_full_arena_returns_none_and_could_fit_agrees(arena: Arena) -> None:
    offs = [arena.alloc(SLAB) for _ in range(N_SLABS)]
    assert None not in offs
    assert arena.used_bytes == arena.size
    assert not arena.could_fit(1)
    assert arena.alloc(1) is None
    arena.free(offs[3])  # type: ignore[arg-type]
    assert arena.could_fit(PAGE) and arena.could_fit(SLAB) and not arena.could_fit(SLAB + 1)


def test_fragmented_arena_cannot_fit_a_multi_slab_slot(arena: Arena) -> None:
    offs = [arena.alloc(SLAB) for _ in range(N_SLABS)]
    for off in offs[::2]:
        arena.free(off)  # type: ignore[arg-type]
    assert arena.size - arena.used_bytes == 4 * SLAB
    assert not arena.could_fit(2 * SLAB)
    assert arena.alloc(2 * SLAB) is None


def test_emptied_unit_returns_its_slabs_to_other_classes(arena: Arena) -> None:
    small = [arena.alloc(PAGE) for _ in range(N_SLABS * SLAB // PAGE)]
    assert arena.alloc(PAGE) is None and arena.alloc(SLAB) is None
    for off in small:
        arena.free(off)  # type: ignore[arg-type]
    assert (arena.used_bytes, arena.allocated_slots) == (0, 0)
    whole = arena.alloc(arena.size)
    assert whole == 0


@pytest.mark.parametrize("bad", ["never-allocated", "double", "tail", "inside", "past-end",
                                 "negative"])
def test_bad_frees_are_refused(arena: Arena, bad: str) -> None:
    # 12 KiB slots in a 16 KiB slab leave a 4 KiB tail that is no slot
    a = arena.alloc(12 * KiB)
    b = arena.alloc(12 * KiB)
    assert a is not None and b is not None
    offset = {"never-allocated": 5 * SLAB, "double": a, "tail": a + 12 * KiB,
              "inside": a + PAGE, "past-end": arena.size, "negative": -PAGE}[bad]
    if bad == "double":
        arena.free(a)
    before = (arena.used_bytes, arena.allocated_slots)
    with pytest.raises(CapacityError, match="not an allocated slot"):
        arena.free(offset)
    assert (arena.used_bytes, arena.allocated_slots) == before
    assert arena.alloc(12 * KiB) is not None  # the allocator is still consistent


# -- state machine ---------------------------------------------------------------------------
SIZES = st.one_of(
    st.integers(0, PAGE),                 # one page
    st.integers(PAGE + 1, SLAB),          # several slots per slab (some with a tail)
    st.integers(SLAB + 1, 3 * SLAB),      # slots spanning two or three slabs
    st.sampled_from([PAGE, 3 * PAGE, SLAB, 2 * SLAB]),
)


class ArenaMachine(RuleBasedStateMachine):
    """Random alloc/free sequences: slots never overlap, accounting is exact."""

    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory(prefix="kvtier-test-", dir=shm_root())
        self.arena = Arena(N_SLABS * SLAB, shm_dir=Path(self._dir.name), slab_bytes=SLAB,
                           prefault=False)
        self.live: dict[int, tuple[int, int, int]] = {}  # handle -> (offset, size, fill byte)
        self.next_handle = 0

    @rule(target=handles, nbytes=SIZES)
    def alloc(self, nbytes: int) -> int:
        could = self.arena.could_fit(nbytes)
        empty = not self.live
        off = self.arena.alloc(nbytes)
        assert (off is not None) == could
        if empty and nbytes <= self.arena.size:
            assert off is not None, "an empty arena must take any slot that fits"
        self.next_handle += 1
        if off is None:
            return self.next_handle
        size = slot_size(nbytes)
        assert off % PAGE == 0 and off >= 0 and off + size <= self.arena.size
        for other, osize, _ in self.live.values():
            assert off + size <= other or other + osize <= off, "slots overlap"
        fill = self.next_handle % 255 + 1
        self.arena.view(off, size)[:] = fill
        self.live[self.next_handle] = (off, size, fill)
        return self.next_handle

    @rule(handle=consumes(handles))
    def free(self, handle: int) -> None:
        if handle not in self.live:  # its alloc failed, or free_everything took it
            return
        off, size, fill = self.live.pop(handle)
        view = self.arena.view(off, size)
        assert int(view.min()) == int(view.max()) == fill, "another slot wrote into this one"
        self.arena.free(off)

    @precondition(lambda self: bool(self.live))
    @rule()
    def free_everything(self) -> None:
        for handle in list(self.live):
            self.free(handle)
        assert self.arena.alloc(self.arena.size) == 0  # every unit went back to the pool
        self.arena.free(0)

    @invariant()
    def accounting_is_exact(self) -> None:
        assert self.arena.used_bytes == sum(size for _, size, _ in self.live.values())
        assert self.arena.allocated_slots == len(self.live)
        assert 0 <= self.arena.used_bytes <= self.arena.size

    @invariant()
    def empty_arena_has_all_slabs_free(self) -> None:
        if not self.live:
            assert self.arena.could_fit(self.arena.size)

    def teardown(self) -> None:
        self.arena.close()
        self._dir.cleanup()


ArenaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                          deadline=None)
test_arena_state_machine = ArenaMachine.TestCase


# -- client mapping --------------------------------------------------------------------------
def test_client_mapping_shares_bytes_with_the_daemon(arena: Arena) -> None:
    off = arena.alloc(PAGE)
    assert off is not None
    client = ArenaMapping(str(arena.path), arena.size)
    try:
        w = client.view(off, PAGE, writable=True)
        w[:] = np.arange(PAGE, dtype=np.uint64).astype(np.uint8)
        assert bytes(arena.view(off, PAGE)) == bytes(w)
        arena.view(off, 16)[:] = 0xAB
        r = client.view(off, PAGE, writable=False)
        assert bytes(r[:16]) == b"\xab" * 16
        with pytest.raises(ValueError):
            r[0] = 1
    finally:
        client.close()


def test_mapping_survives_the_daemon_unlinking_the_file(arena: Arena) -> None:
    client = ArenaMapping(str(arena.path), arena.size)
    try:
        arena.view(0, 4)[:] = 9
        arena.close()
        assert not arena.path.exists()
        assert bytes(client.view(0, 4, writable=False)) == b"\x09" * 4
    finally:
        client.close()


def test_clients_of_one_process_share_one_mapping_per_arena_file(
        arena: Arena, shm_dir: Path) -> None:
    """Each client verifies its own descriptor, but a process maps an arena file once:
    the scheduler, loader and saver clients of an engine do not each walk its pages."""
    before = shared_mappings()
    a = ArenaMapping(str(arena.path), arena.size)
    b = ArenaMapping(str(arena.path), arena.size)
    other = Arena(N_SLABS * SLAB, shm_dir=shm_dir, slab_bytes=SLAB, prefault=False)
    c = ArenaMapping(str(other.path), other.size)
    try:
        assert shared_mappings() == before + 2          # a and b share; c is another file
        assert a.buf.ctypes.data == b.buf.ctypes.data != c.buf.ctypes.data
        a.close()                                        # b still reads and writes
        b.view(0, 8, writable=True)[:] = 7
        assert bytes(arena.view(0, 8)) == b"\x07" * 8
        assert len(a.buf) == 0 and shared_mappings() == before + 2
        b.close()
        assert shared_mappings() == before + 1           # the last reference unmapped
        a.close()                                        # closing twice is harmless
        assert shared_mappings() == before + 1
    finally:
        b.close()
        c.close()
        other.close()
    assert shared_mappings() == before


def test_mapping_of_a_missing_arena_raises(shm_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ArenaMapping(str(shm_dir / "gone.arena"), PAGE)


# -- stale arenas ----------------------------------------------------------------------------
def dead_pid() -> int:
    """The pid of no running process (the highest free one below pid_max), found without
    starting a process: unit tests do not start processes."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 1, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("every pid is in use")


def test_remove_stale_arenas_removes_only_dead_owners(shm_dir: Path) -> None:
    uid = os.getuid()
    pid = dead_pid()
    stale = shm_dir / f"kvtier-{uid}-{pid}-00000000.arena"
    live = shm_dir / f"kvtier-{uid}-{os.getpid()}-00000000.arena"
    other_user = shm_dir / f"kvtier-{uid + 1}-{pid}-00000000.arena"
    garbage = shm_dir / f"kvtier-{uid}-notapid-0.arena"
    unrelated = shm_dir / f"kvtier-{uid}-{pid}-0.txt"
    for p in (stale, live, other_user, garbage, unrelated):
        p.write_bytes(b"")
    assert remove_stale_arenas(shm_dir) == [stale]
    assert not stale.exists()
    assert all(p.exists() for p in (live, other_user, garbage, unrelated))


def test_a_live_arena_is_not_stale(arena: Arena, shm_dir: Path) -> None:
    assert remove_stale_arenas(shm_dir) == []
    assert arena.path.exists()
