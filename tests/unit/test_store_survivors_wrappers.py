"""The store's tier wrappers (kvtier.store.cpu.CpuResidency, kvtier.store.nvme), the
behaviour no other test pinned (mutation review): read locks and in-flight nvme work keep a
block out of the eviction order, a chain's head stays the most recent, a dropped block
gives its slot and its policy entry back and says so, and an nvme drop remembers, erases
and counts exactly as its reason asks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.policy.base import make_eviction_policy
from kvtier.store.cpu import CpuResidency
from kvtier.store.nvme import EvictedFrames, NvmeResidency
from kvtier.tiers.base import EvictionReason, TierCounters
from kvtier.tiers.nvme import NvmeSlot
from tests.support.arena import temp_arena

BLOCK = 4096
NS = b"n" * 16


@pytest.fixture
def cpu() -> Iterator[CpuResidency]:
    with temp_arena(4 * BLOCK, BLOCK) as arena:
        yield CpuResidency(arena, BlockIndex(), make_eviction_policy("lru"))


def loaded(cpu: CpuResidency, key: bytes, parent: bytes | None = None,
           depth: int = 0) -> BlockMeta:
    """A block whose arena slot is taken and being filled (not ready yet)."""
    off = cpu.try_alloc(BLOCK)
    assert off is not None
    meta = BlockMeta(key, NS, 1, BLOCK, parent, depth, cpu=off)
    meta.set_cpu_state(SlotState.LOADING)
    return meta


class MissLog:
    """Records ``removed`` (the rest of MissLogPort is not called by the wrappers)."""

    def __init__(self) -> None:
        self.removed_: list[tuple[bytes, str, str]] = []

    def removed(self, key: bytes, reason: str, tier: str) -> None:
        self.removed_.append((key, reason, tier))

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"unexpected MissLog.{name}")


def test_a_read_lock_keeps_a_block_out_of_the_eviction_order(cpu: CpuResidency) -> None:
    """Pinned, a ready block is no victim until its last reader unpins it (else a read in
    flight would copy from a slot the next put reuses)."""
    meta = loaded(cpu, b"a")
    cpu.ready(meta, 1.0)
    cpu.pin([meta])
    cpu.pin([meta])
    assert cpu.policy.victim() is None
    cpu.unpin([meta])
    assert cpu.policy.victim() is None
    cpu.unpin([meta])
    assert cpu.policy.victim() == b"a"


def test_unpinning_keeps_a_block_busy_on_nvme_pinned(cpu: CpuResidency) -> None:
    """The last reader leaving a block whose nvme write is in flight leaves it pinned (the
    write reads the arena slot); ``refresh_pin`` frees it once the write ends."""
    meta = loaded(cpu, b"a")
    cpu.ready(meta, 1.0)
    meta.nvme_busy = True
    cpu.pin([meta])
    cpu.unpin([meta])
    assert cpu.policy.victim() is None
    meta.nvme_busy = False
    cpu.refresh_pin(meta)
    assert cpu.policy.victim() == b"a"


def test_a_chain_unpinned_or_made_ready_leaves_its_head_the_most_recent(
        cpu: CpuResidency) -> None:
    """Head first in ``metas``, tail first into the order: LRU evicts the tail before the
    head (the head evicted first makes the whole chain unreachable)."""
    head, tail = loaded(cpu, b"h"), loaded(cpu, b"t", b"h", 1)
    cpu.ready_many([head, tail], 1.0, [None, None])
    assert cpu.policy.victim() == b"t"
    cpu.pin([head, tail])
    cpu.unpin([head, tail])
    assert cpu.policy.victim() == b"t"


def test_ready_blocks_are_counted_journaled_and_pinned_while_read(cpu: CpuResidency) -> None:
    """``ready_many`` counts every block resident, hands the journal the blocks with their
    checksums, and keeps a block already leased by a reader out of the eviction order."""
    journaled: list[tuple[list[bytes], list[int | None]]] = []

    def on_ready(metas: Sequence[BlockMeta], sums: Sequence[int | None]) -> None:
        journaled.append(([m.key for m in metas], list(sums)))

    cpu.on_ready = on_ready
    a, b, c = loaded(cpu, b"a"), loaded(cpu, b"b"), loaded(cpu, b"c")
    c.readers = 1
    cpu.ready_many([a, b, c], 1.0, [11, None, 13])
    assert cpu.resident == cpu.blocks == 3
    assert journaled == [([b"a", b"b", b"c"], [11, None, 13])]
    victims = []
    while (v := cpu.policy.victim()) is not None:
        victims.append(v)
        cpu.policy.remove(v)
    assert b"c" not in victims and len(victims) == 2


def test_keep_puts_back_a_block_a_batch_eviction_took_out(cpu: CpuResidency) -> None:
    """A given-up eviction returns the block to the policy: left out, it could never be
    evicted again and its slot stayed taken for good."""
    meta = loaded(cpu, b"a")
    cpu.ready(meta, 1.0)
    cpu.policy.remove(b"a")
    cpu.keep(meta, 2.0)
    assert b"a" in cpu.policy and cpu.policy.victim() == b"a"


def test_a_drop_frees_the_slot_and_says_so(cpu: CpuResidency) -> None:
    """A ready block dropped: slot free, not resident, out of the policy, not prefetched,
    the hbm copy told (inclusion) and the miss log told why."""
    dropped: list[tuple[bytes, EvictionReason]] = []
    log = MissLog()
    cpu.on_drop = lambda m, why: dropped.append((m.key, why))
    cpu.explain = log
    meta = loaded(cpu, b"a")
    cpu.ready(meta, 1.0)
    meta.prefetched = True
    assert cpu.used_bytes == BLOCK
    cpu.drop(meta, EvictionReason.CORRUPT)
    assert cpu.used_bytes == 0 and cpu.resident == 0
    assert meta.cpu is None and meta.cpu_state is SlotState.NONE and not meta.prefetched
    assert b"a" not in cpu.policy
    assert dropped == [(b"a", EvictionReason.CORRUPT)]
    assert log.removed_ == [(b"a", EvictionReason.CORRUPT.value, "cpu")]


def test_a_drop_of_a_block_still_loading_leaves_the_resident_count(cpu: CpuResidency) -> None:
    """A load given up was never counted resident: its drop must not count it out (the
    count would drift below the blocks actually there)."""
    ready = loaded(cpu, b"a")
    cpu.ready(ready, 1.0)
    loading = loaded(cpu, b"b")
    cpu.drop(loading)
    assert cpu.resident == 1 and cpu.used_bytes == BLOCK


async def test_an_allocation_nothing_can_make_room_for_is_counted(cpu: CpuResidency) -> None:
    """A full arena whose blocks are all pinned: None, and one allocation failure."""
    metas = [loaded(cpu, bytes([i])) for i in range(4)]
    cpu.ready_many(metas, 1.0, [None] * 4)
    cpu.pin(metas)
    assert await cpu.alloc(BLOCK) is None
    assert cpu.counters.allocation_failures == 1


# --- nvme --------------------------------------------------------------------------------

class FakeNvme:
    """The NvmePort calls the residency makes, recorded."""

    def __init__(self) -> None:
        self.counters = TierCounters()
        self.freed: list[tuple[NvmeSlot, bool]] = []
        self.erasable: set[NvmeSlot] = set()
        self.erased: list[NvmeSlot] = []

    def free(self, slot: NvmeSlot, *, erase: bool = False) -> None:
        self.freed.append((slot, erase))

    def erase_free(self, slot: NvmeSlot) -> bool:
        if slot in self.erasable:
            self.erased.append(slot)
            return True
        return False


def nvme_meta(key: bytes, slot: NvmeSlot, namespace: bytes = NS) -> BlockMeta:
    meta = BlockMeta(key, namespace, 1, BLOCK, None, 0)
    meta.nvme, meta.nvme_ready = slot, True
    return meta


def residency() -> tuple[NvmeResidency, FakeNvme]:
    tier = FakeNvme()
    return NvmeResidency(tier, make_eviction_policy("lru")), tier  # type: ignore[arg-type]


@pytest.mark.parametrize(("reason", "erase", "erased"), [
    (EvictionReason.CAPACITY, False, False),
    (EvictionReason.CAPACITY, True, True),
    (EvictionReason.CORRUPT, False, True),
])
def test_an_nvme_drop_erases_and_remembers_as_its_reason_asks(
        reason: EvictionReason, erase: bool, erased: bool) -> None:
    """Evicted: freed unerased and remembered (a later delete erases it); dropped for good
    or corrupt: erased, not remembered. Either way out of the policy, not on nvme, counted
    and told to the miss log."""
    res, tier = residency()
    log = MissLog()
    res.explain = log
    slot = NvmeSlot(BLOCK, 3)
    meta = nvme_meta(b"k", slot)
    res.stored(meta, slot, 1.0)
    res.drop(meta, reason, erase=erase)
    assert tier.freed == [(slot, erased)]
    assert res.evicted.of(b"k", NS) == ([] if erased else [slot])
    assert meta.nvme is None and not meta.nvme_ready and not meta.in_nvme
    assert b"k" not in res.policy
    assert tier.counters.evictions == {reason.value: 1}
    assert log.removed_ == [(b"k", reason.value, "nvme")]


def test_a_slot_stored_again_no_longer_names_its_evicted_frame() -> None:
    """``stored`` forgets the evicted frame its slot held: a later delete of the old key
    must not erase the new block's frame."""
    res, tier = residency()
    slot = NvmeSlot(BLOCK, 0)
    old = nvme_meta(b"old", slot)
    res.stored(old, slot, 1.0)
    res.drop(old, EvictionReason.CAPACITY)
    res.stored(nvme_meta(b"new", slot), slot, 2.0)
    tier.erasable.add(slot)
    assert res.erase_evicted(b"old", NS) == 0 and tier.erased == []


