"""The nvme residency: which blocks have a frame on nvme, and which one leaves next.

It owns the nvme fields of each ``BlockMeta`` (``nvme``, ``nvme_ready``, ``nvme_busy`` is
shared with the transfers that hold the slot) and the nvme eviction policy. Making room asks
the policy for a victim and hands it to ``on_victim`` (the store wires demotion to Redis
there). The bytes are moved by ``kvtier.store.transfers``; the tier itself (slot files,
frame I/O, health) is ``kvtier.tiers.nvme``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvtier.index import BlockMeta
from kvtier.policy.base import EvictionPolicy, Key
from kvtier.store.alloc import allocate_with_eviction
from kvtier.store.cpu import unknown_block_tokens
from kvtier.store.ports import MissLogPort, NvmePort
from kvtier.tiers.base import EvictionReason
from kvtier.tiers.nvme import NvmeSlot

__all__ = ["NvmeResidency"]


async def _no_eviction(key: Key) -> None:  # until the store wires demotion
    return None


@dataclass(slots=True, eq=False)
class NvmeResidency:
    tier: NvmePort
    policy: EvictionPolicy
    on_victim: Callable[[Key], Awaitable[None]] = _no_eviction
    explain: MissLogPort | None = None
    tokens_of: Callable[[BlockMeta], int] = unknown_block_tokens   # the store wires it

    async def alloc(self, nbytes: int) -> NvmeSlot | None:
        """A reserved slot, evicting by policy when needed (the tier counts failures)."""
        return await allocate_with_eviction(lambda: self.tier.alloc(nbytes), self.policy,
                                            self.on_victim)

    def stored(self, meta: BlockMeta, slot: NvmeSlot, now: float) -> None:
        """``slot`` now holds ``meta``'s complete frame."""
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
        self.tier.free(meta.nvme, erase=erase or reason is EvictionReason.CORRUPT)
        meta.nvme = None
        meta.nvme_ready = False
        self.policy.remove(meta.key)
        self.tier.counters.evicted(reason)
        if self.explain is not None:
            self.explain.removed(meta.key, reason.value, "nvme")
