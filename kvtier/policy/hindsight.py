"""``hindsight``: ``cost``'s estimator trained on what the optimal cache would have kept.

After Hawkeye (Jain & Lin, ISCA'16): OPTgen replays the past references against an
*occupancy vector* (how many blocks the optimal cache of this capacity holds at each past
moment) and labels every reuse "OPT would have hit it" when the cache had room for the
block over the whole reuse interval, taking that room if so. The label accounts for
capacity competition, which "reused within the horizon" (``WorkloadStats``' label) does
not: a block reused four capacities later behind many others is no hit for any cache of
this size, however reusable it looks.

:class:`HindsightStats` is a :class:`~kvtier.policy.stats.WorkloadStats` whose class and key
records learn that label (same classes, same shrinkage, same per-key Beta posterior), and
:class:`HindsightPolicy` is ``cost``'s GreedyDual ordering with the value ``p x saved``:
``p`` already is "a hit of this block at this capacity", so no hit-density conversion.

OPTgen's window: reuses up to ``window`` capacities apart are labelled (longer ones count
as misses); time is quantised into buckets of ``capacity / 128`` references (the
occupancy vector has ``128 x window`` cells; an interval covers the buckets from its
start's to the one before its end's, so a reuse within one bucket is always a hit). Cost:
one numpy max and add over at most that many cells per reuse, or per chain of distinct
keys while the cache has room to spare over the chain's cells (``opt_hits``: the same
labels in a few numpy calls); memory: ``256 x window`` int32 cells.

Measured on the shared Mooncake trace (docs/replay-analysis.md, "a fourth attempt"):
with a window of 2-4 capacities it hits 1.20x LRU's tokens at 5% of the unique blocks
(mean over nine capacities 0.84-1.16x), where ``cost`` hits 1.17x.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.policy.base import Key, register_eviction_policy
from kvtier.policy.cost import CostPolicy, _Entry
from kvtier.policy.costmodel import BlockCosts
from kvtier.policy.stats import WorkloadStats

WINDOW_CAPACITIES = 4.0
"""OPTgen's window in capacities: reuses further apart are not labelled hits."""
BUCKETS_PER_CAPACITY = 128
"""Time quantum of the occupancy vector: a capacity's worth of references in this many."""