def test_erase_evicted_keeps_naming_a_slot_it_could_not_erase() -> None:
    """A slot handed out again (erase_free refused) stays named: its new frame's write may
    still fail and leave the deleted frame to be adopted at a restart."""
    res, tier = residency()
    a, b = NvmeSlot(BLOCK, 0), NvmeSlot(BLOCK, 1)
    res.evicted.add(a, b"k", NS)
    res.evicted.add(b, b"k", NS)
    tier.erasable.add(a)
    assert res.erase_evicted(b"k", NS) == 1
    assert tier.erased == [a] and res.evicted.of(b"k", NS) == [b]


def test_unbusy_lets_a_block_pinned_while_busy_be_evicted() -> None:
    """An eviction that met the frame busy pinned it; ``unbusy`` clears both."""
    res, _ = residency()
    slot = NvmeSlot(BLOCK, 0)
    meta = nvme_meta(b"k", slot)
    res.stored(meta, slot, 1.0)
    meta.nvme_busy = True
    res.policy.set_pinned(b"k", True)
    assert res.policy.victim() is None
    res.unbusy(meta)
    assert not meta.nvme_busy and res.policy.victim() == b"k"


def test_forgotten_frames_leave_no_empty_key_behind() -> None:
    """A key's last evicted frame forgotten drops the key (else one list per deleted key
    stays in memory for the daemon's life)."""
    frames = EvictedFrames()
    frames.add(NvmeSlot(BLOCK, 0), b"k", NS)
    frames.forget(NvmeSlot(BLOCK, 0))
    assert frames.by_key == {} and frames.by_slot == {}


