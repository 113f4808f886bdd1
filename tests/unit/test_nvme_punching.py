"""The nvme tier's room for a new size class, taken by punching free slots out of other
classes' files (kvtier.tiers.nvme.holes) in the I/O pool: concurrent allocations share a
punch instead of evicting, a failed punch falls back to evicting, a delete's erase during
a punch is not lost, and a cancelled caller does not strand the slots being punched.
(Each case was found by a reviewer of the first version.)"""

from __future__ import annotations

import asyncio
import errno
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.frame import make_header
from kvtier.policy.base import Key
from kvtier.policy.lru import LRUPolicy
from kvtier.store.nvme import NvmeResidency
from kvtier.tiers.aligned import aligned_buffer
from kvtier.tiers.nvme import PAGE, NvmeSlot, NvmeTier
from kvtier.tiers.nvme import holes as nvme_holes

NS = bytes(range(16))
LAYOUT = 0x1234_5678
SMALL, BIG = 4000, 64 * 1024
N = 64


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Full:
    """A tier full of 4 KiB frames, each in an LRU policy, with slots 10..29 freed (one
    run of 20; ``freed`` others): room in ``used`` for two 64 KiB slots (by default), none
    on disk without a punch."""

    def __init__(self, root: Path, n: int = N, freed: range = range(10, 30)) -> None:
        self.n, self.freed = n, freed
        self.tier = NvmeTier(root, n * (PAGE + 4096), direct="off", io_threads=2)
        self.policy = LRUPolicy()
        self.slots: dict[Key, NvmeSlot] = {}     # by key_of(i), the policy's keys
        self.evicted: list[Key] = []

    async def fill(self) -> NvmeResidency:
        self.tier.open()
        rng = random.Random(1)
        for i in range(self.n):
            slot = self.tier.alloc(SMALL)
            assert slot is not None
            buf = aligned_buffer(NvmeTier.slot_bytes_for(SMALL))
            buf[:SMALL] = rng.randbytes(SMALL)
            await self.tier.write(slot, make_header(NS, key_of(i), LAYOUT, buf[:SMALL],
                                                    seq=self.tier.next_seq()), buf)
            self.slots[key_of(i)] = slot
            self.policy.insert(key_of(i), nbytes=SMALL, parent=None, depth=0, now=float(i))
        for i in self.freed:
            self.tier.free(self.slots.pop(key_of(i)))
            self.policy.remove(key_of(i))

        async def on_victim(key: Key) -> None:
            self.tier.free(self.slots.pop(key))
            self.policy.remove(key)
            self.evicted.append(key)

        return NvmeResidency(self.tier, self.policy, on_victim)


@pytest.fixture
def full(tmp_path: Path) -> Iterator[Full]:
    f = Full(tmp_path / "nvme")
    yield f
    f.tier.close()


async def test_concurrent_allocations_share_a_punch_and_evict_nothing(full: Full) -> None:
    res = await full.fill()
    a, b = await asyncio.gather(res.alloc(BIG), res.alloc(BIG))
    assert a is not None and b is not None and a != b
    assert full.evicted == []          # the second evicted every block while the first's
    assert full.tier.disk_bytes <= full.tier.capacity_bytes      # punch ran
    assert full.tier.counters.allocation_failures == 0


async def test_a_batch_of_concurrent_allocations_shares_the_punches(tmp_path: Path) -> None:
    """Room was made for one waiting allocation at a time: the 8th of a batch (cpu
    evictions go 16 at a time) ran out of rounds, failed with room made, or evicted
    every block."""
    full = Full(tmp_path / "nvme", n=400, freed=range(100, 300))
    try:
        res = await full.fill()
        slots = await asyncio.gather(*(res.alloc(BIG) for _ in range(16)))
        assert None not in slots and len(set(slots)) == 16
        assert full.evicted == [] and full.tier.counters.allocation_failures == 0
        assert full.tier.disk_bytes <= full.tier.capacity_bytes
    finally:
        full.tier.close()


async def test_a_free_slot_with_its_disk_is_taken_before_a_hole(full: Full) -> None:
    """After a partial punch the lowest free slots are holes: a small slot was refused
    (and cost a punch or an eviction) though higher free slots still had their disk."""
    await full.fill()
    assert await full.tier.make_room(BIG)                # punches slots 10.. (9 of them)
    assert full.tier.alloc(BIG) is not None              # ... and takes that disk
    assert full.tier.disk_bytes + PAGE + 4096 > full.tier.capacity_bytes
    slot = full.tier.alloc(SMALL)                        # no disk for a hole: a whole slot
    assert slot is not None and slot.index >= 19


