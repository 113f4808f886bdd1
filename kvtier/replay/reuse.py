"""Per-reference reuse facts of a trace, computed before a replay: when each block
reference is used next (Belady's oracle) and how far back its previous use lies (the
replay's reuse-distance breakdown)."""

from __future__ import annotations

from bisect import bisect_left

from kvtier.replay.trace import Trace

__all__ = ["REUSE_EDGES", "next_use_index", "reuse_buckets"]

INF = float("inf")

REUSE_EDGES: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
"""Inclusive upper bounds of the reuse-distance buckets, in capacities (the last bucket,
beyond 16, is open). A reuse within one capacity is always an LRU hit."""


def next_use_index(trace: Trace) -> list[float]:
    """For each block reference (flattened in trace order), the index of its next use."""
    refs = [b for r in trace.requests for b in r.blocks]
    out = [INF] * len(refs)
    last: dict[int, int] = {}
    for i in range(len(refs) - 1, -1, -1):
        k = refs[i]
        j = last.get(k)
        if j is not None:
            out[i] = float(j)
        last[k] = i
    return out


def reuse_buckets(trace: Trace, capacity_blocks: int) -> list[int]:
    """For each block reference (flattened in trace order), its reuse-distance bucket:
    the index into :data:`REUSE_EDGES` of ``(references since the previous use of the same
    block) / capacity_blocks``, ``len(REUSE_EDGES)`` beyond the last edge, -1 for a first use.
    """
    bounds = [e * capacity_blocks for e in REUSE_EDGES]
    out: list[int] = []
    last: dict[int, int] = {}
    i = 0
    for r in trace.requests:
        for k in r.blocks:
            j = last.get(k)
            out.append(-1 if j is None else bisect_left(bounds, i - j))
            last[k] = i
            i += 1
    return out
