"""HBM placement for the store: the optional top tier that GPU clients read from.

``TieredStore`` owns one ``HbmPlacement`` (the hbm residency) when the daemon has an HBM
pool. It only acts for gets that ask for device placement
(``TieredStore.prepare_get_device``): the leading blocks of such a get, already ready and
read-locked in the cpu arena by the store, are copied arena slot -> device slot
(``HbmTier.copy_in``: a cupy H2D copy on a GPU, a memcpy over a host-memory fake in tests),
read-locked in hbm and handed out by hbm offset, so the engine's load is a device-to-device
copy. A later device get of the same block is an hbm hit.

Inclusion: a block is in hbm only while its cpu copy is. Blocks enter hbm from the arena
(never from a put), the store drops the hbm copy whenever it drops the cpu copy (eviction,
delete, orphan), and every hbm read lease also read-locks the cpu copy. So an hbm eviction
never needs a device-to-host write-back: it frees the device slot and the block stays
readable from cpu (and below). The cost is that hbm bytes are also counted in the arena,
which is normally several times larger than the pool. Hot hbm blocks stay hot in the cpu
policy too, because the store touches the cpu copy on every get.

Leases: each hbm read-lock is an ``HbmEntry.readers`` count, kept in the store's ``Lease``
(``Lease.hbm``) and given back on release, expiry or owner disconnect. A block with hbm
readers is pinned in the hbm eviction policy, so the pool never evicts a slot an engine may
be reading; capacity is hard (``SlabAllocator``), so a get that finds the pool full of
pinned blocks serves the rest from cpu.

Runs on the event loop thread like the store; only the copies run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.index import BlockMeta
from kvtier.policy.base import EvictionPolicy, Key, touch_chain
from kvtier.store.alloc import allocate_with_eviction
from kvtier.store.cpu import unknown_block_tokens
from kvtier.store.ports import HbmPort
from kvtier.store.stats import BytesMoved
from kvtier.tiers.arena import Arena
from kvtier.tiers.base import EvictionReason, TierName

log = logging.getLogger("kvtier.store")

__all__ = ["HbmEntry", "HbmPlacement"]


@dataclass(slots=True, eq=False)
class HbmEntry:
    """One block's device slot. ``ready`` once its bytes are on the device."""

    key: bytes
    offset: int
    nbytes: int
    readers: int = 0
    ready: bool = False
    loading: asyncio.Future[bool] | None = None


