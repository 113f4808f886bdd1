"""How doctor reduces scrapes to Signals (kvtier.doctor.signals.derive): the window between
the last two scrapes, the baseline before the first, counter resets (an engine or daemon
restarted between scrapes), and which source wins when the engine and kvtier both report.
Each test builds the samples by hand, so a wrong counter or window shows as a number."""

from __future__ import annotations

import pytest

from kvtier.doctor import engine as m
from kvtier.doctor.engine import EngineSample
from kvtier.doctor.histogram import Histogram
from kvtier.doctor.patterns import Pattern
from kvtier.doctor.rules import diagnose
from kvtier.doctor.signals import derive
from kvtier.doctor.stats import KVTierStats, TierStats

BOUNDS = (1.0, 10.0, 100.0, 1000.0, 10_000.0, float("inf"))


def eng(values: dict[tuple[str, ...], float] | None = None,
        hists: dict[tuple[str, ...], Histogram] | None = None) -> EngineSample:
    """An engine scrape with each value under the first (current) name of its metric."""
    return EngineSample("e.prom", {k[0]: v for k, v in (values or {}).items()},
                        {k[0]: h for k, h in (hists or {}).items()})


def hist(count: float, total: float) -> Histogram:
    """Every observation in the first bucket: only count and sum matter."""
    return Histogram(BOUNDS, (count,) * len(BOUNDS), total, count)


def tier(failures: float | None, used: float = 50.0) -> TierStats:
    return TierStats("cpu", True, 100.0, used, failures, None, None, None, None)


def kst(**kw: object) -> KVTierStats:
    return KVTierStats("s.json", 1, None, **kw)  # type: ignore[arg-type]


def test_recent_window_is_the_last_interval_and_baseline_the_first_scrape() -> None:
    """Three scrapes: recent = last minus the one before (mean 6 s), baseline = the first
    (1 s); last minus first (4 s) or the middle scrape as baseline (1.5 s) dilute a jump."""
    samples = [eng(hists={m.TTFT: hist(c, t)}) for c, t in ((100, 100), (200, 300), (300, 900))]
    s = derive(samples, [], 10.0)
    assert s.ttft_mean == pytest.approx(6.0)
    assert s.ttft_mean_base == pytest.approx(1.0)


def test_engine_counter_resets_restart_from_zero() -> None:
    """An engine restarted between scrapes: preemptions 100 -> 5 are 5 new ones, the
    generation counter going back is no negative throughput, and prefix counters that went
    back are read as counted since the restart."""
    a = eng({m.PREEMPTIONS: 100.0, m.GENERATION_TOKENS: 50_000.0, m.RUNNING: 10.0,
             m.PREFIX_QUERIES: 100_000.0, m.PREFIX_HITS: 90_000.0})
    b = eng({m.PREEMPTIONS: 5.0, m.GENERATION_TOKENS: 1_000.0, m.RUNNING: 30.0,
             m.PREFIX_QUERIES: 50_000.0, m.PREFIX_HITS: 1_000.0})
    s = derive([a, b], [], 10.0)
    assert s.preemptions == 5.0
    assert s.generation_tps == (0.0,)
    assert s.running_avg == (20.0,)   # the interval's mean of the two ends
    assert s.prefix_queries == 50_000.0 and s.prefix_hit_rate == pytest.approx(0.02)
    assert Pattern.PREEMPTION in [f.pattern for f in diagnose(s)]


def test_zero_queried_tokens_is_no_rate_and_no_crash() -> None:
    """An idle engine (prefix counters at 0) has no hit rate; it must not divide by 0."""
    s = derive([eng({m.PREFIX_QUERIES: 0.0, m.PREFIX_HITS: 0.0})], [], None)
    assert s.prefix_hit_rate is None and s.prefix_queries == 0.0


def test_combined_rate_adds_the_connector_hits_and_caps_at_one() -> None:
    """GPU hits plus the KV connector's (kvtier's) over the queried tokens: 50% + 40% is
    90%; more than the queried tokens is capped at 100%."""
    def combined(ext_hits: float) -> float | None:
        e = eng({m.PREFIX_QUERIES: 1000.0, m.PREFIX_HITS: 500.0,
                 m.EXTERNAL_QUERIES: 500.0, m.EXTERNAL_HITS: ext_hits})
        return derive([e], [], None).combined_hit_rate
    assert combined(400.0) == pytest.approx(0.9)
    assert combined(800.0) == 1.0


