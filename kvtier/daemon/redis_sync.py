"""Synchronous write-through to Redis for a put commit (``put_commit`` with ``redis_sync_s``).

A prefill node (vLLM ``kv_producer``) must make a prompt's blocks visible in the shared
Redis before the request is reported finished, or the decode node that asks at once
misses. The write-behind queue gives no such moment, so a commit that asks for it waits:
the committed blocks are handed to the Redis tier from their arena slots (zero-copy,
pinned until their SET is over; unless write-through already did), and the commit waits
for exactly those SETs' replies (``RedisTier.written``): an OK is the confirmation, with no
queue drain and no probe after it. Blocks of the put's chain that were stored before (their
slots were skipped at prepare) and that this daemon has no recent write of are confirmed
with one namespace-checked probe; those Redis lacks are sent too when they are in the
arena; while the tier is healing (a master died and its replica is being promoted), the
sync waits for it and sends again (once per outage: when a sync waited one out in vain,
later ones give up at once, as a slot may stay lost for good). All of it is bounded by the
caller's timeout (at most ``MAX_SYNC_S``); a sync that ends short of the whole chain
(timeout, tier down, a block only on nvme) is counted in ``gave_up``. Writes queued before
ours still go first (the queue is FIFO), so a busy queue delays a sync, but writes queued
after it do not.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.index import BlockMeta
from kvtier.store import TieredStore
from kvtier.store.transfers import Transfer
from kvtier.tiers.base import TierName

MAX_SYNC_S = 60.0
HEAL_POLL_S = 0.05   # how often a sync waiting for a healing tier looks again


@dataclass(slots=True)
class RedisSyncCounters:
    """What synchronous commits did (exported under ``daemon.redis_sync`` in /v1/stats)."""

    commits: int = 0          # commits that asked for a synchronous write-through
    blocks: int = 0           # blocks of their chains confirmed in Redis
    gave_up: int = 0          # commits answered before their whole chain was in Redis
    seconds: float = 0.0      # total time spent waiting
    reasons: dict[str, int] = field(default_factory=dict)  # gave_up by reason


@dataclass(slots=True)
class _Progress:
    """How far one sync got: what a timeout reports, and the outage it is waiting out."""

    visible: int = 0
    waiting_on: float | None = None


@dataclass(frozen=True, slots=True)
class SyncResult:
    visible: int     # leading blocks of the chain confirmed in Redis
    complete: bool   # visible == len(chain)
    reason: str      # "ok", "off", "down", "timeout", "missing"


class RedisSync:
    """Write a committed chain through to Redis and confirm it, within a deadline."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.counters = RedisSyncCounters()
        # an outage (RedisTier.healing_since) that already cost a sync its whole bound:
        # later syncs do not wait for it again (a slot may stay lost for good)
        self._waited_out: float | None = None

    async def sync(self, digest: bytes, chain: list[bytes], fresh: list[BlockMeta],
                   timeout_s: float, since: float) -> SyncResult:
        """``chain``: every key of the put; ``fresh``: the blocks this commit stored;
        ``since``: when the commit began (``time.monotonic()``): a write of a chain key that
        ended since then confirms it without asking Redis, and the bound of ``timeout_s``
        counts from it (the commit's wait for room in the write queue spent part of it)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        progress = _Progress()
        left = min(max(timeout_s, 0.0), MAX_SYNC_S) - (time.monotonic() - since)
        try:
            async with asyncio.timeout(max(left, 0.0)):
                result = await self._sync(digest, chain, fresh, since, progress)
        except TimeoutError:
            result = SyncResult(progress.visible, False, "timeout")
            if progress.waiting_on is not None:
                self._waited_out = progress.waiting_on
        c = self.counters
        c.commits += 1
        c.blocks += result.visible
        c.seconds += loop.time() - t0
        if not result.complete:
            c.gave_up += 1
            c.reasons[result.reason] = c.reasons.get(result.reason, 0) + 1
        return result

    async def _sync(self, digest: bytes, chain: list[bytes], fresh: list[BlockMeta],
                    since: float, progress: _Progress) -> SyncResult:
        store, tier = self.store, self.store.redis
        if tier is None:
            return SyncResult(0, not chain, "off")
        if not chain:
            return SyncResult(0, True, "ok")
        if not tier.up:
            return SyncResult(0, False, "down")
        if not store.redis_write_through:   # the commit queued nothing: send them now
            await self._send([m for m in fresh if store.index.get(m.key) is m])
        visible = progress.visible = await self._confirmed(chain, digest, since)
        while visible < len(chain):
            # blocks of the chain that Redis lacks: stored before this put (skipped at
            # prepare) and written while it was down or evicted there, or a write that met
            # a master that had just died. Send what the arena has again; while the tier is
            # healing (a failed server, unserved slots: a replica is being promoted), wait
            # for it and try again, within the caller's bound, unless an earlier sync
            # already waited this outage out in vain.
            tail = [store.index.get(k) for k in chain[visible:]]
            await self._send([m for m in tail if m is not None and m.namespace == digest])
            visible += await self._confirmed(chain[visible:], digest, since)
            progress.visible = visible
            outage = tier.healing_since
            if visible == len(chain) or outage is None or outage == self._waited_out:
                break
            progress.waiting_on = outage
            while tier.healing_since == outage:
                await asyncio.sleep(HEAL_POLL_S)
            progress.waiting_on = None
        if visible == len(chain):
            return SyncResult(visible, True, "ok")
        return SyncResult(visible, False, "missing" if tier.up else "down")

    async def _confirmed(self, chain: list[bytes], digest: bytes, since: float) -> int:
        """How many leading blocks of ``chain`` Redis holds: the replies to this daemon's
        writes of them since ``since``, then one probe from the first block without one."""
        tier = self.store.redis
        assert tier is not None
        done = 0
        for stored in await tier.written(chain, since):
            if stored is None:
                return done + int(await tier.whole_prefix(chain[done:], namespace=digest))
            if not stored:
                return done
            done += 1
        return done

    async def _send(self, metas: list[BlockMeta]) -> None:
        """Queue ``metas`` for Redis from their arena slots (pinned until written: no copy)."""
        ready = [m for m in metas if m.in_cpu and m.cpu is not None]
        if ready:
            await self.store.transfers.move(TierName.CPU, TierName.REDIS, Transfer(ready))

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"commits": c.commits, "blocks": c.blocks, "gave_up": c.gave_up,
                "seconds": round(c.seconds, 6), "gave_up_by_reason": dict(c.reasons)}
