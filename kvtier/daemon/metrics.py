"""Prometheus metrics, read at scrape time from the same counters as /v1/stats.

Counters live as plain ints in the store and tiers (cheap on the hot path); this
collector turns them into ``kvtier_*`` families when Prometheus scrapes. Operation
latencies are real histograms, observed by the control server.

The names are a stable interface (alerts, dashboards): docs/operations.md lists them all.
Renaming one is a breaking change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.daemon.engines import COUNTERS as ENGINE_COUNTERS
from kvtier.daemon.engines import GAUGES as ENGINE_GAUGES
from kvtier.keys import KEY_SCHEME

_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                    0.25, 0.5, 1.0, 2.5)

# an idle loop on uvloop reads 0-1 ms (millisecond timers)
_LAG_BUCKETS = (1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)

_TIER_COUNTERS = {
    "hit_blocks": ("kvtier_hit_blocks", "Lookups' blocks found in this tier"),
    "miss_blocks": ("kvtier_miss_blocks", "Lookups' first block that reached this tier and "
                    "was not there (at most one per lookup and tier)"),
    "hit_tokens": ("kvtier_hit_tokens", "Tokens of the lookups' blocks found in this tier"),
    "miss_tokens": ("kvtier_miss_tokens", "Tokens of the first missing block per lookup "
                    "and tier"),
    "allocation_failures": ("kvtier_allocation_failures", "Allocations that found no room"),
    "checksum_failures": ("kvtier_checksum_failures", "Frames that failed a check (dropped)"),
    "bytes_read": ("kvtier_tier_read_bytes", "Bytes read from this tier"),
    "bytes_written": ("kvtier_tier_written_bytes", "Bytes written to this tier"),
    "errors": ("kvtier_tier_errors", "I/O or connection errors of this tier"),
    "dropped_writes": ("kvtier_dropped_writes", "Pending writes dropped under backpressure"),
    "redirects": ("kvtier_redis_redirects", "Keys asked again at the server a Redis Cluster "
                  "MOVED or ASK named (slot moved or being migrated)"),
}
# counters only some tiers have: a tier that does not report one gets no series for it
# (a Redis redirect count of 0 for the cpu tier would read as "no reshard seen")
_TIER_OWN = frozenset({"redirects"})
# gauges a tier reports as null when nothing bounds it (redis without redis.bytes or a
# maxmemory): exported as no series, never as 0, which the free-bytes panels read as full
_UNBOUNDED_OK = frozenset({"capacity_bytes", "free_bytes"})


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
                                                "Hard capacity of the tier (absent when "
                                                "nothing bounds it: redis without "
                                                "redis.bytes or maxmemory)", labels=["tier"]),
            "used_bytes": GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes in use",
                                            labels=["tier"]),
            "free_bytes": GaugeMetricFamily("kvtier_tier_free_bytes", "Bytes free (absent "
                                            "when the capacity is)", labels=["tier"]),
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
                if key in _UNBOUNDED_OK and key in t and t[key] is None:
                    continue   # no limit: no series (0 would read as a full tier)
                fam.add_metric([name], float(t.get(key, 0)))
            for key, counter in counters.items():
                if key in t or key not in _TIER_OWN:
                    counter.add_metric([name], float(t.get(key, 0)))
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
                    "puts", "put_blocks", "gets", "get_blocks", "deletes",
                    "namespace_mismatch", "layout_mismatch", "redis_budget_misses"):
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
        yield CounterMetricFamily("kvtier_lease_expired", "Leases released by their deadline "
                                  "(a client hung or crashed)",
                                  value=float(req.get("lease_expired", 0)))
        limited = CounterMetricFamily(
            "kvtier_limited", "What the daemon's limits did to clients: connections refused "
            "or dropped, puts and gets granted less than their process asked, leases refused",
            labels=["event"])
        for key in ("refused_connections", "dropped_idle", "dropped_slow", "capped_puts",
                    "capped_gets", "refused_leases"):
            limited.add_metric([key], float(daemon.get(key, 0)))
        yield limited
        gcs = daemon.get("gc")
        if gcs:
            yield GaugeMetricFamily("kvtier_gc_frozen_objects", "Python objects frozen out of "
                                    "garbage collections, counted at start and at each full "
                                    "collection", value=float(gcs["frozen"]))
            yield GaugeMetricFamily("kvtier_gc_frozen_since_full_objects", "Python objects "
                                    "frozen after that count (some freed since)",
                                    value=float(gcs["frozen_since"]))
            yield CounterMetricFamily("kvtier_gc_full_collections", "Collections over every "
                                      "object (they stop the event loop)",
                                      value=float(gcs["full_collections"]))
            yield GaugeMetricFamily("kvtier_gc_last_full_seconds", "How long the last full "
                                    "collection stopped the event loop",
                                    value=float(gcs["last_full_s"]))
        yield from _admission_families(s.get("admission", {}))
        yield from _nvme_file_families(tiers.get("nvme", {}))
        yield from _explain_families(s.get("explain", {}))
        schemes = GaugeMetricFamily("kvtier_clients_by_key_scheme", "Connected clients per "
                                    "key function version (any this daemon does not know: "
                                    "other)", labels=["scheme"])
        for scheme, n in scheme_counts(daemon.get("key_schemes", {})).items():
            schemes.add_metric([scheme], float(n))
        yield schemes
        yield GaugeMetricFamily("kvtier_leases_quarantined_bytes",
                                "Arena bytes of expired put leases held until their "
                                "connection closes",
                                value=float(s.get("leases", {}).get("quarantined_bytes", 0)))
        yield from _policy_metrics(s)
        conn = s.get("connector", {})
        for key in ENGINE_GAUGES:
            if key in conn:
                yield GaugeMetricFamily(f"kvtier_engine_{key}",
                                        f"Engine {key} as connected connectors report it",
                                        value=float(conn[key]))
        for key in ENGINE_COUNTERS:
            if key in conn:
                yield CounterMetricFamily(f"kvtier_engine_{key}",
                                          f"Engine {key} reported by connectors since the "
                                          "daemon started", value=float(conn[key]))


def scheme_counts(schemes: dict[str, int]) -> dict[str, int]:
    """Clients per key scheme, as labels: a scheme this daemon does not know counts as
    ``other``. A client chooses the string (up to 64 characters), and each new one made a
    new series for good: a client reconnecting with new strings grew Prometheus without
    bound. ``unknown`` (a client that named none) stays."""
    out: dict[str, int] = {}
    for scheme, n in schemes.items():
        label = scheme if scheme in (KEY_SCHEME, "unknown") else "other"
        out[label] = out.get(label, 0) + n
    return out


def admission_stats(admission: Any, nvme_budget_bytes_per_s: int,
                    now: float) -> dict[str, Any]:
    """The /v1/stats ``admission`` section: writes refused per tier, the nvme budget left
    at ``now`` (the store's clock) and the bytes it refused."""
    by_tier: dict[str, Any] = getattr(admission, "_by_tier", {}) or {}
    out: dict[str, Any] = {"rejected": {t: int(getattr(p, "rejected", 0))
                                        for t, p in by_tier.items()}}
    budget = by_tier.get("nvme")
    if budget is not None and hasattr(budget, "available_at"):
        out["nvme_write_budget"] = {"bytes_per_s": nvme_budget_bytes_per_s,
                                    "available_bytes": max(0.0, float(budget.available_at(now))),
                                    "refused_bytes": int(budget.refused_bytes)}
    return out


def _admission_families(adm: dict[str, Any]) -> Iterator[Metric]:
    rejected = CounterMetricFamily("kvtier_admission_rejected", "Writes refused by a tier's "
                                   "admission policy (e.g. the nvme write budget)",
                                   labels=["tier"])
    for tier, n in adm.get("rejected", {}).items():
        rejected.add_metric([tier], float(n))
    yield rejected
    budget = adm.get("nvme_write_budget")
    if budget:
        yield GaugeMetricFamily("kvtier_nvme_write_budget_bytes_per_second",
                                "Configured nvme write budget (0: unlimited)",
                                value=float(budget["bytes_per_s"]))
        yield GaugeMetricFamily("kvtier_nvme_write_budget_available_bytes",
                                "Bytes the nvme write budget can admit now",
                                value=float(budget["available_bytes"]))
        yield CounterMetricFamily("kvtier_nvme_write_budget_refused_bytes",
                                  "Bytes of evicted blocks the nvme write budget refused "
                                  "(dropped instead of written)",
                                  value=float(budget.get("refused_bytes", 0)))


def _nvme_file_families(nvme: dict[str, Any]) -> Iterator[Metric]:
    """The nvme tier's slot file descriptors (``kvtier.tiers.nvme.files``): how many are
    open and how often the bound made the tier close and reopen one (a rate that keeps
    climbing says more block sizes are in use than ``MAX_OPEN_FILES``)."""
    if "open_files" not in nvme:
        return
    yield GaugeMetricFamily("kvtier_nvme_open_files", "Slot file descriptors the nvme tier "
                            "holds open", value=float(nvme["open_files"]))
    yield CounterMetricFamily("kvtier_nvme_file_reopens", "Slot files opened again after "
                              "their descriptor was closed to stay within the bound",
                              value=float(nvme.get("file_reopens", 0)))
    yield CounterMetricFamily("kvtier_nvme_file_closes", "Slot file descriptors closed to "
                              "stay within the bound", value=float(nvme.get("file_closes", 0)))


def _explain_families(ex: dict[str, Any]) -> Iterator[Metric]:
    first = CounterMetricFamily("kvtier_first_miss", "Lookups by the reason their first "
                                "missing block was not found (none: full hit)",
                                labels=["reason"])
    for reason, n in ex.get("first_miss", {}).items():
        first.add_metric([reason], float(n))
    yield first


def _policy_metrics(s: dict[str, Any]) -> Iterator[Metric]:
    """Adaptive policy (issue 13): live mode, switches and miss-ratio curve per tier."""
    policy: dict[str, Any] = s.get("policy", {})
    if "lookups_dropped" in policy:
        dropped = CounterMetricFamily("kvtier_policy_lookups_dropped", "Lookups the adaptive "
                                      "policy's learning dropped unread: it fell behind")
        dropped.add_metric([], float(policy["lookups_dropped"]))
        yield dropped
    tiers: dict[str, dict[str, Any]] = policy.get("tiers", {})
    if not tiers:
        return
    mrc = GaugeMetricFamily("kvtier_policy_mrc_hit_rate", "Token hit rate the tier would have "
                            "at scale x its size (live miss-ratio curve)",
                            labels=["tier", "scale"])
    mode = GaugeMetricFamily("kvtier_policy_mode", "1 for the eviction mode the tier runs now",
                             labels=["tier", "mode"])
    switches = CounterMetricFamily("kvtier_policy_mode_switches", "Changes of the live mode",
                                   labels=["tier"])
    for name, t in tiers.items():
        for p in t.get("mrc", []):
            mrc.add_metric([name, f"{p['scale']:g}"], float(p["hit_rate"]))
        for m in t.get("modes", {}):
            mode.add_metric([name, m], 1.0 if m == t.get("mode") else 0.0)
        switches.add_metric([name], float(t.get("switches", 0)))
    yield mrc
    yield mode
    yield switches


class Metrics:
    """The daemon's private registry: the collector plus per-op latency histograms."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KVTierCollector(snapshot))
        self.op_seconds = Histogram("kvtier_op_seconds", "Control-plane operation latency",
                                    ["op"], registry=self.registry, buckets=_LATENCY_BUCKETS)
        self._by_op: dict[str, Any] = {}   # op -> its labelled child (``labels`` per request
        #                                    costs a lock and a tuple; ops are a fixed set)
        self.loop_lag = Histogram("kvtier_event_loop_lag_seconds",
                                  "How late the event loop ran a timer: how long it served "
                                  "no client (kvtier.daemon.loop_lag)", registry=self.registry,
                                  buckets=_LAG_BUCKETS)

    def observe(self, op: str, seconds: float) -> None:
        child = self._by_op.get(op)
        if child is None:
            child = self._by_op[op] = self.op_seconds.labels(op)
        child.observe(seconds)
