"""Promotion: a block found on nvme or in Redis is loaded into the arena (lower -> cpu).

A lookup starts promotions right away (prefetch); the get that follows waits for them as
``kvtier.policy.prefetch`` says, the same code the replay simulator runs. Loads run as
tasks the store can wait for at drain.

A lookup that goes to Redis does not wait for its probe before reading: ``speculate`` starts
the read of the tail into free arena slots (never evicting, bounded by ``speculate_bytes``)
while the probe runs, with the blocks kept out of the index; ``adopt`` then indexes, as
loading, the leading blocks the probe confirmed (the read verifies each frame before a
block becomes ready, as any Redis promotion does), and the rest of the slots are freed once
the read is over. The get that follows waits on the read already in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

from kvtier.index import BlockMeta, SlotState
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

__all__ = ["Promoter", "Speculation"]

SPECULATE_BYTES = 64 << 20   # at most this much of a lookup's tail is read before its probe
SPECULATE_BLOCKS = 256       # ... and at most this many blocks


@dataclass(slots=True, eq=False)
class Speculation:
    """A Redis read started before the probe answered: ``metas`` (loading, in free arena
    slots, not in the index) and the read; ``decided`` gets how many leading metas the
    probe confirmed and were indexed (0: none, every slot is freed after the read)."""

    metas: list[BlockMeta]
    read: asyncio.Future[TransferResult]
    decided: asyncio.Future[int]


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
    speculate_bytes: int = SPECULATE_BYTES
    speculate_blocks: int = SPECULATE_BLOCKS
    speculated: int = 0          # blocks read before their probe answered ...
    speculated_unused: int = 0   # ... of which the probe did not confirm (slot freed)

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
        off = await self.cpu.alloc(meta.nbytes)
        if off is None or meta.cpu_state is not SlotState.NONE or not meta.in_nvme:
            if off is not None:
                self.cpu.arena.free(off)
            return meta.cpu_state is not SlotState.NONE
        meta.cpu = off
        meta.set_cpu_state(SlotState.LOADING)
        meta.prefetched = prefetched
        meta.nvme_busy = True
        if prefetched:
            self.prefetch.issued += 1
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        meta.loading = fut
        self._spawn(self._load_nvme(meta, off, fut))
        return True

    async def _load_nvme(self, meta: BlockMeta, off: int, fut: asyncio.Future[bool]) -> None:
        try:
            done = await self.transfers.move(TierName.NVME, TierName.CPU, Transfer([meta]))
        finally:
            meta.nvme_busy = False
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

    # -- redis -> cpu -------------------------------------------------------------------
    async def from_redis(self, ns: NamespaceEntry, rkeys: list[bytes], chain: list[bytes],
                         start: int) -> None:
        """Index ``rkeys`` (``chain[start:]``, found in Redis) as loading and start the
        batched load; stops at the first key already indexed or without room."""
        index, layout = self.blocks.index, ns.layout
        metas: list[BlockMeta] = []
        for i, k in enumerate(rkeys):
            if k in index:
                break
            off = await self.cpu.alloc(layout.block_bytes)
            if off is None or k in index:
                if off is not None:
                    self.cpu.arena.free(off)
                break
            meta = _loading_meta(ns, k, chain, start + i, off)
            meta.loading = asyncio.get_running_loop().create_future()
            index[k] = meta
            metas.append(meta)
        if metas:
            self.prefetch.issued += len(metas)
            self._spawn(self._load_redis(metas))

    def speculate(self, ns: NamespaceEntry, rkeys: list[bytes], chain: list[bytes],
                  start: int) -> Speculation | None:
        """Start reading ``rkeys`` (``chain[start:]``) from Redis before the probe says they
        are there: free arena slots only (a block that gets none is not read early), none of
        it indexed until ``adopt``. The caller must ``adopt`` or ``discard`` the result."""
        arena, nbytes = self.cpu.arena, ns.layout.block_bytes
        metas: list[BlockMeta] = []
        budget = self.speculate_bytes
        for i, k in enumerate(rkeys[: self.speculate_blocks]):
            if k in self.blocks.index or budget < nbytes:
                break
            off = arena.alloc(nbytes)   # never evicts: a guess must not cost a cached block
            if off is None:
                break
            budget -= nbytes
            metas.append(_loading_meta(ns, k, chain, start + i, off))
        if not metas:
            return None
        self.speculated += len(metas)
        loop = asyncio.get_running_loop()
        spec = Speculation(metas, asyncio.ensure_future(
            self.transfers.move(TierName.REDIS, TierName.CPU, Transfer(metas))),
            loop.create_future())
        self._spawn(self._finish_speculation(spec))
        return spec

    async def adopt(self, spec: Speculation, found: int, ns: NamespaceEntry,
                    rkeys: list[bytes], chain: list[bytes], start: int) -> None:
        """The probe found ``found`` leading ``rkeys`` in Redis (``spec`` read them from
        ``rkeys[0]`` on): index those as loading, waiting on the read in flight; keys found
        past what ``spec`` covers are promoted as usual. Stops at a key indexed meanwhile."""
        if spec.decided.done():
            return
        index = self.blocks.index
        loop = asyncio.get_running_loop()
        n = 0
        for meta in spec.metas[:found]:
            if meta.key in index:
                break
            meta.loading = loop.create_future()
            index[meta.key] = meta
            n += 1
        self.prefetch.issued += n
        spec.decided.set_result(n)
        if n == len(spec.metas) < found:
            await self.from_redis(ns, rkeys[n:found], chain, start + n)

    @staticmethod
    def discard(spec: Speculation) -> None:
        """Nothing of ``spec`` is wanted (no hit, a failed probe, a cancelled lookup)."""
        if not spec.decided.done():
            spec.decided.set_result(0)

    async def _finish_speculation(self, spec: Speculation) -> None:
        done = await spec.read
        n = await spec.decided
        arena = self.cpu.arena
        for meta in spec.metas[n:]:   # never indexed: no one saw these slots
            assert meta.cpu is not None
            arena.free(meta.cpu)
            meta.cpu = None
            meta.set_cpu_state(SlotState.NONE)
        self.speculated_unused += len(spec.metas) - n
        sums = done.checksums
        self._loaded_redis(spec.metas[:n], min(done.moved, n), sums[:n])

    async def _load_redis(self, metas: list[BlockMeta]) -> None:
        done = await self.transfers.move(TierName.REDIS, TierName.CPU, Transfer(metas))
        self._loaded_redis(metas, done.moved, done.checksums)

    def _loaded_redis(self, metas: list[BlockMeta], n: int, sums: list[int | None]) -> None:
        """The read of ``metas`` (indexed, loading) is over: the leading ``n`` arrived."""
        now = self.clock()
        for i, meta in enumerate(metas):
            ok = i < n
            if ok:   # the frame's verified checksum, when known, spares the journal a hash
                self.cpu.ready(meta, now, sums[i] if i < len(sums) else None)
                if self.forest is not None:
                    self.forest.add(meta.key, meta.parent)
            else:
                self.prefetch.failed += 1
                self.cpu.drop(meta)
                self.blocks.forget_if_gone(meta)
            fut, meta.loading = meta.loading, None
            if fut is not None and not fut.done():
                fut.set_result(ok)

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


def _loading_meta(ns: NamespaceEntry, key: bytes, chain: list[bytes], depth: int,
                  off: int) -> BlockMeta:
    """The index entry of a block of ``ns`` being read from Redis into arena slot ``off``."""
    layout = ns.layout
    parent = chain[depth - 1] if depth > 0 else None
    meta = BlockMeta(key, ns.namespace.digest, layout.fingerprint, layout.block_bytes,
                     parent, depth, cpu=off, prefetched=True)
    meta.set_cpu_state(SlotState.LOADING)
    return meta
