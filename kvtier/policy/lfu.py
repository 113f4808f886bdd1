"""Aged LFU: evict the block with the lowest exponentially decayed use count.

Each use adds 1 to a count that halves every ``half_life_s`` seconds. Comparing decayed
counts at a common time is the same as comparing ``log2(sum 2^(t_i / half_life))``, which
does not change while a block sits idle, so the priority is computed once per use and
kept in a heap (lazy invalidation): O(log n) per call, no periodic re-aging sweep.
Ties go to the deeper block first, so a chain that was used together loses its tail
before its head.
"""

from __future__ import annotations

import heapq
import math

from kvtier.policy.base import Key, register_eviction_policy


@register_eviction_policy("lfu")
class LFUPolicy:
    """Aged-frequency eviction (a baseline for ``cost``)."""

    name = "lfu"

    __slots__ = ("_depth", "_half_life", "_heap", "_pinned", "_score", "_seq")

    def __init__(self, *, half_life_s: float = 300.0) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self._half_life = half_life_s
        self._score: dict[Key, float] = {}
        self._depth: dict[Key, int] = {}
        self._pinned: set[Key] = set()
        self._heap: list[tuple[float, int, int, Key]] = []
        self._seq = 0

    def _bump(self, key: Key, now: float, old: float | None) -> None:
        x = now / self._half_life
        if old is None:
            score = x
        else:
            hi = old if old > x else x
            score = hi + math.log2(1.0 + 2.0 ** (-abs(old - x)))
        self._score[key] = score
        if key not in self._pinned:
            self._seq += 1
            heapq.heappush(self._heap, (score, -self._depth[key], self._seq, key))
            if len(self._heap) > 2 * len(self._score) + 1024:
                self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [
            (s, -self._depth[k], i, k)
            for i, (k, s) in enumerate(self._score.items())
            if k not in self._pinned
        ]
        heapq.heapify(self._heap)
        self._seq = len(self._heap)

    def insert(
        self, key: Key, *, nbytes: int = 0, parent: Key | None = None, depth: int = 0,
        now: float = 0.0,
    ) -> None:
        """Make ``key`` resident with one use at ``now`` (or count a use if resident)."""
        old = self._score.get(key)
        if old is None:
            self._depth[key] = depth
        self._bump(key, now, old)

    def touch(self, key: Key, *, now: float = 0.0) -> None:
        """Count a use of resident ``key``."""
        old = self._score.get(key)
        if old is not None:
            self._bump(key, now, old)

    def remove(self, key: Key) -> None:
        """Forget ``key``."""
        if self._score.pop(key, None) is not None:
            del self._depth[key]
            self._pinned.discard(key)

    def victim(self) -> Key | None:
        """The unpinned block with the lowest decayed count."""
        heap = self._heap
        while heap:
            score, _, _, key = heap[0]
            if self._score.get(key) == score and key not in self._pinned:
                return key
            heapq.heappop(heap)
        return None

    def set_pinned(self, key: Key, pinned: bool) -> None:
        """Hide ``key`` from :meth:`victim` while pinned."""
        if key not in self._score:
            return
        if pinned:
            self._pinned.add(key)
        elif key in self._pinned:
            self._pinned.discard(key)
            self._seq += 1
            heapq.heappush(self._heap, (self._score[key], -self._depth[key], self._seq, key))

    def __contains__(self, key: object) -> bool:
        return key in self._score

    def __len__(self) -> int:
        return len(self._score)
