"""Writes alerts.test.yml: a promtool unit test per alert, firing and quiet.

Each case below gives the synthetic series (promtool's expanding notation, one sample per
minute) under which the alert must fire, and a near-identical healthy variant under which it
must not. The expected annotations are the rule's own templates filled with the case's
labels, so the test checks the expressions and the labels they keep. Run it after editing
alerts.yml or a case, then ``promtool test rules alerts.test.yml``:

    python deploy/prometheus/gen_alert_tests.py
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
INST = 'instance="n1"'


@dataclass(frozen=True)
class Case:
    """``fire`` and ``quiet`` map a series selector to its values."""

    alert: str
    eval_m: int
    labels: dict[str, str]
    fire: dict[str, str]
    quiet: dict[str, str] = field(default_factory=dict)


def _hist(name: str, labels: str, buckets: dict[str, str]) -> dict[str, str]:
    return {f'{name}_bucket{{{labels},le="{le}"}}': v for le, v in buckets.items()}


_PROMPT_HIST = _hist("vllm:request_prompt_tokens", INST, {
    "1000": "0+80x40", "4000": "0+90x40", "16000": "0+95x40", "64000": "0+100x40",
    "+Inf": "0+100x40"})

CASES = [
    Case("KVCacheNearFullPreemptionsRising", 10, {"instance": "n1"},
         {f"vllm:kv_cache_usage_perc{{{INST}}}": "0.97x30",
          f"vllm:num_preemptions_total{{{INST}}}": "0+5x30"},
         {f"vllm:kv_cache_usage_perc{{{INST}}}": "0.80x30",
          f"vllm:num_preemptions_total{{{INST}}}": "0+5x30"}),
    Case("KVPreemptionStorm", 20, {"instance": "n1"},
         {f"vllm:num_preemptions_total{{{INST}}}": "0+120x40"},
         {f"vllm:num_preemptions_total{{{INST}}}": "0+30x40"}),
    Case("KVPrefixHitRateCollapse", 190, {"instance": "n1"},
         {f"vllm:prefix_cache_queries_total{{{INST}}}": "0+1000x210",
          f"vllm:prefix_cache_hits_total{{{INST}}}": "0+800x150 120000+100x59"},
         {f"vllm:prefix_cache_queries_total{{{INST}}}": "0+1000x210",
          f"vllm:prefix_cache_hits_total{{{INST}}}": "0+800x210"}),
    Case("KVTierPrefixHitRateCollapse", 190, {"instance": "n1"},
         {f"kvtier_requests_lookup_blocks_total{{{INST}}}": "0+1000x210",
          f"kvtier_requests_hit_blocks_total{{{INST}}}": "0+800x150 120000+100x59"},
         {f"kvtier_requests_lookup_blocks_total{{{INST}}}": "0+1000x210",
          f"kvtier_requests_hit_blocks_total{{{INST}}}": "0+800x210"}),
    Case("KVTierLowPrefixHitRate", 50, {"instance": "n1"},
         {f"kvtier_prefix_hit_rate{{{INST}}}": "0.1x60",
          f"kvtier_requests_lookup_blocks_total{{{INST}}}": "0+1000x60"},
         {f"kvtier_prefix_hit_rate{{{INST}}}": "0.5x60",
          f"kvtier_requests_lookup_blocks_total{{{INST}}}": "0+1000x60"}),
    Case("KVRequestsQueueing", 25, {"instance": "n1"},
         {f"vllm:num_requests_waiting{{{INST}}}": "1+1x40"},
         {f"vllm:num_requests_waiting{{{INST}}}": "5x40"}),
    Case("KVLongContextTail", 30, {"instance": "n1"},
         {**_PROMPT_HIST, f"vllm:kv_cache_usage_perc{{{INST}}}": "0.95x40"},
         {**_PROMPT_HIST, f"vllm:kv_cache_usage_perc{{{INST}}}": "0.50x40"}),
    Case("KVTierTierDown", 5, {"instance": "n1", "tier": "redis"},
         {f'kvtier_tier_up{{{INST},tier="redis"}}': "0x10"},
         {f'kvtier_tier_up{{{INST},tier="redis"}}': "1x10"}),
    Case("KVTierChecksumFailures", 5, {"instance": "n1", "tier": "nvme"},
         {f'kvtier_checksum_failures_total{{{INST},tier="nvme"}}': "0 0 0 1 1 1 1"},
         {f'kvtier_checksum_failures_total{{{INST},tier="nvme"}}': "0x10"}),
    # allocation failures split at 90% used, as doctor's patterns 9 and 5 (tier_full): a
    # tier not reporting its usage counts as full; one 85% used is fragmented, not pinned
    Case("KVTierAllocationFailures", 15, {"instance": "n1", "tier": "cpu"},
         {f'kvtier_allocation_failures_total{{{INST},tier="cpu"}}': "0+1x20"},
         {f'kvtier_allocation_failures_total{{{INST},tier="cpu"}}': "0+1x20",
          f'kvtier_tier_used_bytes{{{INST},tier="cpu"}}': "85x20",
          f'kvtier_tier_capacity_bytes{{{INST},tier="cpu"}}': "100x20"}),
    Case("KVTierFragmentation", 15, {"instance": "n1", "tier": "cpu"},
         {f'kvtier_allocation_failures_total{{{INST},tier="cpu"}}': "0+1x20",
          f'kvtier_tier_used_bytes{{{INST},tier="cpu"}}': "85x20",
          f'kvtier_tier_capacity_bytes{{{INST},tier="cpu"}}': "100x20"},
         {f'kvtier_allocation_failures_total{{{INST},tier="cpu"}}': "0+1x20",
          f'kvtier_tier_used_bytes{{{INST},tier="cpu"}}': "95x20",
          f'kvtier_tier_capacity_bytes{{{INST},tier="cpu"}}': "100x20"}),
    Case("KVTierPrefetchThrash", 25, {"instance": "n1"},
         {f'kvtier_prefetch_total{{{INST},outcome="issued"}}': "0+600x30",
          f'kvtier_prefetch_total{{{INST},outcome="wasted"}}': "0+400x30"},
         {f'kvtier_prefetch_total{{{INST},outcome="issued"}}': "0+600x30",
          f'kvtier_prefetch_total{{{INST},outcome="wasted"}}': "0+60x30"}),
    Case("KVTierDroppedWrites", 10, {"instance": "n1", "tier": "redis"},
         {f'kvtier_dropped_writes_total{{{INST},tier="redis"}}': "0+50x20"},
         {f'kvtier_dropped_writes_total{{{INST},tier="redis"}}': "0+5x20"}),
    # refusals at 2 MB/min = 33 kB/s against a 100 kB/s budget: over 10% for 10 min; the
    # quiet variant refuses a block now and then (the level after a refusal is no signal:
    # it lands anywhere below one block, so the alert reads the refused bytes' rate)
    Case("KVTierNvmeWriteBudgetExhausted", 22, {"instance": "n1"},
         {f"kvtier_nvme_write_budget_refused_bytes_total{{{INST}}}": "0+2000000x30",
          f"kvtier_nvme_write_budget_bytes_per_second{{{INST}}}": "100000x30"},
         {f"kvtier_nvme_write_budget_refused_bytes_total{{{INST}}}": "0+100000x30",
          f"kvtier_nvme_write_budget_bytes_per_second{{{INST}}}": "100000x30"}),
    Case("KVTierLeaseExpiries", 4, {"instance": "n1"},
         {f"kvtier_lease_expired_total{{{INST}}}": "0 0 1 1 1"},
         {f"kvtier_lease_expired_total{{{INST}}}": "0x10"}),
    Case("KVTierKeySchemeMismatch", 8, {"instance": "n1"},
         {f'kvtier_clients_by_key_scheme{{{INST},scheme="blake2b_128-chain/2"}}': "2x10",
          f'kvtier_clients_by_key_scheme{{{INST},scheme="unknown"}}': "1x10"},
         {f'kvtier_clients_by_key_scheme{{{INST},scheme="blake2b_128-chain/2"}}': "3x10"}),
    Case("KVTierSlowLookups", 15, {"instance": "n1"},
         _hist("kvtier_op_seconds", f'{INST},op="lookup"',
               {"0.005": "0+10x20", "0.025": "0+50x20", "+Inf": "0+100x20"}),
         _hist("kvtier_op_seconds", f'{INST},op="lookup"',
               {"0.005": "0+100x20", "0.025": "0+100x20", "+Inf": "0+100x20"})),
    Case("KVTierEventLoopStalls", 15, {"instance": "n1"},
         _hist("kvtier_event_loop_lag_seconds", INST,
               {"0.002": "0+900x20", "0.05": "0+960x20", "+Inf": "0+1200x20"}),
         _hist("kvtier_event_loop_lag_seconds", INST,
               {"0.002": "0+1195x20", "0.05": "0+1200x20", "+Inf": "0+1200x20"})),
]


def _fill(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""),
                  template)


def build() -> str:
    rules = {r["alert"]: r for g in yaml.safe_load((HERE / "alerts.yml").read_text())["groups"]
             for r in g["rules"]}
    missing = set(rules) - {c.alert for c in CASES}
    if missing:
        raise SystemExit(f"alerts without a test case: {sorted(missing)}")
    tests = []
    for c in CASES:
        rule = rules[c.alert]
        exp = {"exp_labels": {**c.labels, **rule.get("labels", {})},
               "exp_annotations": {k: _fill(v, c.labels)
                                   for k, v in rule.get("annotations", {}).items()}}
        for series, alerts in ((c.fire, [exp]), (c.quiet, [])):
            tests.append({
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "alert_rule_test": [{"eval_time": f"{c.eval_m}m", "alertname": c.alert,
                                     "exp_alerts": alerts}],
            })
    head = "# Generated by gen_alert_tests.py from its cases and alerts.yml: do not edit.\n"
    return head + yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "1m",
                                  "tests": tests}, sort_keys=False, width=100)


if __name__ == "__main__":
    out = HERE / "alerts.test.yml"
    out.write_text(build())
    print(f"wrote {out} ({len(CASES)} alerts, {2 * len(CASES)} tests)", file=sys.stderr)
