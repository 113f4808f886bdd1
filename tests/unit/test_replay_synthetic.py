"""A second, independent workload: multi-turn chat sessions over shared system prompts.

The cost policy must not be fitted to the one Mooncake file; this generator produces a
different shape (Zipf-popular system prompts, sessions whose turns extend the previous
prompt, exponential think times, one-off prompts mixed in) and the tests check that cost
does not lose to LRU here either.
"""

from __future__ import annotations

import heapq
import random

import pytest

from kvtier.replay.simulator import SimConfig, TierSpec, simulate
from kvtier.replay.trace import Request, Trace, TraceFormat


def multi_turn_trace(
    *,
    sessions: int = 1500,
    system_prompts: int = 40,
    seed: int = 7,
    block_tokens: int = 512,
) -> Trace:
    """Sessions arrive as a Poisson process; each picks a system prompt (Zipf), then runs
    1-8 turns, each turn's prompt = previous prompt + previous answer + new user text."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    prompts = [fresh(rng.randint(2, 12)) for _ in range(system_prompts)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(system_prompts)]
    events: list[tuple[float, int, list[int], int]] = []  # (time, seq, blocks, turns left)
    t = 0.0
    seq = 0
    for _ in range(sessions):
        t += rng.expovariate(2.0)
        if rng.random() < 0.3:  # a one-off prompt with no shared prefix
            blocks = fresh(rng.randint(1, 40))
            turns = 1
        else:
            blocks = prompts[rng.choices(range(system_prompts), weights)[0]] + fresh(
                rng.randint(1, 6))
            turns = rng.randint(1, 8)
        heapq.heappush(events, (t, seq, blocks, turns))
        seq += 1
    reqs: list[Request] = []
    while events:
        at, _, blocks, turns = heapq.heappop(events)
        reqs.append(Request(at, len(blocks) * block_tokens, 200, tuple(blocks)))
        if turns > 1:
            nxt = blocks + fresh(rng.randint(1, 4))
            heapq.heappush(events, (at + rng.expovariate(1 / 60.0), seq, nxt, turns - 1))
            seq += 1
    return Trace(tuple(reqs), block_tokens, TraceFormat.MOONCAKE)


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
