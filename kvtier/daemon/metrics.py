"""Prometheus metrics, read at scrape time from the same counters as /v1/stats.

Counters live as plain ints in the store and tiers (cheap on the hot path); this
collector turns them into ``kvtier_*`` families when Prometheus scrapes. Operation
latencies are real histograms, observed by the control server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.daemon.control import CONNECTOR_COUNTERS

_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                    0.25, 0.5, 1.0, 2.5)

_TIER_COUNTERS = {
    "hit_blocks": ("kvtier_hit_blocks", "Blocks found in this tier at lookup"),
    "miss_blocks": ("kvtier_miss_blocks", "Lookups that reached this tier and missed"),
    "hit_tokens": ("kvtier_hit_tokens", "Tokens covered by hits in this tier"),
    "miss_tokens": ("kvtier_miss_tokens", "Tokens of the first missing block per lookup"),
    "allocation_failures": ("kvtier_allocation_failures", "Allocations that found no room"),
    "checksum_failures": ("kvtier_checksum_failures", "Frames that failed a check (dropped)"),
    "bytes_read": ("kvtier_tier_read_bytes", "Bytes read from this tier"),
    "bytes_written": ("kvtier_tier_written_bytes", "Bytes written to this tier"),
    "errors": ("kvtier_tier_errors", "I/O or connection errors of this tier"),
    "dropped_writes": ("kvtier_dropped_writes", "Pending writes dropped under backpressure"),
}


class KVTierCollector:
    """Exports a stats snapshot (``snapshot()`` returns the /v1/stats dict)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        tiers: dict[str, dict[str, Any]] = s.get("tiers", {})
        gauges = {
            "capacity_bytes": GaugeMetricFamily("kvtier_tier_capacity_bytes",
                                                "Hard capacity of the tier", labels=["tier"]),
            "used_bytes": GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes in use",
                                            labels=["tier"]),
            "free_bytes": GaugeMetricFamily("kvtier_tier_free_bytes", "Bytes free",
                                            labels=["tier"]),
            "blocks": GaugeMetricFamily("kvtier_tier_blocks", "Blocks resident",
                                        labels=["tier"]),
            "up": GaugeMetricFamily("kvtier_tier_up", "1 when the tier is reachable",
                                    labels=["tier"]),
        }
        counters = {k: CounterMetricFamily(n, h, labels=["tier"])
                    for k, (n, h) in _TIER_COUNTERS.items()}
        evictions = CounterMetricFamily("kvtier_evictions", "Blocks leaving a tier, by reason",
                                        labels=["tier", "reason"])
        for name, t in tiers.items():
            for key, fam in gauges.items():
                fam.add_metric([name], float(t.get(key, 0)))
            for key, fam in counters.items():
                fam.add_metric([name], float(t.get(key, 0)))
            for reason, n in t.get("evictions", {}).items():
                evictions.add_metric([name, reason], float(n))
        yield from gauges.values()
        yield from counters.values()
        yield evictions
        moved = CounterMetricFamily("kvtier_bytes_moved", "Bytes moved between tiers",
                                    labels=["src", "dst"])
        for row in s.get("bytes_moved", []):
            moved.add_metric([row["src"], row["dst"]], float(row["bytes"]))
        yield moved
        req = s.get("requests", {})
        for key in ("lookups", "lookup_blocks", "hit_blocks", "lookup_tokens", "hit_tokens",
                    "puts", "put_blocks", "gets", "get_blocks", "deletes", "lease_expired"):
            yield CounterMetricFamily(f"kvtier_requests_{key}", f"Connector requests: {key}",
                                      value=float(req.get(key, 0)))
        yield GaugeMetricFamily("kvtier_prefix_hit_rate", "Leading-block hit rate of lookups",
                                value=float(req.get("prefix_hit_rate", 0.0)))
        pre = CounterMetricFamily("kvtier_prefetch", "Promotions started at lookup, by outcome",
                                  labels=["outcome"])
        for k, v in s.get("prefetch", {}).items():
            pre.add_metric([k], float(v))
        yield pre
        daemon = s.get("daemon", {})
        yield GaugeMetricFamily("kvtier_clients", "Connected clients",
                                value=float(daemon.get("clients", 0)))
        yield GaugeMetricFamily("kvtier_leases_active", "Open leases",
                                value=float(s.get("leases", {}).get("active", 0)))
        conn = s.get("connector", {})
        for key in ("running", "waiting", "preemptions", "context_tokens_p50",
                    "context_tokens_p99", *CONNECTOR_COUNTERS):
            if key in conn:
                yield GaugeMetricFamily(f"kvtier_engine_{key}",
                                        f"Engine {key} as reported by connectors",
                                        value=float(conn[key]))


class Metrics:
    """The daemon's private registry: the collector plus per-op latency histograms."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KVTierCollector(snapshot))  # type: ignore[arg-type]
        self.op_seconds = Histogram("kvtier_op_seconds", "Control-plane operation latency",
                                    ["op"], registry=self.registry, buckets=_LATENCY_BUCKETS)

    def observe(self, op: str, seconds: float) -> None:
        self.op_seconds.labels(op).observe(seconds)
