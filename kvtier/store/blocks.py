"""The index's lifecycle: a block leaves the index once no tier holds it, and takes its
orphans (blocks whose parent is gone everywhere, unreachable by any prefix walk) along."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # orphans that were in use when their parent went: dropped once their use is over
    # (``retry_orphans``), not left in the index and on nvme where no lookup reaches them
    pending: dict[bytes, BlockMeta] = field(default_factory=dict)

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
        if meta is None:
            return
        if self.in_use(meta):   # read, loading, written: dropped once that is over
            self.pending[key] = meta
            return
        self._drop(meta)

    def _drop(self, meta: BlockMeta) -> None:
        # erased: a stale frame would come back at the next start once its parent is there
        self.remove(meta, EvictionReason.ORPHAN, erase=True)
        if self.index.get(meta.key) is meta:
            del self.index[meta.key]
            if self.forest is not None:   # what joined under it since: orphans too
                for key in self.forest.discard(meta.key):
                    if isinstance(key, bytes):
                        self._drop_orphan(key)

    def _reachable_parent(self, parent: bytes | None) -> bool:
        """Whether ``parent`` is back as a block of a chain: indexed and in the forest, not
        itself an orphan waiting to go (found by review: a child that rejoined under a
        pending parent outlived it for good). A pending entry that is no longer the parent's
        live one (deleted and stored anew before the sweep) does not count: the parent is
        back, and its child was dropped for it (found by mutation review)."""
        if parent is None:
            return False
        live = self.index.get(parent)
        return (live is not None and self.pending.get(parent) is not live
                and (self.forest is None or parent in self.forest))

    def retry_orphans(self) -> int:
        """Drop the pending orphans no longer in use (the daemon's periodic sweep); one
        whose parent is back in the index (stored again meanwhile) is reachable again and
        rejoins the forest. How many were dropped."""
        dropped = 0
        for key, meta in list(self.pending.items()):
            if self.index.get(key) is not meta:   # gone, or stored anew since
                del self.pending[key]
            elif self._reachable_parent(meta.parent):
                del self.pending[key]
                if self.forest is not None:
                    self.forest.add(key, meta.parent)
            elif not self.in_use(meta):
                del self.pending[key]
                self._drop(meta)
                dropped += 1
        return dropped
