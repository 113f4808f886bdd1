"""Which series the exporter writes for a stats snapshot (no daemon needed)."""
from __future__ import annotations

from typing import Any

from kvtier.daemon.metrics import KVTierCollector

STATS: dict[str, Any] = {
    "tiers": {
        "cpu": {"capacity_bytes": 100, "used_bytes": 10, "hit_blocks": 3},
        "redis": {"capacity_bytes": 0, "hit_blocks": 1, "redirects": 7},
    },
    "requests": {"lookups": 4, "lease_expired": 2},
    "leases": {"active": 1},
}


def _samples() -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in KVTierCollector(lambda: STATS).collect():
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def test_a_tier_only_counter_has_series_only_for_the_tiers_that_count_it() -> None:
    got = _samples()
    assert got["kvtier_redis_redirects_total"] == [({"tier": "redis"}, 7.0)]
    # counters every tier has stay one series per tier, 0 where the tier reported none
    hits = dict((labels["tier"], v) for labels, v in got["kvtier_hit_blocks_total"])
    errors = dict((labels["tier"], v) for labels, v in got["kvtier_tier_errors_total"])
    assert hits == {"cpu": 3.0, "redis": 1.0} and errors == {"cpu": 0.0, "redis": 0.0}


def test_expired_leases_are_one_series() -> None:
    got = _samples()
    assert got["kvtier_lease_expired_total"] == [({}, 2.0)]
    assert "kvtier_requests_lease_expired_total" not in got
    assert got["kvtier_requests_lookups_total"] == [({}, 4.0)]
