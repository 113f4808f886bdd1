"""``cost``: kvtier's default eviction policy, prefix-aware and value-per-byte ordered.

A block's value is ``reuse probability x (recompute seconds - reload seconds from the next
tier down) / bytes``: what keeping it here saves, per byte it occupies.

- reuse probability comes from :class:`~kvtier.policy.stats.WorkloadStats`, learned online
  from the workload itself: every reference of a block falls into a reuse class (reuse
  count so far, generated-token bucket of the request when the store reports it, distance
  from the end of the chain, whether the request hit a cached prefix, prompt length), and
  the class's rate of "referenced again within the horizon" is estimated from decayed
  counts, shrunk level by level toward coarser classes (so a class without evidence takes
  its parent's rate and a feature without signal changes nothing);
- recompute seconds from :class:`~kvtier.policy.costmodel.BlockCosts` (prefill FLOPs of the
  chunk at its position: later chunks of long prompts cost more). The position is depth x
  the tokens per block of the block's own namespace, which the store passes on insert
  (``block_tokens``, from the namespace's layout: vLLM's 16 or 32, an engine's 256);
  ``BlockCosts.block_tokens`` is only the default for a block whose layout is unknown;
- reload seconds from the bandwidth of the tier below (``None``: nothing below, the block
  would have to be recomputed).

Reuse probability is turned into a rate, because a cache pays for a block per unit of time
it holds it, not once: the *hit density* (Beckmann et al., LHD, NSDI'18) of a block with
reuse probability ``p`` and expected reuse gap ``g`` (both from the stats, the key's own
record first), in a tier whose blocks are evicted at age ``T`` (learned from this tier's
own victims), is ``p / (p*g + (1-p)*T)`` hits per block reference of residency, where a
reuse expected later than ``T`` (``g > T``) counts only ``T/g`` of a hit with ``g = T``
(it would mostly find the block gone). The value is that density x ``T`` (so a block whose
reuse comes at the eviction age is worth exactly ``p``) x saved seconds per byte. A prefix
that comes back every few references is worth many times a block that will, at best, come
back once.

Ordering (GreedyDual): a block inserted or used gets the priority ``L + value / unit``,
where ``unit`` is the value of a certainly-reused first chunk and ``L``, the water level,
is the priority of the last block evicted. The victim is the leaf with the lowest
priority. ``L`` rises by about one average value per turnover of the tier, so a block
survives without a hit for a time proportional to its value: twice the average value,
about two turnovers. With equal values this is exactly LRU (priorities only grow with
time). A block worth nothing gets ``L`` itself and leaves at the next eviction, before
anything older: with insert-then-evict (the replay), the block just inserted is the
victim, a bypass, as in Belady's optimum; a store that evicts before it inserts drops it at
its next allocation. This is how blocks the workload shows will not come back (in the
shared Mooncake trace: the tails of prompts that answered at length) stop displacing the
ones that will.

Prefix-aware: only leaves (blocks with no child resident in this tier) are candidates, so
a chain is shortened from its tail and a parent never leaves before its children, also
when the children entered the tier first (a chain demoted from the tier above arrives
tail-first). Orphans
(children of a block gone from every tier) are found by
:class:`~kvtier.policy.prefix.PrefixForest` and removed by the caller.

Heap with lazy invalidation: O(log n) per insert/touch, amortised O(log n) per victim.
"""

from __future__ import annotations

import heapq

from kvtier.policy.base import Key, register_eviction_policy
from kvtier.policy.costmodel import BlockCosts
from kvtier.policy.stats import WorkloadStats

# (depth, block bytes, tokens) values memoised at most: a client picks depths and layouts
SAVED_MEMO_MAX = 1 << 16


