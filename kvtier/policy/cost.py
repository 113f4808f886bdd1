"""``cost``: kvtier's default eviction policy, prefix-aware and value-per-byte ordered.

A block's value is ``reuse probability x (recompute seconds - reload seconds from the next
tier down) / bytes``: what keeping it here saves, per byte it occupies.

- reuse probability comes from :class:`~kvtier.policy.stats.WorkloadStats` (learned online
  per reuse class: use count, fresh-vs-shared, chain tail, depth);
- recompute seconds from :class:`~kvtier.policy.costmodel.BlockCosts` (prefill FLOPs of the
  chunk at its position: later chunks of long prompts cost more);
- reload seconds from the bandwidth of the tier below (``None``: nothing below, the block
  would have to be recomputed).

Ordering: each block gets a deadline ``t + horizon x value / mean value`` when it is
inserted or used, where ``t`` is the lookup clock and ``horizon`` the number of resident
blocks (the time an average block survives under LRU). The victim is the leaf with the
earliest deadline. With equal values this is exactly LRU; a block twice as valuable as
average survives about twice as long without a hit, a worthless one leaves first.

Prefix-aware: only leaves (blocks with no child resident in this tier) are candidates, so
a chain is shortened from its tail and a parent never leaves before its children. Orphans
(children of a block gone from every tier) are found by
:class:`~kvtier.policy.prefix.PrefixForest` and removed by the caller.

Heap with lazy invalidation: O(log n) per insert/touch, amortised O(log n) per victim.
"""

from __future__ import annotations

import heapq

from kvtier.policy.base import Key, register_eviction_policy
from kvtier.policy.costmodel import BlockCosts
from kvtier.policy.stats import WorkloadStats


class _Entry:
    """One resident block (a plain slotted class: mutable, no dataclass overhead)."""

    __slots__ = ("children", "depth", "key", "nbytes", "parent", "pinned", "prio")

    def __init__(self, key: Key, nbytes: int, parent: Key | None, depth: int) -> None:
        self.key = key
        self.nbytes = nbytes
        self.parent = parent
        self.depth = depth
        self.children = 0
        self.pinned = False
        self.prio = 0.0


@register_eviction_policy("cost")
class CostPolicy:
    """Evicts the leaf block with the earliest value-scaled deadline (see module doc).

    ``stats`` is shared by the tiers of one store and fed with every lookup; without it
    every block has the same reuse estimate and the policy orders by cost and recency
    only. ``reload_bandwidth`` is the read bandwidth (B/s) of the next tier down, ``None``
    for the last tier.
    """

    name = "cost"

    __slots__ = (
        "_costs", "_entries", "_heap", "_mean", "_reload_bw", "_saved", "_seq", "_stats",
        "_tick",
    )

    def __init__(
        self,
        *,
        stats: WorkloadStats | None = None,
        costs: BlockCosts | None = None,
        reload_bandwidth: float | None = None,
    ) -> None:
        self._stats = stats
        self._costs = costs or BlockCosts()
        self._reload_bw = reload_bandwidth
        self._entries: dict[Key, _Entry] = {}
        self._heap: list[tuple[float, int, _Entry]] = []
        self._seq = 0
        self._tick = 0
        self._mean = 0.0  # running mean of value, the unit of the deadline bonus
        self._saved: dict[tuple[int, int], float] = {}

    # ------------------------------------------------------------------ value
    def value(self, key: Key) -> float:
        """Expected seconds saved per byte by keeping ``key`` here (0 if not resident)."""
        entry = self._entries.get(key)
        return 0.0 if entry is None else self._value(entry)

    def _saved_per_byte(self, depth: int, nbytes: int) -> float:
        # recompute minus reload seconds, per byte; memoised per (depth, nbytes)
        memo_key = (depth, nbytes)
        saved = self._saved.get(memo_key)
        if saved is None:
            costs = self._costs
            saved = costs.recompute_s(depth)
            if self._reload_bw is not None:
                saved -= costs.reload_s(nbytes, self._reload_bw)
            saved = max(saved, 0.0) / max(nbytes, 1)
            self._saved[memo_key] = saved
        return saved

    def _value(self, entry: _Entry) -> float:
        saved = self._saved_per_byte(entry.depth, entry.nbytes)
        if saved == 0.0:
            return 0.0
        p = self._stats.reuse_probability(entry.key) if self._stats is not None else 0.5
        return p * saved

    def _schedule(self, entry: _Entry) -> None:
        value = self._value(entry)
        mean = self._mean
        mean = value if mean == 0.0 else mean + (value - mean) * 0.001
        self._mean = mean
        now = self._stats.tick if self._stats is not None else self._tick
        self._tick += 1
        bonus = len(self._entries) * (value / mean) if mean > 0.0 else 0.0
        entry.prio = now + bonus
        if entry.children == 0 and not entry.pinned:
            self._push(entry)

    def _push(self, entry: _Entry) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (entry.prio, self._seq, entry))
        if len(self._heap) > 2 * len(self._entries) + 1024:
            self._compact()

    def _compact(self) -> None:
        heap = [
            (e.prio, i, e)
            for i, e in enumerate(self._entries.values())
            if e.children == 0 and not e.pinned
        ]
        heapq.heapify(heap)
        self._heap = heap
        self._seq = len(heap)

    # ------------------------------------------------------------------ protocol
    def insert(
        self, key: Key, *, nbytes: int, parent: Key | None = None, depth: int = 0,
        now: float = 0.0,
    ) -> None:
        """Make ``key`` resident (or touch it if it already is)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._schedule(entry)
            return
        entry = _Entry(key, nbytes, parent, depth)
        self._entries[key] = entry
        if parent is not None:
            up = self._entries.get(parent)
            if up is not None:
                up.children += 1
        self._schedule(entry)

    def touch(self, key: Key, *, now: float = 0.0) -> None:
        """A use of resident ``key``: re-estimate its value and push its deadline."""
        entry = self._entries.get(key)
        if entry is not None:
            self._schedule(entry)

    def remove(self, key: Key) -> None:
        """``key`` left the tier; its parent may become a leaf (and a candidate)."""
        entry = self._entries.pop(key, None)
        if entry is None or entry.parent is None:
            return
        up = self._entries.get(entry.parent)
        if up is not None and up.children > 0:
            up.children -= 1
            if up.children == 0 and not up.pinned:
                self._push(up)

    def victim(self) -> Key | None:
        """The unpinned leaf with the earliest deadline, or ``None``."""
        heap = self._heap
        entries = self._entries
        while heap:
            prio, _, entry = heap[0]
            if (
                entries.get(entry.key) is entry
                and entry.prio == prio
                and entry.children == 0
                and not entry.pinned
            ):
                return entry.key
            heapq.heappop(heap)
        return None

    def set_pinned(self, key: Key, pinned: bool) -> None:
        """Pinned blocks are never victims; unpinning makes a leaf a candidate again."""
        entry = self._entries.get(key)
        if entry is None or entry.pinned == pinned:
            return
        entry.pinned = pinned
        if not pinned and entry.children == 0:
            self._push(entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
