"""Workload statistics learned online from lookups: how likely is a block to be reused?

The store (or the replay simulator) reports every lookup's full prefix chain to one
:class:`WorkloadStats` shared by the tiers' ``cost`` policies. It sorts each access into a
small *reuse class* from signals every prefix-caching workload has:

- how many distinct lookups have asked for the block so far (1, 2, 3-4, 5-8, 9+),
- whether the block was new to this lookup and, if so, whether the lookup matched a
  prefix before it (a fresh suffix behind a shared prefix vs. a wholly new prompt),
- whether it is the tail of the chain (the last chunk a prompt produced),
- its depth in the chain (log buckets).

For each class it keeps exponentially decayed counts of accesses and of accesses that
were followed by another one within the history horizon, so the estimate follows the
workload as it shifts. Nothing here is fitted to a particular trace: a new deployment
starts from a neutral prior and learns its own rates.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.policy.base import Key

_USE_BUCKETS = 5
_DEPTH_BUCKETS = 4
N_CLASSES = _USE_BUCKETS * 3 * 2 * _DEPTH_BUCKETS


def _use_bucket(uses: int) -> int:
    if uses <= 2:
        return uses - 1
    if uses <= 4:
        return 2
    return 3 if uses <= 8 else 4


def _depth_bucket(depth: int) -> int:
    if depth < 4:
        return 0
    if depth < 16:
        return 1
    return 2 if depth < 64 else 3


@dataclass(slots=True)
class _History:
    uses: int
    cls: int
    last: int  # lookup-clock tick of the last access


class WorkloadStats:
    """Per-class reuse probabilities, learned from the lookups the store reports.

    ``history`` bounds the keys remembered (an LRU of key records); a reuse that comes
    after a key fell out of the history counts as a new block, which is the horizon that
    matters to a cache of about ``history / 4`` blocks. ``half_life`` (in accesses) sets how
    fast old evidence fades. O(len(keys)) per lookup, O(1) per query.
    """

    __slots__ = (
        "_access", "_decay", "_hist", "_history", "_reuse", "_scale", "horizon", "prior", "tick",
    )

    def __init__(
        self, *, horizon: int = 65536, history: int = 1 << 20, half_life: float = 200_000.0
    ) -> None:
        if history <= 0 or half_life <= 0:
            raise ValueError("history and half_life must be positive")
        self._history = history
        self._hist: OrderedDict[Key, _History] = OrderedDict()
        self._access = [0.0] * N_CLASSES
        self._reuse = [0.0] * N_CLASSES
        # decayed counts are stored scaled by _scale, which grows each access (no O(n) decay)
        self._decay = 0.5 ** (1.0 / half_life)
        self._scale = 1.0
        self.prior = 0.5   # neutral guess before a class has evidence
        self.tick = 0      # lookup clock: block references seen so far
        self.horizon = horizon  # a reuse counts only within this many references

    # ---------------------------------------------------------------- observer API
    def on_lookup(self, keys: Sequence[Key], hit_blocks: int, *, now: float = 0.0) -> None:
        """Record one lookup of the chain ``keys`` whose first ``hit_blocks`` were cached."""
        hist = self._hist
        access = self._access
        reuse = self._reuse
        n = len(keys)
        fresh_kind = 1 if hit_blocks > 0 else 2
        for depth, key in enumerate(keys):
            self._scale /= self._decay
            w = self._scale
            rec = hist.get(key)
            tail = 1 if depth == n - 1 else 0
            if rec is None:
                uses = 1
                kind = fresh_kind
            else:
                if self.tick - rec.last <= self.horizon:
                    reuse[rec.cls] += w
                hist.move_to_end(key)
                uses = rec.uses + 1
                kind = 0
            cls = ((_use_bucket(uses) * 3 + kind) * 2 + tail) * _DEPTH_BUCKETS + _depth_bucket(
                depth
            )
            access[cls] += w
            if rec is None:
                hist[key] = _History(uses, cls, self.tick)
                if len(hist) > self._history:
                    hist.popitem(last=False)
            else:
                rec.uses = uses
                rec.cls = cls
                rec.last = self.tick
            self.tick += 1
        if self._scale > 1e200:
            self._renormalise()

    # ---------------------------------------------------------------- queries
    def reuse_probability(self, key: Key) -> float:
        """Estimated probability that ``key`` is asked for again within the horizon."""
        rec = self._hist.get(key)
        if rec is None:
            return self.prior
        return self.class_probability(rec.cls)

    def class_probability(self, cls: int) -> float:
        """Smoothed reuse rate of one class (Bayesian: two pseudo-accesses at ``prior``)."""
        s = self._scale
        pseudo = 2.0 * s
        return (self._reuse[cls] + pseudo * self.prior) / (self._access[cls] + pseudo)

    def uses(self, key: Key) -> int:
        """Distinct lookups that asked for ``key`` while it stayed in the history."""
        rec = self._hist.get(key)
        return 0 if rec is None else rec.uses

    def _renormalise(self) -> None:
        s = self._scale
        self._access = [a / s for a in self._access]
        self._reuse = [r / s for r in self._reuse]
        self._scale = 1.0

    def __len__(self) -> int:
        return len(self._hist)
