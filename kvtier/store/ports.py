"""What the store needs from its collaborators, as Protocols (no ``Any`` on the seams).

The concrete classes live elsewhere (``kvtier.tiers.nvme.NvmeTier``,
``kvtier.tiers.redis.RedisTier``, ``kvtier.tiers.hbm.HbmTier``, ``kvtier.explain.MissLog``,
``kvtier.policy.prefix.PrefixForest``); tests pass real ones, and a fake needs only these
methods. Admission and the workload observer use the policy package's own Protocols.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Protocol

from kvtier.frame import FrameHeader
from kvtier.policy.base import AdmissionPolicy, LookupObserver
from kvtier.tiers.base import TierCounters, TierName
from kvtier.tiers.nvme import NvmeSlot
from kvtier.tiers.nvme.recovery import Recovered
from kvtier.tiers.slab import SlabAllocator

__all__ = ["AdmissionPolicy", "ForestPort", "HbmPort", "LookupObserver", "MissLogPort",
           "NvmePort", "RedisPort"]


class _TierFace(Protocol):
    name: TierName
    counters: TierCounters

    @property
    def backend(self) -> str: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def blocks(self) -> int: ...

    @property
    def up(self) -> bool: ...


class NvmePort(_TierFace, Protocol):
    """Frames in slot files: allocate, write, read back, free (``NvmeTier``)."""

    @property
    def degraded(self) -> bool: ...

    def refuse_write(self) -> None: ...

    def open(self) -> Recovered: ...

    def alloc(self, payload_len: int) -> NvmeSlot | None: ...

    def free(self, slot: NvmeSlot, *, erase: bool = False) -> None: ...

    def next_seq(self) -> int: ...

    async def write(self, slot: NvmeSlot, header: FrameHeader, payload: memoryview, *,
                    sync: bool = False) -> None: ...

    async def read_into(self, slot: NvmeSlot, out: memoryview, *, namespace: bytes | None,
                        key: bytes | None, layout_fp: int | None) -> FrameHeader: ...


class RedisPort(_TierFace, Protocol):
    """The shared lowest tier (``RedisTier``): writes are queued, reads are batched."""

    def submit(self, namespace: bytes, key: bytes, layout_fp: int, payload: memoryview, *,
               seq: int = 0) -> None: ...

    async def exists_prefix(self, keys: Sequence[bytes], *,
                            namespace: bytes | None = None) -> int: ...

    async def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview], *,
                       namespace: bytes, layout_fp: int) -> int: ...

    async def delete(self, keys: Sequence[bytes], *, namespace: bytes | None = None) -> int: ...

    async def flush(self, timeout: float | None = None) -> bool: ...


class HbmPort(_TierFace, Protocol):
    """Device slots of the HBM pool (``HbmTier``; a host-memory fake in tests)."""

    allocator: SlabAllocator
    placement: str

    def alloc(self, nbytes: int) -> int | None: ...

    def free(self, offset: int) -> None: ...

    def copy_in(self, items: Sequence[tuple[int, object]]) -> None: ...


class ForestPort(Protocol):
    """Parent links of stored chains (``PrefixForest``): who is orphaned when a block goes."""

    def add(self, key: bytes, parent: bytes | None) -> None: ...

    def discard(self, key: bytes) -> list[bytes]: ...


class MissLogPort(Protocol):
    """Why lookups miss (``kvtier.explain.MissLog``): the store reports, it classifies."""

    def rejected(self, digest: bytes, n_keys: int, code: str) -> None: ...

    def lookup(self, digest: bytes, keys: list[bytes], hits: int, n_cpu: int, n_local: int,
               index: Container[bytes], lower_tier_down: bool) -> None: ...

    def removed(self, key: bytes, reason: str, tier: str) -> None: ...

    def refused(self, key: bytes, tier: str) -> None: ...
