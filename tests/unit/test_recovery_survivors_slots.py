"""The nvme tier's slot books (``kvtier.tiers.nvme.slots``) and reclaim (``reclaim``),
pinned where the mutation review of warm restarts found no test: after punches, hole
reuse, tail cuts and erases, ``disk_bytes`` is what the files hold (their spans less the
punched holes), nothing is leaked or handed out twice, and a restart finds exactly the
frames still stored."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import random
import threading
from pathlib import Path

import pytest

from kvtier.frame import make_header
from kvtier.tiers.aligned import aligned_buffer
from kvtier.tiers.nvme import PAGE, NvmeSlot, NvmeTier
from kvtier.tiers.nvme import holes as nvme_holes
from kvtier.tiers.nvme import reclaim as reclaim_module

NS = bytes(range(16))
LAYOUT = 0x1234_5678
SMALL, BIG = 4000, 16 * 1024
STRIDE = PAGE + 4096              # a 4 KiB class slot
N = 8


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


async def put(t: NvmeTier, i: int, rng: random.Random, n: int = SMALL) -> NvmeSlot:
    slot = t.alloc(n)
    assert slot is not None
    buf = aligned_buffer(NvmeTier.slot_bytes_for(n))
    buf[:n] = rng.randbytes(n)
    await t.write(slot, make_header(NS, key_of(i), LAYOUT, buf[:n], seq=t.next_seq()), buf)
    return slot


def check_books(t: NvmeTier) -> None:
    """(Every slot handed out written.) ``disk_bytes`` is the files' spans less their
    holes, within the capacity, and ``used_bytes`` the footprint of the slots handed out."""
    spans = sum(p.stat().st_size for p in t.root.glob("slots-*.dat"))
    assert t.disk_bytes == spans - t.hole_bytes
    busy = sum(len(c.busy) * c.stride for c in t._slots.classes.values())
    assert t.used_bytes == busy <= t.disk_bytes <= t.capacity_bytes
    for c in t._slots.classes.values():   # every slot below the tail in exactly one list
        assert sorted([*c.free, *c.busy, *c.punching]) == list(range(c.high_water))
        assert c.holes <= set(c.free)
    assert t._slots.punching_bytes == sum(len(c.punching) * c.stride
                                          for c in t._slots.classes.values())



def hold_erases(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every erase in its I/O thread until the returned event is set (at most 10 s)."""
    gate = threading.Event()
    real_erase = reclaim_module._erase_sync

    def gated_erase(fd: int, offset: int, prev: object) -> int:
        gate.wait(10)
        return real_erase(fd, offset, prev)  # type: ignore[arg-type]

    monkeypatch.setattr(reclaim_module, "_erase_sync", gated_erase)
    return gate


async def test_a_hole_taken_again_counts_its_disk_again(tmp_path: Path) -> None:
    """Eight 4 KiB frames fill the tier; four are evicted, three of them punched out for
    a 16 KiB block. A small block then takes the one free slot that kept its disk, and
    the next is refused (only holes left, no disk for them). Once the big block goes, a
    small block takes the lowest hole: the slot has disk again, so ``disk_bytes`` grows
    by its stride and the hole is no hole."""
    rng = random.Random(1)
    t = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    t.open()
    try:
        slots = [await put(t, i, rng) for i in range(N)]
        for s in slots[2:6]:
            t.free(s)                                  # evicted: frames stay on disk
        assert t.alloc(BIG) is None and t.disk_short(BIG) > 0
        assert await t.make_room(BIG)
        check_books(t)
        big = await put(t, 100, rng, BIG)
        check_books(t)
        assert await put(t, 300, rng) == NvmeSlot(4096, 5)   # a free slot with its disk
        assert t.alloc(SMALL) is None                  # only holes left, and no disk
        check_books(t)
        t.free(big, erase=True)
        await t.erased()
        again = await put(t, 200, rng)                 # trims the 16 KiB file, takes a hole
        assert again == NvmeSlot(4096, 2)
        check_books(t)
        assert t.hole_bytes == 2 * STRIDE
        assert t.disk_bytes == 6 * STRIDE
    finally:
        t.close()
    t2 = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    try:
        keys = {h.key for _, h in t2.open()}
        assert key_of(200) in keys and key_of(100) not in keys
        assert {key_of(i) for i in (0, 1, 6, 7, 300)} <= keys
        check_books(t2)
    finally:
        t2.close()


