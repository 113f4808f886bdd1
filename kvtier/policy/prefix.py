"""Prefix-chain bookkeeping: which resident blocks become orphans when a block is gone.

A block is only reachable through its whole prefix chain (a lookup stops at the first
miss), so once a block has left every tier its descendants are worthless wherever they
live. The store (and the replay simulator) keeps one :class:`PrefixForest` over the blocks
resident in ANY tier and drops the orphans it reports.
"""

from __future__ import annotations

from kvtier.policy.base import Key


class PrefixForest:
    """Parent/child links among the blocks resident somewhere in the hierarchy.

    Invariant: ``_parent`` holds exactly the keys added and not yet discarded;
    ``_children[p]`` holds the resident children of ``p`` (the entry exists only while
    non-empty). Both operations are O(1) plus the size of the orphaned subtree.
    """

    __slots__ = ("_children", "_parent")

    def __init__(self) -> None:
        self._parent: dict[Key, Key | None] = {}
        self._children: dict[Key, set[Key]] = {}

    def add(self, key: Key, parent: Key | None) -> None:
        """``key`` became resident in some tier; ``parent`` is its chain predecessor."""
        if key in self._parent:
            return
        self._parent[key] = parent
        if parent is not None:
            kids = self._children.get(parent)
            if kids is None:
                self._children[parent] = {key}
            else:
                kids.add(key)

    def discard(self, key: Key) -> list[Key]:
        """``key`` left every tier: forget it and return its (now orphaned) descendants.

        The returned keys are forgotten too; the caller removes them from their tiers.
        """
        parents = self._parent
        if key not in parents:
            return []
        parent = parents.pop(key)
        children = self._children
        if parent is not None:
            kids = children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del children[parent]
        kids = children.pop(key, None)
        if not kids:  # a leaf (the common case): nothing orphaned
            return []
        orphans: list[Key] = []
        stack = [kids]  # child sets still to walk, depth first
        while stack:
            for kid in stack.pop():
                del parents[kid]
                orphans.append(kid)
                grandkids = children.pop(kid, None)
                if grandkids:
                    stack.append(grandkids)
        return orphans

    def parent(self, key: Key) -> Key | None:
        """The recorded parent of a resident ``key`` (``None`` for roots and unknown keys)."""
        return self._parent.get(key)

    def n_children(self, key: Key) -> int:
        """How many resident blocks name ``key`` as their parent."""
        kids = self._children.get(key)
        return len(kids) if kids else 0

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def __len__(self) -> int:
        return len(self._parent)