class HindsightStats(WorkloadStats):
    """Reuse classes learned from OPTgen's labels at ``capacity_blocks`` (see module doc;
    0: given later with :meth:`set_capacity`). ``window_capacities``: OPTgen's window. The
    other arguments are :class:`WorkloadStats`'.
    """

    __slots__ = ("_base", "_cap", "_occ", "_quantum", "_span", "_window", "_window_caps")

    def __init__(self, *, capacity_blocks: int = 0,
                 window_capacities: float = WINDOW_CAPACITIES, horizon: int = 65536,
                 history: int = 1 << 20, half_life: float = 200_000.0, strength: float = 8.0,
                 prior: float = 0.5, key_strength: float = 2.0) -> None:
        super().__init__(horizon=horizon, history=history, half_life=half_life,
                         strength=strength, prior=prior, key_strength=key_strength)
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must not be negative, got {capacity_blocks}")
        if not window_capacities > 0:
            raise ValueError(f"window_capacities must be positive, got {window_capacities}")
        self._window_caps = window_capacities
        self._cap = 0
        self._window = self._quantum = self._span = self._base = 0
        self._occ = np.zeros(0, dtype=np.int32)
        if capacity_blocks:
            self.set_capacity(capacity_blocks)

    @property
    def capacity_blocks(self) -> int:
        """The cache size OPTgen labels for (0: not known yet)."""
        return self._cap

    def set_capacity(self, capacity_blocks: int) -> None:
        """Label for a cache of ``capacity_blocks`` from now on (a daemon learns its tier's
        size in blocks at its first put). Until a size is known a reuse is labelled as
        ``WorkloadStats`` does (within the horizon); a new size restarts the vector."""
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if capacity_blocks == self._cap:
            return
        self._cap = capacity_blocks
        self._window = max(1, int(self._window_caps * capacity_blocks))
        self._quantum = max(1, capacity_blocks // BUCKETS_PER_CAPACITY)
        self._span = self._window // self._quantum + 2  # buckets an interval may cover
        self._occ = np.zeros(2 * self._span, dtype=np.int32)
        self._base = self.tick // self._quantum  # bucket number of _occ[0]

    def opt_hit(self, last: int, tick: int) -> bool:
        """OPTgen: would the optimal cache have held the block from ``last`` to ``tick``?
        If so the interval takes its room (the occupancy vector rises over it)."""
        if not self._cap:  # no size yet: "reused within the horizon"
            return tick - last <= self.horizon
        if tick - last > self._window:
            return False
        q = self._quantum
        b = tick // q - self._base
        if b >= len(self._occ):  # slide: keep the last span of buckets
            span = self._span
            keep = self._occ[b - span + 1:b + 1].copy() if b - span + 1 < len(self._occ) \
                else np.zeros(span, dtype=np.int32)
            self._occ[:] = 0
            self._occ[:len(keep)] = keep
            self._base += b - span + 1
            b = span - 1
        a = last // q - self._base
        seg = self._occ[max(a, 0):b]  # [last, tick): the reuse itself takes no room
        if seg.size and int(seg.max()) >= self._cap:
            return False
        seg += 1
        return True

    def opt_hits(self, lasts: Sequence[int], ticks: Sequence[int]) -> list[bool] | None:
        """``opt_hit`` of each (last, tick) pair in order, in a few numpy calls, or None
        (nothing changed) where the batch could differ from the calls one by one: when the
        vector would slide, or when the room could run out within the batch (the
        occupancy over the batch's cells plus its intervals reaches the capacity); a
        request's chain on a tier with room to spare takes the batch."""
        q, base, occ = self._quantum, self._base, self._occ
        if not self._cap or not ticks or ticks[-1] // q - base >= len(occ):
            return None
        window = self._window
        out: list[bool] = []
        starts: list[int] = []
        ends: list[int] = []
        for last, tick in zip(lasts, ticks, strict=True):
            if tick - last > window:
                out.append(False)
                continue
            out.append(True)
            a, b = max(last // q - base, 0), tick // q - base
            if a < b:   # a reuse within one bucket takes no room
                starts.append(a)
                ends.append(b)
        if not starts:
            return out
        lo, hi = min(starts), max(ends)
        seg = occ[lo:hi]
        if int(seg.max()) + len(starts) - 1 >= self._cap:
            return None
        rise = (np.bincount(np.array(starts) - lo, minlength=hi - lo + 1)
                - np.bincount(np.array(ends) - lo, minlength=hi - lo + 1))
        seg += np.cumsum(rise[:-1]).astype(np.int32)
        return out

    def _labels(self, keys: Sequence[Key], start: int, stop: int) -> list[bool | None] | None:
        """OPTgen's labels of a chain's references at once (``opt_hits``), where that is
        exactly what labelling them one by one gives: distinct keys, none of whose records
        the history can drop on the way."""
        n = stop - start
        hist = self._hist
        if n < 2 or not self._cap or len(hist) + n > self._history:
            return None
        piece = keys[start:stop]
        if len(set(piece)) != n:
            return None
        tick = self.tick
        where: list[int] = []
        lasts: list[int] = []
        for j, key in enumerate(piece):
            rec = hist.get(key)
            if rec is not None:
                where.append(j)
                lasts.append(rec.last)
        labels: list[bool | None] = [None] * n
        if not where:
            return labels
        hits = self.opt_hits(lasts, [tick + j for j in where])
        if hits is None:
            return None
        for j, hit in zip(where, hits, strict=True):
            labels[j] = hit
        return labels

    def _reused_in_time(self, last: int, tick: int) -> bool:
        """OPTgen's label in place of "within the horizon" (see ``opt_hit``)."""
        return self.opt_hit(last, tick)


@register_eviction_policy("hindsight")
class HindsightPolicy(CostPolicy):
    """``cost``'s GreedyDual with the value ``p x saved``, ``p`` from :class:`HindsightStats`
    (any :class:`WorkloadStats` works; with OPTgen's labels ``p`` is "OPT would hit it")."""

    name = "hindsight"

    __slots__ = ("_size_stats",)

    def __init__(self, *, stats: WorkloadStats | None = None, costs: BlockCosts | None = None,
                 reload_bandwidth: float | None = None, size_stats: bool = False) -> None:
        super().__init__(stats=stats, costs=costs, reload_bandwidth=reload_bandwidth)
        # size_stats: this is the tier whose size OPTgen labels for, learned at the first
        # eviction (its population then) when nobody gave it earlier
        self._size_stats = size_stats

    def victim(self) -> Key | None:
        """As ``cost``; the first call may size the stats' OPTgen (``size_stats``)."""
        if self._size_stats:
            self._size_stats = False
            stats = self._stats
            if isinstance(stats, HindsightStats) and not stats.capacity_blocks and self._entries:
                stats.set_capacity(len(self._entries))
        return super().victim()

    def _value(self, entry: _Entry) -> float:
        stats = self._stats
        if stats is None:
            return 0.5 * entry.saved
        return entry.saved * stats.reuse_estimate(entry.key)[0]

    def _schedule(self, entry: _Entry) -> None:
        self._place(entry, self._value(entry))