def test_kvtier_lookup_counters_reset_and_idle() -> None:
    """The daemon restarted between two /v1/stats (lookup tokens went back): the new counts
    are since the restart, not a negative window; no lookups at all is no rate (not 0%)."""
    a = kst(lookup_tokens=1_000_000.0, hit_tokens=900_000.0)
    b = kst(lookup_tokens=20_000.0, hit_tokens=10_000.0)
    s = derive([], [a, b], 10.0)
    assert s.kvtier_queries == 20_000.0 and s.kvtier_hit_rate == pytest.approx(0.5)
    idle = derive([], [kst(lookup_tokens=0.0, hit_tokens=0.0)], None)
    assert idle.kvtier_hit_rate is None and idle.prefix_hit_rate is None


def test_kvtier_rate_alone_from_an_older_daemon() -> None:
    """A daemon that reports only requests.prefix_hit_rate (no token counts): that rate."""
    s = derive([], [kst(prefix_hit_rate=0.4)], None)
    assert s.kvtier_hit_rate == 0.4 and s.prefix_hit_rate == 0.4


def test_engine_prefix_rate_is_not_replaced_by_kvtier_s() -> None:
    """The GPU's own rate stays the GPU's: kvtier's rate goes in its own field and only
    stands in when the engine gives none."""
    e = eng({m.PREFIX_QUERIES: 100_000.0, m.PREFIX_HITS: 1_000.0})
    s = derive([e], [kst(lookup_tokens=20_000.0, hit_tokens=10_000.0)], None)
    assert s.prefix_hit_rate == pytest.approx(0.01)
    assert s.kvtier_hit_rate == pytest.approx(0.5)


def test_tier_allocation_failures_after_a_daemon_restart() -> None:
    """100 failures then 3 (the daemon restarted): 3 in the window, which is still a
    finding (a negative count hid it)."""
    a = kst(tiers={"cpu": tier(100.0)})
    b = kst(tiers={"cpu": tier(3.0)})
    s = derive([], [a, b], 10.0)
    assert s.tiers[0].allocation_failures == 3.0
    assert [f.pattern for f in diagnose(s)] == [Pattern.FRAGMENTATION]
    steady = derive([], [kst(tiers={"cpu": tier(3.0)}), b], 10.0)
    assert steady.tiers[0].allocation_failures == 0.0


def test_kvtier_preemption_counter_reset() -> None:
    a = kst(preemptions=50.0)
    b = kst(preemptions=4.0)
    assert derive([], [a, b], 10.0).preemptions == 4.0


def test_engine_numbers_win_over_the_connector_s() -> None:
    """The engine's own gauges and counters come first; kvtier's connector fills gaps."""
    e0 = eng({m.RUNNING: 8.0, m.WAITING: 1.0, m.PREEMPTIONS: 10.0})
    e1 = eng({m.RUNNING: 9.0, m.WAITING: 2.0, m.PREEMPTIONS: 15.0})
    k0 = kst(running=1.0, waiting=0.0, preemptions=0.0)
    k1 = kst(running=2.0, waiting=0.0, preemptions=0.0)
    s = derive([e0, e1], [k0, k1], 10.0)
    assert (s.running_first, s.running_last) == (8.0, 9.0)
    assert (s.waiting_first, s.waiting_last) == (1.0, 2.0)
    assert s.preemptions == 5.0


def test_first_and_last_fields_and_quantiles() -> None:
    """KV usage and context P50 first/last come from the first and last scrape; the P99
    and P90 are those quantiles (a P90 in place of the P99 understates the tail that pattern
    8 sizes for); interval is None with one sample."""
    prompts = Histogram(BOUNDS, (0.0, 0.0, 0.0, 90.0, 100.0, 100.0), 50_000.0, 100.0)
    ttft = Histogram(BOUNDS, (50.0, 100.0, 100.0, 100.0, 100.0, 100.0), 200.0, 100.0)
    e0 = eng({m.KV_USAGE: 0.2}, {m.PROMPT_LEN: prompts, m.TTFT: ttft})
    e1 = eng({m.KV_USAGE: 0.7}, {m.PROMPT_LEN: prompts, m.TTFT: ttft})
    s = derive([e0, e1], [kst(context_p50=100.0), kst(context_p50=900.0)], 10.0)
    assert (s.kv_usage_first, s.kv_usage_last) == (0.2, 0.7)
    assert (s.context_p50_first, s.context_p50_last) == (100.0, 900.0)
    assert s.prompt_p99 == pytest.approx(9_100.0)
    assert derive([e1], [], 10.0).interval_s is None
    one = derive([e1], [], None)
    assert one.ttft_p90 == pytest.approx(8.2)


def test_a_newer_stats_version_is_noted() -> None:
    """Version 2 of /v1/stats is newer than this doctor knows: it says so."""
    s = derive([], [KVTierStats("s.json", 2, None)], None)
    assert any("version 2 is newer" in n for n in s.notes)
    assert not any("newer" in n for n in derive([], [kst()], None).notes)
