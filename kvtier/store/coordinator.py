"""TieredStore: the store's public API, wiring the residencies, promoter and demoter.

The store is the control plane of the daemon: it decides and keeps the index; tiers move
bytes. It is the sole writer of the index and runs on the event loop thread; blocking I/O
happens inside the tiers' thread pools or Redis' asyncio client. How a request passes
through the parts is drawn in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierError, LeaseExpired
from kvtier.index import BlockIndex, BlockMeta
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.leases import LeaseKind, LeaseTable, Quarantine
from kvtier.policy.base import AdmissionPolicy, EvictionPolicy, LookupObserver
from kvtier.policy.base import make_eviction_policy as _make_policy
from kvtier.policy.prefetch import TIMEOUT_BASE_S, PrefetchWait
from kvtier.store.blocks import Blocks
from kvtier.store.cpu import CpuResidency
from kvtier.store.demotion import Demoter
from kvtier.store.hbm import HbmPlacement
from kvtier.store.leasing import LeaseKeeper
from kvtier.store.namespaces import NamespaceEntry, NamespaceRegistry, split_keys
from kvtier.store.nvme import NvmeResidency
from kvtier.store.ports import ForestPort, HbmPort, MissLogPort, NvmePort, RedisPort
from kvtier.store.promoter import Promoter
from kvtier.store.reads import Reader
from kvtier.store.recovery import CommitLog, RecoveryCounters, rebuild_nvme_only, recover
from kvtier.store.slices import Turn
from kvtier.store.stats import LookupResult, PrefetchCounters, RequestCounters, store_stats
from kvtier.store.transfers import Transfers
from kvtier.store.writes import Writer
from kvtier.tiers.arena import Arena
from kvtier.tiers.base import EvictionReason, Tier, TierName
from kvtier.tiers.journal_replay import JournalState

for _mod in ("lru", "lfu", "cost"):  # policies register themselves on import
    with contextlib.suppress(ImportError):
        importlib.import_module(f"kvtier.policy.{_mod}")

__all__ = ["TieredStore"]


class TieredStore:
    """The daemon's block store. All methods run on the event loop thread."""

    def __init__(self, arena: Arena, *, nvme: NvmePort | None = None,
                 redis: RedisPort | None = None, hbm: HbmPort | None = None,
                 eviction: str = "lru", lease_ttl_s: float = 30.0,
                 prefetch_wait: str = "timeout", prefetch_ms_per_block: float = 2.0,
                 prefetch_base_s: float = TIMEOUT_BASE_S,
                 policy_factory: Callable[[str, TierName], EvictionPolicy] | None = None,
                 admission: AdmissionPolicy | None = None,
                 observer: LookupObserver | None = None,
                 redis_write_through: bool = False, forest: ForestPort | None = None,
                 redis_lookup_budget_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, max_namespaces: int = 4096,
                 ) -> None:
        make = policy_factory or (lambda name, tier: _make_policy(name))
        self.arena, self.nvme, self.redis, self.hbm = arena, nvme, redis, hbm
        self.clock, self.lease_ttl_s = clock, lease_ttl_s
        self.redis_write_through = redis_write_through      # read by daemon.redis_sync
        self.redis_lookup_budget_s = redis_lookup_budget_s  # and by daemon.prefix
        self.admission, self.observer, self.forest = admission, observer, forest
        self.index = BlockIndex()
        self.requests = RequestCounters()
        self.prefetch = PrefetchCounters()
        self.ns = NamespaceRegistry(self.requests, max_namespaces)
        self.commit_log = CommitLog(arena)     # journal COMMIT records (warm restart)
        self.recovery: RecoveryCounters | None = None
        self.cpu = CpuResidency(arena, self.index, make(eviction, TierName.CPU),
                                on_ready=self.commit_log.ready_many, tokens_of=self.block_tokens)
        self.transfers = Transfers(arena, nvme, redis, pin=self.cpu.pin, unpin=self.cpu.unpin,
                                   alive=lambda m: self.index.get(m.key) is m,
                                   journal_defer=self.commit_log.defer)
        self.bandwidth = self.transfers.bandwidth  # reload rates returned with lookups
        self.nvme_policy: EvictionPolicy = make(eviction, TierName.NVME)
        self.nvme_residency = None if nvme is None else NvmeResidency(
            nvme, self.nvme_policy, tokens_of=self.block_tokens)
        self.hbm_place: HbmPlacement | None = None
        if hbm is not None:
            self.hbm_place = HbmPlacement(hbm, make(eviction, TierName.HBM), arena,
                                          clock=clock, moved=self.transfers.moved,
                                          pin_cpu=self.cpu.pin, unpin_cpu=self.cpu.unpin)
            self.hbm_place.tokens_of = self.block_tokens
            self.cpu.on_drop = self._drop_hbm_copy
        self.blocks = Blocks(self.index, self.cpu, self.nvme_residency, forest)
        self.demoter = Demoter(self.blocks, self.cpu, self.nvme_residency, redis, self.transfers,
                               self.prefetch, clock, admission, redis_write_through)
        self.cpu.on_victim = self.demoter.evict_cpu
        if self.nvme_residency is not None:
            self.nvme_residency.on_victim = self.demoter.evict_nvme
        self.promoter = Promoter(self.blocks, self.cpu, self.nvme_residency, self.transfers,
                                 self.prefetch, clock, PrefetchWait(prefetch_wait),
                                 prefetch_ms_per_block / 1000.0, prefetch_base_s, forest)
        self.leases = LeaseTable(lease_ttl_s, clock)
        self.quarantine = Quarantine()  # slots of expired put leases, see kvtier.leases
        self.lease_keeper = LeaseKeeper(self.leases, self.quarantine, self.blocks, self.cpu,
                                        self.requests, clock, self.bandwidth, self.hbm_place)
        self.reader = Reader(self.index, self.ns, self.cpu, self.nvme_policy, nvme, redis,
                             self.promoter, self.lease_keeper, self.bandwidth, self.requests,
                             self.prefetch, clock, self.hbm_place, redis_lookup_budget_s,
                             observer)
        self.writer = Writer(self.index, self.cpu, self.lease_keeper, self.demoter,
                             self.transfers, self.requests, clock, observer, forest,
                             redis is not None and redis_write_through, nvme is not None)
        self._explain: MissLogPort | None = None

    # -- wiring --------------------------------------------------------------------------
    @property
    def explain(self) -> MissLogPort | None:
        """kvtier.explain.MissLog: why lookups miss (set by the daemon)."""
        return self._explain

    @explain.setter
    def explain(self, log: MissLogPort | None) -> None:
        self._explain = log
        for part in (self.cpu, self.nvme_residency, self.demoter, self.reader, self.lease_keeper):
            if part is not None:
                part.explain = log

    @property
    def cpu_policy(self) -> EvictionPolicy:
        return self.cpu.policy

    @property
    def bytes_moved(self) -> dict[tuple[str, str], int]:
        return self.transfers.moved.by_pair

    @property
    def tiers(self) -> list[Tier]:
        out: list[Tier] = [self.hbm, self.cpu] if self.hbm is not None else [self.cpu]
        if self.nvme is not None:
            out.append(self.nvme)
        if self.redis is not None:
            out.append(self.redis)
        return out

    def block_tokens(self, meta: BlockMeta) -> int:
        """Tokens per block of ``meta``'s namespace, 0 while its layout is unknown (the
        eviction policies' cost of a block follows its token position)."""
        layout = self.ns.layout(meta.namespace)
        return 0 if layout is None else layout.tokens_per_block

    def _drop_hbm_copy(self, meta: BlockMeta, reason: EvictionReason) -> None:
        if self.hbm_place is not None:
            self.hbm_place.drop(meta.key, reason)

    # -- warm restart --------------------------------------------------------------------
    def rebuild_from_nvme(self) -> int:
        """Index every valid frame found on nvme (oldest first, so LRU order survives) and
        drop the frames no chain head leads to. Sync (runs ``nvme.open()``); the daemon uses
        ``recover``, which also adopts the arena."""
        return rebuild_nvme_only(self)

    async def recover(self, state: JournalState | None, *, last_run: bytes | None,
                      begin_run: Callable[[], bytes],
                      journal: Path | None = None) -> RecoveryCounters:
        """Warm restart: index nvme frames and the adopted arena's verified blocks (of the
        journal of ``last_run`` only), drop orphans, quarantine slots in flight at the
        crash for one lease TTL, then journal to ``journal`` (see ``kvtier.store.recovery``)."""
        return await recover(self, state, journal=journal, quarantine_s=self.lease_ttl_s,
                             last_run=last_run, begin_run=begin_run)

    # -- namespaces ----------------------------------------------------------------------
    @property
    def namespaces(self) -> OrderedDict[bytes, NamespaceEntry]:
        return self.ns.entries

    @property
    def namespaces_evicted(self) -> int:
        return self.ns.evicted

    def namespaces_named(self, model_id: str, cache_salt: str | None, tp_rank: int,
                         tp_size: int) -> list[Namespace]:
        """Registered namespaces a router names by model (``NamespaceRegistry.named``)."""
        return self.ns.named(model_id, cache_salt, tp_rank, tp_size)

    def register_namespace(self, layout: KVLayout, model_id: str, tp_rank: int, tp_size: int,
                           cache_salt: str | None) -> Namespace:
        return self.ns.register(layout, model_id, tp_rank, tp_size, cache_salt)

    def touch_namespace(self, digest: bytes) -> KVLayout | None:
        """The layout a registered namespace uses (marking it recently used), or None."""
        return self.ns.touch(digest)

    split_keys = staticmethod(split_keys)

    # -- lookup / get --------------------------------------------------------------------
    async def lookup(self, digest: bytes, layout_fp: int, keys: list[bytes],
                     *, prefetch: bool = True) -> LookupResult:
        """Leading keys present anywhere (cpu -> nvme -> redis); starts promotion."""
        try:
            ns = self.ns.resolve(digest, layout_fp)
        except KVTierError as exc:
            if self._explain is not None:
                self._explain.rejected(digest, len(keys), exc.code)
            raise
        return await self.reader.lookup(ns, keys, prefetch=prefetch)

    async def prepare_get(self, owner: int, digest: bytes, layout_fp: int,
                          keys: list[bytes]) -> tuple[int, list[int]]:
        """Read-locked arena slots for the leading keys that are (or become) readable."""
        return await self.reader.lease(owner, self.ns.resolve(digest, layout_fp), keys)

    async def prepare_get_device(self, owner: int, digest: bytes, layout_fp: int,
                                 keys: list[bytes]) -> tuple[int, list[int], list[str]]:
        """``prepare_get`` for a client that maps the HBM pool: (lease, offsets, devices).

        ``devices[i]`` is "hbm" when ``offsets[i]`` is a read-locked slot of the HBM pool and
        "cpu" when it is an arena slot (no hbm tier, no room in it, or a failed copy). The
        leading blocks are promoted cpu -> hbm first; the lease read-locks both copies.
        """
        return await self.reader.lease_device(owner, self.ns.resolve(digest, layout_fp), keys)

    async def release_get(self, owner: int, lease_id: int, *,
                          copy_s: float | None = None) -> None:
        """``copy_s``: how long the client's copy took, when it says (else the hold time
        measures the serve bandwidth)."""
        lease = self.lease_keeper.take(owner, lease_id, LeaseKind.GET)
        self.bandwidth.get_finished(lease_id, copy_s)
        await self.lease_keeper.release_get_in_turns(lease)

    # -- put -----------------------------------------------------------------------------
    async def prepare_put(self, owner: int, digest: bytes, layout_fp: int,
                          keys: list[bytes], *, parent: bytes | None = None,
                          depth: int = 0, max_new: int | None = None
                          ) -> tuple[int, list[int | None]]:
        """Write-locked arena slots for the keys not stored yet (None: skip this key).

        ``keys`` is a piece of a prefix chain: ``parent`` is the key before ``keys[0]``
        and ``depth`` its 0-based position in the chain (0 and None for a whole prompt).
        ``max_new``: slots given at most (the leading new keys get them).
        """
        return await self.writer.prepare(owner, self.ns.resolve(digest, layout_fp), keys,
                                         parent, depth, max_new=max_new)

    async def commit_put(self, owner: int, lease_id: int, *, durable: bool = False,
                         output_tokens: int | None = None,
                         redis_wait_s: float | None = None) -> int:
        """Make the written blocks visible; ``durable`` also writes them to nvme first.

        ``output_tokens`` (what the engine generated after this prompt, when known) feeds
        the workload observer: reuse is learned per class of request. ``redis_wait_s``: a
        synchronous write-through's bound on waiting for room in the Redis write queue.
        """
        return await self.writer.commit(owner, lease_id, durable=durable,
                                        output_tokens=output_tokens, redis_wait_s=redis_wait_s)

    def abort_put(self, owner: int, lease_id: int) -> None:
        """Drop a put; past its deadline this is a quiet no-op (nothing was stored, which is
        what an abort asks), and the lease's quarantined slots go back (the client stopped
        writing into them)."""
        try:
            lease = self.lease_keeper.take(owner, lease_id, LeaseKind.PUT)
        except LeaseExpired:
            return
        self.lease_keeper.abort_put(lease)

    # -- delete --------------------------------------------------------------------------
    async def delete(self, digest: bytes, layout_fp: int, keys: list[bytes]) -> int:
        """Remove the caller's blocks from every tier (blocks under a read lease, and blocks
        of another namespace, are skipped). Their Redis writes still queued are dropped
        first: a write-through pins its blocks until sent, and a delete right after a put
        skipped all of them (and the SET, sent after the DEL, brought them back)."""
        ns = self.ns.resolve(digest, layout_fp)
        if self.redis is not None:
            await self.redis.forget_writes(keys, namespace=digest)
        turn = Turn()
        mine: list[bytes] = []
        for i, k in enumerate(keys):
            if (m := self.index.get(k)) is not None and not self.ns.foreign(m, ns):
                mine.append(k)
            if turn.due(i):
                await turn.pause()
        before = len(mine)
        # tail first: a chain's head deleted first drops all its descendants as orphans
        # in one go (forget_if_gone), past any pause
        for i, k in enumerate(reversed(mine)):
            if turn.due(i):
                await turn.pause()
            meta = self.index.get(k)
            if meta is None or self.blocks.in_use(meta):
                continue
            self.blocks.remove(meta, EvictionReason.DELETED, erase=True)
            self.blocks.forget_if_gone(meta)  # also drops descendants orphaned by this delete
        n = before - sum(1 for k in mine if k in self.index)
        if self.nvme_residency is not None:   # frames the keys left on disk when evicted
            for i, k in enumerate(keys):
                self.nvme_residency.erase_evicted(k, ns.namespace.digest)
                if turn.due(i):
                    await turn.pause()
        if self.nvme is not None:   # answered once the frames are erased: a crash after the
            await self.nvme.erased()   # reply must not bring a deleted block back
        if self.redis is not None and self.redis.up:
            n = max(n, await self.redis.delete(keys, namespace=digest))
        self.requests.deletes += 1
        return n

    # -- leases --------------------------------------------------------------------------
    def expire_leases(self) -> int:
        """Take back leases past their deadline (a client that hung, stalled or forgot):
        get leases are released, put leases' slots are quarantined."""
        return self.lease_keeper.expire()

    def retry_orphans(self) -> int:
        """Drop orphans that were in use when their parent went and are no longer
        (``Blocks.retry_orphans``); the daemon calls it with its lease sweep."""
        return self.blocks.retry_orphans()

    def release_owner(self, owner: int, *, may_write: bool = False) -> int:
        """A client connection closed: release its reads; abort its puts and free its
        quarantined slots (it can no longer write into them), or with ``may_write`` (the
        daemon closed it) quarantine its puts' slots until ``free_quarantine``."""
        return self.lease_keeper.release_owner(owner, may_write=may_write)

    def free_quarantine(self, owner: int) -> int:
        """``owner`` can no longer write (its process exited): free its quarantine."""
        return self.lease_keeper.free_quarantine(owner)

    def held_put_bytes(self, owner: int) -> int:
        """Arena bytes ``owner`` holds for writing (open put leases, quarantine)."""
        return self.lease_keeper.held_put_bytes(owner)

    def held_get_bytes(self, owner: int) -> int:
        """Bytes of the blocks ``owner`` pins for reading (open get leases)."""
        return self.lease_keeper.held_get_bytes(owner)

    # -- shutdown ------------------------------------------------------------------------
    async def drain(self, deadline: float) -> int:
        """Finish in-flight I/O and persist cpu-only blocks to nvme until ``deadline``."""
        await self.promoter.settle(deadline - self.clock())
        saved = 0
        if self.nvme is not None:
            for meta in list(self.index.values()):
                if self.clock() >= deadline:
                    break
                if meta.in_cpu and not meta.in_nvme and await self.demoter.persist(meta):
                    saved += 1
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.flush(timeout=max(0.0, deadline - self.clock()))
        return saved

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The store's part of /v1/stats (tiers, requests, prefetch, leases, ...)."""
        return store_stats(self.tiers, self.requests, self.prefetch, self.transfers.moved,
                           self.bandwidth.stats(),
                           {"active": len(self.leases), "ttl_s": self.leases.ttl_s,
                            "quarantined_slots": self.quarantine.slots,
                            "quarantined_bytes": self.quarantine.bytes,
                            "quarantined_total": self.quarantine.total_slots},
                           eviction=getattr(self.cpu.policy, "name", "?"),
                           namespaces=len(self.ns), index_blocks=len(self.index),
                           recovery=self.recovery)
