"""The Redis tier's capacity when nothing configured bounds it: the servers' ``maxmemory``
(every master's), else no limit, never 0. Before, ``redis.bytes = 0`` with no
``maxmemory`` showed "capacity 0 B, used 101.1 MiB" in ``kvtier stats`` and exported
``kvtier_tier_free_bytes{tier="redis"} 0``: a full tier on the dashboard."""

from __future__ import annotations

from typing import Any

from kvtier.cli import render_stats
from kvtier.daemon.metrics import KVTierCollector
from kvtier.store.stats import count_redis_lookup
from kvtier.tiers.base import TierCounters
from kvtier.tiers.redis_info import ServerStats

MiB = 1 << 20


def _answer(used: int, maxmemory: int | str, keys: int = 3) -> list[Any]:
    info = f"# Memory\r\nused_memory:{used}\r\nmaxmemory:{maxmemory}\r\n".encode()
    return [b"PONG", info, keys]


def test_the_limit_is_the_masters_maxmemory_only_when_every_master_has_one() -> None:
    s = ServerStats()
    s.take([_answer(10 * MiB, 64 * MiB), _answer(20 * MiB, 64 * MiB)])
    assert (s.used, s.limit, s.keys) == (30 * MiB, 128 * MiB, 6)
    s.take([_answer(10 * MiB, 64 * MiB), _answer(20 * MiB, 0)])   # one master unbounded
    assert (s.used, s.limit) == (30 * MiB, 0)
    s.take([_answer(10 * MiB, "lots")])                           # not a number: unknown
    assert s.limit == 0
    s.take([])
    assert s.limit == 0


def _tiers(redis: dict[str, Any]) -> dict[str, Any]:
    cpu = {"name": "cpu", "up": True, "backend": "shm", "capacity_bytes": 100 * MiB,
           "used_bytes": 10 * MiB, "free_bytes": 90 * MiB, "blocks": 1}
    base = {"name": "redis", "up": True, "backend": "redis", "used_bytes": 101 * MiB,
            "blocks": 7, "evictions": {}}
    return {"tiers": {"cpu": cpu, "redis": {**base, **redis}}}


def _series(stats: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for fam in KVTierCollector(lambda: stats).collect():
        for s in fam.samples:
            if "tier" in s.labels:
                out.setdefault(s.name, {})[s.labels["tier"]] = s.value
    return out


def test_an_unbounded_redis_exports_no_capacity_or_free_series() -> None:
    got = _series(_tiers({"capacity_bytes": None, "free_bytes": None,
                          "capacity_from": "none"}))
    assert got["kvtier_tier_capacity_bytes"] == {"cpu": 100 * MiB}
    assert got["kvtier_tier_free_bytes"] == {"cpu": 90 * MiB}
    assert got["kvtier_tier_used_bytes"] == {"cpu": 10 * MiB, "redis": 101 * MiB}
    bounded = _series(_tiers({"capacity_bytes": 128 * MiB, "free_bytes": 27 * MiB,
                              "capacity_from": "maxmemory"}))
    assert bounded["kvtier_tier_free_bytes"]["redis"] == 27 * MiB
    assert bounded["kvtier_tier_capacity_bytes"]["redis"] == 128 * MiB


def _redis_row(stats: dict[str, Any]) -> str:
    return next(line for line in render_stats(stats).splitlines()
                if line.startswith("redis "))


def test_kvtier_stats_says_no_limit_or_the_servers_maxmemory() -> None:
    row = _redis_row(_tiers({"capacity_bytes": None, "free_bytes": None,
                             "capacity_from": "none"}))
    assert row.split()[3:7] == ["no", "limit", "101.0", "MiB"]   # capacity, then used
    row = _redis_row(_tiers({"capacity_bytes": 128 * MiB, "free_bytes": 27 * MiB,
                             "capacity_from": "maxmemory"}))
    assert row.split()[3:6] == ["128.0", "MiB", "maxmemory"]
    row = _redis_row(_tiers({"capacity_bytes": 1024 * MiB, "free_bytes": 0,
                             "capacity_from": "redis.bytes"}))
    assert row.split()[3:7] == ["1.0", "GiB", "101.0", "MiB"]


def test_redis_lookup_counting() -> None:
    c = TierCounters()
    count_redis_lookup(c, 0, 0, 16)        # the local tiers held the chain: not reached
    assert (c.hit_blocks, c.miss_blocks) == (0, 0)
    count_redis_lookup(c, 5, 3, 16)        # 3 found, the 4th the one miss
    count_redis_lookup(c, 2, 2, 16)        # the rest of the chain, all found
    count_redis_lookup(c, 4, 0, 16)        # nothing found (absent, cut, or down)
    assert (c.hit_blocks, c.miss_blocks, c.hit_tokens, c.miss_tokens) == (5, 2, 80, 32)
