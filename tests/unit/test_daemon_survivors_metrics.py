"""The ``kvtier_*`` families a stats snapshot turns into: names, types, labels and values
(found by a mutation review: most families were read by no unit test)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints
from prometheus_client.core import Metric

from kvtier.daemon.engines import COUNTERS as ENGINE_COUNTERS
from kvtier.daemon.engines import GAUGES as ENGINE_GAUGES
from kvtier.daemon.metrics import KVTierCollector, Metrics, admission_stats, scheme_counts
from kvtier.keys import KEY_SCHEME

SNAPSHOT: dict[str, Any] = {
    "tiers": {
        "cpu": {"capacity_bytes": 100, "used_bytes": 100, "free_bytes": 0, "blocks": 2,
                "up": 1, "hit_blocks": 3, "evictions": {"capacity": 5, "expired": 6}},
        "redis": {"capacity_bytes": None, "free_bytes": None, "used_bytes": 9, "up": 1,
                  "redirects": 7},
        "nvme": {"capacity_bytes": 400, "open_files": 3, "file_reopens": 11,
                 "file_closes": 12},
    },
    "bytes_moved": [{"src": "cpu", "dst": "nvme", "bytes": 1024}],
    "requests": {"lookups": 1, "lookup_blocks": 2, "hit_blocks": 3, "lookup_tokens": 4,
                 "hit_tokens": 5, "puts": 6, "put_blocks": 7, "gets": 8, "get_blocks": 9,
                 "deletes": 10, "namespace_mismatch": 11, "layout_mismatch": 12,
                 "redis_budget_misses": 13, "prefix_hit_rate": 0.25, "lease_expired": 14},
    "prefetch": {"started": 2, "timed_out": 1},
    "daemon": {"clients": 3, "refused_connections": 21, "dropped_idle": 22,
               "dropped_slow": 23, "capped_puts": 24, "capped_gets": 25,
               "refused_leases": 26,
               "gc": {"frozen": 1000, "frozen_since": 40, "full_collections": 2,
                      "last_full_s": 0.5, "last_full_waited_s": 9.0},
               "key_schemes": {KEY_SCHEME: 1, "unknown": 2, "v0-mine": 3, "v9-yours": 4}},
    "leases": {"active": 4, "quarantined_bytes": 4096},
    "admission": {"rejected": {"nvme": 31},
                  "nvme_write_budget": {"bytes_per_s": 1000, "available_bytes": 250.0,
                                        "refused_bytes": 77}},
    "explain": {"first_miss": {"none": 5, "evicted": 6}},
    "policy": {"lookups_dropped": 0,
               "tiers": {"cpu": {"mrc": [{"scale": 0.5, "hit_rate": 0.1},
                                         {"scale": 2.0, "hit_rate": 0.9}],
                                 "modes": {"lru": {}, "lfu": {}}, "mode": "lfu",
                                 "switches": 3}}},
    "connector": {**{k: 1.0 + i for i, k in enumerate(ENGINE_GAUGES)},
                  **{k: 100.0 + i for i, k in enumerate(ENGINE_COUNTERS)}},
}

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _families() -> dict[str, Metric]:
    return {f.name: f for f in KVTierCollector(lambda: SNAPSHOT).collect()}


def _samples() -> Samples:
    out: Samples = {}
    for fam in _families().values():
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def _by(got: Samples, name: str, label: str) -> dict[str, float]:
    return {labels[label]: v for labels, v in got[name]}


def test_a_full_tier_exports_zero_free_bytes_and_an_unbounded_one_no_series() -> None:
    """A free size of 0 is a full tier: dropping it with the unbounded ones (None) hid a
    full cpu tier from the free-bytes panels and alerts."""
    got = _samples()
    assert _by(got, "kvtier_tier_free_bytes", "tier") == {"cpu": 0.0, "nvme": 0.0}
    assert _by(got, "kvtier_tier_capacity_bytes", "tier") == {"cpu": 100.0, "nvme": 400.0}
    assert _by(got, "kvtier_tier_used_bytes", "tier") == {"cpu": 100.0, "redis": 9.0,
                                                          "nvme": 0.0}


def test_evictions_and_moves_keep_their_label_order() -> None:
    """Swapped labels put a reason in ``tier`` (and a destination in ``src``): every
    eviction and movement panel read the wrong series."""
    got = _samples()
    assert sorted((d["tier"], d["reason"], v) for d, v in got["kvtier_evictions_total"]) == [
        ("cpu", "capacity", 5.0), ("cpu", "expired", 6.0)]
    assert got["kvtier_bytes_moved_total"] == [({"src": "cpu", "dst": "nvme"}, 1024.0)]


def test_every_request_counter_is_exported_with_its_own_value() -> None:
    """Each ``kvtier_requests_*`` counter reads its own stats key (a dropped key loses a
    documented series); the hit rate is a gauge (it goes down)."""
    got = _samples()
    req = SNAPSHOT["requests"]
    for key in ("lookups", "lookup_blocks", "hit_blocks", "lookup_tokens", "hit_tokens",
                "puts", "put_blocks", "gets", "get_blocks", "deletes", "namespace_mismatch",
                "layout_mismatch", "redis_budget_misses"):
        assert got[f"kvtier_requests_{key}_total"] == [({}, float(req[key]))], key
    fams = _families()
    assert fams["kvtier_prefix_hit_rate"].type == "gauge"
    assert got["kvtier_prefix_hit_rate"] == [({}, 0.25)]


def test_daemon_gauges_and_limit_counters_read_their_own_values() -> None:
    """Clients, open leases, quarantined bytes and every ``kvtier_limited`` event: each
    series reads its own stats key."""
    got = _samples()
    assert got["kvtier_clients"] == [({}, 3.0)]
    assert got["kvtier_leases_active"] == [({}, 4.0)]
    assert got["kvtier_leases_quarantined_bytes"] == [({}, 4096.0)]
    assert _by(got, "kvtier_limited_total", "event") == {
        "refused_connections": 21.0, "dropped_idle": 22.0, "dropped_slow": 23.0,
        "capped_puts": 24.0, "capped_gets": 25.0, "refused_leases": 26.0}
    assert _by(got, "kvtier_prefetch_total", "outcome") == {"started": 2.0, "timed_out": 1.0}


def test_gc_families_read_their_own_fields_with_their_types() -> None:
    """The frozen counts, the full collections (a counter: ``rate()`` over it) and the last
    collection's pause (not its wait for a quiet moment)."""
    got, fams = _samples(), _families()
    assert got["kvtier_gc_frozen_objects"] == [({}, 1000.0)]
    assert got["kvtier_gc_frozen_since_full_objects"] == [({}, 40.0)]
    assert got["kvtier_gc_full_collections_total"] == [({}, 2.0)]
    assert fams["kvtier_gc_full_collections"].type == "counter"
    assert got["kvtier_gc_last_full_seconds"] == [({}, 0.5)]