async def test_a_slot_whose_erase_is_still_queued_is_not_punched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot 2 is deleted (its erase queued, held back), 3-5 evicted: the punch for a
    16 KiB block must take 3-5, not the slot with I/O queued (the erase landing after
    the punch would give the hole its disk back behind the books)."""
    rng = random.Random(2)
    t = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    t.open()
    gate = hold_erases(monkeypatch)
    try:
        slots = [await put(t, i, rng) for i in range(N)]
        t.free(slots[2], erase=True)
        for s in slots[3:6]:
            t.free(s)
        assert await t.make_room(BIG)
        assert t._slots.classes[4096].holes == {3, 4, 5}
        gate.set()
        await t.erased()
        check_books(t)
        assert await put(t, 100, rng, BIG) is not None
        check_books(t)
    finally:
        gate.set()
        t.close()
    t2 = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    try:
        keys = {h.key for _, h in t2.open()}
        assert keys == {key_of(i) for i in (0, 1, 6, 7, 100)}
        check_books(t2)
    finally:
        t2.close()


async def test_a_tail_cut_over_punched_slots_counts_only_their_lost_disk(
        tmp_path: Path) -> None:
    """Slots 4-7 evicted, 4-6 punched out for a 16 KiB block. The next small block takes
    hole 4, which needs disk: the tail (5-7) is cut first. Holes 5 and 6 held no disk, so
    the cut gives back one stride, not three, and they leave the hole set with the file."""
    rng = random.Random(3)
    t = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    t.open()
    try:
        slots = [await put(t, i, rng) for i in range(N)]
        for s in slots[4:]:
            t.free(s)
        assert await t.make_room(BIG)
        assert t._slots.classes[4096].holes == {4, 5, 6}
        await put(t, 100, rng, BIG)
        check_books(t)
        assert await put(t, 200, rng) == NvmeSlot(4096, 4)
        check_books(t)
        assert t._slots.classes[4096].high_water == 5 and t.hole_bytes == 0
        assert t.disk_bytes == 5 * STRIDE + PAGE + BIG
    finally:
        t.close()


async def test_a_free_tail_slot_whose_erase_is_queued_is_not_cut(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tail slot is deleted (its erase held back) and two below it evicted: a block
    that needs their disk must wait, since cutting the file under the queued erase lets
    the erase write its page past the new end (a file longer than the books say). Once
    the erase is on disk the cut and the allocation go through."""
    rng = random.Random(4)
    t = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    t.open()
    gate = hold_erases(monkeypatch)
    try:
        slots = [await put(t, i, rng) for i in range(N)]
        t.free(slots[7], erase=True)
        t.free(slots[6])
        t.free(slots[5])
        assert t.alloc(BIG) is None
        gate.set()
        await t.erased()
        check_books(t)
        assert await put(t, 100, rng, BIG) is not None
        check_books(t)
    finally:
        gate.set()
        t.close()


async def test_the_free_slot_taken_instead_of_a_hole_is_one_with_disk(
        tmp_path: Path) -> None:
    """Slots 2 and 4 are holes and 3 is free with its disk; the disk is full. A small
    block refused hole 2 must take slot 3, not any other free slot (hole 4 would be used
    without its disk counted: files past the books, a hole that is busy)."""
    rng = random.Random(5)
    t = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    t.open()
    try:
        slots = [await put(t, i, rng) for i in range(N)]
        t.free(slots[2])
        t.free(slots[4])
        assert await t.make_room(8192)
        assert t._slots.classes[4096].holes == {2, 4}
        await put(t, 100, rng, 8192)
        t.free(slots[3])
        assert await put(t, 200, rng) == NvmeSlot(4096, 3)
        check_books(t)
        assert t.disk_bytes == 6 * STRIDE + PAGE + 8192
    finally:
        t.close()


