"""The index's lifecycle: a block leaves the index once no tier holds it, and takes its
orphans (blocks whose parent is gone everywhere, unreachable by any prefix walk) along."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.store.cpu import CpuResidency
from kvtier.store.nvme import NvmeResidency
from kvtier.store.ports import ForestPort
from kvtier.tiers.base import EvictionReason

__all__ = ["Blocks"]


@dataclass(slots=True, eq=False)
class Blocks:
    index: BlockIndex
    cpu: CpuResidency
    nvme: NvmeResidency | None
    forest: ForestPort | None

    @staticmethod
    def in_use(meta: BlockMeta) -> bool:
        """Read, being written, loaded or moved: no delete or orphan collection touches it."""
        return bool(meta.readers or meta.nvme_busy or meta.cpu_state in (
            SlotState.WRITING, SlotState.LOADING))

    def remove(self, meta: BlockMeta, reason: EvictionReason, *, erase: bool = False) -> None:
        """Drop ``meta`` from the cpu and nvme tiers (the caller checked ``in_use``)."""
        if meta.in_cpu:
            self.cpu.drop(meta, reason)
            self.cpu.counters.evicted(reason)
        if meta.nvme is not None and self.nvme is not None:
            self.nvme.drop(meta, reason, erase=erase)

    def forget_if_gone(self, meta: BlockMeta) -> None:
        """Drop ``meta`` from the index once no tier holds it, and with it its orphans."""
        if meta.cpu is None and meta.nvme is None and self.index.get(meta.key) is meta:
            del self.index[meta.key]
            if self.forest is not None:
                for key in self.forest.discard(meta.key):
                    if isinstance(key, bytes):   # the store's keys are bytes
                        self._drop_orphan(key)

    def _drop_orphan(self, key: bytes) -> None:
        meta = self.index.get(key)
        if meta is None or self.in_use(meta):
            return  # in use: it stays until it is evicted the ordinary way
        # erased: a stale frame would come back at the next start once its parent is there
        self.remove(meta, EvictionReason.ORPHAN, erase=True)
        if self.index.get(key) is meta:
            del self.index[key]
