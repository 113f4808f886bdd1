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

import json
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from kvtier.plan.errors import PlanError

PERCENTILES: tuple[str, ...] = ("p50", "p95", "p99")


class TraceFormat(str, Enum):
    """The ``kvtier replay`` trace formats the planner can measure."""

    MOONCAKE = "mooncake"
    BAILIAN = "bailian"

    @property
    def block_tokens(self) -> int:
        """Tokens per ``hash_ids`` entry in this format's published traces."""
        return 512 if self is TraceFormat.MOONCAKE else 16


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


def parse_context(text: str) -> ContextPercentiles:
    """Parse ``--context``: one length for all percentiles, or ``P50,P95,P99``."""
    try:
        values = [int(float(v)) for v in text.replace(" ", "").split(",") if v]
    except ValueError as exc:
        raise PlanError(f"--context takes integers like 2048,8192,32768, got {text!r}") from exc
    if len(values) == 1:
        values *= 3
    if len(values) != 3 or any(v <= 0 for v in values):
        raise PlanError(f"--context takes one length or three (P50,P95,P99), got {text!r}")
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


def _length(record: dict[str, object], key: str, where: str) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise PlanError(f"{where}: field {key!r} must be a non-negative number, got {value!r}")
    return int(value)


def read_trace(path: str | Path, block_tokens: int | None = None) -> TraceSummary:
    """Measure context percentiles and prefix reuse from a replay trace (JSONL)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read trace {path}: {exc}") from exc
    fmt: TraceFormat | None = None
    seq: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    seen: set[object] = set()
    refs: dict[object, int] = {}
    prompt_total = 0
    hit_total = 0
    block_refs = 0
    block_hits = 0
    block: int | None = block_tokens
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{where}: not JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise PlanError(f"{where}: expected a JSON object per line")
        if fmt is None:
            fmt = TraceFormat.BAILIAN if "chat_id" in record else TraceFormat.MOONCAKE
            block = block or fmt.block_tokens
        assert block is not None
        prompt = _length(record, "input_length", where)
        output = _length(record, "output_length", where)
        prompts.append(prompt)
        outputs.append(output)
        seq.append(prompt + output)
        hashes = record.get("hash_ids") or []
        if not isinstance(hashes, list):
            raise PlanError(f"{where}: 'hash_ids' must be a list")
        keys = [h if isinstance(h, int | str) else json.dumps(h) for h in hashes]
        hit_blocks = 0
        for key in keys:
            if key not in seen:
                break
            hit_blocks += 1
        for key in keys:
            seen.add(key)
            refs[key] = refs.get(key, 0) + 1
        prompt_total += prompt
        hit_total += min(hit_blocks * block, prompt)
        block_refs += len(keys)
        block_hits += hit_blocks
    if fmt is None or block is None:
        raise PlanError(f"trace {path} holds no requests")
    return TraceSummary(
        path=str(path),
        format=fmt,
        requests=len(seq),
        block_tokens=block,
        sequence_tokens=_percentiles(seq),
        prompt_tokens=_percentiles(prompts),
        output_tokens_p99=percentile(sorted(outputs), 99),
        prefix_share=hit_total / prompt_total if prompt_total else 0.0,
        block_hit_share=block_hits / block_refs if block_refs else 0.0,
        unique_blocks=len(refs),
        reused_blocks=sum(1 for n in refs.values() if n >= 2),
    )