async def test_concurrent_rooms_punch_only_what_both_need(tmp_path: Path) -> None:
    """Two 16 KiB blocks wait for room at once: the second counts the slots the first's
    punch is already giving back, so five 8 KiB slots are punched (3 + 2), not eight:
    every extra slot punched is an evicted frame lost for nothing."""
    rng = random.Random(6)
    t = NvmeTier(tmp_path / "nvme", 2 * N * STRIDE, direct="off", io_threads=2)
    t.open()
    try:
        slots = [await put(t, i, rng) for i in range(2 * N)]
        for s in slots[2:14]:
            t.free(s)
        assert all(await asyncio.gather(t.make_room(BIG), t.make_room(BIG)))
        assert t.stats_extra()["punched_slots"] == 5
        check_books(t)
        await put(t, 100, rng, BIG)
        await put(t, 101, rng, BIG)
        check_books(t)
    finally:
        t.close()


async def test_erase_free_leaves_a_slot_handed_out_again_alone(tmp_path: Path) -> None:
    """A key's evicted frame is deleted after its slot went to another block: the erase
    of the old frame must not zero the new block's header (it would be lost at the next
    start), and says so (False)."""
    rng = random.Random(7)
    t = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    t.open()
    try:
        old = await put(t, 1, rng)
        t.free(old)                                    # evicted: frame still on disk
        new = await put(t, 2, rng)
        assert new == old
        assert not t.erase_free(old)
        await t.erased()
    finally:
        t.close()
    t2 = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    try:
        assert [(s, h.key) for s, h in t2.open()] == [(new, key_of(2))]
    finally:
        t2.close()


async def test_erase_free_of_a_punched_slot_writes_nothing(tmp_path: Path) -> None:
    """A punched slot's frame is gone with its disk: erasing it again would write a page
    into the hole, taking disk the books say is free."""
    rng = random.Random(8)
    t = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    t.open()
    try:
        slots = [await put(t, i, rng) for i in range(N)]
        for s in slots[2:5]:
            t.free(s)
        assert await t.make_room(BIG)
        path = t.root / "slots-4096.dat"
        before = path.stat().st_blocks
        assert t.erase_free(slots[3])
        await t.erased()
        assert path.stat().st_blocks == before
        check_books(t)
    finally:
        t.close()


@pytest.mark.parametrize("refusal", ["EOPNOTSUPP", "ENOSYS"])
async def test_a_file_system_without_holes_is_not_asked_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str) -> None:
    """Once fallocate says the file system cannot punch (EOPNOTSUPP: tmpfs of old
    kernels, some network file systems; ENOSYS), the tier stops asking: ``disk_short``
    is 0 and ``make_room`` answers False at once, so the store evicts instead of paying
    a failed punch (and an error counted) per allocation."""
    calls = 0

    def unsupported(fd: int, mode: int, offset: int, length: int) -> int:
        nonlocal calls
        calls += 1
        ctypes.set_errno(getattr(errno, refusal))
        return -1

    monkeypatch.setattr(nvme_holes, "_fallocate", unsupported)
    rng = random.Random(9)
    t = NvmeTier(tmp_path / "nvme", N * STRIDE, direct="off", io_threads=2)
    t.open()
    try:
        slots = [await put(t, i, rng) for i in range(N)]
        for s in slots[2:5]:
            t.free(s)
        await t.make_room(BIG)
        assert calls == 1 and t.hole_bytes == 0
        assert t.disk_short(BIG) == 0
        assert not await t.make_room(BIG)
        assert calls == 1 and t.counters.errors == 0
        check_books(t)
    finally:
        t.close()


async def test_a_delete_waits_for_every_erase_even_after_the_list_is_pruned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 65th erase queued (a long chain deleted) prunes the list of erases in
    flight: pruning must drop the finished ones only, or ``erased()`` (what a delete
    awaits before it answers) returns while erases are still queued, and a crash then
    brings deleted blocks back."""
    gate = hold_erases(monkeypatch)
    t = NvmeTier(tmp_path / "nvme", 100 * STRIDE, direct="off", io_threads=2)
    t.open()
    try:
        slots = [t.alloc(SMALL) for _ in range(65)]   # the 65th prunes
        for s in slots:
            assert s is not None
            t.free(s, erase=True)
        waiting = asyncio.ensure_future(t.erased())
        await asyncio.sleep(0.05)
        assert not waiting.done(), "a delete answered before its erase was on disk"
        gate.set()
        await waiting
    finally:
        gate.set()
        t.close()
