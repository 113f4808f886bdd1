"""Trace measurement for ``kvtier plan --trace``: both replay formats, checked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.plan import PlanError
from kvtier.plan.workload import TraceFormat, parse_context, percentile, read_trace
from tests.support.paths import MOONCAKE_TRACE

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "plan"
MOONCAKE = MOONCAKE_TRACE


def test_mooncake_format_by_hand() -> None:
    t = read_trace(FIXTURES / "mooncake_small.jsonl")
    assert t.format is TraceFormat.MOONCAKE and t.block_tokens == 512
    assert t.requests == 4
    # sequences 1024, 1512, 400, 2100 -> nearest rank P50 = 1024, P95 = P99 = 2100
    assert (t.sequence_tokens.p50, t.sequence_tokens.p95, t.sequence_tokens.p99) == (
        1024, 2100, 2100)
    # hits: request 2 reuses blocks 0,1 (1,024 tokens), request 4 reuses 0,1,2 (1,536)
    assert t.prefix_share == pytest.approx((1024 + 1536) / (1000 + 1500 + 300 + 2048))
    assert t.block_hit_share == pytest.approx(5 / 10)
    assert (t.unique_blocks, t.reused_blocks) == (5, 3)
    assert t.output_tokens_p99 == 100


def test_bailian_format_by_hand() -> None:
    t = read_trace(FIXTURES / "bailian_small.jsonl")
    assert t.format is TraceFormat.BAILIAN and t.block_tokens == 16
    assert (t.sequence_tokens.p50, t.sequence_tokens.p99) == (48, 80)
    assert t.prefix_share == pytest.approx(48 / 132)  # turn 2 reuses turn 1's 3 blocks


def test_block_size_override() -> None:
    t = read_trace(FIXTURES / "bailian_small.jsonl", block_tokens=8)
    assert t.prefix_share == pytest.approx(24 / 132)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared Mooncake trace not present")
def test_real_mooncake_trace_matches_its_published_reference() -> None:
    t = read_trace(MOONCAKE)
    assert t.requests == 3993
    # traces/README.md: 121,877 references, 43,924 unique blocks, unbounded cache 64.0%
    assert t.unique_blocks == 43_924
    assert t.block_hit_share == pytest.approx((121_877 - 43_924) / 121_877, abs=1e-6)


@pytest.mark.parametrize(("body", "needle"), [
    ("", "no requests"),
    ("not json\n", "not JSON"),
    ('{"input_length": -4, "output_length": 1}\n', "input_length"),
    ('{"input_length": 4, "output_length": 1, "hash_ids": 7}\n', "hash_ids"),
    ("[1, 2]\n", "JSON object"),
])
def test_bad_traces_name_the_line(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(body)
    with pytest.raises(PlanError, match=needle):
        read_trace(path)


def test_context_and_percentile_helpers() -> None:
    assert parse_context("4096").items() == [("p50", 4096), ("p95", 4096), ("p99", 4096)]
    assert parse_context("1000, 2000, 3000").p95 == 2000
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 50) == 5
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 99) == 10
    with pytest.raises(PlanError):
        parse_context("1,2")