def test_clients_by_scheme_fold_unknown_strings_into_other_and_add_up() -> None:
    """Strings a client chose become ``other`` (summed, bounded series), ``unknown`` (a
    client that named none) and this daemon's scheme stay."""
    assert scheme_counts(SNAPSHOT["daemon"]["key_schemes"]) == {
        KEY_SCHEME: 1, "unknown": 2, "other": 7}
    assert _by(_samples(), "kvtier_clients_by_key_scheme", "scheme") == {
        KEY_SCHEME: 1.0, "unknown": 2.0, "other": 7.0}


def test_admission_and_nvme_file_families() -> None:
    got = _samples()
    assert got["kvtier_admission_rejected_total"] == [({"tier": "nvme"}, 31.0)]
    assert got["kvtier_nvme_write_budget_bytes_per_second"] == [({}, 1000.0)]
    assert got["kvtier_nvme_write_budget_available_bytes"] == [({}, 250.0)]
    assert got["kvtier_nvme_write_budget_refused_bytes_total"] == [({}, 77.0)]
    assert got["kvtier_nvme_open_files"] == [({}, 3.0)]
    assert got["kvtier_nvme_file_reopens_total"] == [({}, 11.0)]
    assert got["kvtier_nvme_file_closes_total"] == [({}, 12.0)]
    assert _by(got, "kvtier_first_miss_total", "reason") == {"none": 5.0, "evicted": 6.0}


