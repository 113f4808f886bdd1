"""Allocate with eviction: the one loop every tier uses to make room for a block."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvtier.policy.base import EvictionPolicy, Key

__all__ = ["EVICT_BATCH", "MAX_EVICTIONS_PER_ALLOC", "allocate_with_eviction"]

S = TypeVar("S")

# A policy may offer victims that cannot go (pinned since it was asked: the evictor re-pins
# them) or that free a slot of another size class; this bounds the work of one allocation.
MAX_EVICTIONS_PER_ALLOC = 4096
# Victims evicted at a time by a put that will need that many slots: their writes to nvme
# overlap in the tier's I/O threads. One at a time, each cost a round trip between the loop
# and an I/O thread: a full arena spilling 64 KiB blocks ran at 336-391 MB/s, 502-581 MB/s
# so. (Promotions still evict one at a time: batching them measured +20% at 64 KiB and
# -12% at 256 KiB, lookup + get of 32 blocks from nvme: not a clear win.)
EVICT_BATCH = 16


async def allocate_with_eviction(try_alloc: Callable[[], S | None], policy: EvictionPolicy,
                                 evict: Callable[[Key], Awaitable[None]], *,
                                 batch: int = 1) -> S | None:
    """``try_alloc()``, asking ``policy`` for a victim and ``evict``-ing it after each
    failure; None when the policy has no victim left (or the bound is reached). The caller
    counts the failure: what it means differs per tier.

    ``batch`` > 1 (a caller that will need that many slots): up to ``batch`` victims are
    chosen one after the other, each removed from the policy as it is chosen (as its
    eviction would remove it, so the next is the one the policy would offer after it: a
    leaf-first policy offers its parent), then evicted together so that their writes to
    the next tier overlap instead of costing a round trip to an I/O thread each. An
    ``evict`` that keeps such a victim puts it back in the policy."""
    evicted = 0
    while evicted < MAX_EVICTIONS_PER_ALLOC:
        got = try_alloc()
        if got is not None:
            return got
        victims = _victims(policy, max(1, min(batch, MAX_EVICTIONS_PER_ALLOC - evicted)))
        if not victims:
            return None
        evicted += len(victims)
        if len(victims) == 1:
            await evict(victims[0])
        else:
            await asyncio.gather(*(evict(v) for v in victims))
    return None


def _victims(policy: EvictionPolicy, n: int) -> list[Key]:
    """The policy's next ``n`` victims, in the order it would offer them one eviction at a
    time; with ``n`` > 1 they leave the policy here (see ``allocate_with_eviction``)."""
    first = policy.victim()
    if first is None or n == 1:
        return [first] if first is not None else []
    out: list[Key] = []
    key: Key | None = first
    while key is not None:
        policy.remove(key)
        out.append(key)
        key = policy.victim() if len(out) < n else None
    return out
