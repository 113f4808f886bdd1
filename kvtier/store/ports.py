"""What the store needs from its collaborators, as Protocols (no ``Any`` on the seams).

The concrete classes live elsewhere (``kvtier.tiers.nvme.NvmeTier``,
``kvtier.tiers.redis.RedisTier``, ``kvtier.tiers.hbm.HbmTier``, ``kvtier.explain.MissLog``,
``kvtier.policy.prefix.PrefixForest``); tests pass real ones, and a fake needs only these
methods. Admission and the workload observer use the policy package's own Protocols.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING, Protocol

from kvtier.frame import FrameHeader
from kvtier.policy.base import AdmissionPolicy, Key, LookupObserver
from kvtier.tiers.base import Tier
from kvtier.tiers.nvme import NvmeSlot
from kvtier.tiers.nvme.recovery import Recovered
from kvtier.tiers.redis_queue import Borrowed
from kvtier.tiers.slab import SlabAllocator

__all__ = ["AdmissionPolicy", "ForestPort", "HbmPort", "LookupObserver", "MissLogPort",
           "NvmePort", "RedisPort"]


class NvmePort(Tier, Protocol):
    """Frames in slot files: allocate, write, read back, free (``NvmeTier``)."""

    @property
    def degraded(self) -> bool: ...

    def refuse_write(self) -> None: ...

    def open(self) -> Recovered: ...

    def alloc(self, payload_len: int) -> NvmeSlot | None: ...

    def disk_short(self, payload_len: int) -> int: ...

    async def make_room(self, payload_len: int) -> bool: ...

    def free(self, slot: NvmeSlot, *, erase: bool = False) -> None: ...

    def erase_free(self, slot: NvmeSlot) -> bool: ...

    async def erased(self) -> None: ...

    def next_seq(self) -> int: ...

    async def write(self, slot: NvmeSlot, header: FrameHeader, payload: memoryview, *,
                    sync: bool = False) -> None: ...

    async def read_into(self, slot: NvmeSlot, out: memoryview, *, namespace: bytes | None,
                        key: bytes | None, layout_fp: int | None) -> FrameHeader: ...


class RedisPort(Tier, Protocol):
    """The shared lowest tier (``RedisTier``): writes are queued, reads are batched."""

    def submit(self, namespace: bytes, key: bytes, layout_fp: int, payload: memoryview, *,
               seq: int = 0, release: Callable[[], None] | None = None,
               on_checksum: Callable[[int | None], None] | None = None,
               owned: bool = False) -> None: ...

    def submit_many(self, blocks: Sequence[Borrowed]) -> None: ...

    async def exists_prefix(self, keys: Sequence[bytes], *,
                            namespace: bytes | None = None) -> int: ...

    async def whole_prefix(self, keys: Sequence[bytes], *, namespace: bytes) -> int: ...

    async def forget_writes(self, keys: Sequence[bytes], *, namespace: bytes) -> int: ...

    async def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview], *,
                       namespace: bytes, layout_fp: int,
                       checksums: list[int | None] | None = None) -> int: ...

    async def delete(self, keys: Sequence[bytes], *, namespace: bytes | None = None) -> int: ...

    async def flush(self, timeout: float | None = None) -> bool: ...

    async def written(self, keys: Sequence[bytes], since: float) -> list[bool | None]: ...

    async def room(self, n: int, timeout: float) -> int: ...

    @property
    def healing_since(self) -> float | None: ...


class HbmPort(Tier, Protocol):
    """Device slots of the HBM pool (``HbmTier``; a host-memory fake in tests)."""

    allocator: SlabAllocator
    placement: str

    def alloc(self, nbytes: int) -> int | None: ...

    def free(self, offset: int) -> None: ...

    def copy_in(self, items: Sequence[tuple[int, object]]) -> None: ...


class ForestPort(Protocol):
    """Parent links of stored chains (``PrefixForest``): who is orphaned when a block goes."""

    def add(self, key: Key, parent: Key | None) -> None: ...

    def discard(self, key: Key) -> list[Key]: ...

    def __contains__(self, key: object) -> bool: ...


class MissLogPort(Protocol):
    """Why lookups miss (``kvtier.explain.MissLog``): the store reports, it classifies."""

    def rejected(self, digest: bytes, n_keys: int, code: str) -> None: ...

    def lookup(self, digest: bytes, keys: list[bytes], hits: int, n_cpu: int, n_local: int,
               index: Container[bytes], lower_tier_down: bool) -> None: ...

    def removed(self, key: bytes, reason: str, tier: str) -> None: ...

    def refused(self, key: bytes, tier: str) -> None: ...


if TYPE_CHECKING:  # the real classes satisfy the ports: the type checker verifies this
    from kvtier.explain import MissLog
    from kvtier.policy.prefix import PrefixForest
    from kvtier.tiers.hbm import HbmTier
    from kvtier.tiers.nvme import NvmeTier
    from kvtier.tiers.redis import RedisTier

    def _conforms(n: NvmeTier, r: RedisTier, h: HbmTier, m: MissLog,
                  f: PrefixForest) -> tuple[NvmePort, RedisPort, HbmPort, MissLogPort,
                                            ForestPort]:
        return n, r, h, m, f