def test_a_snapshot_without_nvme_files_or_budget_has_no_such_series() -> None:
    got = {s.name for f in KVTierCollector(lambda: {"tiers": {"cpu": {}}}).collect()
           for s in f.samples}
    assert not {"kvtier_nvme_open_files", "kvtier_nvme_write_budget_bytes_per_second",
                "kvtier_gc_frozen_objects", "kvtier_policy_lookups_dropped_total"} & got


def test_policy_families_name_their_scale_and_mark_only_the_live_mode() -> None:
    """``scale`` labels read 0.5 and 2 (the dashboards' selectors), one mode is 1, and a
    policy that dropped nothing still has its counter at 0 (``rate()`` needs it)."""
    got = _samples()
    assert sorted((d["scale"], v) for d, v in got["kvtier_policy_mrc_hit_rate"]) == [
        ("0.5", 0.1), ("2", 0.9)]
    assert _by(got, "kvtier_policy_mode", "mode") == {"lru": 0.0, "lfu": 1.0}
    assert got["kvtier_policy_mode_switches_total"] == [({"tier": "cpu"}, 3.0)]
    assert got["kvtier_policy_lookups_dropped_total"] == [({}, 0.0)]


def test_engine_reports_are_gauges_and_counters_as_documented() -> None:
    """Engine counters are ``_total`` counters (cumulative), engine gauges are gauges."""
    fams = _families()
    for key in ENGINE_GAUGES:
        assert fams[f"kvtier_engine_{key}"].type == "gauge", key
    for key in ENGINE_COUNTERS:
        assert fams[f"kvtier_engine_{key}"].type == "counter", key
    got = _samples()
    assert got[f"kvtier_engine_{ENGINE_COUNTERS[0]}_total"] == [({}, 100.0)]


def test_admission_stats_reads_the_budget_at_the_store_clock() -> None:
    """The budget left is the one at ``now`` with the configured rate; the rejected
    counts cover every tier."""
    class Budget:
        rejected = 2
        refused_bytes = 5

        def available_at(self, now: float) -> float:
            return now * 10

    class Other:
        rejected = 3

    class Admission:
        _by_tier = {"nvme": Budget(), "redis": Other()}

    out = admission_stats(Admission(), 4096, now=7.0)
    assert out == {"rejected": {"nvme": 2, "redis": 3},
                   "nvme_write_budget": {"bytes_per_s": 4096, "available_bytes": 70.0,
                                         "refused_bytes": 5}}


def _alert_threshold(rule: str) -> float:
    root = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((root / "deploy/prometheus/alerts.yml").read_text())
    for group in doc["groups"]:
        for r in group["rules"]:
            if r.get("alert") == rule:
                return float(str(r["expr"]).rsplit(">", 1)[1])
    raise AssertionError(f"no alert {rule}")


def test_the_alerts_thresholds_are_bucket_bounds_of_their_histograms() -> None:
    """``histogram_quantile`` is exact only at a bucket bound: the loop-lag alert's 20 ms
    and the lookup latency alert's 10 ms must be bounds (the loop-lag buckets start at
    1 ms, a uvloop timer's resolution)."""
    m = Metrics(lambda: {"tiers": {}})
    m.observe("lookup", 0.003)
    m.observe("lookup", 0.003)
    m.loop_lag.observe(0.0)
    bounds: dict[str, list[str]] = {}
    for fam in m.registry.collect():
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                bounds.setdefault(s.name, []).append(s.labels["le"])
    lag = [float(b) for b in bounds["kvtier_event_loop_lag_seconds_bucket"]]
    ops = [float(b) for b in bounds["kvtier_op_seconds_bucket"]]
    assert lag[0] == 1e-3 and lag[-1] == float("inf")
    assert _alert_threshold("KVTierEventLoopStalls") in lag
    assert _alert_threshold("KVTierSlowLookups") in ops
    counts = {s.labels["le"]: s.value for fam in m.registry.collect() for s in fam.samples
              if s.name == "kvtier_op_seconds_bucket" and s.labels["op"] == "lookup"}
    assert counts["0.0025"] == 0.0 and counts["0.005"] == 2.0
