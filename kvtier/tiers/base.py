"""What every tier exposes to the store, the stats endpoint and the metrics exporter.

Counters are plain ints bumped on the hot path (no locks: the daemon's tiers are driven
from one event loop; worker threads report back through the loop). The Prometheus
exporter and ``/v1/stats`` both read these same objects at scrape time, so the two views
never disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable


class TierName(str, Enum):
    """Tiers from fastest to slowest; lookups walk them in this order."""

    HBM = "hbm"
    CPU = "cpu"
    NVME = "nvme"
    REDIS = "redis"


class EvictionReason(str, Enum):
    CAPACITY = "capacity"    # room was needed for another block
    EXPIRED = "expired"      # TTL ran out (redis)
    DELETED = "deleted"      # a client asked
    CORRUPT = "corrupt"      # failed a frame check
    ORPHAN = "orphan"        # its parent is gone from every tier


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters of one tier (exported as kvtier_*_total)."""

    hit_blocks: int = 0
    miss_blocks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    allocation_failures: int = 0
    checksum_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    dropped_writes: int = 0
    evictions: dict[str, int] = field(default_factory=dict)

    def evicted(self, reason: EvictionReason, n: int = 1) -> None:
        self.evictions[reason.value] = self.evictions.get(reason.value, 0) + n

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["evictions"] = {r.value: self.evictions.get(r.value, 0) for r in EvictionReason}
        return data


@runtime_checkable
class Tier(Protocol):
    """The read-only face of a tier: identity, capacity, occupancy and health."""

    name: TierName
    counters: TierCounters

    @property
    def backend(self) -> str: ...      # e.g. "shm", "posix", "posix+odirect", "kvikio"

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def blocks(self) -> int: ...

    @property
    def up(self) -> bool: ...


def tier_stats(tier: Tier) -> dict[str, Any]:
    """The per-tier section of /v1/stats."""
    out: dict[str, Any] = {
        "name": tier.name.value,
        "up": tier.up,
        "backend": tier.backend,
        "capacity_bytes": tier.capacity_bytes,
        "used_bytes": tier.used_bytes,
        "free_bytes": max(tier.capacity_bytes - tier.used_bytes, 0),
        "blocks": tier.blocks,
    }
    out.update(tier.counters.to_dict())
    return out