async def test_a_delete_answers_only_after_the_punch_of_its_slot(
        full: Full, monkeypatch: pytest.MonkeyPatch) -> None:
    """``erased()`` (what a delete awaits before it answers) did not wait for a punch
    in flight that was to remove the frame: a crash then brought the block back."""
    await full.fill()
    tier = full.tier
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()
    real = nvme_holes.punch_hole

    def gated(fd: int, offset: int, length: int) -> None:
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
        real(fd, offset, length)

    monkeypatch.setattr(nvme_holes, "punch_hole", gated)
    room = asyncio.ensure_future(tier.make_room(BIG))
    await asyncio.sleep(0.05)
    assert tier.erase_free(NvmeSlot(4096, 10))
    answered = asyncio.ensure_future(tier.erased())
    await asyncio.sleep(0.1)
    assert not answered.done()                           # the punch is not over yet
    gate.set()
    await answered
    assert await room


async def test_a_punch_that_fails_falls_back_to_evicting(
        full: Full, monkeypatch: pytest.MonkeyPatch) -> None:
    res = await full.fill()
    for err in (errno.EIO, errno.EOPNOTSUPP):   # (the second turns punching off for good)
        monkeypatch.setattr(nvme_holes, "punch_hole", _failing(err))
        slot = await res.alloc(BIG)          # an UnboundLocalError escaped here before
        assert slot is not None
        full.tier.free(slot)
    assert full.evicted                      # room made the old way
    assert full.tier.counters.allocation_failures == 0


def _failing(err: int) -> object:
    def punch(fd: int, offset: int, length: int) -> None:
        cls = nvme_holes.HolesUnsupported if err == errno.EOPNOTSUPP else OSError
        raise cls(err, "refused")
    return punch


async def test_a_delete_during_a_punch_still_erases_when_the_punch_fails(
        full: Full, monkeypatch: pytest.MonkeyPatch) -> None:
    """A free slot being punched is in no list: an erase queued then raced the punch (a
    page written back into a hole); now it waits for the punch's outcome."""
    await full.fill()
    tier = full.tier
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()
    real = nvme_holes.punch_hole

    def slow_failing(fd: int, offset: int, length: int) -> None:
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
        raise OSError(errno.EIO, "refused")

    monkeypatch.setattr(nvme_holes, "punch_hole", slow_failing)
    room = asyncio.ensure_future(tier.make_room(BIG))
    await asyncio.sleep(0.05)
    freed = NvmeSlot(4096, 10)                          # in the run being punched
    assert tier.erase_free(freed)                       # a delete of its evicted frame
    gate.set()
    assert await room
    monkeypatch.setattr(nvme_holes, "punch_hole", real)
    await tier.erased()                                 # the erase ran after the punch
    with open(tier.root / "slots-4096.dat", "rb") as f:
        f.seek(freed.offset)
        assert not f.read(PAGE).strip(b"\0")           # the frame is gone all the same


async def test_a_cancelled_caller_does_not_strand_the_slots_being_punched(
        full: Full) -> None:
    await full.fill()
    tier = full.tier
    room = asyncio.ensure_future(tier.make_room(BIG))
    await asyncio.sleep(0)
    room.cancel()
    with pytest.raises(asyncio.CancelledError):
        await room
    while tier._reclaim._punches:                               # the punch itself went on
        await asyncio.sleep(0.01)
    assert tier.alloc(BIG) is not None                 # its room is there, no slot lost
    assert tier.stats_extra()["punched_slots"] > 0


async def test_two_deletes_behind_a_punch_each_wait_for_their_own_erase(
        full: Full, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both waited for the punch; the first to wake took every queued erase, the second
    found none and answered with its erase not yet on disk (found by review)."""
    import threading

    from kvtier.tiers.nvme import reclaim as reclaim_module

    await full.fill()
    tier = full.tier
    punch_gate, erase_gate = threading.Event(), threading.Event()
    real_punch, real_erase = nvme_holes.punch_hole, reclaim_module._erase_sync

    def gated_punch(fd: int, offset: int, length: int) -> None:
        punch_gate.wait(10)
        real_punch(fd, offset, length)

    def gated_erase(fd: int, offset: int, prev: object) -> int:
        erase_gate.wait(10)
        return real_erase(fd, offset, prev)  # type: ignore[arg-type]

    monkeypatch.setattr(nvme_holes, "punch_hole", gated_punch)
    monkeypatch.setattr(reclaim_module, "_erase_sync", gated_erase)
    room = asyncio.ensure_future(tier.make_room(BIG))
    await asyncio.sleep(0.05)
    tier.free(full.slots.pop(key_of(40)), erase=True)
    first = asyncio.ensure_future(tier.erased())
    await asyncio.sleep(0.01)
    tier.free(full.slots.pop(key_of(41)), erase=True)
    second = asyncio.ensure_future(tier.erased())
    await asyncio.sleep(0.05)
    punch_gate.set()
    await asyncio.sleep(0.2)
    assert not first.done() and not second.done()   # the erases are not on disk yet
    erase_gate.set()
    await first
    await second
    assert await room
