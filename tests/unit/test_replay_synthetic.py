"""Workloads besides the Mooncake file: the cost policy must not be fitted to one trace.

Four seeded shapes from tests/support/workloads.py (multi-turn chat, document QA, agent
loops, scans). On each, cost must stay below Belady's bound and not lose to LRU; where the
shape gives a cost/frequency-aware policy something to win (popular documents, one-off
scans) it must win clearly. Agent loops are pure recency: there cost may trail LRU, by
less than 1% (measured: 0.992-0.998 at 2-20%), and the test holds it to that.

Measured in the store's order (the default; 2026-12-06): the bounds held head first and
still hold. Head first the figures were cost/LRU 1.42x / 1.22x (documents, 2% / 5%),
1.13-1.17x (scans) and 0.994-0.998 (agents, 5-20%).
"""

from __future__ import annotations

import pytest

from kvtier.replay.simulator import SimConfig, TierSpec, simulate
from kvtier.replay.trace import Trace
from tests.support.workloads import agent_trace, multi_turn_trace, rag_trace, scan_trace


@pytest.fixture(scope="module")
def trace() -> Trace:
    return multi_turn_trace()


def run(trace: Trace, policy: str, fraction: float) -> float:
    cap = max(1, int(trace.n_unique_blocks * fraction))
    cfg = SimConfig(tiers=(TierSpec("cpu", cap, 25e9),))
    return simulate(trace, policy, cfg, capacity_fraction=fraction).token_hit_rate


@pytest.mark.parametrize("fraction", [0.02, 0.05, 0.1, 0.2])
def test_cost_not_worse_than_lru_on_multi_turn_sessions(trace: Trace, fraction: float) -> None:
    lru = run(trace, "lru", fraction)
    cost = run(trace, "cost", fraction)
    belady = run(trace, "belady", fraction)
    assert belady >= cost
    assert cost >= lru


@pytest.fixture(scope="module")
def rag() -> Trace:
    return rag_trace()


@pytest.fixture(scope="module")
def agent() -> Trace:
    return agent_trace()


@pytest.fixture(scope="module")
def scan() -> Trace:
    return scan_trace()


@pytest.mark.parametrize("fraction", [0.02, 0.05, 0.1, 0.2])
def test_cost_wins_on_popular_documents(rag: Trace, fraction: float) -> None:
    lru, cost, belady = (run(rag, p, fraction) for p in ("lru", "cost", "belady"))
    assert lru <= cost <= belady
    if fraction <= 0.05:  # measured 1.37x / 1.20x: frequency and value pay off when small
        assert cost >= 1.1 * lru


@pytest.mark.parametrize("fraction", [0.02, 0.05, 0.1])
def test_cost_resists_scans(scan: Trace, fraction: float) -> None:
    lru, cost, belady = (run(scan, p, fraction) for p in ("lru", "cost", "belady"))
    assert cost <= belady
    assert cost >= 1.1 * lru  # measured 1.13-1.17x; Belady 1.17-1.39x (store order)


@pytest.mark.parametrize("fraction", [0.02, 0.05, 0.1, 0.2])
def test_cost_follows_lru_on_agent_loops(agent: Trace, fraction: float) -> None:
    lru, cost, belady = (run(agent, p, fraction) for p in ("lru", "cost", "belady"))
    assert cost <= belady
    assert cost >= 0.99 * lru
