"""TieredStore: lookup / put / get / promote / demote across cpu, nvme and redis.

The store is the control plane of the daemon. It decides and keeps the index; tiers move
bytes. It is the sole writer of the index and runs on the event loop thread; blocking I/O
happens inside the tiers' thread pools or Redis' asyncio client.

Movement:
- put: a client leases write-locked arena slots (``prepare_put``), fills them through
  shared memory and commits; a ``durable`` commit also writes the frames through to nvme
  before answering (what a caller needs to survive a daemon crash).
- get: ``lookup`` walks cpu -> nvme -> redis until the first miss and starts promoting
  lower-tier hits into the arena right away (prefetch); ``prepare_get`` waits for them
  as the prefetch policy says and hands out read-locked slots.
- eviction: each tier asks its eviction policy for a victim; a cpu victim is demoted to
  nvme (if admitted), an nvme victim to redis (if configured); otherwise it is dropped.
- leases expire, so a crashed client never pins arena memory.
- hbm (optional, GPU hosts): gets that ask for device placement (``prepare_get_device``)
  also copy their leading blocks into the daemon's HBM pool and hand out device offsets;
  the pool is inclusive of the arena, see ``kvtier.store_hbm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.bandwidth import BandwidthTracker
from kvtier.errors import (
    CapacityError,
    FrameError,
    KVTierError,
    LayoutMismatch,
    LeaseExpired,
    ProtocolError,
    UnknownNamespace,
)
from kvtier.frame import Codec, make_header
from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.keys import KEY_BYTES, Namespace
from kvtier.layout import KVLayout
from kvtier.leases import Lease, LeaseKind, LeaseTable, Quarantine, expired_error
from kvtier.policy.base import EvictionPolicy, make_eviction_policy
from kvtier.store_hbm import HbmEntry, HbmPlacement
from kvtier.store_recovery import CommitLog, RecoveryCounters, rebuild_nvme_only, recover
from kvtier.tiers._aligned import aligned_buffer
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_journal import JournalState
from kvtier.tiers.base import EvictionReason, Tier, TierCounters, TierName
from kvtier.tiers.slab import round_up

log = logging.getLogger("kvtier.store")

for _mod in ("lru", "lfu", "cost"):  # policies register themselves on import
    with contextlib.suppress(ImportError):
        importlib.import_module(f"kvtier.policy.{_mod}")


def _nothing() -> None:
    """Release callback for a buffer that nobody else holds."""


@dataclass(slots=True)
class LookupResult:
    hits: int
    tiers: list[str]


@dataclass(slots=True)
class RequestCounters:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    puts: int = 0
    put_blocks: int = 0
    gets: int = 0
    get_blocks: int = 0
    deletes: int = 0
    lease_expired: int = 0
    redis_budget_misses: int = 0   # Redis lookups cut at redis_lookup_budget_s: counted a miss
    namespace_mismatch: int = 0  # a key found, but stored under another namespace: a miss
    layout_mismatch: int = 0     # same namespace, another layout or block size: a miss


@dataclass(slots=True)
class PrefetchCounters:
    issued: int = 0
    hit_before_use: int = 0
    late: int = 0
    wasted: int = 0
    failed: int = 0


@dataclass(slots=True)
class CpuTier:
    """The arena seen as a tier (capacity, occupancy, counters)."""

    arena: Arena
    index: BlockIndex
    name: TierName = TierName.CPU
    counters: TierCounters = field(default_factory=TierCounters)
    resident: int = 0

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


@dataclass(slots=True)
class _Namespace:
    namespace: Namespace
    layout: KVLayout
    slot_bytes: int


class TieredStore:
    """The daemon's block store. All methods run on the event loop thread."""

    def __init__(self, arena: Arena, *, nvme: Any = None, redis: Any = None, hbm: Any = None,
                 eviction: str = "lru", lease_ttl_s: float = 30.0,
                 prefetch_wait: str = "timeout", prefetch_ms_per_block: float = 2.0,
                 policy_factory: Callable[[str, TierName], EvictionPolicy] | None = None,
                 admission: Any = None, observer: Any = None,
                 redis_write_through: bool = False, forest: Any = None,
                 redis_lookup_budget_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, max_namespaces: int = 4096,
                 ) -> None:
        self.index = BlockIndex()
        self.arena = arena
        self.cpu = CpuTier(arena, self.index)
        self.nvme = nvme
        self.redis = redis
        self.redis_write_through = redis_write_through
        self.redis_lookup_budget_s = redis_lookup_budget_s
        self.clock = clock
        self.lease_ttl_s = lease_ttl_s
        self.prefetch_wait = prefetch_wait
        self.prefetch_s_per_block = prefetch_ms_per_block / 1000.0
        make = policy_factory or (lambda name, tier: make_eviction_policy(name))
        self.cpu_policy: EvictionPolicy = make(eviction, TierName.CPU)
        self.nvme_policy: EvictionPolicy = make(eviction, TierName.NVME)
        self.hbm = hbm
        self.hbm_place: HbmPlacement | None = None
        if hbm is not None:
            self.hbm_place = HbmPlacement(hbm, make(eviction, TierName.HBM), arena,
                                          clock=clock, moved=self._moved, pin_cpu=self._pin,
                                          unpin_cpu=self._unpin)
        self.admission = admission
        self.observer = observer
        self.forest = forest  # PrefixForest: orphans of a block gone from every tier
        # least recently used first; beyond max_namespaces the head is forgotten (its blocks
        # stay; a client that uses it again gets UnknownNamespace and re-registers)
        self.namespaces: OrderedDict[bytes, _Namespace] = OrderedDict()
        self.max_namespaces = max(1, max_namespaces)
        self.namespaces_evicted = 0
        self.leases = LeaseTable(lease_ttl_s, clock)
        self.quarantine = Quarantine()  # slots of expired put leases, see kvtier.leases
        self.requests = RequestCounters()
        self.prefetch = PrefetchCounters()
        self.bytes_moved: dict[tuple[str, str], int] = {}
        self.explain: Any = None  # kvtier.explain.MissLog: why lookups miss (set by the daemon)
        self.bandwidth = BandwidthTracker()  # reload rates returned with lookups
        self._tasks: set[asyncio.Task[Any]] = set()
        self.commit_log = CommitLog(arena)     # journal COMMIT records (warm restart)
        self.recovery: RecoveryCounters | None = None

    # -- tiers ---------------------------------------------------------------------------
    @property
    def tiers(self) -> list[Tier]:
        out: list[Tier] = [self.hbm, self.cpu] if self.hbm is not None else [self.cpu]
        if self.nvme is not None:
            out.append(self.nvme)
        if self.redis is not None:
            out.append(self.redis)
        return out

    def _moved(self, src: str, dst: str, nbytes: int) -> None:
        k = (src, dst)
        self.bytes_moved[k] = self.bytes_moved.get(k, 0) + nbytes

    def rebuild_from_nvme(self) -> int:
        """Index every valid frame found on nvme (oldest first, so LRU order survives) and
        drop the frames no chain head leads to. Sync (runs ``nvme.open()``); the daemon uses
        ``recover``, which also adopts the arena."""
        return rebuild_nvme_only(self)

    async def recover(self, state: JournalState | None, *,
                      journal: Any = None) -> RecoveryCounters:
        """Warm restart: index nvme frames and the adopted arena's verified blocks, drop
        orphans, quarantine slots in flight at the crash for one lease TTL, then journal to
        ``journal`` (see ``kvtier.store_recovery``)."""
        return await recover(self, state, journal=journal, quarantine_s=self.lease_ttl_s)

    async def _redis_prefix(self, keys: list[bytes], digest: bytes) -> int:
        """``redis.exists_prefix`` (frames of namespace ``digest`` only) bounded by
        ``redis_lookup_budget_s`` (not by the Redis op timeout, which can be the connector's
        whole step budget): past it, a counted miss."""
        try:
            return int(await asyncio.wait_for(self.redis.exists_prefix(keys, namespace=digest),
                                              self.redis_lookup_budget_s))
        except asyncio.TimeoutError:
            self.requests.redis_budget_misses += 1
            return 0

    # -- namespaces ----------------------------------------------------------------------
    def register_namespace(self, layout: KVLayout, model_id: str, tp_rank: int, tp_size: int,
                           cache_salt: str | None) -> Namespace:
        ns = Namespace(model_id, layout, tp_rank, tp_size, cache_salt)
        self.namespaces[ns.digest] = _Namespace(ns, layout, round_up(layout.block_bytes))
        self.namespaces.move_to_end(ns.digest)
        while len(self.namespaces) > self.max_namespaces:
            self.namespaces.popitem(last=False)
            self.namespaces_evicted += 1
        return ns

    def touch_namespace(self, digest: bytes) -> KVLayout | None:
        """The layout a registered namespace uses (marking it recently used), or None."""
        entry = self.namespaces.get(digest)
        if entry is None:
            return None
        self.namespaces.move_to_end(digest)
        return entry.layout

    def _ns(self, digest: bytes, layout_fp: int) -> _Namespace:
        entry = self.namespaces.get(digest)
        if entry is None:
            raise UnknownNamespace("namespace not registered with this daemon: call "
                                   "register_layout first (the daemon may have restarted)")
        if entry.layout.fingerprint != layout_fp:
            raise LayoutMismatch("the layout fingerprint does not match the namespace's "
                                 "registered layout")
        return entry

    @staticmethod
    def split_keys(blob: bytes) -> list[bytes]:
        if not isinstance(blob, bytes) or len(blob) % KEY_BYTES:
            raise ProtocolError(f"keys must be a byte string of 16-byte keys, "
                                f"got {type(blob).__name__} of length {len(blob)}")
        return [blob[i: i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]

    def _foreign(self, meta: BlockMeta, ns: _Namespace) -> bool:
        """True (and counted) when ``meta`` is not the caller's to see: stored under another
        namespace (knowing a key is not a permission), or under another layout or block size
        (its slot would be read with the wrong length). To the caller it is a miss."""
        if meta.namespace != ns.namespace.digest:
            self.requests.namespace_mismatch += 1
            return True
        if meta.layout_fp != ns.layout.fingerprint or meta.nbytes != ns.layout.block_bytes:
            self.requests.layout_mismatch += 1
            return True
        return False

    # -- lookup + prefetch ---------------------------------------------------------------
    async def lookup(self, digest: bytes, layout_fp: int, keys: list[bytes],
                     *, prefetch: bool = True) -> LookupResult:
        """Leading keys present anywhere (cpu -> nvme -> redis); starts promotion."""
        try:
            ns = self._ns(digest, layout_fp)
        except KVTierError as exc:
            if self.explain is not None:
                self.explain.rejected(digest, len(keys), exc.code)
            raise
        now = self.clock()
        tiers: list[str] = []
        to_promote: list[BlockMeta] = []
        local: list[BlockMeta] = []
        cpu_c, tpb = self.cpu.counters, ns.layout.tokens_per_block
        for k in keys:
            meta = self.index.get(k)
            if meta is None or not meta.present or self._foreign(meta, ns):
                break
            local.append(meta)
            if meta.cpu_state in (SlotState.READY, SlotState.LOADING):
                tiers.append("cpu")
                if meta.in_cpu:
                    self.cpu_policy.touch(k, now=now)
            else:
                tiers.append("nvme")
                self.nvme_policy.touch(k, now=now)
                to_promote.append(meta)
        # Per tier: a hit is a block found there; a miss is a block that reached the tier
        # and was not there (blocks past the first overall miss reach no tier).
        n_local = len(tiers)
        n_cpu = tiers.count("cpu")
        stopped = 1 if n_local < len(keys) else 0
        cpu_c.hit_blocks += n_cpu
        cpu_c.hit_tokens += n_cpu * tpb
        cpu_c.miss_blocks += n_local - n_cpu + stopped
        cpu_c.miss_tokens += (n_local - n_cpu + stopped) * tpb
        if self.nvme is not None:
            nc = self.nvme.counters
            nc.hit_blocks += n_local - n_cpu
            nc.hit_tokens += (n_local - n_cpu) * tpb
            nc.miss_blocks += stopped
            nc.miss_tokens += stopped * tpb
        redis_keys: list[bytes] = []
        if n_local < len(keys) and self.redis is not None and self.redis.up:
            n_r = await self._redis_prefix(keys[n_local:], digest)
            redis_keys = keys[n_local: n_local + n_r]
            tiers.extend(["redis"] * n_r)
        hits = len(tiers)
        r = self.requests
        r.lookups += 1
        r.lookup_blocks += len(keys)
        r.hit_blocks += hits
        r.lookup_tokens += len(keys) * tpb
        r.hit_tokens += hits * tpb
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
            self._pin(chain)
            try:
                for meta in to_promote:
                    if not await self._promote_from_nvme(meta, prefetched=True):
                        break
                else:
                    if redis_keys:
                        await self._promote_from_redis(ns, redis_keys, keys, n_local)
            finally:
                self._unpin(chain)
        return LookupResult(hits, tiers)

    def _pin(self, metas: list[BlockMeta]) -> None:
        for meta in metas:
            meta.readers += 1
            if meta.in_cpu:
                self.cpu_policy.set_pinned(meta.key, True)

    def _unpin(self, metas: list[BlockMeta]) -> None:
        for meta in metas:
            meta.readers -= 1
            if meta.readers == 0 and meta.in_cpu:
                self.cpu_policy.set_pinned(meta.key, meta.cpu_pinned)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _promote_from_nvme(self, meta: BlockMeta, *, prefetched: bool) -> bool:
        """Start loading ``meta`` into the arena; False when there was no room for it."""
        if meta.cpu_state is not SlotState.NONE:
            return True
        if not meta.in_nvme or meta.nvme_busy:
            return False
        off = await self._alloc_cpu(meta.nbytes)
        if off is None or meta.cpu_state is not SlotState.NONE or not meta.in_nvme:
            if off is not None:
                self.arena.free(off)
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
        view = memoryview(self.arena.view(off, round_up(meta.nbytes)))
        ok = corrupt = False
        checksum = None
        t0 = time.perf_counter()
        try:
            header = await self.nvme.read_into(meta.nvme, view, namespace=meta.namespace,
                                               key=meta.key, layout_fp=meta.layout_fp)
            ok = True
            if header.codec is Codec.NONE and header.payload_len == meta.nbytes:
                checksum = header.checksum   # the arena now holds exactly the payload
            self.bandwidth.observe("nvme", "cpu", meta.nbytes, time.perf_counter() - t0)
        except FrameError as exc:  # the frame is bad for good: drop it
            corrupt = True
            log.warning("dropping nvme block %s: %s", meta.key.hex(), exc)
        except KVTierError as exc:  # transient I/O trouble: keep the frame, miss this time
            log.warning("nvme read of %s failed: %s", meta.key.hex(), exc)
        except Exception:  # pragma: no cover - keep serving, never hand out the slot
            log.exception("nvme read failed for %s", meta.key.hex())
            self.nvme.counters.errors += 1
        finally:
            meta.nvme_busy = False
        meta.loading = None
        if ok and meta.cpu == off:
            self._cpu_ready(meta, self.clock(), checksum)
            self._moved("nvme", "cpu", meta.nbytes)
        elif meta.cpu == off:
            self._drop_cpu(meta)
            self.prefetch.failed += 1
            if corrupt:
                self._drop_nvme(meta, EvictionReason.CORRUPT)
            self._forget_if_gone(meta)
        if not fut.done():
            fut.set_result(ok)

    async def _promote_from_redis(self, ns: _Namespace, rkeys: list[bytes],
                                  chain: list[bytes], start: int) -> None:
        metas: list[BlockMeta] = []
        for i, k in enumerate(rkeys):
            if k in self.index:
                break
            off = await self._alloc_cpu(ns.layout.block_bytes)
            if off is None or k in self.index:
                if off is not None:
                    self.arena.free(off)
                break
            depth = start + i
            parent = chain[depth - 1] if depth > 0 else None
            meta = BlockMeta(k, ns.namespace.digest, ns.layout.fingerprint,
                             ns.layout.block_bytes, parent, depth, cpu=off, prefetched=True)
            meta.set_cpu_state(SlotState.LOADING)
            meta.loading = asyncio.get_running_loop().create_future()
            self.index[k] = meta
            metas.append(meta)
        if metas:
            self.prefetch.issued += len(metas)
            self._spawn(self._load_redis(metas))

    async def _load_redis(self, metas: list[BlockMeta]) -> None:
        views = [memoryview(self.arena.view(m.cpu, m.nbytes)) for m in metas]  # type: ignore[arg-type]
        t0 = time.perf_counter()
        try:
            n = await self.redis.get_into([m.key for m in metas], views,
                                          namespace=metas[0].namespace,
                                          layout_fp=metas[0].layout_fp)
            self.bandwidth.observe("redis", "cpu", sum(m.nbytes for m in metas[:n]),
                                   time.perf_counter() - t0)
        except Exception:  # the tier promises not to raise; be defensive anyway
            log.exception("redis promotion failed")
            n = 0
        now = self.clock()
        for i, meta in enumerate(metas):
            ok = i < n
            if ok:
                self._cpu_ready(meta, now)
                if self.forest is not None:
                    self.forest.add(meta.key, meta.parent)
                self._moved("redis", "cpu", meta.nbytes)
            else:
                self.prefetch.failed += 1
                self._drop_cpu(meta)
                self._forget_if_gone(meta)
            fut, meta.loading = meta.loading, None
            if fut is not None and not fut.done():
                fut.set_result(ok)

    def _cpu_ready(self, meta: BlockMeta, now: float, checksum: int | None = None) -> None:
        """A slot's bytes are complete: make it readable and evictable (unless in use), and
        journal it (``checksum``: its payload's xxh3-64 when known, else hashed off-loop)."""
        meta.set_cpu_state(SlotState.READY)
        self.commit_log.ready(meta, checksum)
        self.cpu.resident += 1
        self.cpu_policy.insert(meta.key, nbytes=meta.nbytes, parent=meta.parent,
                               depth=meta.depth, now=now)
        if meta.cpu_pinned:
            self.cpu_policy.set_pinned(meta.key, True)

    # -- cpu allocation and eviction -----------------------------------------------------
    async def _alloc_cpu(self, nbytes: int) -> int | None:
        """A free arena slot, evicting by policy when needed; None if nothing can go."""
        for _ in range(4096):
            off = self.arena.alloc(nbytes)
            if off is not None:
                return off
            victim = self.cpu_policy.victim()
            if victim is None:
                break
            await self._evict_cpu(victim)
        self.cpu.counters.allocation_failures += 1
        return None

    async def _evict_cpu(self, key: Any) -> None:
        meta = self.index.get(key)
        if meta is None or not meta.in_cpu:
            self.cpu_policy.remove(key)
            return
        if meta.cpu_pinned:  # the policy should not offer it; keep it out of its queue
            self.cpu_policy.set_pinned(key, True)
            return
        if not meta.in_nvme and self.nvme is not None and self._admit(meta, "nvme"):
            await self._write_nvme(meta)
        if meta.readers or meta.cpu_state is not SlotState.READY:
            return  # re-pinned while we were writing
        if meta.prefetched:
            self.prefetch.wasted += 1
        self._drop_cpu(meta)
        self.cpu.counters.evicted(EvictionReason.CAPACITY)
        self._forget_if_gone(meta)

    def _admit(self, meta: BlockMeta, tier: str) -> bool:
        if self.admission is None:
            return True
        ok = bool(self.admission.admit(meta.key, tier=tier, nbytes=meta.nbytes,
                                       now=self.clock()))
        if not ok and self.explain is not None:
            self.explain.refused(meta.key, tier)
        return ok

    def _drop_cpu(self, meta: BlockMeta,
                  reason: EvictionReason = EvictionReason.CAPACITY) -> None:
        """Free the arena slot; an hbm copy goes with it (hbm is inclusive of cpu)."""
        if meta.cpu is None:
            return
        if self.hbm_place is not None:
            self.hbm_place.drop(meta.key, reason)
        was_ready = meta.in_cpu
        self.arena.free(meta.cpu)
        meta.cpu = None
        meta.set_cpu_state(SlotState.NONE)
        meta.prefetched = False
        if was_ready:
            self.cpu.resident -= 1
        self.cpu_policy.remove(meta.key)
        if self.explain is not None:
            self.explain.removed(meta.key, reason.value, "cpu")

    def _forget_if_gone(self, meta: BlockMeta) -> None:
        """Drop ``meta`` from the index once no tier holds it, and with it its orphans:
        a block whose parent is gone everywhere can never be reached by a prefix walk."""
        if meta.cpu is None and meta.nvme is None and self.index.get(meta.key) is meta:
            del self.index[meta.key]
            if self.forest is not None:
                for key in self.forest.discard(meta.key):
                    self._drop_orphan(key)

    def _drop_orphan(self, key: bytes) -> None:
        meta = self.index.get(key)
        if meta is None or meta.readers or meta.nvme_busy or meta.cpu_state in (
                SlotState.WRITING, SlotState.LOADING):
            return  # in use: it stays until it is evicted the ordinary way
        if meta.in_cpu:
            self._drop_cpu(meta, EvictionReason.ORPHAN)
            self.cpu.counters.evicted(EvictionReason.ORPHAN)
        if meta.nvme is not None:
            self._drop_nvme(meta, EvictionReason.ORPHAN)
        if self.index.get(key) is meta:
            del self.index[key]

    # -- nvme ----------------------------------------------------------------------------
    async def _alloc_nvme(self, nbytes: int) -> Any:
        for _ in range(4096):
            slot = self.nvme.alloc(nbytes)
            if slot is not None:
                return slot
            victim = self.nvme_policy.victim()
            if victim is None:
                return None
            await self._evict_nvme(victim)
        return None

    async def _evict_nvme(self, key: Any) -> None:
        meta = self.index.get(key)
        if meta is None or not meta.in_nvme:
            self.nvme_policy.remove(key)
            return
        if meta.nvme_busy:
            self.nvme_policy.set_pinned(key, True)
            return
        if self.redis is not None and self.redis.up and not self.redis_write_through \
                and self._admit(meta, "redis"):
            await self._demote_to_redis(meta)
        if meta.nvme_busy or not meta.in_nvme:
            return
        self._drop_nvme(meta, EvictionReason.CAPACITY)
        self._forget_if_gone(meta)

    async def _demote_to_redis(self, meta: BlockMeta) -> None:
        """Hand a block leaving nvme to Redis (from the arena copy, or read back first)."""
        if meta.in_cpu:
            self._submit_redis_from_slot(meta)
            self._moved("nvme", "redis", meta.nbytes)
            return
        buf = aligned_buffer(round_up(meta.nbytes))
        meta.nvme_busy = True
        try:
            await self.nvme.read_into(meta.nvme, buf, namespace=meta.namespace,
                                      key=meta.key, layout_fp=meta.layout_fp)
        except KVTierError:
            return
        finally:
            meta.nvme_busy = False
        self.redis.submit(meta.namespace, meta.key, meta.layout_fp,  # buf is ours: no copy
                          buf[: meta.nbytes], seq=meta.seq, release=_nothing)
        self._moved("nvme", "redis", meta.nbytes)

    def _submit_redis_from_slot(self, meta: BlockMeta) -> None:
        """Zero-copy hand-off to Redis: the arena slot is pinned (a reader) until the tier
        releases it, once the SET is done, dropped or failed."""
        self._pin([meta])
        self.redis.submit(meta.namespace, meta.key, meta.layout_fp,
                          memoryview(self.arena.view(meta.cpu, meta.nbytes)), seq=meta.seq,
                          release=lambda: self._unpin([meta]))

    def _drop_nvme(self, meta: BlockMeta, reason: EvictionReason, *, erase: bool = False) -> None:
        if meta.nvme is None:
            return
        self.nvme.free(meta.nvme, erase=erase)
        meta.nvme = None
        meta.nvme_ready = False
        self.nvme_policy.remove(meta.key)
        self.nvme.counters.evicted(reason)
        if self.explain is not None:
            self.explain.removed(meta.key, reason.value, "nvme")

    async def _write_nvme(self, meta: BlockMeta, *, sync: bool = False) -> bool:
        """Write the arena copy of ``meta`` to nvme as a frame; True when it is durable."""
        if meta.in_nvme:
            return True
        if meta.nvme_busy or not meta.in_cpu:
            return False
        if self.nvme.degraded:  # full disk: refused before allocating, which would evict
            self.nvme.refuse_write()
            return False
        meta.nvme_busy = True
        self.cpu_policy.set_pinned(meta.key, True)
        try:
            slot = await self._alloc_nvme(meta.nbytes)
            if slot is None or not meta.in_cpu:
                if slot is not None:
                    self.nvme.free(slot)
                return False
            meta.seq = self.nvme.next_seq()
            payload = memoryview(self.arena.view(meta.cpu, round_up(meta.nbytes)))
            header = make_header(meta.namespace, meta.key, meta.layout_fp,
                                 payload[: meta.nbytes], seq=meta.seq, chain=(meta.parent,))
            try:
                await self.nvme.write(slot, header, payload, sync=sync)
            except Exception as exc:
                log.warning("nvme write of %s failed: %s", meta.key.hex(), exc)
                self.nvme.free(slot)
                return False
            meta.nvme = slot
            meta.nvme_ready = True
            self.nvme_policy.insert(meta.key, nbytes=meta.nbytes, parent=meta.parent,
                                    depth=meta.depth, now=self.clock())
            self._moved("cpu", "nvme", meta.nbytes)
            return True
        finally:
            meta.nvme_busy = False
            if meta.in_cpu:
                self.cpu_policy.set_pinned(meta.key, meta.cpu_pinned)

    # -- put -----------------------------------------------------------------------------
    async def prepare_put(self, owner: int, digest: bytes, layout_fp: int,
                          keys: list[bytes], *, parent: bytes | None = None,
                          depth: int = 0) -> tuple[int, list[int | None]]:
        """Write-locked arena slots for the keys not stored yet (None: skip this key).

        ``keys`` is a piece of a prefix chain: ``parent`` is the key before ``keys[0]``
        and ``depth`` its 0-based position in the chain (0 and None for a whole prompt).
        """
        ns = self._ns(digest, layout_fp)
        nbytes = ns.layout.block_bytes
        self._check_fits(nbytes, keys)
        metas: list[BlockMeta] = []
        offsets: list[int | None] = []
        full = False  # after one failed allocation the rest would fail too: stop evicting
        for i, k in enumerate(keys):
            if full or k in self.index:
                offsets.append(None)
                continue
            off = await self._alloc_cpu(nbytes)
            if off is None or k in self.index:
                if off is not None:
                    self.arena.free(off)
                full = off is None
                offsets.append(None)
                continue
            meta = BlockMeta(k, digest, layout_fp, nbytes, keys[i - 1] if i else parent,
                             depth + i, cpu=off)
            meta.set_cpu_state(SlotState.WRITING)
            self.index[k] = meta
            metas.append(meta)
            offsets.append(off)
        lease = self._new_lease(LeaseKind.PUT, owner, metas)
        lease.chain = keys
        return lease.id, offsets

    def _check_fits(self, nbytes: int, keys: list[bytes]) -> None:
        """Fail fast, before evicting anything, when the new blocks could never fit."""
        slot = round_up(nbytes)
        if slot > self.arena.size:
            raise CapacityError(f"a block of {nbytes} bytes is larger than the cpu tier "
                                f"({self.arena.size} bytes): raise cpu.bytes or use smaller "
                                "blocks (tokens_per_block)")
        if len(keys) * slot > self.arena.size:
            new = len({k for k in keys if k not in self.index})
            if new * slot > self.arena.size:
                raise CapacityError(f"a put of {new} new blocks ({new * slot} bytes) exceeds "
                                    f"the cpu tier ({self.arena.size} bytes): put fewer "
                                    "blocks per request")

    async def commit_put(self, owner: int, lease_id: int, *, durable: bool = False,
                         output_tokens: int | None = None) -> int:
        """Make the written blocks visible; ``durable`` also writes them to nvme first.

        ``output_tokens`` (what the engine generated after this prompt, when known) feeds
        the workload observer: reuse is learned per class of request.
        """
        lease = self._take_lease(owner, lease_id, LeaseKind.PUT)
        now = self.clock()
        on_stored = getattr(self.observer, "on_stored", None)
        if on_stored is not None and lease.chain:
            on_stored(lease.chain, output_tokens=output_tokens, now=now)
        committed = []
        for meta in lease.metas:
            if meta.cpu_state is not SlotState.WRITING or self.index.get(meta.key) is not meta:
                continue
            self._cpu_ready(meta, now)
            if self.forest is not None:
                self.forest.add(meta.key, meta.parent)
            committed.append(meta)
        self.requests.puts += 1
        self.requests.put_blocks += len(committed)
        self.cpu.counters.bytes_written += sum(m.nbytes for m in committed)
        if self.redis is not None and self.redis_write_through:
            for meta in committed:
                self._submit_redis_from_slot(meta)
                self._moved("cpu", "redis", meta.nbytes)
        if durable and self.nvme is not None:
            results = await asyncio.gather(*(self._write_nvme(m, sync=True) for m in committed))
            return sum(results)
        return len(committed)

    def abort_put(self, owner: int, lease_id: int) -> None:
        """Drop a put; past its deadline this is a quiet no-op (nothing was stored, which is
        what an abort asks; the slots stay quarantined until the connection closes)."""
        try:
            lease = self._take_lease(owner, lease_id, LeaseKind.PUT)
        except LeaseExpired:
            return
        self._abort_put(lease)

    def _abort_put(self, lease: Lease) -> None:
        for meta in lease.metas:
            if meta.cpu_state is SlotState.WRITING and self.index.get(meta.key) is meta:
                self._drop_cpu(meta)
                if self.explain is not None:
                    self.explain.removed(meta.key, "lease", "cpu")
                self._forget_if_gone(meta)

    # -- get -----------------------------------------------------------------------------
    async def prepare_get(self, owner: int, digest: bytes, layout_fp: int,
                          keys: list[bytes]) -> tuple[int, list[int]]:
        """Read-locked arena slots for the leading keys that are (or become) readable."""
        metas = await self._readable_prefix(digest, layout_fp, keys)
        self.cpu.counters.bytes_read += sum(m.nbytes for m in metas)
        lease = self._new_lease(LeaseKind.GET, owner, metas)
        self.bandwidth.get_started(lease.id, sum(m.nbytes for m in metas))
        return lease.id, [m.cpu for m in metas]  # type: ignore[misc]

    async def prepare_get_device(self, owner: int, digest: bytes, layout_fp: int,
                                 keys: list[bytes]) -> tuple[int, list[int], list[str]]:
        """``prepare_get`` for a client that maps the HBM pool: (lease, offsets, devices).

        ``devices[i]`` is "hbm" when ``offsets[i]`` is a read-locked slot of the HBM pool and
        "cpu" when it is an arena slot (no hbm tier, no room in it, or a failed copy). The
        leading blocks are promoted cpu -> hbm first; the lease read-locks both copies.
        """
        metas = await self._readable_prefix(digest, layout_fp, keys)
        entries: list[HbmEntry | None] = [None] * len(metas)
        in_hbm: set[bytes] = set()
        if self.hbm_place is not None and metas:
            in_hbm = {m.key for m in metas if m.key in self.hbm_place.entries}
            tpb = self.namespaces[digest].layout.tokens_per_block
            try:
                entries = await self.hbm_place.acquire(metas, tpb)
            except BaseException:   # cancelled: no lease will hold the cpu read-locks
                self._unpin(metas)
                raise
        # read from cpu: blocks served from the arena and blocks copied from it into hbm
        self.cpu.counters.bytes_read += sum(m.nbytes for m, e in zip(metas, entries, strict=True)
                                            if e is None or m.key not in in_hbm)
        lease = self._new_lease(LeaseKind.GET, owner, metas)
        lease.hbm = [e for e in entries if e is not None]
        offsets = [m.cpu if e is None else e.offset for m, e in zip(metas, entries, strict=True)]
        devices = ["cpu" if e is None else "hbm" for e in entries]
        self.bandwidth.get_started(lease.id, sum(m.nbytes for m in metas),
                                   "hbm" if devices and "cpu" not in devices else "cpu")
        return lease.id, offsets, devices  # type: ignore[return-value]

    async def _readable_prefix(self, digest: bytes, layout_fp: int,
                               keys: list[bytes]) -> list[BlockMeta]:
        """The leading keys ready in the arena (promoting and waiting as the prefetch policy
        says), each read-locked once for the caller's lease."""
        ns = self._ns(digest, layout_fp)
        pending: list[asyncio.Future[bool]] = []
        chain: list[BlockMeta] = []
        for k in keys:
            meta = self.index.get(k)
            if meta is None or not meta.present or self._foreign(meta, ns):
                break
            self._pin([meta])  # pinned as it joins: the tail never evicts the head
            chain.append(meta)
            if meta.cpu_state is SlotState.NONE:
                await self._promote_from_nvme(meta, prefetched=False)
            if meta.cpu_state is SlotState.NONE:
                chain.pop()
                self._unpin([meta])
                break
            if meta.loading is not None:
                pending.append(meta.loading)
        if len(chain) < len(keys) and self.redis is not None and self.redis.up:
            before = len(chain)
            rkeys = keys[before:]
            n_r = await self._redis_prefix(rkeys, digest)
            if n_r:
                await self._promote_from_redis(ns, rkeys[:n_r], keys, before)
                for k in rkeys[:n_r]:
                    meta = self.index.get(k)
                    if meta is None or meta.loading is None:
                        break
                    self._pin([meta])
                    pending.append(meta.loading)
                    chain.append(meta)
        if pending:
            await self._wait_prefetch(pending)
        now = self.clock()
        metas: list[BlockMeta] = []
        ready = True
        for meta in chain:  # keep the leading ready blocks pinned; let the rest go
            ready = ready and meta.in_cpu and self.index.get(meta.key) is meta
            if not ready:
                self._unpin([meta])
                continue
            if meta.prefetched:
                self.prefetch.hit_before_use += 1
                meta.prefetched = False
            self.cpu_policy.touch(meta.key, now=now)
            metas.append(meta)
        self.requests.gets += 1
        self.requests.get_blocks += len(metas)
        return metas

    async def _wait_prefetch(self, pending: list[asyncio.Future[bool]]) -> None:
        not_done = [f for f in pending if not f.done()]
        if not not_done or self.prefetch_wait == "best_effort":
            self.prefetch.late += len(not_done)
            return
        timeout = None
        if self.prefetch_wait == "timeout":
            timeout = 0.05 + self.prefetch_s_per_block * len(pending)
        _done, still = await asyncio.wait(not_done, timeout=timeout)
        self.prefetch.late += len(not_done)
        if still:
            log.info("prefetch deadline passed with %d of %d blocks pending",
                     len(still), len(pending))

    def release_get(self, owner: int, lease_id: int, *, copy_s: float | None = None) -> None:
        """``copy_s``: how long the client's copy took, when it says (else the hold time
        measures the serve bandwidth)."""
        lease = self._take_lease(owner, lease_id, LeaseKind.GET)
        self.bandwidth.get_finished(lease_id, copy_s)
        self._release_get(lease)

    def _release_get(self, lease: Lease) -> None:
        if lease.hbm and self.hbm_place is not None:
            self.hbm_place.release(lease.hbm)
            lease.hbm = []
        for meta in lease.metas:
            meta.readers -= 1
            if meta.readers == 0 and meta.in_cpu:
                self.cpu_policy.set_pinned(meta.key, meta.cpu_pinned)

    # -- delete --------------------------------------------------------------------------
    async def delete(self, digest: bytes, layout_fp: int, keys: list[bytes]) -> int:
        """Remove the caller's blocks from every tier (blocks under a read lease, and blocks
        of another namespace, are skipped)."""
        ns = self._ns(digest, layout_fp)
        mine = [k for k in keys
                if (m := self.index.get(k)) is not None and not self._foreign(m, ns)]
        before = len(mine)
        for k in mine:
            meta = self.index.get(k)
            if meta is None or meta.readers or meta.nvme_busy or meta.cpu_state in (
                    SlotState.WRITING, SlotState.LOADING):
                continue
            if meta.in_cpu:
                self._drop_cpu(meta, EvictionReason.DELETED)
                self.cpu.counters.evicted(EvictionReason.DELETED)
            if meta.nvme is not None:
                self._drop_nvme(meta, EvictionReason.DELETED, erase=True)
            self._forget_if_gone(meta)  # also drops descendants orphaned by this delete
        n = before - sum(1 for k in mine if k in self.index)
        if self.redis is not None and self.redis.up:
            n = max(n, await self.redis.delete(keys, namespace=digest))
        self.requests.deletes += 1
        return n

    # -- leases --------------------------------------------------------------------------
    def _new_lease(self, kind: LeaseKind, owner: int, metas: list[BlockMeta]) -> Lease:
        return self.leases.open(kind, owner, metas)

    def _take_lease(self, owner: int, lease_id: int, kind: LeaseKind) -> Lease:
        """The lease a commit/abort/release names; ``LeaseExpired`` once past its deadline,
        whether or not the sweeper has reached it yet (the outcome never depends on it)."""
        lease = self.leases.take(owner, lease_id, kind)
        if lease.deadline <= self.clock():
            self._expire(lease)
            self.requests.lease_expired += 1
            raise expired_error(kind, lease_id, self.leases.ttl_s)
        return lease

    def expire_leases(self) -> int:
        """Take back leases past their deadline (a client that hung, stalled or forgot):
        get leases are released, put leases' slots are quarantined."""
        expired = self.leases.take_expired()
        for lease in expired:
            self._expire(lease)
        self.requests.lease_expired += len(expired)
        return len(expired)

    def _expire(self, lease: Lease) -> None:
        if lease.kind is LeaseKind.PUT:
            self._quarantine_put(lease)
        else:
            self._release_get(lease)

    def _quarantine_put(self, lease: Lease) -> None:
        """Forget an expired put's blocks but keep their slots allocated (quarantined) until
        the owner's connection closes: it may still be writing into them."""
        for meta in lease.metas:
            if meta.cpu_state is not SlotState.WRITING or meta.cpu is None:
                continue
            self.quarantine.add(lease.owner, meta.cpu, self.arena.slots.slot_size(meta.cpu))
            meta.cpu = None
            meta.set_cpu_state(SlotState.NONE)
            self._forget_if_gone(meta)

    def release_owner(self, owner: int) -> int:
        """A client connection closed: abort its puts, release its reads, free its
        quarantined slots (it can no longer write into them)."""
        mine = self.leases.take_owner(owner)
        for lease in mine:
            self._drop_lease(lease)
        for off in self.quarantine.take_owner(owner):
            self.arena.free(off)
        return len(mine)

    def _drop_lease(self, lease: Lease) -> None:
        self.bandwidth.get_abandoned(lease.id)
        if lease.kind is LeaseKind.PUT:
            self._abort_put(lease)
        else:
            self._release_get(lease)

    # -- shutdown ------------------------------------------------------------------------
    async def drain(self, deadline: float) -> int:
        """Finish in-flight I/O and persist cpu-only blocks to nvme until ``deadline``."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=max(0.0, deadline - self.clock()))
        saved = 0
        if self.nvme is not None:
            for meta in list(self.index.values()):
                if self.clock() >= deadline:
                    break
                if meta.in_cpu and not meta.in_nvme and await self._write_nvme(meta):
                    saved += 1
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.flush(timeout=max(0.0, deadline - self.clock()))
        return saved

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        from kvtier.tiers.base import tier_stats

        r = self.requests
        hit_rate = r.hit_blocks / r.lookup_blocks if r.lookup_blocks else 0.0
        out_tiers = {}
        for t in self.tiers:
            out_tiers[t.name.value] = tier_stats(t)
            extra = getattr(t, "stats_extra", None)
            if callable(extra):
                out_tiers[t.name.value].update(extra())
        return {
            "tiers": out_tiers,
            "requests": {**_asdict(r), "prefix_hit_rate": round(hit_rate, 6)},
            "prefetch": _asdict(self.prefetch),
            "bytes_moved": [{"src": s, "dst": d, "bytes": b}
                            for (s, d), b in sorted(self.bytes_moved.items())],
            "bandwidth": self.bandwidth.stats(),
            "leases": {"active": len(self.leases), "ttl_s": self.leases.ttl_s,
                       "quarantined_slots": self.quarantine.slots,
                       "quarantined_bytes": self.quarantine.bytes,
                       "quarantined_total": self.quarantine.total_slots},
            "policy": {"eviction": getattr(self.cpu_policy, "name", "?")},
            "namespaces": len(self.namespaces),
            "index_blocks": len(self.index),
            "recovery": _asdict(self.recovery) if self.recovery is not None else {},
        }


def _asdict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}
