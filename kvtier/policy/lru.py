"""Least-recently-used eviction: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policy.base import Key, register_eviction_policy


@register_eviction_policy("lru")
class LRUPolicy:
    """Evicts the block whose last use is oldest.

    Invariant: ``_order`` holds exactly the resident, unpinned keys from least to most
    recently used; ``_pinned`` holds the resident, pinned ones. A pinned block leaves the
    order and re-enters it at the most-recent end when unpinned (it was just in use).
    Every call is O(1) and allocates nothing beyond the OrderedDict's own link.

    Prefix note: the store inserts and touches a chain tail first (``touch_chain``), so a
    parent is at least as recent as its children and LRU evicts leaves before their
    parents (touched head first, the head went first and took its chain with it). Only
    approximately: a block unpinned after its parent (an nvme write that ends later)
    re-enters after it, so a head can still go first; ``cost`` counts resident children
    and never does.
    """

    name = "lru"

    __slots__ = ("_order", "_pinned")

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()
        self._pinned: set[Key] = set()

    def insert(
        self, key: Key, *, nbytes: int = 0, parent: Key | None = None, depth: int = 0,
        now: float = 0.0, block_tokens: int = 0,
    ) -> None:
        """Make ``key`` resident as the most recently used block (or touch it)."""
        if key in self._pinned:
            return
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key, *, now: float = 0.0) -> None:
        """Mark a use of ``key``; unknown keys are ignored."""
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        """Forget ``key`` (no-op if absent)."""
        if key in self._order:
            del self._order[key]
        else:
            self._pinned.discard(key)

    def victim(self) -> Key | None:
        """The least recently used unpinned key, or ``None``."""
        for key in self._order:
            return key
        return None

    def set_pinned(self, key: Key, pinned: bool) -> None:
        """Hide ``key`` from ``victim`` while pinned; unknown keys are ignored."""
        if pinned:
            if key in self._order:
                del self._order[key]
                self._pinned.add(key)
        elif key in self._pinned:
            self._pinned.discard(key)
            self._order[key] = None

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned)
