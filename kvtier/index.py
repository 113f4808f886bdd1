"""BlockIndex: what the daemon knows about each block, per tier.

Residency is data: a ``BlockMeta`` says whether the block is in the cpu arena (and in
what state), on nvme, or both; readers pin it. Only the store (``kvtier.store``) mutates it,
always on the event loop thread, so no locks are needed.

Slot states (cpu arena):
    NONE -> WRITING (put lease) -> READY          (commit)
    NONE -> LOADING (promotion from nvme/redis) -> READY
    WRITING/LOADING -> NONE                       (abort, expiry, failed load)
Illegal transitions raise: a bug here would hand out wrong bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from kvtier.errors import KVTierError

if TYPE_CHECKING:
    from kvtier.tiers.nvme import NvmeSlot


class SlotState(str, Enum):
    NONE = "none"
    WRITING = "writing"
    LOADING = "loading"
    READY = "ready"


_ALLOWED = {
    (SlotState.NONE, SlotState.WRITING),
    (SlotState.NONE, SlotState.LOADING),
    (SlotState.WRITING, SlotState.READY),
    (SlotState.LOADING, SlotState.READY),
    (SlotState.WRITING, SlotState.NONE),
    (SlotState.LOADING, SlotState.NONE),
    (SlotState.READY, SlotState.NONE),
}


@dataclass(slots=True, eq=False)
class BlockMeta:
    """One block: identity, geometry and where it lives."""

    key: bytes
    namespace: bytes
    layout_fp: int
    nbytes: int
    parent: bytes | None
    depth: int
    cpu: int | None = None              # arena offset
    cpu_state: SlotState = SlotState.NONE
    nvme: NvmeSlot | None = None        # its frame's slot when on nvme
    nvme_ready: bool = False            # frame completely written
    nvme_busy: bool = False             # a write or read of the nvme slot is in flight
    readers: int = 0                    # read leases holding the cpu slot
    loading: asyncio.Future[bool] | None = None
    prefetched: bool = False            # promoted ahead of use (for prefetch metrics)
    seq: int = 0

    def set_cpu_state(self, new: SlotState) -> None:
        if (self.cpu_state, new) not in _ALLOWED:
            raise KVTierError(f"illegal cpu slot transition {self.cpu_state} -> {new}")
        self.cpu_state = new

    @property
    def in_cpu(self) -> bool:
        return self.cpu_state is SlotState.READY

    @property
    def in_nvme(self) -> bool:
        return self.nvme is not None and self.nvme_ready

    @property
    def present(self) -> bool:
        """Readable now or soon (a promotion in flight counts)."""
        return (self.cpu_state in (SlotState.READY, SlotState.LOADING)) or self.in_nvme

    @property
    def cpu_pinned(self) -> bool:
        """Must not be evicted from the cpu tier right now."""
        return self.readers > 0 or self.cpu_state is not SlotState.READY or self.nvme_busy

    @property
    def where(self) -> str:
        if self.cpu_state in (SlotState.READY, SlotState.LOADING):
            return "cpu"
        return "nvme" if self.in_nvme else "none"


class KeySet(Protocol):
    """Told of every key entering and leaving the index (kvtier.presence)."""

    def add(self, key: bytes) -> None: ...
    def add_many(self, keys: Sequence[bytes]) -> None: ...
    def remove(self, key: bytes) -> None: ...


class BlockIndex(dict[bytes, BlockMeta]):
    """key -> BlockMeta. A dict with a name: O(1) lookups on the hot path. ``presence``,
    when set, is told of every key that enters or leaves (item assignment and ``del``
    are the only ways the store changes the index)."""

    __slots__ = ("presence",)

    def __init__(self) -> None:
        super().__init__()
        self.presence: KeySet | None = None

    def __setitem__(self, key: bytes, meta: BlockMeta) -> None:
        if self.presence is not None and key not in self:
            self.presence.add(key)
        super().__setitem__(key, meta)

    def new_positions(self, keys: Sequence[bytes]) -> list[int]:
        """Positions in ``keys`` of keys not in the index, first occurrences only (what a
        batch would add)."""
        seen: set[bytes] = set()
        out = []
        for i, k in enumerate(keys):
            if k not in self and k not in seen:
                seen.add(k)
                out.append(i)
        return out

    def add_new(self, metas: Sequence[BlockMeta]) -> None:
        """``index[m.key] = m`` for blocks whose keys are not in the index (distinct): one
        presence update for the batch."""
        if self.presence is not None:
            self.presence.add_many([m.key for m in metas])
        self.update((m.key, m) for m in metas)   # dict's own: __setitem__ is not called

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        if self.presence is not None:
            self.presence.remove(key)

    def leading(self, keys: Iterable[bytes],
                accept: Callable[[BlockMeta], bool] | None = None) -> Iterator[BlockMeta]:
        """The leading blocks of a chain present in the local tiers (and ``accept``-ed),
        up to the first that is not. Lazy: each key is looked up when the caller asks for
        the next block, so a caller may await between blocks and see the index as it is."""
        for k in keys:
            meta = self.get(k)
            if meta is None or not meta.present or (accept is not None and not accept(meta)):
                return
            yield meta

    def leading_present(self, keys: list[bytes]) -> int:
        """How many leading keys of a chain are present in the local tiers."""
        return sum(1 for _ in self.leading(keys))