class HbmPlacement:
    """Residency, leases and eviction of blocks in the HBM pool (see the module docstring).

    ``tier`` is an ``HbmTier`` (or anything with its slot interface, ``HbmPort``); ``arena``
    the cpu arena the copies read from; ``moved`` the store's bytes-moved counter;
    ``pin_cpu``/``unpin_cpu`` the store's read-lock of cpu copies (to keep a copy's source
    while a cancelled get's copy finishes).
    """

    def __init__(self, tier: HbmPort, policy: EvictionPolicy, arena: Arena, *,
                 clock: Callable[[], float], moved: BytesMoved,
                 pin_cpu: Callable[[list[BlockMeta]], None],
                 unpin_cpu: Callable[[list[BlockMeta]], None]) -> None:
        self.tier = tier
        self.policy = policy
        self.arena = arena
        self.clock = clock
        self.moved = moved
        self._pin_cpu = pin_cpu
        self._unpin_cpu = unpin_cpu
        self.entries: dict[bytes, HbmEntry] = {}
        self.tokens_of: Callable[[BlockMeta], int] = unknown_block_tokens  # store wires it
        tier.placement = ("store: gets with device placement promote cpu -> hbm; inclusive "
                          "of cpu (evicting from hbm frees the device slot)")

    def __contains__(self, key: object) -> bool:
        entry = self.entries.get(key)  # type: ignore[call-overload]
        return entry is not None and entry.ready

    # -- gets ----------------------------------------------------------------------------
    async def acquire(self, metas: list[BlockMeta],
                      tokens_per_block: int) -> list[HbmEntry | None]:
        """Read-lock ``metas`` in hbm, copying the ones not there yet from the arena.

        The caller has the blocks ready in cpu and read-locked there for the whole call.
        Returns, per block, the read-locked entry to hand out, or None where the block is
        served from cpu (no room for it, or its copy failed). Promotion stops at the first
        block that does not fit; blocks after it that are already in hbm are still used.
        """
        out: list[HbmEntry | None] = [None] * len(metas)
        copies: list[tuple[int, BlockMeta, HbmEntry]] = []
        waits: list[tuple[int, HbmEntry]] = []
        can_place = True
        now = self.clock()
        c = self.tier.counters
        hits: list[bytes] = []
        for i, meta in enumerate(metas):
            entry = self.entries.get(meta.key)
            if entry is not None:
                c.hit_blocks += 1
                c.hit_tokens += tokens_per_block
                if entry.ready:
                    self._lock(entry)
                    hits.append(meta.key)
                    out[i] = entry
                else:  # another get is copying it right now: wait for that copy
                    waits.append((i, entry))
                continue
            c.miss_blocks += 1
            c.miss_tokens += tokens_per_block
            if not can_place:
                continue
            off = await self._alloc(meta.nbytes)
            if off is None:
                can_place = False
                continue
            entry = HbmEntry(meta.key, off, meta.nbytes, readers=1,
                             loading=asyncio.get_running_loop().create_future())
            self.entries[meta.key] = entry
            copies.append((i, meta, entry))
        touch_chain(self.policy, hits, now)   # tail first; locked, they are no victims
        try:
            if copies:
                await self._copy(copies, out)
            for i, entry in waits:
                if entry.loading is not None:
                    await asyncio.shield(entry.loading)
                if self.entries.get(entry.key) is entry and entry.ready:
                    self._lock(entry)
                    out[i] = entry
        except BaseException:   # cancelled: no lease will hold these locks
            self.release([e for e in out if e is not None])
            raise
        for entry in out:
            if entry is not None:
                c.bytes_read += entry.nbytes
        return out

    async def _copy(self, copies: list[tuple[int, BlockMeta, HbmEntry]],
                    out: list[HbmEntry | None]) -> None:
        """Run the copies in a worker thread and settle their entries.

        If the waiting get is cancelled the copy still finishes in its thread (its slots
        cannot be reused before that), and the entries are settled and unlocked then."""
        items = [(e.offset, self._source(m)) for _, m, e in copies]
        job = asyncio.get_running_loop().run_in_executor(None, self.tier.copy_in, items)
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            sources = [m for _, m, _ in copies]
            self._pin_cpu(sources)    # the caller unpins its get; the thread still reads

            def finish(f: asyncio.Future[None]) -> None:
                self._settle(copies, None, f)
                self._unpin_cpu(sources)

            job.add_done_callback(finish)
            raise
        except Exception:
            pass
        self._settle(copies, out, job)

    def _settle(self, copies: list[tuple[int, BlockMeta, HbmEntry]],
                out: list[HbmEntry | None] | None, job: asyncio.Future[None]) -> None:
        """Make copied entries ready (or drop them when the copy failed); ``out`` None: the
        get that started them is gone, so their read-locks are given back too."""
        exc = None if job.cancelled() else job.exception()
        ok = not job.cancelled() and exc is None
        if not ok:  # a device error: serve these blocks from cpu
            self.tier.counters.errors += 1
            log.warning("cpu -> hbm copy of %d blocks failed: %s", len(copies), exc)
        now = self.clock()
        for i, meta, entry in reversed(copies):   # a chain tail first (``touch_chain``)
            fut, entry.loading = entry.loading, None
            if ok:
                entry.ready = True
                self.policy.insert(meta.key, nbytes=meta.nbytes, parent=meta.parent,
                                   depth=meta.depth, now=now,
                                   block_tokens=self.tokens_of(meta))
                self.policy.set_pinned(meta.key, True)
                self.tier.counters.bytes_written += meta.nbytes
                self.moved.add(TierName.CPU, TierName.HBM, meta.nbytes)
                if out is not None:
                    out[i] = entry
                else:
                    self.release([entry])
            else:
                del self.entries[meta.key]
                self.tier.free(entry.offset)
            if fut is not None and not fut.done():
                fut.set_result(ok)

    def _source(self, meta: BlockMeta) -> object:
        assert meta.cpu is not None  # the caller read-locked it in cpu
        return self.arena.view(meta.cpu, meta.nbytes)

    def _lock(self, entry: HbmEntry) -> None:
        entry.readers += 1
        self.policy.set_pinned(entry.key, True)

    def release(self, entries: list[HbmEntry]) -> None:
        """Give back the read-locks of a get lease (released, expired or owner gone), a
        chain's tail first (``entries`` head first): the head re-enters a recency policy
        as the most recent block, so the chain is shortened from its tail (``touch_chain``).
        """
        for entry in reversed(entries):
            entry.readers -= 1
            if entry.readers == 0 and self.entries.get(entry.key) is entry:
                self.policy.set_pinned(entry.key, False)

    # -- capacity ------------------------------------------------------------------------
    async def _alloc(self, nbytes: int) -> int | None:
        """A device slot, evicting unpinned blocks by policy; None (counted) when full."""
        tier = self.tier
        off = await allocate_with_eviction(
            lambda: tier.alloc(nbytes) if tier.allocator.could_fit(nbytes) else None,
            self.policy, self._evict)
        if off is None:
            tier.counters.allocation_failures += 1
        return off

    async def _evict(self, victim: Key) -> None:
        entry = self.entries.get(victim)  # type: ignore[call-overload]
        if entry is None:
            self.policy.remove(victim)
        elif entry.readers or not entry.ready:  # the policy should not offer it
            self.policy.set_pinned(victim, True)
        else:
            self.drop(entry.key, EvictionReason.CAPACITY)

    def drop(self, key: bytes, reason: EvictionReason) -> bool:
        """Free ``key``'s device slot (the cpu copy, when there is one, is untouched).

        The store calls it before dropping a cpu copy; a block still being copied or read
        is left alone (the store never drops such a block: its cpu copy is read-locked).
        """
        entry = self.entries.get(key)
        if entry is None:
            return False
        if entry.readers or not entry.ready:   # would break inclusion: a bug, say so
            log.error("hbm copy of %s is in use while its cpu copy is dropped", key.hex())
            return False
        del self.entries[key]
        self.tier.free(entry.offset)
        self.policy.remove(key)
        self.tier.counters.evicted(reason)
        return True
