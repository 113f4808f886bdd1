"""The write side: a put leases write-locked arena slots, the client fills them through
shared memory, and the commit makes them visible (and, ``durable``, writes them to nvme
before answering: what a caller needs to survive a daemon crash)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import CapacityError
from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.leases import LeaseKind
from kvtier.policy.base import LookupObserver, SlicedStoreObserver
from kvtier.store.alloc import EVICT_BATCH
from kvtier.store.cpu import CpuResidency
from kvtier.store.demotion import Demoter
from kvtier.store.leasing import LeaseKeeper
from kvtier.store.namespaces import NamespaceEntry
from kvtier.store.ports import ForestPort
from kvtier.store.slices import Turn, slices
from kvtier.store.stats import RequestCounters
from kvtier.store.transfers import Transfer, Transfers
from kvtier.tiers.aligned import round_up
from kvtier.tiers.base import TierName

__all__ = ["Writer"]

# new keys placed per batch (slots, journal records, index entries, presence counters at
# once) between two looks at the request's turn on the event loop (kvtier.store.slices)
PREPARE_BATCH = 128
# chain keys reported stored to the workload observer between two such looks
STORED_PIECE = 256
# committed blocks queued for Redis (write-through) between two such looks
WRITE_THROUGH_PIECE = 128
# a durable commit waits this long at most for nvme writes of its chain already in flight
BUSY_WAIT_S = 10.0
BUSY_POLL_S = 0.002


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
                      parent: bytes | None, depth: int, *, max_new: int | None = None
                      ) -> tuple[int, list[int | None]]:
        """Write-locked arena slots for the keys not stored yet (None: skip this key), for
        at most ``max_new`` of them (the leading ones)."""
        digest, layout_fp = ns.namespace.digest, ns.layout.fingerprint
        nbytes = ns.layout.block_bytes
        self._check_fits(nbytes, keys)
        index, cpu = self.index, self.cpu
        offsets: list[int | None] = [None] * len(keys)
        metas: list[BlockMeta] = []
        fresh = index.new_positions(keys)
        end = len(keys)   # keys from here on get no slot
        if max_new is not None and len(fresh) > max_new:
            end = fresh[max_new]
            fresh = fresh[:max_new]
        # the common case first: room for the new keys without evicting, no await, the
        # slots, journal records and presence counters taken a batch at a time
        turn = Turn()
        for part in slices(fresh, PREPARE_BATCH):
            if turn.over():   # (another put may have indexed some of them meanwhile)
                await turn.pause()
                part = [i for i in part if keys[i] not in index]
            slots = cpu.try_alloc_many(nbytes, len(part))   # (fewer on a full arena)
            new = [BlockMeta(keys[i], digest, layout_fp, nbytes, keys[i - 1] if i else parent,
                             depth + i, cpu=off, cpu_state=SlotState.WRITING)
                   for i, off in zip(part[:len(slots)], slots, strict=True)]
            index.add_new(new)
            metas += new
            for i, off in zip(part, slots, strict=False):
                offsets[i] = off
            if len(slots) < len(part):   # the rest, evicting for room
                await self._place_evicting(keys, part[len(slots)], end, parent, depth, ns,
                                           metas, offsets)
                break
        lease = self.leases.open(LeaseKind.PUT, owner, metas)
        lease.chain = keys
        lease.namespace = digest
        return lease.id, offsets

    async def _place_evicting(self, keys: list[bytes], start: int, end: int,
                              parent: bytes | None, depth: int, ns: NamespaceEntry,
                              metas: list[BlockMeta], offsets: list[int | None]) -> None:
        """``prepare``'s slots for ``keys[start:end]``, evicting by policy to make room
        (appended to ``metas``, set in ``offsets``)."""
        digest, layout_fp = ns.namespace.digest, ns.layout.fingerprint
        nbytes = ns.layout.block_bytes
        index, cpu = self.index, self.cpu
        after: int | None = None   # new keys after this one (counted at the first eviction)
        for i in range(start, end):
            k = keys[i]
            if k in index:
                continue
            if after is not None:
                after -= 1
            off = cpu.try_alloc(nbytes)   # (an eviction may have freed more than one)
            if off is None:   # evict for the keys still to place, several at a time
                if after is None:
                    after = sum(1 for x in keys[i + 1:end] if x not in index)
                off = await cpu.alloc(nbytes, batch=min(EVICT_BATCH, after + 1))
                if off is None or k in index:   # (stored by another put meanwhile)
                    if off is not None:
                        cpu.arena.free(off)
                    if off is None:   # the rest would fail too: stop evicting
                        return
                    continue
            meta = BlockMeta(k, digest, layout_fp, nbytes, keys[i - 1] if i else parent,
                             depth + i, cpu=off, cpu_state=SlotState.WRITING)
            index[k] = meta
            metas.append(meta)
            offsets[i] = off

    async def _report_stored(self, chain: list[bytes], output_tokens: int | None, now: float,
                             turn: Turn) -> None:
        """Tell the observer the request is stored, before its blocks are inserted: a piece
        at a time when it can take one (the lookups it queued before, then the chain)."""
        observer = self.observer
        if not isinstance(observer, SlicedStoreObserver):
            on_stored = getattr(observer, "on_stored", None)
            if on_stored is not None:
                on_stored(chain, output_tokens=output_tokens, now=now)
            return
        mark = observer.queued_through()
        while not observer.replay_until(mark):
            await turn.pause()
        for lo in range(0, len(chain), STORED_PIECE):
            if turn.over():
                await turn.pause()
            observer.on_stored_range(chain, output_tokens=output_tokens, now=now, start=lo,
                                     stop=lo + STORED_PIECE)

    async def _write_through(self, metas: list[BlockMeta], turn: Turn,
                             wait_s: float | None) -> None:
        """Queue ``metas`` for Redis a piece at a time. The write queue holds
        ``redis.write_queue_blocks`` and drops its oldest when full: a synchronous commit
        (``wait_s``) waits for room before each piece instead (up to ``wait_s`` in all),
        its blocks pinned until queued, so that a chain longer than the queue does not
        push its own head out (it was: a 300-block chain, visible 0 of 300)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        redis = self.transfers.redis
        pinned = queued = 0   # metas[:pinned] pinned here; metas[:queued] queued (unpinned)
        # no pause before the first piece: it is framed in the commit's own turn, before the
        # journal's drain can hash its blocks (the frame's checksum is the record's)
        try:
            while deadline is not None and pinned < len(metas):   # none evicted before its
                if pinned and turn.over():                          # turn to be queued
                    await turn.pause()
                chunk = metas[pinned: pinned + 4 * WRITE_THROUGH_PIECE]
                self.transfers.pin(chunk)
                pinned += len(chunk)
            while queued < len(metas):
                if queued and turn.over():
                    await turn.pause()
                take = min(WRITE_THROUGH_PIECE, len(metas) - queued)
                if deadline is not None and redis is not None:
                    # no more than the queue has room for (when it has none by the
                    # deadline, or Redis is down, the piece goes as it would have)
                    free = await redis.room(take, deadline - time.monotonic())
                    take = min(take, free) if free else take
                part = metas[queued: queued + take]
                # (unpinned, a block committed before a pause may have been evicted since)
                live = [m for m in part if m.in_cpu and self.index.get(m.key) is m]
                if live:
                    await self.transfers.move(TierName.CPU, TierName.REDIS, Transfer(live))
                queued += len(part)
                if pinned:
                    self.transfers.unpin(part)
        except BaseException:
            if pinned > queued:
                self.transfers.unpin(metas[queued:pinned])
            raise

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
                     output_tokens: int | None, redis_wait_s: float | None = None) -> int:
        """Make the written blocks visible; how many are stored (durably, with ``durable``).
        ``redis_wait_s``: a synchronous write-through (kvtier.daemon.redis_sync) may wait
        that long in all for room in the Redis write queue rather than drop blocks."""
        lease = self.leases.take(owner, lease_id, LeaseKind.PUT)
        now = self.clock()
        turn = Turn()
        if lease.chain:
            await self._report_stored(lease.chain, output_tokens, now, turn)
        committed: list[BlockMeta] = []
        for part in slices(lease.metas):   # (a lease's slots are its own across a pause)
            if turn.over():
                await turn.pause()
            ready = [m for m in part
                     if m.cpu_state is SlotState.WRITING and self.index.get(m.key) is m]
            self.cpu.ready_many(ready, now, [None] * len(ready))
            if self.forest is not None:
                for meta in ready:
                    self.forest.add(meta.key, meta.parent)
            committed += ready
        self.requests.puts += 1
        self.requests.put_blocks += len(committed)
        self.cpu.counters.bytes_written += sum(m.nbytes for m in committed)
        if self.redis_write_through and committed:
            await self._write_through(committed, turn, redis_wait_s)
        if durable and self.nvme_present:
            return await self._persist_chain(lease.chain, committed)
        return len(committed)

    async def _persist_chain(self, chain: list[bytes], committed: list[BlockMeta]) -> int:
        """A durable commit: its blocks to nvme, and with them every block a lookup walks
        to reach them (the chain's ancestors and its keys stored before, when they are in
        the arena only); how many of the commit's blocks have their whole chain there.

        Persisting the new blocks alone was not durable: after a crash that lost the arena,
        recovery erases the nvme frames no chain head leads to (found by review: 7 blocks
        acknowledged durable behind a head stored without ``durable``, erased)."""
        index = self.index
        turn = Turn()
        path: dict[bytes, BlockMeta] = {}
        first = index.get(chain[0]) if chain else None
        up = first.parent if first is not None else None
        while up is not None and up not in path:   # (a parent cycle ends at a seen key)
            meta = index.get(up)
            if meta is None:   # an ancestor in no tier: recovery would drop the chain
                break
            path[up] = meta
            up = meta.parent
            if turn.due(len(path)):   # (a long context's chain: thousands of ancestors)
                await turn.pause()
        reachable = up is None   # (not a missing ancestor, nor a cycle)
        ancestors = list(reversed(path.values()))
        fresh = {id(m) for m in committed}
        own = [m for k in chain if (m := index.get(k)) is not None and id(m) not in fresh]
        todo = [m for m in {id(m): m for m in [*ancestors, *own, *committed]}.values()
                if not m.in_nvme]   # (one task per block still to write, not per ancestor)
        await asyncio.gather(*(self.demoter.persist(m, sync=True) for m in todo))
        # a block another write had in flight (an eviction's demotion, a concurrent durable
        # commit sharing the prefix) was not written here: its outcome is that write's
        await self._until_written([m for m in todo if m.nvme_busy])
        # counted as they are now: a frame written here may have evicted one of the chain
        # written before (a small nvme tier), and that chain is not durable any more
        if not reachable or not all(m.in_nvme and index.get(m.key) is m for m in ancestors):
            return 0
        stored = 0
        for k in chain:   # a block counts when every block before it is on nvme too
            meta = index.get(k)
            if meta is None or not meta.in_nvme:
                break
            stored += id(meta) in fresh
        return stored

    async def _until_written(self, metas: list[BlockMeta]) -> None:
        """Until no write to nvme is in flight for ``metas`` (bounded: a stuck write
        leaves them not durable)."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while metas and time.monotonic() < deadline:
            await asyncio.sleep(BUSY_POLL_S)
            metas = [m for m in metas if m.nvme_busy]
