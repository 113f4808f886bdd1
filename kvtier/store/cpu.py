"""The cpu residency: the shared-memory arena as the store's working tier.

It owns the cpu fields of each ``BlockMeta`` (``cpu``, ``cpu_state``, ``readers``,
``prefetched``), the cpu eviction policy and the tier's counters. Every block a client
reads is here (read leases pin it); puts land here first. Making room asks the policy for a
victim and hands it to ``on_victim`` (the store wires the demotion path there).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.policy.base import EvictionPolicy, Key
from kvtier.store.alloc import allocate_with_eviction
from kvtier.store.ports import MissLogPort
from kvtier.tiers.arena import Arena
from kvtier.tiers.base import EvictionReason, TierCounters, TierName

__all__ = ["CpuResidency"]


async def _no_eviction(key: Key) -> None:  # until the store wires demotion
    return None


def unknown_block_tokens(meta: BlockMeta) -> int:
    """Tokens per block when no namespace layout is known: 0 (the policy's default)."""
    return 0


@dataclass(slots=True, eq=False)
class CpuResidency:
    """The arena seen as a tier (capacity, occupancy, counters) plus its block state."""

    arena: Arena
    index: BlockIndex
    policy: EvictionPolicy
    name: TierName = TierName.CPU
    counters: TierCounters = field(default_factory=TierCounters)
    resident: int = 0
    on_victim: Callable[[Key], Awaitable[None]] = _no_eviction
    on_drop: Callable[[BlockMeta, EvictionReason], None] | None = None  # hbm inclusion
    # the commit journal, told of blocks made ready (with their checksums when known)
    on_ready: Callable[[Sequence[BlockMeta], Sequence[int | None]], None] | None = None
    explain: MissLogPort | None = None
    # tokens per block of a block's namespace (the store wires its registry): the cost
    # policy prices a block's recompute by its token position, depth x tokens per block
    tokens_of: Callable[[BlockMeta], int] = unknown_block_tokens

    # -- the Tier face ------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return "shm"

    @property
    def capacity_bytes(self) -> int:
        return self.arena.size

    @property
    def used_bytes(self) -> int:
        return self.arena.used_bytes

    @property
    def blocks(self) -> int:
        return self.resident

    @property
    def up(self) -> bool:
        return True

    # -- read locks ---------------------------------------------------------------------
    def pin(self, metas: list[BlockMeta]) -> None:
        """Read-lock ``metas``: they cannot leave the arena until unpinned."""
        for meta in metas:
            meta.readers += 1
            if meta.in_cpu:
                self.policy.set_pinned(meta.key, True)

    def unpin(self, metas: list[BlockMeta]) -> None:
        """Give back read-locks, a chain's tail first (``metas`` head first): the head
        re-enters a recency policy as the most recent block (``touch_chain``'s rule;
        unpinned head first, LRU evicted the head and made its chain unreachable)."""
        for meta in reversed(metas):
            meta.readers -= 1
            if meta.readers == 0 and meta.in_cpu:
                self.policy.set_pinned(meta.key, meta.cpu_pinned)

    def keep(self, meta: BlockMeta, now: float) -> None:
        """An eviction of ``meta`` was given up: it stays, pinned in the policy as long as it
        must not go (put back first when a batch eviction took it out: kvtier.store.alloc)."""
        if not meta.in_cpu:
            return
        if meta.key not in self.policy:
            self._enter_policy(meta, now)
        self.policy.set_pinned(meta.key, meta.cpu_pinned)

    def refresh_pin(self, meta: BlockMeta) -> None:
        """Tell the policy whether ``meta`` may be evicted now (after an nvme write ends)."""
        if meta.in_cpu:
            self.policy.set_pinned(meta.key, meta.cpu_pinned)

    # -- slots --------------------------------------------------------------------------
    def try_alloc(self, nbytes: int) -> int | None:
        """A free arena slot without evicting anything (no await: a put's common case)."""
        return self.arena.alloc(nbytes)

    def try_alloc_many(self, nbytes: int, n: int) -> list[int]:
        """Up to ``n`` free slots without evicting anything (fewer when the arena is full)."""
        return self.arena.alloc_many(nbytes, n) if n else []

    async def alloc(self, nbytes: int, *, batch: int = 1) -> int | None:
        """A free arena slot, evicting by policy when needed (``batch`` victims at a time:
        see ``allocate_with_eviction``); None if nothing can go."""
        off = await allocate_with_eviction(lambda: self.arena.alloc(nbytes), self.policy,
                                           self.on_victim, batch=batch)
        if off is None:
            self.counters.allocation_failures += 1
        return off

    def ready(self, meta: BlockMeta, now: float, checksum: int | None = None) -> None:
        """A slot's bytes are complete: make it readable and evictable (unless in use), and
        journal it (``checksum``: its payload's xxh3-64 when known, else hashed off-loop)."""
        self.ready_many((meta,), now, (checksum,))

    def ready_many(self, metas: Sequence[BlockMeta], now: float,
                   checksums: Sequence[int | None]) -> None:
        """``ready`` of each block (``checksums`` as long as ``metas``), journaled at once."""
        for meta in metas:
            meta.set_cpu_state(SlotState.READY)
        if self.on_ready is not None:
            self.on_ready(metas, checksums)
        self.resident += len(metas)
        for meta in reversed(metas):   # a chain tail first, its head the most recent
            self._enter_policy(meta, now)
            if meta.cpu_pinned:
                self.policy.set_pinned(meta.key, True)

    def _enter_policy(self, meta: BlockMeta, now: float) -> None:
        self.policy.insert(meta.key, nbytes=meta.nbytes, parent=meta.parent,
                           depth=meta.depth, now=now, block_tokens=self.tokens_of(meta))

    def drop(self, meta: BlockMeta, reason: EvictionReason = EvictionReason.CAPACITY) -> None:
        """Free the arena slot; an hbm copy goes with it (hbm is inclusive of cpu)."""
        if meta.cpu is None:
            return
        if self.on_drop is not None:
            self.on_drop(meta, reason)
        was_ready = meta.in_cpu
        self.arena.free(meta.cpu)
        meta.cpu = None
        meta.set_cpu_state(SlotState.NONE)
        meta.prefetched = False
        if was_ready:
            self.resident -= 1
        self.policy.remove(meta.key)
        if self.explain is not None:
            self.explain.removed(meta.key, reason.value, "cpu")
