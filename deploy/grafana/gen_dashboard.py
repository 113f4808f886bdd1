"""Writes kvtier.json, the Grafana dashboard, from the panel list below.

Rows: the seed's monitoring list (KV used/free, allocation failures, prefix hit rate,
evictions, preemptions, context-length percentiles, running/waiting; vLLM's series where the
engine exports them next to what kvtier's connectors report), then kvtier's tiers (use, hit
rate per tier, bytes moved by source and destination, latency percentiles per op, prefetch
outcomes, checksum failures, evictions by reason, first-miss reasons, write budget, leases).
Every query is run against a real Prometheus in tests/integration/test_prometheus_dashboard.py.

    python deploy/grafana/gen_dashboard.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
K = 'instance=~"$instance"'        # kvtier daemons
V = 'instance=~"$engine"'          # vLLM engines
R = "$__rate_interval"

# (row title, [(panel title, unit, [(expr, legend)])])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Engine KV cache (seed monitoring list)", [
        ("KV cache used (vLLM)", "percentunit", [
            (f"vllm:kv_cache_usage_perc{{{V}}}", "{{instance}} engine {{engine}}")]),
        ("Tier blocks used / bytes free", "short", [
            (f"kvtier_tier_blocks{{{K}}}", "{{tier}} blocks"),
            (f"kvtier_tier_free_bytes{{{K}}} / 1048576", "{{tier}} free MiB"),
            # a tier nothing bounds (redis without redis.bytes or maxmemory) has no free
            # or capacity series: its use instead, rather than no line or a full tier
            (f"(kvtier_tier_used_bytes{{{K}}} unless on (instance, tier) "
             f"kvtier_tier_capacity_bytes{{{K}}}) / 1048576", "{{tier}} used MiB (no limit)")]),
        ("Allocation failures /s", "ops", [
            (f"sum by (tier) (rate(kvtier_allocation_failures_total{{{K}}}[{R}]))", "{{tier}}")]),
        ("Prefix hit rate", "percentunit", [
            (f"kvtier_prefix_hit_rate{{{K}}}", "kvtier {{instance}}"),
            (f"sum by (instance) (rate(vllm:prefix_cache_hits_total{{{V}}}[{R}])) / "
             f"sum by (instance) (rate(vllm:prefix_cache_queries_total{{{V}}}[{R}]))",
             "vLLM {{instance}}")]),
        ("Evictions /s", "ops", [
            (f"sum by (tier) (rate(kvtier_evictions_total{{{K}}}[{R}]))", "{{tier}}")]),
        ("Preemptions", "short", [
            (f"sum by (instance) (rate(vllm:num_preemptions_total{{{V}}}[{R}]))",
             "vLLM {{instance}} /s"),
            (f"sum by (instance) (rate(kvtier_engine_preemptions_total{{{K}}}[{R}]))",
             "connectors {{instance}} /s")]),
        ("Context length percentiles (tokens)", "short", [
            (f"histogram_quantile(0.5, sum by (le) (rate(vllm:request_prompt_tokens_bucket"
             f"{{{V}}}[{R}])))", "vLLM prompt P50"),
            (f"histogram_quantile(0.99, sum by (le) (rate(vllm:request_prompt_tokens_bucket"
             f"{{{V}}}[{R}])))", "vLLM prompt P99"),
            (f"kvtier_engine_context_tokens_p50{{{K}}}", "connectors P50"),
            (f"kvtier_engine_context_tokens_p99{{{K}}}", "connectors P99")]),
        ("Running / waiting sequences", "short", [
            (f"sum(vllm:num_requests_running{{{V}}})", "vLLM running"),
            (f"sum(vllm:num_requests_waiting{{{V}}})", "vLLM waiting"),
            (f"kvtier_engine_running{{{K}}}", "connectors running"),
            (f"kvtier_engine_waiting{{{K}}}", "connectors waiting")]),
    ]),
    ("kvtier tiers", [
        ("Tier used / capacity", "percentunit", [
            (f"kvtier_tier_used_bytes{{{K}}} / kvtier_tier_capacity_bytes{{{K}}}", "{{tier}}")]),
        ("Hit rate per tier", "percentunit", [
            (f"sum by (tier) (rate(kvtier_hit_blocks_total{{{K}}}[{R}])) / "
             f"(sum by (tier) (rate(kvtier_hit_blocks_total{{{K}}}[{R}])) + "
             f"sum by (tier) (rate(kvtier_miss_blocks_total{{{K}}}[{R}])))", "{{tier}}")]),
        ("Bytes moved by source -> destination", "Bps", [
            (f"sum by (src, dst) (rate(kvtier_bytes_moved_total{{{K}}}[{R}]))",
             "{{src}} -> {{dst}}")]),
        ("Operation latency P50 / P99", "s", [
            (f"histogram_quantile(0.5, sum by (op, le) (rate(kvtier_op_seconds_bucket{{{K}}}"
             f"[{R}])))", "{{op}} P50"),
            (f"histogram_quantile(0.99, sum by (op, le) (rate(kvtier_op_seconds_bucket{{{K}}}"
             f"[{R}])))", "{{op}} P99")]),
        ("Event loop lag P50 / P99 (every client waits this long)", "s", [
            (f"histogram_quantile(0.5, sum by (instance, le) (rate("
             f"kvtier_event_loop_lag_seconds_bucket{{{K}}}[{R}])))", "{{instance}} P50"),
            (f"histogram_quantile(0.99, sum by (instance, le) (rate("
             f"kvtier_event_loop_lag_seconds_bucket{{{K}}}[{R}])))", "{{instance}} P99")]),
        ("Evictions /s by reason", "ops", [
            (f"sum by (tier, reason) (rate(kvtier_evictions_total{{{K}}}[{R}]))",
             "{{tier}} {{reason}}")]),
        ("Prefetch outcomes /s", "ops", [
            (f"sum by (outcome) (rate(kvtier_prefetch_total{{{K}}}[{R}]))", "{{outcome}}")]),
        ("Checksum failures", "short", [
            (f"sum by (tier) (increase(kvtier_checksum_failures_total{{{K}}}[{R}]))",
             "{{tier}}")]),
        ("First-miss reasons /s (kvtier explain)", "ops", [
            (f"sum by (reason) (rate(kvtier_first_miss_total{{{K}}}[{R}]))", "{{reason}}")]),
        ("Tier up, write drops, errors", "short", [
            (f"kvtier_tier_up{{{K}}}", "{{tier}} up"),
            (f"sum by (tier) (increase(kvtier_dropped_writes_total{{{K}}}[{R}]))",
             "{{tier}} dropped writes"),
            (f"sum by (tier) (increase(kvtier_tier_errors_total{{{K}}}[{R}]))",
             "{{tier}} errors"),
            (f"sum by (tier) (increase(kvtier_redis_redirects_total{{{K}}}[{R}]))",
             "{{tier}} cluster redirects followed")]),
        ("nvme write budget", "bytes", [
            (f"kvtier_nvme_write_budget_available_bytes{{{K}}}", "available"),
            (f"kvtier_nvme_write_budget_bytes_per_second{{{K}}}", "per second"),
            (f"sum by (tier) (increase(kvtier_admission_rejected_total{{{K}}}[{R}]))",
             "{{tier}} refused writes")]),
        ("Leases and clients", "short", [
            (f"kvtier_leases_active{{{K}}}", "active leases"),
            (f"increase(kvtier_lease_expired_total{{{K}}}[{R}])", "expired"),
            (f"kvtier_clients_by_key_scheme{{{K}}}", "clients {{scheme}}")]),
    ]),
]


def _var(name: str, label: str, query: str) -> dict[str, object]:
    return {"name": name, "label": label, "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query,
            "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
            "current": {"selected": True, "text": "All", "value": "$__all"}}


def build() -> str:
    panels: list[dict[str, object]] = []
    pid, y = 1, 0
    for row_title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets) in enumerate(row):
            panels.append({
                "id": pid, "type": "timeseries", "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"x": (i % 3) * 8, "y": y + (i // 3) * 8, "w": 8, "h": 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [{"refId": chr(ord("A") + j), "expr": e, "legendFormat": lg}
                            for j, (e, lg) in enumerate(targets)],
            })
            pid += 1
        y += ((len(row) + 2) // 3) * 8
    dash = {
        "title": "kvtier", "uid": "kvtier-ops", "tags": ["kvtier", "vllm", "kv-cache"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}},
            _var("instance", "kvtier daemon", "label_values(kvtier_tier_up, instance)"),
            _var("engine", "vLLM engine", "label_values(vllm:num_requests_running, instance)"),
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }
    return json.dumps(dash, indent=2) + "\n"


if __name__ == "__main__":
    out = HERE / "kvtier.json"
    out.write_text(build())
    print(f"wrote {out}", file=sys.stderr)
