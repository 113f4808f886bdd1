"""Allocate with eviction: the one loop every tier uses to make room for a block."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvtier.policy.base import EvictionPolicy, Key

__all__ = ["MAX_EVICTIONS_PER_ALLOC", "allocate_with_eviction"]

S = TypeVar("S")

# A policy may offer victims that cannot go (pinned since it was asked: the evictor re-pins
# them) or that free a slot of another size class; this bounds the work of one allocation.
MAX_EVICTIONS_PER_ALLOC = 4096


async def allocate_with_eviction(try_alloc: Callable[[], S | None], policy: EvictionPolicy,
                                 evict: Callable[[Key], Awaitable[None]]) -> S | None:
    """``try_alloc()``, asking ``policy`` for a victim and ``evict``-ing it after each
    failure; None when the policy has no victim left (or the bound is reached). The caller
    counts the failure: what it means differs per tier."""
    for _ in range(MAX_EVICTIONS_PER_ALLOC):
        got = try_alloc()
        if got is not None:
            return got
        victim = policy.victim()
        if victim is None:
            return None
        await evict(victim)
    return None
