"""Demotion: a cpu victim goes to nvme (if admitted), an nvme victim to Redis (if admitted);
without an nvme tier a cpu victim goes to Redis (if admitted).

The store wires ``evict_cpu`` and ``evict_nvme`` as the residencies' ``on_victim``, so
making room in a tier walks the chain cpu -> nvme -> redis. ``persist`` is the cpu -> nvme
write that durable commits, drains and cpu demotion share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.index import BlockMeta, SlotState
from kvtier.policy.base import AdmissionPolicy, Key
from kvtier.store.blocks import Blocks
from kvtier.store.cpu import CpuResidency
from kvtier.store.nvme import NvmeResidency
from kvtier.store.ports import MissLogPort, RedisPort
from kvtier.store.stats import PrefetchCounters
from kvtier.store.transfers import Transfer, Transfers
from kvtier.tiers.base import EvictionReason, TierName

__all__ = ["Demoter"]


@dataclass(slots=True, eq=False)
class Demoter:
    blocks: Blocks
    cpu: CpuResidency
    nvme: NvmeResidency | None
    redis: RedisPort | None
    transfers: Transfers
    prefetch: PrefetchCounters
    clock: Callable[[], float]
    admission: AdmissionPolicy | None = None
    redis_write_through: bool = False
    explain: MissLogPort | None = None

    def admit(self, meta: BlockMeta, tier: TierName) -> bool:
        if self.admission is None:
            return True
        ok = bool(self.admission.admit(meta.key, tier=tier.value, nbytes=meta.nbytes,
                                       now=self.clock()))
        if not ok and self.explain is not None:
            self.explain.refused(meta.key, tier.value)
        return ok

    async def evict_cpu(self, key: Key) -> None:
        """Make ``key`` leave the arena, writing it to nvme first when admitted."""
        meta = self.blocks.index.get(key)  # type: ignore[call-overload]
        if meta is None or not meta.in_cpu:
            self.cpu.policy.remove(key)
            return
        if meta.cpu_pinned:  # the policy should not offer it; keep it out of its queue
            self.cpu.keep(meta, self.clock())
            return
        if not meta.in_nvme and self.nvme is not None and self.admit(meta, TierName.NVME):
            try:
                await self.persist(meta)
            except BaseException:
                # a batch eviction took it out of the policy: back in, or it could never
                # leave the arena again
                self.cpu.keep(meta, self.clock())
                raise
        elif (self.nvme is None and meta.cpu_state is SlotState.READY and not meta.readers
              and self._to_redis(meta)):
            # no nvme tier (``nvme.bytes = 0``): the next tier down is Redis; a copy is
            # queued, so the slot is free now (the victims of a node without nvme were
            # dropped, and its kv_both engines shared nothing through Redis: found by review)
            await self.transfers.move(TierName.CPU, TierName.REDIS, Transfer([meta], copy=True))
        if meta.readers or meta.cpu_state is not SlotState.READY:
            self.cpu.keep(meta, self.clock())
            return  # re-pinned while we were writing
        if meta.prefetched:
            self.prefetch.wasted += 1
        self.cpu.drop(meta)
        self.cpu.counters.evicted(EvictionReason.CAPACITY)
        self.blocks.forget_if_gone(meta)

    async def evict_nvme(self, key: Key) -> None:
        """Make ``key`` leave nvme, handing it to Redis first when admitted."""
        assert self.nvme is not None
        meta = self.blocks.index.get(key)  # type: ignore[call-overload]
        if meta is None or not meta.in_nvme:
            self.nvme.policy.remove(key)
            return
        if meta.nvme_busy:
            self.nvme.policy.set_pinned(key, True)
            return
        if self._to_redis(meta):
            await self.transfers.move(TierName.NVME, TierName.REDIS, Transfer([meta]))
        if meta.nvme_busy or not meta.in_nvme:
            return
        self.nvme.drop(meta, EvictionReason.CAPACITY)
        self.blocks.forget_if_gone(meta)

    def _to_redis(self, meta: BlockMeta) -> bool:
        """Whether a block leaving this node's last local tier goes to Redis: not when
        every commit is written through already, nor when admission refuses it."""
        return (self.redis is not None and self.redis.up and not self.redis_write_through
                and self.admit(meta, TierName.REDIS))

    async def persist(self, meta: BlockMeta, *, sync: bool = False) -> bool:
        """Write the arena copy of ``meta`` to nvme as a frame; True when it is there."""
        nvme = self.nvme
        assert nvme is not None
        if meta.in_nvme:
            return True
        if meta.nvme_busy or not meta.in_cpu:
            return False
        if nvme.tier.degraded:  # full disk: refused before allocating, which would evict
            nvme.tier.refuse_write()
            return False
        meta.nvme_busy = True
        self.cpu.policy.set_pinned(meta.key, True)
        try:
            slot = await nvme.alloc(meta.nbytes)
            if slot is None or not meta.in_cpu:
                if slot is not None:
                    nvme.tier.free(slot)
                return False
            done = await self.transfers.move(TierName.CPU, TierName.NVME,
                                             Transfer([meta], slot=slot, sync=sync))
            if not done.moved:
                nvme.tier.free(slot)
                return False
            nvme.stored(meta, slot, self.clock())
            return True
        finally:
            nvme.unbusy(meta)
            self.cpu.refresh_pin(meta)