class ShortDisk(FakeNvme):
    """A tier whose room is in other files' free slots: ``alloc`` fails until ``room_at``
    calls, ``disk_short`` holds for its first ``short_for`` calls, ``make_room`` answers
    ``punches``."""

    def __init__(self, room_at: int, short_for: int, punches: bool) -> None:
        super().__init__()
        self.room_at, self.short_for, self.punches = room_at, short_for, punches
        self.allocs = self.shorts = self.punched = 0

    def alloc(self, nbytes: int) -> NvmeSlot | None:
        self.allocs += 1
        return NvmeSlot(BLOCK, 7) if self.allocs >= self.room_at else None

    def disk_short(self, nbytes: int) -> bool:
        self.shorts += 1
        return self.shorts <= self.short_for

    async def make_room(self, nbytes: int) -> bool:
        self.punched += 1
        return self.punches


async def test_a_punch_that_makes_no_room_is_not_retried() -> None:
    """``make_room`` False: punching stops at once and eviction makes the room (seven more
    futile punches each cost a pass over the files in the I/O pool)."""
    tier = ShortDisk(room_at=10**9, short_for=10**9, punches=False)
    res = NvmeResidency(tier, make_eviction_policy("lru"))  # type: ignore[arg-type]
    assert await res.alloc(BLOCK) is None
    assert tier.punched == 1
    assert tier.counters.allocation_failures == 1


async def test_the_room_the_last_punch_made_is_taken() -> None:
    """Every round punched room another allocation took; after the last one the slot is
    taken without asking whether the disk is still short (no longer, once punched)."""
    tier = ShortDisk(room_at=9, short_for=8, punches=True)
    res = NvmeResidency(tier, make_eviction_policy("lru"))  # type: ignore[arg-type]
    assert await res.alloc(BLOCK) == NvmeSlot(BLOCK, 7)
    assert tier.punched == 8 and tier.counters.allocation_failures == 0
