"""Store counters: requests, prefetch outcomes and bytes moved between tiers.

Plain slotted dataclasses bumped on the event loop thread; ``/v1/stats`` and the Prometheus
exporter read the same objects (``kvtier.daemon.metrics``), so the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.tiers.base import Tier, TierCounters, TierName, tier_stats

__all__ = ["BytesMoved", "LookupResult", "PrefetchCounters", "RequestCounters",
           "count_lookup", "count_redis_lookup", "slots_dict", "store_stats"]


@dataclass(slots=True)
class LookupResult:
    hits: int
    tiers: list[str]


@dataclass(slots=True)
class RequestCounters:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    puts: int = 0
    put_blocks: int = 0
    gets: int = 0
    get_blocks: int = 0
    deletes: int = 0
    lease_expired: int = 0
    redis_budget_misses: int = 0   # Redis lookups cut at redis_lookup_budget_s: counted a miss
    namespace_mismatch: int = 0  # a key found, but stored under another namespace: a miss
    layout_mismatch: int = 0     # same namespace, another layout or block size: a miss

    def lookup(self, n_keys: int, hits: int, tokens_per_block: int) -> None:
        self.lookups += 1
        self.lookup_blocks += n_keys
        self.hit_blocks += hits
        self.lookup_tokens += n_keys * tokens_per_block
        self.hit_tokens += hits * tokens_per_block

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


@dataclass(slots=True)
class PrefetchCounters:
    issued: int = 0
    hit_before_use: int = 0
    late: int = 0
    wasted: int = 0
    failed: int = 0


@dataclass(slots=True)
class BytesMoved:
    """Bytes moved per (source, destination) tier; ``by_pair`` keys are the tier names."""

    by_pair: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, src: TierName, dst: TierName, nbytes: int) -> None:
        k = (src.value, dst.value)
        self.by_pair[k] = self.by_pair.get(k, 0) + nbytes

    def rows(self) -> list[dict[str, Any]]:
        return [{"src": s, "dst": d, "bytes": b} for (s, d), b in sorted(self.by_pair.items())]


def count_lookup(cpu: TierCounters, nvme: TierCounters | None, n_keys: int, n_local: int,
                 n_cpu: int, tokens_per_block: int) -> None:
    """Per-tier hits and misses of one lookup: a hit is a block found in that tier, a miss a
    block that reached the tier and was not there (blocks past the first overall miss reach
    no tier)."""
    stopped = 1 if n_local < n_keys else 0
    below_cpu = n_local - n_cpu
    cpu.hit_blocks += n_cpu
    cpu.hit_tokens += n_cpu * tokens_per_block
    cpu.miss_blocks += below_cpu + stopped
    cpu.miss_tokens += (below_cpu + stopped) * tokens_per_block
    if nvme is not None:
        nvme.hit_blocks += below_cpu
        nvme.hit_tokens += below_cpu * tokens_per_block
        nvme.miss_blocks += stopped
        nvme.miss_tokens += stopped * tokens_per_block


def count_redis_lookup(redis: TierCounters, asked: int, found: int,
                       tokens_per_block: int) -> None:
    """The Redis tier's hits and misses of one lookup, counted as ``count_lookup`` counts
    cpu and nvme: ``asked`` blocks of the chain reached Redis (those past the local tiers'
    prefix: 0 when cpu and nvme held the whole chain), and the probe found the leading
    ``found`` of them. A hit is a block found, a miss the first block asked and not found
    (one at most per lookup: the blocks past it reach no tier). A probe that could not
    answer (the tier down, or cut by ``redis.lookup_budget_s``) found nothing: its first
    block is the miss. Counted once per lookup, by the lookup, never by the get that
    follows or by a prefix-locality probe."""
    if asked <= 0:
        return
    found = min(max(found, 0), asked)
    redis.hit_blocks += found
    redis.hit_tokens += found * tokens_per_block
    if found < asked:
        redis.miss_blocks += 1
        redis.miss_tokens += tokens_per_block


def slots_dict(obj: object) -> dict[str, Any]:
    """A slotted dataclass as a dict (its fields only)."""
    return {name: getattr(obj, name) for name in obj.__slots__}  # type: ignore[attr-defined]


def store_stats(tiers: list[Tier], requests: RequestCounters, prefetch: PrefetchCounters,
                moved: BytesMoved, bandwidth: dict[str, float], leases: dict[str, Any], *,
                eviction: str, namespaces: int, index_blocks: int,
                recovery: object | None) -> dict[str, Any]:
    """The store's section of /v1/stats."""
    out_tiers = {}
    for t in tiers:
        out_tiers[t.name.value] = tier_stats(t)
        extra = getattr(t, "stats_extra", None)
        if callable(extra):
            out_tiers[t.name.value].update(extra())
    return {
        "tiers": out_tiers,
        "requests": {**slots_dict(requests),
                     "prefix_hit_rate": round(requests.prefix_hit_rate, 6)},
        "prefetch": slots_dict(prefetch),
        "bytes_moved": moved.rows(),
        "bandwidth": bandwidth,
        "leases": leases,
        "policy": {"eviction": eviction},
        "namespaces": namespaces,
        "index_blocks": index_blocks,
        "recovery": slots_dict(recovery) if recovery is not None else {},
    }
