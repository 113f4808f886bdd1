"""The ``hindsight`` policy on the shared trace and every workload generator (issue 13):
never below 0.99x the better of LRU and LFU at 1-40% of the unique blocks, and 1.18x LRU's
token hits at 5% of the shared trace, where ``cost`` reaches 1.13x.

Replays run in the store's order (the default since 2026-12-06; head first before, where
the shared trace gave 1.205x LRU at 5% and ``cost`` 1.18x). Measured in the store's order:
hindsight / max(LRU, LFU) 0.995-1.175 on these five workloads at 1-40%; at 5% of the
shared trace 1.193x LRU, mean 1.185 and min 1.169 over five capacities 0.92-1.08x
(``bench_replay.py --spread``): the 1.2x bound became 1.18x, what those support.

About 90 replays, most of small generated traces (marked slow).
"""

from __future__ import annotations

import pytest

from kvtier.replay.simulator import SimConfig, TierSpec, simulate
from kvtier.replay.trace import Trace, load_trace
from tests.support import workloads
from tests.support.paths import MOONCAKE_TRACE

FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.40)
NAMES = ("mooncake", "multi_turn_trace", "rag_trace", "agent_trace", "scan_trace")

pytestmark = pytest.mark.slow

_traces: dict[str, Trace] = {}
_hits: dict[tuple[str, str, int], int] = {}


def _trace(name: str) -> Trace:
    if name not in _traces:
        if name == "mooncake":
            if not MOONCAKE_TRACE.exists():
                pytest.skip("shared Mooncake trace not present")
            _traces[name] = load_trace(MOONCAKE_TRACE)
        else:
            _traces[name] = getattr(workloads, name)()
    return _traces[name]


def _hit_tokens(name: str, policy: str, fraction: float) -> int:
    cap = max(1, int(_trace(name).n_unique_blocks * fraction))
    key = (name, policy, cap)
    if key not in _hits:
        cfg = SimConfig(tiers=(TierSpec("cpu", cap, 25e9),))
        _hits[key] = simulate(_trace(name), policy, cfg).hit_tokens
    return _hits[key]


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("name", NAMES)
def test_hindsight_never_below_the_better_of_lru_and_lfu(name: str, fraction: float) -> None:
    best = max(_hit_tokens(name, "lru", fraction), _hit_tokens(name, "lfu", fraction))
    assert _hit_tokens(name, "hindsight", fraction) >= 0.99 * best


def test_hindsight_hits_1_18x_lru_at_5_percent_on_the_shared_trace() -> None:
    assert _hit_tokens("mooncake", "hindsight", 0.05) >= 1.18 * _hit_tokens(
        "mooncake", "lru", 0.05)
