"""Workload inputs: context-length percentiles, given or measured from a request trace.

A trace is a JSONL file in one of the ``kvtier replay`` formats:

- Mooncake: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``
  (prefix-chained block hashes, 512 tokens a block);
- Alibaba Bailian: ``chat_id``, ``parent_chat_id``, ``timestamp`` (s), ``input_length``,
  ``output_length``, ``turn``, ``hash_ids`` (16 tokens a block).

A sequence's length is what it holds KV for at its end: ``input_length + output_length``.
The prefix share is measured as an unbounded cache would see it: a request reuses the
longest prefix of its ``hash_ids`` already seen, counted in prompt tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvtier.plan.errors import PlanError
from kvtier.replay.trace import TraceError, TraceFormat, load_trace

PERCENTILES: tuple[str, ...] = ("p50", "p95", "p99")


@dataclass(frozen=True, slots=True)
class ContextPercentiles:
    """Tokens per sequence at P50, P95 and P99."""

    p50: int
    p95: int
    p99: int

    def items(self) -> list[tuple[str, int]]:
        return [("p50", self.p50), ("p95", self.p95), ("p99", self.p99)]


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """What a trace says about the workload the planner sizes for."""

    path: str
    format: TraceFormat
    requests: int
    block_tokens: int
    sequence_tokens: ContextPercentiles  # input + output
    prompt_tokens: ContextPercentiles
    output_tokens_p99: int
    prefix_share: float  # share of prompt tokens in a previously seen prefix
    block_hit_share: float  # share of block references an unbounded cache hits
    unique_blocks: int
    reused_blocks: int  # unique blocks referenced by two or more requests


MAX_CONTEXT = 2**31
"""Longest ``--context`` length in tokens."""


def parse_context(text: str) -> ContextPercentiles:
    """Parse ``--context``: one length for all percentiles, or ``P50,P95,P99``."""
    try:
        values = [int(float(v)) for v in text.replace(" ", "").split(",") if v]
    except (ValueError, OverflowError) as exc:  # not a number, NaN; an infinity
        raise PlanError(f"--context takes integers like 2048,8192,32768, got {text!r}") from exc
    if len(values) == 1:
        values *= 3
    if len(values) != 3 or any(not 0 < v <= MAX_CONTEXT for v in values):
        raise PlanError(f"--context takes one length or three (P50,P95,P99), each from 1 to "
                        f"{MAX_CONTEXT:,} tokens, got {text!r}")
    if not values[0] <= values[1] <= values[2]:
        raise PlanError(f"--context percentiles must not decrease: {text!r}")
    return ContextPercentiles(*values)


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile (the value at or above ``q`` percent of samples)."""
    if not sorted_values:
        raise PlanError("no values to take a percentile of")
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def _percentiles(values: list[int]) -> ContextPercentiles:
    ordered = sorted(values)
    return ContextPercentiles(percentile(ordered, 50), percentile(ordered, 95),
                              percentile(ordered, 99))


def read_trace(path: str | Path, block_tokens: int | None = None) -> TraceSummary:
    """Measure context percentiles and prefix reuse from a replay trace (JSONL).

    Parsing is ``kvtier replay``'s (one reader for both tools); requests are taken in
    arrival order, as the simulator replays them.
    """
    try:
        trace = load_trace(path, block_tokens=block_tokens)
    except TraceError as exc:
        raise PlanError(str(exc)) from None
    block = trace.block_tokens
    seq: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    refs: dict[int, int] = {}
    prompt_total = hit_total = block_refs = block_hits = 0
    for req in trace.requests:
        if req.input_tokens + req.output_tokens > 0:  # an empty request holds no KV
            prompts.append(req.input_tokens)
            outputs.append(req.output_tokens)
            seq.append(req.input_tokens + req.output_tokens)
        hit_blocks = 0
        for key in req.blocks:
            if key not in refs:
                break
            hit_blocks += 1
        for key in req.blocks:
            refs[key] = refs.get(key, 0) + 1
        prompt_total += req.input_tokens
        hit_total += min(hit_blocks * block, req.input_tokens)
        block_refs += len(req.blocks)
        block_hits += hit_blocks
    if not seq:   # it planned "0 sequences fit" (found by review)
        raise PlanError(f"trace {path}: no request has any token (input and output lengths "
                        "are all 0): nothing to plan")
    return TraceSummary(
        path=str(path),
        format=trace.format,
        requests=len(trace.requests),
        block_tokens=block,
        sequence_tokens=_percentiles(seq),
        prompt_tokens=_percentiles(prompts),
        output_tokens_p99=percentile(sorted(outputs), 99),
        prefix_share=hit_total / prompt_total if prompt_total else 0.0,
        block_hit_share=block_hits / block_refs if block_refs else 0.0,
        unique_blocks=len(refs),
        reused_blocks=sum(1 for n in refs.values() if n >= 2),
    )
