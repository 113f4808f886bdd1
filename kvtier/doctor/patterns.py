"""What doctor reports and where it draws its lines: the patterns, a finding, thresholds.

Kept apart from the rules (kvtier.doctor.rules) so each file stays short; the rules
module re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Pattern(str, Enum):
    """The failure patterns doctor recognises, numbered as in the docs."""

    LONG_PROMPTS_KV_FULL = "long-prompts-kv-full"  # 1
    DECODE_SLOWS_WITH_CONTEXT = "decode-slows-with-context"  # 2
    DECODE_MEMORY_BOUND = "decode-memory-bound"  # 3
    LOW_PREFIX_HIT_RATE = "low-prefix-hit-rate"  # 4
    FRAGMENTATION = "fragmentation"  # 5
    PREEMPTION = "preemption"  # 6
    AGENT_CHAIN_TTFT = "agent-chain-ttft"  # 7
    SIZED_BELOW_P99 = "sized-below-p99"  # 8
    TIER_PINNED = "kvtier-tier-pinned"  # 9
    TIER_DOWN = "kvtier-tier-down"  # 10

    @property
    def number(self) -> int:
        return list(Pattern).index(self) + 1


@dataclass(frozen=True, slots=True)
class Finding:
    """One diagnosed pattern: what is seen, the numbers, why, and what to change."""

    pattern: Pattern
    title: str
    symptom: str
    evidence: tuple[str, ...]
    cause: str
    actions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Where each signal counts as abnormal."""

    kv_near_full: float = 0.85
    kv_full: float = 0.90
    kv_climb: float = 0.30  # rise of KV usage between first and last sample
    jump: float = 2.0  # recent / baseline for TTFT and queue
    shift: float = 1.5  # recent / baseline for prompt length, context and ITL
    queue_min: float = 4.0  # waiting requests that count as a queue
    batch_growth: float = 1.5
    throughput_flat: float = 1.2
    gpu_busy_pct: float = 90.0
    dram_busy: float = 0.5
    tensor_idle: float = 0.3
    hit_rate_low: float = 0.15
    hit_rate_min_queries: float = 10_000.0  # tokens looked up before the rate means much
    tier_full: float = 0.90  # allocation failures below it: 5 (fragmented); at or above: 1, 9
    preemptions_min: float = 3.0
    p99_over_pool: float = 1.5  # P99 demand / pool; histogram buckets are 2-2.5x wide
    agent_ttft_s: float = 0.5
    agent_ttft_share: float = 0.4
    agent_output_max: float = 256.0
