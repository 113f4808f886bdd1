"""The read side: lookup (how long a prefix is stored, starting promotion) and the read
leases a get hands out. Both walk the chain with ``BlockIndex.leading``: cpu -> nvme in the
index, then Redis (bounded by ``redis_lookup_budget_s``) for the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.bandwidth import BandwidthTracker
from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.leases import LeaseKind
from kvtier.policy.base import EvictionPolicy, LookupObserver
from kvtier.store.cpu import CpuResidency
from kvtier.store.hbm import HbmEntry, HbmPlacement
from kvtier.store.leasing import LeaseKeeper
from kvtier.store.namespaces import NamespaceEntry, NamespaceRegistry
from kvtier.store.ports import MissLogPort, NvmePort, RedisPort
from kvtier.store.promoter import Promoter
from kvtier.store.slices import Turn, slices
from kvtier.store.stats import (
    LookupResult,
    PrefetchCounters,
    RequestCounters,
    count_lookup,
    count_redis_lookup,
)
from kvtier.tiers.base import TierName

__all__ = ["Reader"]


@dataclass(slots=True, eq=False)
class Reader:
    index: BlockIndex
    namespaces: NamespaceRegistry
    cpu: CpuResidency
    nvme_policy: EvictionPolicy
    nvme: NvmePort | None
    redis: RedisPort | None
    promoter: Promoter
    leases: LeaseKeeper
    bandwidth: BandwidthTracker
    requests: RequestCounters
    prefetch: PrefetchCounters
    clock: Callable[[], float]
    hbm: HbmPlacement | None = None
    redis_lookup_budget_s: float = 0.1
    observer: LookupObserver | None = None
    explain: MissLogPort | None = None

    def _mine(self, ns: NamespaceEntry) -> Callable[[BlockMeta], bool]:
        return lambda meta: not self.namespaces.foreign(meta, ns)

    async def _redis_prefix(self, keys: list[bytes], digest: bytes) -> int:
        """``redis.exists_prefix`` (frames of namespace ``digest`` only) bounded by
        ``redis_lookup_budget_s`` (not by the Redis op timeout, which can be the connector's
        whole step budget): past it, a counted miss."""
        assert self.redis is not None
        try:
            return int(await asyncio.wait_for(self.redis.exists_prefix(keys, namespace=digest),
                                              self.redis_lookup_budget_s))
        except asyncio.TimeoutError:
            self.requests.redis_budget_misses += 1
            return 0

    def _redis_up(self) -> bool:
        return self.redis is not None and self.redis.up

    async def lookup(self, ns: NamespaceEntry, keys: list[bytes], *,
                     prefetch: bool) -> LookupResult:
        """Leading keys present anywhere (cpu -> nvme -> redis); starts promotion."""
        digest = ns.namespace.digest
        now = self.clock()
        tiers: list[str] = []
        to_promote: list[BlockMeta] = []
        local: list[BlockMeta] = []
        turn = Turn()
        in_cpu: list[bytes] = []
        for i, meta in enumerate(self.index.leading(keys, self._mine(ns))):
            local.append(meta)
            if meta.cpu_state in (SlotState.READY, SlotState.LOADING):
                tiers.append("cpu")
                if meta.in_cpu:
                    in_cpu.append(meta.key)
            else:
                tiers.append("nvme")
                to_promote.append(meta)
            if turn.due(i):   # the next block is looked up after the pause; those counted
                await turn.pause()   # may go meanwhile, as across the Redis probe below
        await touch_chain_in_turns(self.cpu.policy, in_cpu, now, turn)   # the head stays longest
        if to_promote:
            await touch_chain_in_turns(self.nvme_policy, [m.key for m in to_promote], now, turn)
        n_local, n_cpu, tpb = len(tiers), tiers.count("cpu"), ns.layout.tokens_per_block
        count_lookup(self.cpu.counters, None if self.nvme is None else self.nvme.counters,
                     len(keys), n_local, n_cpu, tpb)
        redis_keys: list[bytes] = []
        if n_local < len(keys) and self.redis is not None:
            n_r = await self._redis_prefix(keys[n_local:], digest) if self.redis.up else 0
            count_redis_lookup(self.redis.counters, len(keys) - n_local, n_r, tpb)
            redis_keys = keys[n_local: n_local + n_r]
            tiers.extend(["redis"] * n_r)
        hits = len(tiers)
        self.requests.lookup(len(keys), hits, tpb)
        if self.observer is not None:
            self.observer.on_lookup(keys, hits, now=now)
        if self.explain is not None:
            self.explain.lookup(digest, keys, hits, n_cpu, n_local, self.index,
                                self.redis is not None and not self.redis.up)
        if prefetch and (to_promote or redis_keys):
            # Pin the chain while its tail is promoted: promotion must never evict the
            # head of the same chain (a chain longer than the arena keeps what fits).
            # (The Redis probe awaited: blocks of the local prefix may be gone meanwhile.)
            chain = [m for m in local if self.index.get(m.key) is m]
            self.cpu.pin(chain)
            try:
                for meta in to_promote:
                    if not await self.promoter.from_nvme(meta, prefetched=True):
                        break
                else:
                    if redis_keys:
                        await self.promoter.from_redis(ns, redis_keys, keys, n_local)
            finally:
                self.cpu.unpin(chain)
        return LookupResult(hits, tiers)

    async def readable_prefix(self, ns: NamespaceEntry, keys: list[bytes]) -> list[BlockMeta]:
        """The leading keys ready in the arena (promoting and waiting as the prefetch policy
        says), each read-locked once for the caller's lease."""
        pending: list[asyncio.Future[bool]] = []
        chain: list[BlockMeta] = []
        turn = Turn()
        for i, meta in enumerate(self.index.leading(keys, self._mine(ns))):
            self.cpu.pin([meta])  # pinned as it joins: the tail never evicts the head
            chain.append(meta)
            if meta.cpu_state is SlotState.NONE:
                await self.promoter.from_nvme(meta, prefetched=False)
            if meta.cpu_state is SlotState.NONE:
                chain.pop()
                self.cpu.unpin([meta])
                break
            if meta.loading is not None:
                pending.append(meta.loading)
            if turn.due(i):   # the blocks pinned so far stay; the next is looked up after
                await turn.pause()
        if len(chain) < len(keys) and self._redis_up():
            before = len(chain)
            rkeys = keys[before:]
            n_r = await self._redis_prefix(rkeys, ns.namespace.digest)
            if n_r:
                await self.promoter.from_redis(ns, rkeys[:n_r], keys, before)
                for k in rkeys[:n_r]:
                    got = self.index.get(k)
                    if got is None or got.loading is None:
                        break
                    self.cpu.pin([got])
                    pending.append(got.loading)
                    chain.append(got)
        if pending:
            await self.promoter.wait(pending)
        now = self.clock()
        metas: list[BlockMeta] = []
        ready = True
        for i, meta in enumerate(chain):  # keep the leading ready blocks pinned; let the
            if turn.due(i):                   # rest go (pinned, they stay across a pause)
                await turn.pause()
            ready = ready and meta.in_cpu and self.index.get(meta.key) is meta
            if not ready:
                self.cpu.unpin([meta])
                continue
            if meta.prefetched:
                self.prefetch.hit_before_use += 1
                meta.prefetched = False
            metas.append(meta)
        await touch_chain_in_turns(self.cpu.policy, [m.key for m in metas], now, turn)
        self.requests.gets += 1
        self.requests.get_blocks += len(metas)
        return metas

    async def lease(self, owner: int, ns: NamespaceEntry,
                    keys: list[bytes]) -> tuple[int, list[int]]:
        """A read lease on the readable prefix of ``keys``: (lease id, arena offsets)."""
        metas = await self.readable_prefix(ns, keys)
        self.cpu.counters.bytes_read += sum(m.nbytes for m in metas)
        lease = self.leases.open(LeaseKind.GET, owner, metas)
        self.bandwidth.get_started(lease.id, sum(m.nbytes for m in metas))
        return lease.id, [m.cpu for m in metas]  # type: ignore[misc]

    async def lease_device(self, owner: int, ns: NamespaceEntry,
                           keys: list[bytes]) -> tuple[int, list[int], list[str]]:
        """``lease`` placing the blocks in hbm when there is room: (lease, offsets, devices)."""
        metas = await self.readable_prefix(ns, keys)
        entries = await self._place_in_hbm(self.hbm, metas, ns)
        lease = self.leases.open(LeaseKind.GET, owner, metas)
        lease.hbm = [e for e in entries if e is not None]
        offsets = [m.cpu if e is None else e.offset for m, e in zip(metas, entries, strict=True)]
        devices = [TierName.CPU.value if e is None else TierName.HBM.value for e in entries]
        self.bandwidth.get_started(lease.id, sum(m.nbytes for m in metas),
                                   "hbm" if devices and "cpu" not in devices else "cpu")
        return lease.id, offsets, devices  # type: ignore[return-value]

    async def _place_in_hbm(self, hbm: HbmPlacement | None, metas: list[BlockMeta],
                            ns: NamespaceEntry) -> list[HbmEntry | None]:
        """Read-lock ``metas`` (ready and read-locked in cpu) in hbm too, copying them there
        when needed; None where a block is served from cpu. Counts the cpu reads."""
        entries: list[HbmEntry | None] = [None] * len(metas)
        in_hbm: set[bytes] = set()
        if hbm is not None and metas:
            in_hbm = {m.key for m in metas if m.key in hbm.entries}
            try:
                entries = await hbm.acquire(metas, ns.layout.tokens_per_block)
            except BaseException:   # cancelled: no lease will hold the cpu read-locks
                self.cpu.unpin(metas)
                raise
        # read from cpu: blocks served from the arena and blocks copied from it into hbm
        self.cpu.counters.bytes_read += sum(m.nbytes for m, e in zip(metas, entries, strict=True)
                                            if e is None or m.key not in in_hbm)
        return entries


async def touch_chain_in_turns(policy: EvictionPolicy, keys: list[bytes], now: float,
                       turn: Turn) -> None:
    """``kvtier.policy.base.touch_chain`` (tail first) in the request's turns: a chain of
    131,072 one-token blocks held the event loop for 200 ms in one piece (found by review).
    A key evicted during a pause is ignored by every policy's ``touch``."""
    touch = policy.touch
    for piece in slices(keys[::-1]):   # a look at the clock per piece, not per block
        for key in piece:
            touch(key, now=now)
        if turn.over():
            await turn.pause()