class _Entry:
    """One resident block (a plain slotted class: mutable, no dataclass overhead)."""

    __slots__ = (
        "at", "children", "key", "order", "parent", "pinned", "prio", "saved", "seq",
    )

    def __init__(self, key: Key, parent: Key | None, saved: float) -> None:
        self.key = key
        self.parent = parent
        self.saved = saved  # recompute minus reload seconds per byte (fixed at insert)
        self.children = 0
        self.pinned = False
        self.prio = 0.0
        # number of its one live heap item; -1 while it is no candidate (a child is
        # resident, it is pinned or it left): older items and those of non-candidates are
        # stale, so a heap item is live exactly when its number equals its entry's
        self.seq = -1
        self.order = 0  # when it was last inserted or used: ties go to the oldest use
        self.at = 0  # the stats' reference count when it was last inserted or used


@register_eviction_policy("cost")
class CostPolicy:
    """Evicts the leaf block with the lowest GreedyDual priority (see module doc).

    ``stats`` is shared by the tiers of one store and fed with every lookup and store;
    without it every block has the same reuse estimate and the policy orders by cost and
    recency only. ``reload_bandwidth`` is the read bandwidth (B/s) of the next tier down, ``None``
    for the last tier. A block's recompute cost follows its own tokens per block
    (``block_tokens`` on :meth:`insert`, the store's namespace layout), else
    ``costs.block_tokens``.
    """

    name = "cost"

    __slots__ = (
        "_costs", "_entries", "_heap", "_kids", "_level", "_life", "_reload_bw", "_saved",
        "_seq", "_stats", "_unit", "_uses", "_victim",
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
        # resident entries per parent key, whether or not the parent is resident: a lower
        # tier receives a chain tail-first (the tier above demotes its leaves first), and a
        # parent that arrives after its children must not be taken for a leaf
        self._kids: dict[Key, int] = {}
        self._heap: list[tuple[float, int, int, _Entry]] = []
        self._seq = 0  # heap items pushed (an entry's live item has its latest number)
        self._uses = 0  # inserts and touches: the tie-break order among equal priorities
        self._level = 0.0  # inflation value L: the priority of the last block evicted
        self._unit = 0.0   # value of a sure-to-be-reused depth-0 block: prio's scale
        self._victim: _Entry | None = None  # what victim() named last
        self._saved: dict[tuple[int, int, int], float] = {}
        self._life = 0.0  # mean age (block references since last use) of evicted blocks

    # ------------------------------------------------------------------ value
    def value(self, key: Key) -> float:
        """Expected seconds saved per byte by keeping ``key`` here (0 if not resident)."""
        entry = self._entries.get(key)
        return 0.0 if entry is None else self._value(entry)

    def _saved_per_byte(self, depth: int, nbytes: int, block_tokens: int = 0) -> float:
        # recompute minus reload seconds, per byte; memoised per (depth, nbytes, tokens)
        memo_key = (depth, nbytes, block_tokens)
        saved = self._saved.get(memo_key)
        if saved is None:
            costs = self._costs
            saved = costs.recompute_s(depth, block_tokens=block_tokens or None)
            if self._reload_bw is not None:
                saved -= costs.reload_s(nbytes, self._reload_bw)
            saved = max(saved, 0.0) / max(nbytes, 1)
            if len(self._saved) >= SAVED_MEMO_MAX:   # clients pick depths and layouts
                self._saved.clear()
            self._saved[memo_key] = saved
        return saved

    def _value(self, entry: _Entry) -> float:
        saved = entry.saved
        if saved == 0.0:
            return 0.0
        stats = self._stats
        if stats is None:
            return 0.5 * saved
        p, gap = stats.reuse_estimate(entry.key)
        life = self._life or float(len(self._entries) + 1)
        # hit density: expected hits per block reference of residency (see module doc)
        if gap > life:  # a reuse that late is likely to find the block already evicted
            p *= life / gap
            gap = life
        return saved * p * life / (p * gap + (1.0 - p) * life)

    def _schedule(self, entry: _Entry) -> None:
        # _value inlined (the hot path: every insert and touch)
        saved = entry.saved
        stats = self._stats
        if saved == 0.0:
            value = 0.0
        elif stats is None:
            value = 0.5 * saved
        else:
            p, gap = stats.reuse_estimate(entry.key)
            life = self._life or float(len(self._entries) + 1)
            if gap > life:
                p *= life / gap
                gap = life
            value = saved * p * life / (p * gap + (1.0 - p) * life)
        self._place(entry, value)

    def _place(self, entry: _Entry, value: float) -> None:
        """GreedyDual: ``entry``'s priority is the water level plus its value (in units of
        the cheapest block); an evictable leaf joins the heap."""
        entry.prio = self._level + value / self._unit
        entry.order = self._uses = self._uses + 1
        stats = self._stats
        if stats is not None:
            entry.at = stats.tick
        if entry.children == 0 and not entry.pinned:
            self._push(entry)

    def _push(self, entry: _Entry) -> None:
        seq = self._seq = self._seq + 1
        entry.seq = seq
        heap = self._heap
        heapq.heappush(heap, (entry.prio, entry.order, seq, entry))
        if len(heap) > 2 * len(self._entries) + 1024:
            self._compact()

    def _compact(self) -> None:
        heap = [(e.prio, e.order, e.seq, e) for e in self._entries.values() if e.seq >= 0]
        heapq.heapify(heap)
        self._heap = heap

    # ------------------------------------------------------------------ protocol
    def insert(
        self, key: Key, *, nbytes: int, parent: Key | None = None, depth: int = 0,
        now: float = 0.0, block_tokens: int = 0,
    ) -> None:
        """Make ``key`` resident (or touch it if it already is). ``block_tokens``: tokens
        per block of its namespace (0: ``costs.block_tokens``); with ``depth`` it places the
        block's tokens in the prompt, which sets its recompute cost."""
        entries = self._entries
        entry = entries.get(key)
        if entry is None:
            saved = self._saved.get((depth, nbytes, block_tokens))
            if saved is None:
                saved = self._saved_per_byte(depth, nbytes, block_tokens)
            entry = _Entry(key, parent, saved)
            entry.children = self._kids.get(key, 0)   # those resident before it
            entries[key] = entry
            if self._unit == 0.0:
                self._unit = self._saved_per_byte(0, nbytes, block_tokens) or 1.0
            if parent is not None:
                self._kids[parent] = self._kids.get(parent, 0) + 1
                up = entries.get(parent)
                if up is not None:
                    up.children += 1
                    up.seq = -1  # no longer a leaf: its heap item is stale
        self._schedule(entry)

    def touch(self, key: Key, *, now: float = 0.0) -> None:
        """A use of resident ``key``: re-estimate its value and raise its priority."""
        entry = self._entries.get(key)
        if entry is not None:
            self._schedule(entry)

    def remove(self, key: Key) -> None:
        """``key`` left the tier; its parent may become a leaf (and a candidate)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        entry.seq = -1
        if entry is self._victim:  # evicted: the water level rises to its priority
            self._victim = None
            if entry.prio > self._level:
                self._level = entry.prio
            if self._stats is not None:
                age = float(self._stats.tick - entry.at)
                self._life = age if self._life == 0.0 else self._life + (age - self._life) / 64.0
        if entry.parent is None:
            return
        left = self._kids.get(entry.parent, 0) - 1
        if left > 0:
            self._kids[entry.parent] = left
        else:
            self._kids.pop(entry.parent, None)
        up = self._entries.get(entry.parent)
        if up is not None and up.children > 0:
            up.children -= 1
            if up.children == 0 and not up.pinned:
                self._push(up)

    def victim(self) -> Key | None:
        """The unpinned leaf with the lowest priority (oldest first among equals), or None."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            item = heap[0]
            entry = item[3]
            if entry.seq == item[2]:
                self._victim = entry
                return entry.key
            pop(heap)
        return None

    def set_pinned(self, key: Key, pinned: bool) -> None:
        """Pinned blocks are never victims; unpinning makes a leaf a candidate again."""
        entry = self._entries.get(key)
        if entry is None or entry.pinned == pinned:
            return
        entry.pinned = pinned
        if pinned:
            entry.seq = -1
        elif entry.children == 0:
            self._push(entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
