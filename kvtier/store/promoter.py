"""Promotion: a block found on nvme or in Redis is loaded into the arena (lower -> cpu).

A lookup starts promotions right away (prefetch); the get that follows waits for them as
``kvtier.policy.prefetch`` says, the same code the replay simulator runs. Loads run as
tasks the store can wait for at drain.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

from kvtier.index import BlockMeta, SlotState
from kvtier.lograte import LogRate
from kvtier.policy.prefetch import TIMEOUT_BASE_S, PrefetchWait, prefetch_deadline
from kvtier.store.blocks import Blocks
from kvtier.store.cpu import CpuResidency
from kvtier.store.namespaces import NamespaceEntry
from kvtier.store.nvme import NvmeResidency
from kvtier.store.ports import ForestPort
from kvtier.store.stats import PrefetchCounters
from kvtier.store.transfers import Transfer, TransferResult, Transfers
from kvtier.tiers.base import EvictionReason, TierName

log = logging.getLogger("kvtier.store")
_warn = LogRate(log)

__all__ = ["Promoter"]


@dataclass(slots=True, eq=False)
class Promoter:
    blocks: Blocks
    cpu: CpuResidency
    nvme: NvmeResidency | None
    transfers: Transfers
    prefetch: PrefetchCounters
    clock: Callable[[], float]
    wait_policy: PrefetchWait = PrefetchWait.TIMEOUT
    per_block_s: float = 0.002
    base_s: float = TIMEOUT_BASE_S   # grace of a ``timeout`` wait before the per-block part
    forest: ForestPort | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- nvme -> cpu --------------------------------------------------------------------
    async def from_nvme(self, meta: BlockMeta, *, prefetched: bool) -> bool:
        """Start loading ``meta`` into the arena; False when there was no room for it."""
        if meta.cpu_state is not SlotState.NONE:
            return True
        if not meta.in_nvme or meta.nvme_busy:
            return False
        # busy from here: the arena's eviction below may demote a block to nvme, whose own
        # eviction must not pick this one (it was dropped from every tier while being read)
        meta.nvme_busy = True
        off = await self.cpu.alloc(meta.nbytes)
        if off is None or meta.cpu_state is not SlotState.NONE or not meta.in_nvme:
            self._unbusy(meta)
            if off is not None:
                self.cpu.arena.free(off)
            return meta.cpu_state is not SlotState.NONE
        meta.cpu = off
        meta.set_cpu_state(SlotState.LOADING)
        meta.prefetched = prefetched
        if prefetched:
            self.prefetch.issued += 1
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        meta.loading = fut
        self._spawn(self._load_nvme(meta, off, fut))
        return True

    async def _move_in(self, src: TierName, job: Transfer) -> TransferResult:
        """The load's result; a miss when the move raised (its handlers catch what they
        expect): the blocks' futures must resolve and their slots go back whatever
        happened, or every get waiting on them (no deadline under ``wait``) waits for good
        and the blocks stay LOADING."""
        try:
            return await self.transfers.move(src, TierName.CPU, job)
        except Exception as exc:   # rate-limited: a bug hit by every get floods the log
            _warn.warning(f"load-{src.value}", "%s -> cpu load of %d blocks failed, served "
                          "as a miss: %r", src.value, len(job.metas), exc)
            return TransferResult()

    async def _load_nvme(self, meta: BlockMeta, off: int, fut: asyncio.Future[bool]) -> None:
        try:
            done = await self._move_in(TierName.NVME, Transfer([meta]))
        finally:
            self._unbusy(meta)
        meta.loading = None
        ok = done.moved == 1
        if ok and meta.cpu == off:
            self.cpu.ready(meta, self.clock(), done.checksum)
        elif meta.cpu == off:
            self.cpu.drop(meta)
            self.prefetch.failed += 1
            if done.corrupt and self.nvme is not None:
                self.nvme.drop(meta, EvictionReason.CORRUPT)
            self.blocks.forget_if_gone(meta)
        if not fut.done():
            fut.set_result(ok)

    def _unbusy(self, meta: BlockMeta) -> None:
        if self.nvme is not None:
            self.nvme.unbusy(meta)
        else:
            meta.nvme_busy = False

    # -- redis -> cpu -------------------------------------------------------------------
    async def from_redis(self, ns: NamespaceEntry, rkeys: list[bytes], chain: list[bytes],
                         start: int) -> None:
        """Index ``rkeys`` (``chain[start:]``, found in Redis) as loading and start the
        batched load; stops at the first key already indexed or without room."""
        index, layout, cpu = self.blocks.index, ns.layout, self.cpu
        loop = asyncio.get_running_loop()
        digest, fp, nbytes = ns.namespace.digest, layout.fingerprint, layout.block_bytes

        def meta_at(i: int, off: int) -> BlockMeta:
            depth = start + i
            return BlockMeta(rkeys[i], digest, fp, nbytes,
                             chain[depth - 1] if depth > 0 else None, depth, cpu=off,
                             cpu_state=SlotState.LOADING, loading=loop.create_future(),
                             prefetched=True)

        # the leading keys not indexed yet, placed without evicting in one batch (no await)
        fresh = index.new_positions(rkeys)   # the leading run of them: up to a known key
        n = next((j for j, i in enumerate(fresh) if i != j), len(fresh))
        metas = [meta_at(i, off) for i, off in enumerate(cpu.try_alloc_many(nbytes, n))]
        index.add_new(metas)
        for i in range(len(metas), n):   # the rest, evicting for each
            if rkeys[i] in index:   # (indexed by another request during an eviction)
                break
            off = await cpu.alloc(nbytes)
            if off is None or rkeys[i] in index:
                if off is not None:
                    cpu.arena.free(off)
                break
            meta = meta_at(i, off)
            index[meta.key] = meta
            metas.append(meta)
        if metas:
            self.prefetch.issued += len(metas)
            self._spawn(self._load_redis(metas))

    async def _load_redis(self, metas: list[BlockMeta]) -> None:
        done = await self._move_in(TierName.REDIS, Transfer(metas))
        n, sums = done.moved, done.checksums
        # the frames' verified checksums, when known, spare the journal a hash
        self.cpu.ready_many(metas[:n], self.clock(), [sums[i] if i < len(sums) else None
                                                      for i in range(n)])
        if self.forest is not None:
            for meta in metas[:n]:
                self.forest.add(meta.key, meta.parent)
        for meta in metas[n:]:
            self.prefetch.failed += 1
            self.cpu.drop(meta)
            self.blocks.forget_if_gone(meta)
        for i, meta in enumerate(metas):
            fut, meta.loading = meta.loading, None
            if fut is not None and not fut.done():
                fut.set_result(i < n)

    # -- waiting ------------------------------------------------------------------------
    async def wait(self, pending: list[asyncio.Future[bool]]) -> None:
        """Wait for in-flight promotions as the prefetch policy says (``pending`` is every
        promotion a get found; the deadline grows with their number)."""
        not_done = [f for f in pending if not f.done()]
        self.prefetch.late += len(not_done)
        if not not_done:
            return
        now = self.clock()
        deadline = prefetch_deadline(self.wait_policy, len(pending), self.per_block_s, now,
                                     base_s=self.base_s)
        if deadline is not None and deadline <= now:
            return  # best effort: use what is ready now
        timeout = None if deadline is None else deadline - now
        _done, still = await asyncio.wait(not_done, timeout=timeout)
        if still:
            log.info("prefetch deadline passed with %d of %d blocks pending",
                     len(still), len(pending))

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the loads in flight (drain)."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=max(0.0, timeout))

