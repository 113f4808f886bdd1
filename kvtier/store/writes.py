"""The write side: a put leases write-locked arena slots, the client fills them through
shared memory, and the commit makes them visible (and, ``durable``, writes them to nvme
before answering: what a caller needs to survive a daemon crash)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import CapacityError
from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.leases import LeaseKind
from kvtier.policy.base import LookupObserver
from kvtier.store.alloc import EVICT_BATCH
from kvtier.store.cpu import CpuResidency
from kvtier.store.demotion import Demoter
from kvtier.store.leasing import LeaseKeeper
from kvtier.store.namespaces import NamespaceEntry
from kvtier.store.ports import ForestPort
from kvtier.store.stats import RequestCounters
from kvtier.store.transfers import Transfer, Transfers
from kvtier.tiers.aligned import round_up
from kvtier.tiers.base import TierName

__all__ = ["Writer"]


@dataclass(slots=True, eq=False)
class Writer:
    index: BlockIndex
    cpu: CpuResidency
    leases: LeaseKeeper
    demoter: Demoter
    transfers: Transfers
    requests: RequestCounters
    clock: Callable[[], float]
    observer: LookupObserver | None = None
    forest: ForestPort | None = None
    redis_write_through: bool = False   # (and a Redis tier): commits also go to Redis
    nvme_present: bool = False

    async def prepare(self, owner: int, ns: NamespaceEntry, keys: list[bytes],
                      parent: bytes | None, depth: int) -> tuple[int, list[int | None]]:
        """Write-locked arena slots for the keys not stored yet (None: skip this key)."""
        digest, layout_fp = ns.namespace.digest, ns.layout.fingerprint
        nbytes = ns.layout.block_bytes
        self._check_fits(nbytes, keys)
        metas: list[BlockMeta] = []
        offsets: list[int | None] = []
        index, cpu = self.index, self.cpu
        full = False  # after one failed allocation the rest would fail too: stop evicting
        after: int | None = None   # new keys after this one (counted at the first eviction)
        for i, k in enumerate(keys):
            if full or k in index:
                offsets.append(None)
                continue
            if after is not None:
                after -= 1
            off = cpu.try_alloc(nbytes)   # the common case: room without evicting, no await
            if off is None:   # evict for the keys still to place, several at a time
                if after is None:
                    after = sum(1 for x in keys[i + 1:] if x not in index)
                off = await cpu.alloc(nbytes, batch=min(EVICT_BATCH, after + 1))
                if off is None or k in index:   # (stored by another put meanwhile)
                    if off is not None:
                        cpu.arena.free(off)
                    full = off is None
                    offsets.append(None)
                    continue
            meta = BlockMeta(k, digest, layout_fp, nbytes, keys[i - 1] if i else parent,
                             depth + i, cpu=off, cpu_state=SlotState.WRITING)
            index[k] = meta
            metas.append(meta)
            offsets.append(off)
        lease = self.leases.open(LeaseKind.PUT, owner, metas)
        lease.chain = keys
        return lease.id, offsets

    def _check_fits(self, nbytes: int, keys: list[bytes]) -> None:
        """Fail fast, before evicting anything, when the new blocks could never fit."""
        slot, size = round_up(nbytes), self.cpu.arena.size
        if slot > size:
            raise CapacityError(f"a block of {nbytes} bytes is larger than the cpu tier "
                                f"({size} bytes): raise cpu.bytes or use smaller "
                                "blocks (tokens_per_block)")
        if len(keys) * slot > size:
            new = len({k for k in keys if k not in self.index})
            if new * slot > size:
                raise CapacityError(f"a put of {new} new blocks ({new * slot} bytes) exceeds "
                                    f"the cpu tier ({size} bytes): put fewer "
                                    "blocks per request")

    async def commit(self, owner: int, lease_id: int, *, durable: bool,
                     output_tokens: int | None) -> int:
        """Make the written blocks visible; how many are stored (durably, with ``durable``)."""
        lease = self.leases.take(owner, lease_id, LeaseKind.PUT)
        now = self.clock()
        on_stored = getattr(self.observer, "on_stored", None)
        if on_stored is not None and lease.chain:
            on_stored(lease.chain, output_tokens=output_tokens, now=now)
        committed = []
        for meta in lease.metas:
            if meta.cpu_state is not SlotState.WRITING or self.index.get(meta.key) is not meta:
                continue
            self.cpu.ready(meta, now)
            if self.forest is not None:
                self.forest.add(meta.key, meta.parent)
            committed.append(meta)
        self.requests.puts += 1
        self.requests.put_blocks += len(committed)
        self.cpu.counters.bytes_written += sum(m.nbytes for m in committed)
        if self.redis_write_through and committed:
            await self.transfers.move(TierName.CPU, TierName.REDIS, Transfer(committed))
        if durable and self.nvme_present:
            results = await asyncio.gather(*(self.demoter.persist(m, sync=True)
                                             for m in committed))
            return sum(results)
        return len(committed)
