"""Synchronous write-through to Redis for a put commit (``put_commit`` with ``redis_sync_s``).

A prefill node (vLLM ``kv_producer``) must make a prompt's blocks visible in the shared
Redis before the request is reported finished, or the decode node that asks at once
misses. The write-behind queue gives no such moment, so a commit that asks for it waits:
the committed blocks are handed to the Redis tier (unless write-through already did), the
queue is flushed, and one namespace-checked probe confirms how many leading blocks of the
put's chain Redis now holds; blocks of the chain that were stored before (their slots were
skipped at prepare) and that Redis lacks are sent too when they are in the arena. All of
it is bounded by the caller's timeout (at most ``MAX_SYNC_S``); a sync that ends short of
the whole chain (timeout, tier down, a block only on nvme) is counted in ``gave_up``.

Only the Redis tier's public surface is used (``submit``, ``flush``, ``exists_prefix``).
``flush`` waits for the queue to drain, including other clients' writes queued before
ours: the price of not reaching into the tier; it is FIFO, so ours are never overtaken.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvtier.index import BlockMeta
from kvtier.store import TieredStore

MAX_SYNC_S = 60.0


@dataclass(slots=True)
class RedisSyncCounters:
    """What synchronous commits did (exported under ``daemon.redis_sync`` in /v1/stats)."""

    commits: int = 0          # commits that asked for a synchronous write-through
    blocks: int = 0           # blocks of their chains confirmed in Redis
    gave_up: int = 0          # commits answered before their whole chain was in Redis
    seconds: float = 0.0      # total time spent waiting
    reasons: dict[str, int] = field(default_factory=dict)  # gave_up by reason


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

    async def sync(self, digest: bytes, chain: list[bytes], fresh: list[BlockMeta],
                   timeout_s: float) -> SyncResult:
        """``chain``: every key of the put; ``fresh``: the blocks this commit stored."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            async with asyncio.timeout(min(max(timeout_s, 0.0), MAX_SYNC_S)):
                result = await self._sync(digest, chain, fresh)
        except TimeoutError:
            result = SyncResult(0, False, "timeout")
        c = self.counters
        c.commits += 1
        c.blocks += result.visible
        c.seconds += loop.time() - t0
        if not result.complete:
            c.gave_up += 1
            c.reasons[result.reason] = c.reasons.get(result.reason, 0) + 1
        return result

    async def _sync(self, digest: bytes, chain: list[bytes],
                    fresh: list[BlockMeta]) -> SyncResult:
        store, tier = self.store, self.store.redis
        if tier is None:
            return SyncResult(0, not chain, "off")
        if not chain:
            return SyncResult(0, True, "ok")
        if not tier.up:
            return SyncResult(0, False, "down")
        if not store.redis_write_through:   # the commit queued nothing: send them now
            self._send(m for m in fresh if store.index.get(m.key) is m)
        await tier.flush()
        visible = int(await tier.exists_prefix(chain, namespace=digest))
        if visible < len(chain):
            # blocks of the chain stored before this put (skipped at prepare) that Redis
            # lacks, e.g. written while it was down or evicted there: send what the arena has
            tail = [store.index.get(k) for k in chain[visible:]]
            self._send(m for m in tail if m is not None and m.namespace == digest)
            await tier.flush()
            visible = int(await tier.exists_prefix(chain, namespace=digest))
        if visible == len(chain):
            return SyncResult(visible, True, "ok")
        return SyncResult(visible, False, "missing" if tier.up else "down")

    def _send(self, metas: Any) -> None:
        store, tier = self.store, self.store.redis
        if tier is None:   # _sync checked it; the store's redis is typed optional
            return
        for meta in metas:
            if meta.in_cpu and meta.cpu is not None:
                tier.submit(meta.namespace, meta.key, meta.layout_fp,
                            store.arena.view(meta.cpu, meta.nbytes).data, seq=meta.seq)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"commits": c.commits, "blocks": c.blocks, "gave_up": c.gave_up,
                "seconds": round(c.seconds, 6), "gave_up_by_reason": dict(c.reasons)}
