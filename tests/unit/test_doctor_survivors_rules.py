"""Doctor's rules at the edges of the signatures docs/operations.md gives ("The ten patterns"):
each test builds Signals by hand and checks one threshold, one exclusion or one fallback
that the fixture scenarios (far from every edge) do not reach."""

from __future__ import annotations

from dataclasses import replace

from kvtier.doctor.patterns import Pattern, Thresholds
from kvtier.doctor.rules import diagnose
from kvtier.doctor.signals import Signals, TierSignal

# Pattern 1's signature, clear of every edge: KV 95%, queue 0 -> 10, TTFT 3x, prompts 3x.
LONG = Signals(samples=2, interval_s=10.0, kv_usage_first=0.5, kv_usage_last=0.95,
               waiting_first=0.0, waiting_last=10.0, ttft_mean=3.0, ttft_mean_base=1.0,
               prompt_mean=3000.0, prompt_mean_base=1000.0)
# Pattern 2's: ITL 2x, prompts 2x, batch steady, no queue.
SLOW = Signals(samples=2, interval_s=10.0, itl_mean=0.04, itl_mean_base=0.02,
               prompt_mean=2000.0, prompt_mean_base=1000.0, running_first=10.0,
               running_last=10.0, waiting_first=0.0, waiting_last=0.0)
# Pattern 4's: 1% of 100k queried tokens hit.
LOW_HITS = Signals(samples=2, interval_s=10.0, prefix_hit_rate=0.01, prefix_queries=100_000.0)
# Pattern 7's: TTFT 1 s of a 2 s request, 100 output tokens, no queue, KV half used.
AGENT = Signals(samples=2, interval_s=10.0, ttft_mean=1.0, e2e_mean=2.0, output_mean=100.0,
                waiting_last=0.0, kv_usage_last=0.5)


def found(s: Signals, t: Thresholds | None = None) -> list[Pattern]:
    return [f.pattern for f in diagnose(s, t)]


def test_documented_pattern_numbers() -> None:
    """The report prints ``[N]`` and --json ``number`` as the docs' table numbers them,
    1 to 10: a 0-based number sends operators to the wrong row."""
    assert Pattern.LONG_PROMPTS_KV_FULL.number == 1
    assert Pattern.SIZED_BELOW_P99.number == 8
    assert Pattern.TIER_DOWN.number == 10


def test_pattern_1_base_signature() -> None:
    assert found(LONG) == [Pattern.LONG_PROMPTS_KV_FULL]


def test_pattern_1_at_its_documented_thresholds() -> None:
    """KV >= 85% (not 90%), a queue of exactly queue_min (4), prompts exactly 1.5x: each at
    its line counts; a strict comparison or pattern 8's 90% misses the operator's case."""
    edge = replace(LONG, kv_usage_last=0.86, waiting_last=4.0, prompt_mean=1500.0)
    assert found(edge) == [Pattern.LONG_PROMPTS_KV_FULL]


def test_pattern_1_needs_a_queue_jump_and_a_2x_ttft() -> None:
    """Without the queue jump, with TTFT up only 1.8x (a shift, not a jump), or with KV
    under 85%, the long prompts are no admission stall."""
    assert Pattern.LONG_PROMPTS_KV_FULL not in found(replace(LONG, waiting_last=0.0))
    assert Pattern.LONG_PROMPTS_KV_FULL not in found(replace(LONG, ttft_mean=1.8))
    assert Pattern.LONG_PROMPTS_KV_FULL not in found(replace(LONG, kv_usage_last=0.84))


def test_pattern_1_from_full_tier_failures_without_a_prompt_shift() -> None:
    """The docs' "(or kvtier allocation failures on a full tier)": with the queue and TTFT
    jumping, a full tier failing allocations is pattern 1 (not 9), even with no shift."""
    s = replace(LONG, prompt_mean=1000.0, kv_usage_first=0.9,
                tiers=(TierSignal("cpu", 5.0, 0.97),))
    findings = diagnose(s)
    assert [f.pattern for f in findings] == [Pattern.LONG_PROMPTS_KV_FULL]
    assert any("allocation failures" in e for e in findings[0].evidence)


