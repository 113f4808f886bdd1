"""Seeded synthetic request traces of the workload shapes prefix caching meets in practice.

The cost policy must not be fitted to the one Mooncake file, so its tests also replay
these, each a different reuse structure:

- :func:`multi_turn_trace`: chat sessions over Zipf-popular system prompts, each turn
  extending the previous prompt, exponential think times, one-off prompts mixed in;
- :func:`rag_trace`: document QA, a system prompt + one document (Zipf popularity whose
  ranks drift) + a fresh question; the document is the reusable part;
- :func:`agent_trace`: agent loops, 3-30 fast calls per session over a shared tool schema,
  each call extending the context by a tool result, one pause in ten lasting minutes;
- :func:`scan_trace`: a hot interactive working set interrupted by batch phases that read
  long documents once (scan resistance).
"""

from __future__ import annotations

import heapq
import random

from kvtier.replay.trace import Request, Trace, TraceFormat


class _Ids:
    """Fresh block ids, never reused by accident."""

    def __init__(self) -> None:
        self.next = 0

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def multi_turn_trace(
    *, sessions: int = 1500, system_prompts: int = 40, seed: int = 7, block_tokens: int = 512,
) -> Trace:
    """Sessions arrive as a Poisson process; each picks a system prompt (Zipf), then runs
    1-8 turns, each turn's prompt = previous prompt + previous answer + new user text."""
    rng = random.Random(seed)
    ids = _Ids()
    prompts = [ids.fresh(rng.randint(2, 12)) for _ in range(system_prompts)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(system_prompts)]
    events: list[tuple[float, int, list[int], int]] = []  # (time, seq, blocks, turns left)
    t = 0.0
    seq = 0
    for _ in range(sessions):
        t += rng.expovariate(2.0)
        if rng.random() < 0.3:  # a one-off prompt with no shared prefix
            blocks = ids.fresh(rng.randint(1, 40))
            turns = 1
        else:
            blocks = prompts[rng.choices(range(system_prompts), weights)[0]] + ids.fresh(
                rng.randint(1, 6))
            turns = rng.randint(1, 8)
        heapq.heappush(events, (t, seq, blocks, turns))
        seq += 1
    reqs: list[Request] = []
    while events:
        at, _, blocks, turns = heapq.heappop(events)
        reqs.append(Request(at, len(blocks) * block_tokens, 200, tuple(blocks)))
        if turns > 1:
            nxt = blocks + ids.fresh(rng.randint(1, 4))
            heapq.heappush(events, (at + rng.expovariate(1 / 60.0), seq, nxt, turns - 1))
            seq += 1
    return Trace(tuple(reqs), block_tokens, TraceFormat.MOONCAKE)


def rag_trace(
    *, requests: int = 2000, docs: int = 1000, seed: int = 3, block_tokens: int = 512,
) -> Trace:
    """Document QA: one of five system prompts + a document drawn by Zipf popularity (a
    tenth of the ranks reshuffled every 500 requests) + a one-block question."""
    rng = random.Random(seed)
    ids = _Ids()
    system = [ids.fresh(rng.randint(1, 4)) for _ in range(5)]
    doc = [ids.fresh(rng.randint(4, 60)) for _ in range(docs)]
    rank = list(range(docs))
    rng.shuffle(rank)
    weights = [1.0 / (i + 1) ** 0.9 for i in range(docs)]
    reqs: list[Request] = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(5.0)
        if i % 500 == 0:
            moved = rng.sample(range(docs), docs // 10)
            vals = [rank[j] for j in moved]
            rng.shuffle(vals)
            for j, v in zip(moved, vals, strict=True):
                rank[j] = v
        d = rank[rng.choices(range(docs), weights)[0]]
        blocks = system[d % 5] + doc[d] + ids.fresh(1)
        tokens = len(blocks) * block_tokens - rng.randint(0, block_tokens - 1)
        reqs.append(Request(t, tokens, rng.randint(5, 300), tuple(blocks)))
    return Trace(tuple(reqs), block_tokens, TraceFormat.MOONCAKE)


def agent_trace(*, sessions: int = 200, seed: int = 5, block_tokens: int = 512) -> Trace:
    """Agent loops over a shared 6-block tool schema: each session makes 3-30 calls, each
    extending its context by 1-3 blocks of tool output; the next call comes ~2 s later, or
    (one time in ten) after a pause of ~5 min."""
    rng = random.Random(seed)
    ids = _Ids()
    tools = ids.fresh(6)
    events: list[tuple[float, int, list[int], int]] = []
    t = 0.0
    seq = 0
    for _ in range(sessions):
        t += rng.expovariate(0.5)
        heapq.heappush(events, (t, seq, tools + ids.fresh(rng.randint(1, 8)),
                                rng.randint(3, 30)))
        seq += 1
    reqs: list[Request] = []
    while events:
        at, _, ctx, left = heapq.heappop(events)
        reqs.append(Request(at, len(ctx) * block_tokens, rng.randint(20, 400), tuple(ctx)))
        if left > 1:
            gap = rng.expovariate(1 / 2.0) if rng.random() < 0.9 else rng.expovariate(1 / 300.0)
            heapq.heappush(events, (at + gap, seq, ctx + ids.fresh(rng.randint(1, 3)), left - 1))
            seq += 1
    return Trace(tuple(reqs), block_tokens, TraceFormat.MOONCAKE)


def scan_trace(*, requests: int = 3000, seed: int = 9, block_tokens: int = 512) -> Trace:
    """Interactive requests over 200 Zipf-popular prefixes; every third phase of 400
    requests is a batch job reading long documents once, with tiny outputs."""
    rng = random.Random(seed)
    ids = _Ids()
    hot = [ids.fresh(rng.randint(2, 20)) for _ in range(200)]
    weights = [1.0 / (i + 1) ** 0.8 for i in range(200)]
    reqs: list[Request] = []
    for i in range(requests):
        if (i // 400) % 3 == 2:
            blocks, out = ids.fresh(rng.randint(20, 80)), rng.randint(1, 20)
        else:
            blocks, out = hot[rng.choices(range(200), weights)[0]] + ids.fresh(1), rng.randint(
                20, 300)
        reqs.append(Request(0.1 * i, len(blocks) * block_tokens, out, tuple(blocks)))
    return Trace(tuple(reqs), block_tokens, TraceFormat.MOONCAKE)
