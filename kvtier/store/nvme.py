"""The nvme residency: which blocks have a frame on nvme, and which one leaves next.

It owns the nvme fields of each ``BlockMeta`` (``nvme``, ``nvme_ready``, ``nvme_busy`` is
shared with the transfers that hold the slot) and the nvme eviction policy. Making room asks
the policy for a victim and hands it to ``on_victim`` (the store wires demotion to Redis
there). The bytes are moved by ``kvtier.store.transfers``; the tier itself (slot files,
frame I/O, health) is ``kvtier.tiers.nvme``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvtier.index import BlockMeta
from kvtier.policy.base import EvictionPolicy, Key
from kvtier.store.alloc import allocate_with_eviction
from kvtier.store.cpu import unknown_block_tokens
from kvtier.store.ports import MissLogPort, NvmePort
from kvtier.tiers.base import EvictionReason
from kvtier.tiers.nvme import NvmeSlot

__all__ = ["EvictedFrames", "NvmeResidency"]


async def _no_eviction(key: Key) -> None:  # until the store wires demotion
    return None


@dataclass(slots=True)
class EvictedFrames:
    """Frames evicted from nvme and left on disk, by key, until a new frame is stored in
    their slot (a slot handed out whose write then fails may still hold the old frame).
    Eviction does not erase (the bytes are right, and it would cost a write per eviction);
    a delete of the key erases them, else a restart would adopt a deleted block. At most
    one entry per slot: a slot evicted again names its newest frame only."""

    by_slot: dict[NvmeSlot, tuple[Key, bytes]] = field(default_factory=dict)
    by_key: dict[Key, list[NvmeSlot]] = field(default_factory=dict)

    def add(self, slot: NvmeSlot, key: Key, namespace: bytes) -> None:
        self.forget(slot)
        self.by_slot[slot] = (key, namespace)
        self.by_key.setdefault(key, []).append(slot)

    def forget(self, slot: NvmeSlot) -> None:
        """``slot`` holds no evicted frame any more (another frame stored, or erased)."""
        entry = self.by_slot.pop(slot, None)
        if entry is None:
            return
        slots = self.by_key[entry[0]]
        slots.remove(slot)
        if not slots:
            del self.by_key[entry[0]]

    def of(self, key: Key, namespace: bytes) -> list[NvmeSlot]:
        """The slots holding ``key``'s evicted frames under ``namespace``."""
        return [s for s in self.by_key.get(key, ()) if self.by_slot[s][1] == namespace]


MAX_PUNCH_ROUNDS = 8   # rounds of punching for one slot (others may take the room meanwhile)


class _DiskShort(Exception):
    """An allocation whose room lies in free slots of other files (punch, do not evict)."""


@dataclass(slots=True, eq=False)
class NvmeResidency:
    tier: NvmePort
    policy: EvictionPolicy
    on_victim: Callable[[Key], Awaitable[None]] = _no_eviction
    explain: MissLogPort | None = None
    tokens_of: Callable[[BlockMeta], int] = unknown_block_tokens   # the store wires it
    evicted: EvictedFrames = field(default_factory=EvictedFrames)

    async def alloc(self, nbytes: int) -> NvmeSlot | None:
        """A reserved slot, evicting by policy when needed; None (counted as an allocation
        failure) when nothing can go. A full tier that evicts to make room is a cache's
        normal state, not a failure: the alert on failures must not fire for it."""
        tier = self.tier

        def attempt() -> NvmeSlot | None:
            slot = tier.alloc(nbytes)
            if slot is None and tier.disk_short(nbytes):
                raise _DiskShort   # the room is in free slots: punch them, evict nothing
            return slot

        slot: NvmeSlot | None = None
        for _ in range(MAX_PUNCH_ROUNDS):
            try:
                slot = await allocate_with_eviction(attempt, self.policy, self.on_victim)
                break
            except _DiskShort:
                if not await tier.make_room(nbytes):
                    break
        else:   # the last round made room: take it
            slot = tier.alloc(nbytes)
        if slot is None and tier.disk_short(nbytes):   # punching could not: evict for it
            slot = await allocate_with_eviction(lambda: tier.alloc(nbytes), self.policy,
                                                self.on_victim)
        if slot is None:
            tier.counters.allocation_failures += 1
        return slot

    def erase_evicted(self, key: Key, namespace: bytes) -> int:
        """Erase the frames ``key`` left on disk under ``namespace`` when it was evicted
        (a delete: none of them may come back at a restart); how many were queued. A slot
        handed out again meanwhile stays named: its new frame's write may yet fail."""
        queued = 0
        for slot in self.evicted.of(key, namespace):
            if self.tier.erase_free(slot):
                self.evicted.forget(slot)
                queued += 1
        return queued

    def unbusy(self, meta: BlockMeta) -> None:
        """A disk operation on ``meta``'s frame is over: it may be evicted again (an
        eviction that met it busy pinned it in the policy, which nothing undid: the block
        then stayed on nvme for good)."""
        meta.nvme_busy = False
        if meta.in_nvme and meta.key in self.policy:
            self.policy.set_pinned(meta.key, False)

    def stored(self, meta: BlockMeta, slot: NvmeSlot, now: float) -> None:
        """``slot`` now holds ``meta``'s complete frame."""
        self.evicted.forget(slot)
        meta.nvme = slot
        meta.nvme_ready = True
        self.policy.insert(meta.key, nbytes=meta.nbytes, parent=meta.parent,
                           depth=meta.depth, now=now, block_tokens=self.tokens_of(meta))

    def drop(self, meta: BlockMeta, reason: EvictionReason, *, erase: bool = False) -> None:
        """Free ``meta``'s frame. ``erase`` (a frame dropped for good: deleted, orphaned) also
        zeroes its header, off the event loop, so it does not come back after a restart; a
        corrupt frame is always erased (else every start would index it again)."""
        if meta.nvme is None:
            return
        erase = erase or reason is EvictionReason.CORRUPT
        self.tier.free(meta.nvme, erase=erase)
        if not erase:
            self.evicted.add(meta.nvme, meta.key, meta.namespace)
        meta.nvme = None
        meta.nvme_ready = False
        self.policy.remove(meta.key)
        self.tier.counters.evicted(reason)
        if self.explain is not None:
            self.explain.removed(meta.key, reason.value, "nvme")
