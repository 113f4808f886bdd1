"""Aged LFU: evict the block with the lowest exponentially decayed use count.

Each use adds 1 to a count that halves every ``half_life_uses`` uses of the tier (a clock
that counts uses, not seconds, so aging follows the tier's traffic, not the wall clock).
Comparing decayed counts at a common time is the same as comparing
``log2(sum 2^(t_i / half_life))``, which does not change while a block sits idle, so the
priority is computed once per use and kept in a heap (lazy invalidation): O(log n) per
call, no periodic re-aging sweep.

Counts outlive residency: an evicted block's decayed count stays in a bounded history
(the role of TinyLFU's frequency sketch), so a block that keeps coming back is known as
frequent even though each stay was short. Without that, every re-insert starts from one
use and LFU degenerates into "evict whatever arrived last" (0.75x LRU's hits on the shared
Mooncake trace at 5% capacity; with it, within a few per cent of LRU either way, as aged
LFU is known to be there).

Defaults that follow the tier's size: the half-life is twice the number of resident blocks
and the history eight times, both fixed at the first eviction (when the tier is full, its
population is its capacity). Ties go to the deeper block first, so a chain that was used
together loses its tail before its head.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from kvtier.policy.base import Key, register_eviction_policy

HALF_LIFE_TIERS = 2.0
"""Default half-life in multiples of the tier's population (uses of the tier)."""
HISTORY_TIERS = 8
"""Default history of evicted blocks' counts in multiples of the tier's population."""


@register_eviction_policy("lfu")
class LFUPolicy:
    """Aged-frequency eviction (a baseline for ``cost``).

    ``half_life_uses``: uses of the tier after which a use weighs half (default: twice the
    population at the first eviction). ``history``: evicted blocks whose counts are
    remembered (default: eight times that population).
    """

    name = "lfu"

    __slots__ = (
        "_depth", "_half_life", "_heap", "_history", "_max_history", "_pinned", "_score",
        "_seq", "_uses",
    )

    def __init__(self, *, half_life_uses: float | None = None,
                 history: int | None = None) -> None:
        if half_life_uses is not None and half_life_uses <= 0:
            raise ValueError("half_life_uses must be positive")
        if history is not None and history < 0:
            raise ValueError("history must not be negative")
        self._half_life = half_life_uses or 0.0  # 0: not known yet (until the first victim)
        self._max_history = history
        self._score: dict[Key, float] = {}
        self._depth: dict[Key, int] = {}
        self._pinned: set[Key] = set()
        self._heap: list[tuple[float, int, int, Key]] = []
        self._history: OrderedDict[Key, float] = OrderedDict()
        self._seq = 0
        self._uses = 0

    def _bump(self, key: Key, old: float | None) -> None:
        self._uses += 1
        # before the half-life is known (nothing evicted yet) every use counts as time 0
        x = self._uses / self._half_life if self._half_life else 0.0
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
        now: float = 0.0, block_tokens: int = 0,
    ) -> None:
        """Make ``key`` resident with one more use (its remembered count, if any, resumes)."""
        old = self._score.get(key)
        if old is None:
            self._depth[key] = depth
            old = self._history.pop(key, None)
        self._bump(key, old)

    def touch(self, key: Key, *, now: float = 0.0) -> None:
        """Count a use of resident ``key``."""
        old = self._score.get(key)
        if old is not None:
            self._bump(key, old)

    def remove(self, key: Key) -> None:
        """``key`` left the tier; its count goes to the bounded history."""
        score = self._score.pop(key, None)
        if score is None:
            return
        del self._depth[key]
        self._pinned.discard(key)
        limit = self._max_history
        if limit is None:  # before the first eviction: size it on the population so far
            limit = self._default_history()
        if limit > 0:
            self._history[key] = score
            while len(self._history) > limit:
                self._history.popitem(last=False)

    def _default_history(self) -> int:
        return int(HISTORY_TIERS * max(len(self._score), 1))

    def victim(self) -> Key | None:
        """The unpinned block with the lowest decayed count."""
        if not self._half_life:
            self._half_life = HALF_LIFE_TIERS * max(len(self._score), 1)
            if self._max_history is None:
                self._max_history = self._default_history()
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