def test_pattern_1_from_tier_failures_is_not_also_pattern_8() -> None:
    """Tier failures fire pattern 1 without a prompt shift; KV that also climbed 30
    points (pattern 8's signature) is the same cause: one finding, not two."""
    s = replace(LONG, prompt_mean=1000.0, kv_usage_first=0.5,
                tiers=(TierSignal("cpu", 5.0, 0.97),))
    assert found(s) == [Pattern.LONG_PROMPTS_KV_FULL]
    assert found(replace(s, tiers=())) == [Pattern.SIZED_BELOW_P99]


def test_queue_jump_from_an_empty_queue_needs_jump_times_one() -> None:
    """A queue that was empty must reach jump x 1 (not jump x 0 = anything): with a tuned
    queue_min of 1, one waiting request after none is no jump."""
    t = Thresholds(queue_min=1.0)
    assert Pattern.LONG_PROMPTS_KV_FULL not in found(replace(LONG, waiting_last=1.0), t)
    assert found(replace(LONG, waiting_last=2.0), t) == [Pattern.LONG_PROMPTS_KV_FULL]


def test_zero_baselines_do_not_crash() -> None:
    """A baseline of 0 (every observation 0, possible in a histogram) is no ratio: doctor
    must not die with ZeroDivisionError."""
    s = replace(LONG, ttft_mean_base=0.0, prompt_mean_base=0.0, itl_mean=0.02,
                itl_mean_base=0.0, running_first=0.0, running_last=5.0)
    assert Pattern.LONG_PROMPTS_KV_FULL not in found(s)


def test_pattern_2_base_and_growth_from_the_connector_context() -> None:
    """Growth is the larger of prompt and context growth: prompts steady but the kvtier
    connector's context P50 doubling (chat histories) is still pattern 2."""
    assert found(SLOW) == [Pattern.DECODE_SLOWS_WITH_CONTEXT]
    s = replace(SLOW, prompt_mean=1000.0, context_p50_first=4000.0, context_p50_last=8000.0)
    assert found(s) == [Pattern.DECODE_SLOWS_WITH_CONTEXT]


def test_pattern_2_needs_context_growth() -> None:
    """Slower ITL with contexts the same length is not "slows as contexts grow"."""
    assert found(replace(SLOW, prompt_mean=1000.0)) == []


def test_pattern_2_defers_to_a_growing_batch_and_to_a_queue_jump() -> None:
    """A batch up 1.5x is pattern 3's signature and a jumping queue pattern 1's: pattern 2
    must not fire on either (one cause, one finding)."""
    assert found(replace(SLOW, running_last=15.0)) == []
    assert found(replace(SLOW, waiting_last=10.0)) == []


def test_pattern_3_gpu_counters_need_idle_tensor_cores() -> None:
    """Busy GPU and memory with busy tensor cores is compute-bound prefill, not pattern 3."""
    busy = Signals(samples=1, interval_s=None, gpu_util=95.0, dram_active=0.7)
    assert found(replace(busy, tensor_active=0.1)) == [Pattern.DECODE_MEMORY_BOUND]
    assert found(replace(busy, tensor_active=0.8)) == []


def test_pattern_3_throughput_that_scales_is_healthy() -> None:
    """The batch doubling and tokens/s doubling with it is the GPU doing its job; flat is
    under 1.2x."""
    s = Signals(samples=2, interval_s=10.0, running_avg=(10.0, 20.0))
    assert found(replace(s, generation_tps=(1000.0, 1100.0))) == [Pattern.DECODE_MEMORY_BOUND]
    assert found(replace(s, generation_tps=(1000.0, 2000.0))) == []


