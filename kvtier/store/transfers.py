"""Byte movement between tiers, dispatched by (source, destination) ``TierName``.

The residencies decide what moves and keep the block state; the handlers here only move
bytes (arena slot <-> nvme frame, arena slot <-> Redis, nvme frame -> Redis) and count them
in ``BytesMoved``. cpu -> hbm copies run in ``kvtier.store.hbm`` (a batched device copy
in a worker thread) and are counted in the same ``BytesMoved``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from kvtier.bandwidth import BandwidthTracker
from kvtier.errors import FrameError, KVTierError
from kvtier.frame import Codec, FrameHeader, make_header, payload_checksum
from kvtier.index import BlockMeta
from kvtier.lograte import LogRate
from kvtier.store.ports import NvmePort, RedisPort
from kvtier.store.stats import BytesMoved
from kvtier.tiers.aligned import aligned_buffer, byte_view, round_up
from kvtier.tiers.arena import Arena
from kvtier.tiers.base import TierName
from kvtier.tiers.nvme import NvmeSlot
from kvtier.tiers.redis_queue import Borrowed

log = logging.getLogger("kvtier.store")
_warn = LogRate(log)   # per-block nvme failures: a failing disk has thousands

# A block at least this large is hashed for its nvme frame on a worker thread, not on the
# event loop (35 GB/s: 4 MiB is ~0.12 ms of hashing, a 32 MiB block ~1 ms, and an eviction
# demotes up to 16 at once); below it, the hop to the thread costs more than it spares.
HASH_OFF_LOOP_BYTES = 4 << 20

__all__ = ["Transfer", "TransferResult", "Transfers"]


@dataclass(slots=True)
class Transfer:
    """What to move: ``metas`` (one block, or a batch for Redis reads); ``slot`` the
    reserved destination of a write to nvme; ``sync`` makes that write durable; ``copy``
    sends a block to Redis as a copy, not from its pinned slot (a block leaving the arena:
    its slot is freed at once, not when the SET is over)."""

    metas: list[BlockMeta]
    slot: NvmeSlot | None = None
    sync: bool = False
    copy: bool = False


@dataclass(slots=True)
class TransferResult:
    moved: int = 0                 # leading blocks whose bytes arrived
    corrupt: bool = False          # the source frame is bad for good (drop it)
    checksum: int | None = None    # xxh3-64 of the payload now in the arena, when known
    checksums: list[int | None] = field(default_factory=list)  # the same, per block of a batch


Handler = Callable[[Transfer], Awaitable[TransferResult]]


def _no_lock(metas: list[BlockMeta]) -> None:
    return None


def _always(meta: BlockMeta) -> bool:
    return True


def _copy(dst: memoryview, src: memoryview) -> None:
    """A block's bytes into a private buffer, on a worker thread (numpy drops the GIL)."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def _not_plain(header: FrameHeader, meta: BlockMeta) -> str | None:
    """Why a verified nvme frame does not hold ``meta``'s raw bytes, or None. kvtier writes
    nvme frames unencoded and whole (``_cpu_to_nvme``), so anything else (a codec, a payload
    of another length) is a bad frame: its payload must never be served as the block."""
    if header.codec is not Codec.NONE:
        return f"encoded frame (codec {header.codec.name}); nvme frames are never encoded"
    if header.payload_len != meta.nbytes or header.raw_len != meta.nbytes:
        return (f"frame of {header.payload_len} bytes ({header.raw_len} raw) for a block of "
                f"{meta.nbytes}")
    return None


