"""The simulator against the shared Mooncake trace: reference figures and acceptance.

Runs ~14 replays of 121,877 block references (about 20 s on 2 cores).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvtier.replay.simulator import ReplayResult, SimConfig, TierSpec, simulate
from kvtier.replay.trace import Trace, load_trace
from tests.support.paths import MOONCAKE_TRACE

TRACE = MOONCAKE_TRACE

pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="shared Mooncake trace not present")

FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.40)
# shared/traces/README.md: block hit rates of LRU and Belady at each capacity
REFERENCE = {
    0.01: (0.0343, 0.1854), 0.02: (0.0758, 0.2613), 0.05: (0.1548, 0.3956),
    0.10: (0.2598, 0.5063), 0.20: (0.3905, 0.6080), 0.40: (0.5446, 0.6396),
}
_cache: dict[tuple[str, float], ReplayResult] = {}


@pytest.fixture(scope="module")
def trace() -> Trace:
    return load_trace(TRACE)


def replay(trace: Trace, policy: str, fraction: float) -> ReplayResult:
    key = (policy, fraction)
    if key not in _cache:
        cap = int(trace.n_unique_blocks * fraction)
        cfg = SimConfig(tiers=(TierSpec("cpu", cap, 25e9),))
        _cache[key] = simulate(trace, policy, cfg, capacity_fraction=fraction)
    return _cache[key]


def test_trace_shape(trace: Trace) -> None:
    assert len(trace.requests) == 3993
    assert trace.n_references == 121_877 and trace.n_unique_blocks == 43_924


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_lru_matches_reference(trace: Trace, fraction: float) -> None:
    assert replay(trace, "lru", fraction).block_hit_rate == pytest.approx(
        REFERENCE[fraction][0], abs=5e-4)


@pytest.mark.parametrize("fraction", [0.05, 0.10])
def test_belady_matches_reference(trace: Trace, fraction: float) -> None:
    assert replay(trace, "belady", fraction).block_hit_rate == pytest.approx(
        REFERENCE[fraction][1], abs=5e-4)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_cost_never_hits_fewer_tokens_than_lru(trace: Trace, fraction: float) -> None:
    assert replay(trace, "cost", fraction).hit_tokens >= replay(trace, "lru", fraction).hit_tokens


@pytest.mark.xfail(strict=True, reason="issue 4 target not reached: cost is 1.18x/1.15x LRU "
                   "at 5%/10% (means 1.16x/1.14x over nearby capacities). docs/replay-"
                   "analysis.md: the bottleneck is predicting which already-reused blocks "
                   "come back (online AUC 0.64; an oracle for those alone gives 1.79x/1.50x), "
                   "the online estimate matches a cross-fitted offline model on the same "
                   "features, and ~40 estimator and eviction variants did not move the means")
@pytest.mark.parametrize("fraction", [0.05, 0.10])
def test_cost_hits_1_2x_lru_at_5_and_10_percent(trace: Trace, fraction: float) -> None:
    cost = replay(trace, "cost", fraction).hit_tokens
    assert cost >= 1.2 * replay(trace, "lru", fraction).hit_tokens


@pytest.mark.parametrize("fraction", [0.05, 0.10])
def test_cost_holds_up_when_output_lengths_carry_no_signal(trace: Trace, fraction: float) -> None:
    """Control: shuffled output lengths are noise; the learned estimates must not hurt."""
    outs = [r.output_tokens for r in trace.requests]
    random.Random(1).shuffle(outs)
    reqs = tuple(replace(r, output_tokens=o) for r, o in zip(trace.requests, outs, strict=True))
    noisy = Trace(reqs, trace.block_tokens, trace.format)
    cfg = SimConfig(tiers=(TierSpec("cpu", int(trace.n_unique_blocks * fraction), 25e9),))
    cost = simulate(noisy, "cost", cfg).hit_tokens
    assert cost >= 0.97 * replay(trace, "lru", fraction).hit_tokens