def test_pattern_3_compares_the_last_interval_with_the_first() -> None:
    """Three scrapes: the batch grew in the first interval and stayed: first vs last shows
    it, the last two intervals alone would not."""
    s = Signals(samples=3, interval_s=10.0, running_avg=(10.0, 20.0, 20.0),
                generation_tps=(1000.0, 1000.0, 1000.0))
    assert found(s) == [Pattern.DECODE_MEMORY_BOUND]


def test_pattern_4_needs_enough_queried_tokens() -> None:
    """< 15% of >= 10k queried tokens: 9k tokens are too few to call the rate low, and a
    rate of exactly 15% is not under 15%."""
    assert found(LOW_HITS) == [Pattern.LOW_PREFIX_HIT_RATE]
    assert found(replace(LOW_HITS, prefix_queries=9_000.0)) == []
    assert found(replace(LOW_HITS, prefix_hit_rate=0.15)) == []
    assert found(replace(LOW_HITS, prefix_queries=10_000.0)) == [Pattern.LOW_PREFIX_HIT_RATE]


def test_pattern_4_kvtier_hits_count_when_its_query_count_is_unknown() -> None:
    """An older daemon reports only prefix_hit_rate (no token counts): its 50% hit rate
    still shows prompts do share prefixes, so the GPU's low rate is no finding."""
    s = replace(LOW_HITS, kvtier_hit_rate=0.5, kvtier_queries=None)
    assert found(s) == []
    assert found(replace(s, kvtier_queries=500.0)) == [Pattern.LOW_PREFIX_HIT_RATE]


def test_pattern_5_and_6_at_their_smallest_counts() -> None:
    """One allocation failure on a half-empty tier is pattern 5; exactly 3 preemptions
    (">= 3" in the docs) is pattern 6, 2 is not."""
    s = Signals(samples=2, interval_s=10.0, tiers=(TierSignal("cpu", 1.0, 0.5),))
    assert found(s) == [Pattern.FRAGMENTATION]
    p = Signals(samples=2, interval_s=10.0, preemptions=3.0)
    assert found(p) == [Pattern.PREEMPTION]
    assert found(replace(p, preemptions=2.0)) == []


def test_pattern_7_edges() -> None:
    """Short outputs (<= 256 tokens), TTFT >= 40% of end to end, no queue, free KV: a
    queue or full KV is pattern 1's or 8's cause, long outputs are no short calls."""
    assert found(AGENT) == [Pattern.AGENT_CHAIN_TTFT]
    assert found(replace(AGENT, output_mean=256.0)) == [Pattern.AGENT_CHAIN_TTFT]
    assert found(replace(AGENT, output_mean=300.0)) == []
    assert found(replace(AGENT, e2e_mean=3.0)) == []          # TTFT 33% of the request
    assert found(replace(AGENT, waiting_last=4.0)) == []
    assert found(replace(AGENT, kv_usage_last=0.86)) == []


def test_pattern_8_sizes_from_the_connector_p99_without_engine_histograms() -> None:
    """No prompt histogram: the kvtier connector's context P99 is the demand: 20 running
    x 10k tokens is > 1.5x a 100k-token pool."""
    s = Signals(samples=2, interval_s=10.0, kv_usage_first=0.9, kv_usage_last=0.95,
                running_last=20.0, kv_capacity_tokens=100_000, context_p99=10_000.0)
    findings = diagnose(s)
    assert [f.pattern for f in findings] == [Pattern.SIZED_BELOW_P99]
    assert any("P99 context 10,000" in e for e in findings[0].evidence)


def test_pattern_8_climb_is_30_points() -> None:
    """KV 65% -> 92% (27 points) is not the documented ">= 30 points" climb."""
    s = Signals(samples=2, interval_s=10.0, kv_usage_first=0.65, kv_usage_last=0.92)
    assert found(s) == []
    assert found(replace(s, kv_usage_first=0.6)) == [Pattern.SIZED_BELOW_P99]
