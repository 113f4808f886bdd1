"""Belady's offline optimum (MIN): evict the block whose next use lies furthest ahead.

Only the simulator can run it, because it needs the future: before every ``insert`` or
``touch`` the simulator sets :attr:`BeladyPolicy.next_use` to the reference index at which
the block is used next (``inf`` if never). With insert-then-evict, the just-inserted block
is a candidate too, so a block nobody will ask for again bypasses the cache.

It maximises block hits, not tokens saved: every block counts one hit whatever it holds,
so a policy that keeps full blocks over a request's short last block can save more tokens
(kvtier.replay.report compares with Belady on block hits only). With one tier and blocks
that keep their prefix (chained hash ids) it is a bound on block hits: a block's parent is
always used before it, so MIN evicts the child first and never strands a prefix.
"""

from __future__ import annotations

import heapq

from kvtier.policy.base import Key


class BeladyPolicy:
    """Offline optimum of block hits over the EvictionPolicy protocol (replay only).

    Max-heap on next use with lazy invalidation; pins are honoured like everywhere else.
    """

    name = "belady"

    __slots__ = ("_heap", "_next", "_pinned", "next_use")

    def __init__(self) -> None:
        self._next: dict[Key, float] = {}
        self._pinned: set[Key] = set()
        self._heap: list[tuple[float, Key]] = []
        self.next_use = float("inf")

    def insert(
        self, key: Key, *, nbytes: int = 0, parent: Key | None = None, depth: int = 0,
        now: float = 0.0, block_tokens: int = 0,
    ) -> None:
        """Make ``key`` resident, next used at :attr:`next_use`."""
        self.touch(key, now=now, _insert=True)

    def touch(self, key: Key, *, now: float = 0.0, _insert: bool = False) -> None:
        """A use of ``key``; its next use is :attr:`next_use`."""
        if not _insert and key not in self._next:
            return
        nu = self.next_use
        self._next[key] = nu
        heapq.heappush(self._heap, (-nu, key))
        if len(self._heap) > 2 * len(self._next) + 1024:
            self._heap = [(-n, k) for k, n in self._next.items()]
            heapq.heapify(self._heap)

    def next_use_of(self, key: Key) -> float:
        """The recorded next use of a resident ``key`` (``inf`` if unknown)."""
        return self._next.get(key, float("inf"))

    def remove(self, key: Key) -> None:
        """Forget ``key``."""
        self._next.pop(key, None)
        self._pinned.discard(key)

    def victim(self) -> Key | None:
        """The unpinned block used furthest in the future."""
        heap = self._heap
        nxt = self._next
        skipped: list[tuple[float, Key]] = []
        found: Key | None = None
        while heap:
            neg, key = heap[0]
            if nxt.get(key) != -neg:
                heapq.heappop(heap)
                continue
            if key in self._pinned:
                skipped.append(heapq.heappop(heap))
                continue
            found = key
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def set_pinned(self, key: Key, pinned: bool) -> None:
        """Hide ``key`` from :meth:`victim` while pinned."""
        if key not in self._next:
            return
        if pinned:
            self._pinned.add(key)
        else:
            self._pinned.discard(key)

    def __contains__(self, key: object) -> bool:
        return key in self._next

    def __len__(self) -> int:
        return len(self._next)