@dataclass(slots=True, eq=False)
class Transfers:
    """``pin``/``unpin`` read-lock arena slots that another tier reads in place (a
    zero-copy Redis write keeps its slot pinned until the SET is over); ``bandwidth``
    learns the reload rates (lower tier -> cpu) that lookups report to connectors."""

    arena: Arena
    nvme: NvmePort | None = None
    redis: RedisPort | None = None
    pin: Callable[[list[BlockMeta]], None] = _no_lock
    unpin: Callable[[list[BlockMeta]], None] = _no_lock
    # whether a block is still the live entry of its key (not deleted meanwhile)
    alive: Callable[[BlockMeta], bool] = _always
    # the commit journal's CommitLog.defer: a block framed for Redis from its slot hands its
    # frame checksum (the same xxh3-64 of the same bytes) to the journal, hashed once
    journal_defer: Callable[[BlockMeta], Callable[[int | None], None] | None] | None = None
    moved: BytesMoved = field(default_factory=BytesMoved)
    bandwidth: BandwidthTracker = field(default_factory=BandwidthTracker)
    _routes: dict[tuple[TierName, TierName], Handler] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._routes = {
            (TierName.CPU, TierName.NVME): self._cpu_to_nvme,
            (TierName.NVME, TierName.CPU): self._nvme_to_cpu,
            (TierName.REDIS, TierName.CPU): self._redis_to_cpu,
            (TierName.CPU, TierName.REDIS): self._cpu_to_redis,
            (TierName.NVME, TierName.REDIS): self._nvme_to_redis,
        }

    async def move(self, src: TierName, dst: TierName, job: Transfer) -> TransferResult:
        """Move ``job``'s bytes from ``src`` to ``dst``; never raises for tier trouble."""
        return await self._routes[(src, dst)](job)

    def _count(self, src: TierName, dst: TierName, metas: list[BlockMeta]) -> None:
        for meta in metas:
            self.moved.add(src, dst, meta.nbytes)

    def _arena_view(self, meta: BlockMeta, nbytes: int) -> memoryview:
        assert meta.cpu is not None
        return byte_view(self.arena.view(meta.cpu, nbytes))

    async def _cpu_to_nvme(self, job: Transfer) -> TransferResult:
        meta, nvme = job.metas[0], self.nvme
        assert nvme is not None and job.slot is not None
        meta.seq = nvme.next_seq()
        payload = self._arena_view(meta, round_up(meta.nbytes))
        body = payload[: meta.nbytes]
        checksum = None
        if meta.nbytes >= HASH_OFF_LOOP_BYTES:   # (the package releases the GIL as it hashes)
            checksum = await asyncio.get_running_loop().run_in_executor(
                None, payload_checksum, body)
        header = make_header(meta.namespace, meta.key, meta.layout_fp, body, seq=meta.seq,
                             chain=(meta.parent,), checksum=checksum)
        try:
            await nvme.write(job.slot, header, payload, sync=job.sync)
        except Exception as exc:
            _warn.warning("nvme-write", "nvme write of %s failed: %s", meta.key.hex(), exc)
            return TransferResult()
        self._count(TierName.CPU, TierName.NVME, job.metas)
        return TransferResult(moved=1)

    async def _nvme_to_cpu(self, job: Transfer) -> TransferResult:
        meta, nvme = job.metas[0], self.nvme
        assert nvme is not None and meta.nvme is not None
        view = self._arena_view(meta, round_up(meta.nbytes))
        t0 = time.perf_counter()
        try:
            header = await nvme.read_into(meta.nvme, view, namespace=meta.namespace,
                                          key=meta.key, layout_fp=meta.layout_fp)
            self.bandwidth.observe(TierName.NVME.value, TierName.CPU.value, meta.nbytes,
                                   time.perf_counter() - t0)
        except FrameError as exc:  # the frame is bad for good: drop it
            _warn.warning("nvme-bad", "dropping nvme block %s: %s", meta.key.hex(), exc)
            return TransferResult(corrupt=True)
        except KVTierError as exc:  # transient I/O trouble: keep the frame, miss this time
            _warn.warning("nvme-read", "nvme read of %s failed: %s", meta.key.hex(), exc)
            return TransferResult()
        except Exception:  # pragma: no cover - keep serving, never hand out the slot
            log.exception("nvme read failed for %s", meta.key.hex())
            nvme.counters.errors += 1
            return TransferResult()
        why = _not_plain(header, meta)
        if why is not None:   # the arena holds something else than the block: a miss
            nvme.counters.checksum_failures += 1
            _warn.warning("nvme-bad", "dropping nvme block %s: %s", meta.key.hex(), why)
            return TransferResult(corrupt=True)
        self._count(TierName.NVME, TierName.CPU, job.metas)
        # the arena now holds exactly the payload the frame's checksum covers
        return TransferResult(moved=1, checksum=header.checksum)

    async def _redis_to_cpu(self, job: Transfer) -> TransferResult:
        metas, redis = job.metas, self.redis
        assert redis is not None
        views = [self._arena_view(m, m.nbytes) for m in metas]
        sums: list[int | None] = [None] * len(metas)   # verified frame checksums
        t0 = time.perf_counter()
        try:
            n = await redis.get_into([m.key for m in metas], views,
                                     namespace=metas[0].namespace,
                                     layout_fp=metas[0].layout_fp, checksums=sums)
            self.bandwidth.observe(TierName.REDIS.value, TierName.CPU.value,
                                   sum(m.nbytes for m in metas[:n]), time.perf_counter() - t0)
        except Exception:  # the tier promises not to raise; be defensive anyway
            log.exception("redis promotion failed")
            n = 0
        self._count(TierName.REDIS, TierName.CPU, metas[:n])
        return TransferResult(moved=n, checksums=sums[:n])

    def _submit_from_slots(self, metas: list[BlockMeta]) -> None:
        """Zero-copy hand-off to Redis: each arena slot is pinned (a reader) until the tier
        releases it, once its SET is done, dropped or failed."""
        assert self.redis is not None
        self.pin(metas)
        defer, unpin = self.journal_defer, self.unpin
        self.redis.submit_many([
            Borrowed(m.namespace, m.key, m.layout_fp, self._arena_view(m, m.nbytes), m.seq,
                     partial(unpin, [m]), None if defer is None else defer(m))
            for m in metas])

    async def _cpu_to_redis(self, job: Transfer) -> TransferResult:
        if not job.copy:
            self._submit_from_slots(job.metas)
            self._count(TierName.CPU, TierName.REDIS, job.metas)
            return TransferResult(moved=len(job.metas))
        assert self.redis is not None
        moved = []
        for m in job.metas:
            if m.nbytes < HASH_OFF_LOOP_BYTES:   # ``submit`` copies what it is not lent
                self.redis.submit(m.namespace, m.key, m.layout_fp,
                                  self._arena_view(m, m.nbytes), seq=m.seq)
                moved.append(m)
                continue
            # a large block is copied on a worker thread (a fresh 32 MiB buffer is ms of
            # page faults and memcpy), its slot pinned meanwhile (a delete skips it, as it
            # skips a block being read); no longer the key's live block after all, the
            # copy is not sent (a SET after the key's DEL would bring it back in Redis)
            buf = np.empty(m.nbytes, np.uint8).data
            self.pin([m])
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, _copy, buf, self._arena_view(m, m.nbytes))
            finally:
                self.unpin([m])
            if self.alive(m) and m.in_cpu:
                self.redis.submit(m.namespace, m.key, m.layout_fp, buf, seq=m.seq, owned=True)
                moved.append(m)
        self._count(TierName.CPU, TierName.REDIS, moved)
        return TransferResult(moved=len(moved))

    async def _nvme_to_redis(self, job: Transfer) -> TransferResult:
        """A block leaving nvme: from its arena copy when it has one, else read back."""
        meta, nvme = job.metas[0], self.nvme
        if meta.in_cpu:
            self._submit_from_slots([meta])
        else:
            assert nvme is not None and meta.nvme is not None
            buf = aligned_buffer(round_up(meta.nbytes))
            meta.nvme_busy = True
            try:
                header = await nvme.read_into(meta.nvme, buf, namespace=meta.namespace,
                                              key=meta.key, layout_fp=meta.layout_fp)
            except KVTierError:
                return TransferResult()
            finally:
                meta.nvme_busy = False
            if _not_plain(header, meta) is not None:
                nvme.counters.checksum_failures += 1
                return TransferResult()
            assert self.redis is not None  # buf is ours: no copy (counted as the queue's)
            self.redis.submit(meta.namespace, meta.key, meta.layout_fp, buf[: meta.nbytes],
                              seq=meta.seq, owned=True)
        self._count(TierName.NVME, TierName.REDIS, job.metas)
        return TransferResult(moved=1)
