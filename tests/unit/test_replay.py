"""Trace readers, the simulator's semantics on tiny traces, and the CLI."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvtier.policy.admission import AlwaysAdmit, SecondHitAdmission
from kvtier.replay import cli
from kvtier.replay.report import belady_note, table_rows, to_record
from kvtier.replay.simulator import (
    REUSE_EDGES,
    Order,
    SimConfig,
    TierSpec,
    next_use_index,
    reuse_buckets,
    simulate,
)
from kvtier.replay.trace import Request, Trace, TraceError, TraceFormat, load_trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"


def tiny(blocks: list[list[int]], block_tokens: int = 4) -> Trace:
    reqs = tuple(
        Request(arrival_s=float(i), input_tokens=len(b) * block_tokens, output_tokens=1,
                blocks=tuple(b))
        for i, b in enumerate(blocks)
    )
    return Trace(reqs, block_tokens, TraceFormat.MOONCAKE)


def one_tier(cap: int, order: Order = Order.STORE) -> SimConfig:
    return SimConfig(tiers=(TierSpec("cpu", cap, 25e9),), order=order)


def test_mooncake_reader() -> None:
    tr = load_trace(FIXTURES / "mooncake_small.jsonl")
    assert tr.format is TraceFormat.MOONCAKE and tr.block_tokens == 512
    assert tr.requests[1].arrival_s == pytest.approx(0.1)
    assert tr.requests[0].blocks == (0, 1, 2, 3)
    assert tr.n_references == 16 and tr.n_unique_blocks == 7


def test_bailian_reader() -> None:
    tr = load_trace(FIXTURES / "bailian_small.jsonl")
    assert tr.format is TraceFormat.BAILIAN and tr.block_tokens == 16
    first, _, third, fourth = tr.requests
    assert first.parent_chat_id is None and first.turn == 1
    assert third.parent_chat_id == 10 and fourth.turn == 3
    assert third.arrival_s == 3.0


def test_reader_errors_say_where(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1]}\nnot json\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2"):
        load_trace(bad)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress])
def test_compressed_traces_read_like_plain_ones(tmp_path: Path, compress: Any) -> None:
    for name in ("mooncake_small.jsonl", "bailian_small.jsonl"):
        plain = load_trace(FIXTURES / name)
        packed = tmp_path / f"{name}.any-suffix"   # told apart by magic bytes, not by name
        packed.write_bytes(compress((FIXTURES / name).read_bytes()))
        assert load_trace(packed) == plain


MOONCAKE_LINES = (FIXTURES / "mooncake_small.jsonl").read_bytes()


def test_unreadable_bytes_are_a_trace_error(tmp_path: Path) -> None:
    cases = {"binary.jsonl": b"\xff\xfe\x00garbage\n",
             "truncated.jsonl.gz": gzip.compress(MOONCAKE_LINES)[:-12],   # no end marker
             "trace.jsonl.zst": b"\x28\xb5\x2f\xfd\x00\x00"}
    words = {"binary.jsonl": "not UTF-8 JSONL", "truncated.jsonl.gz": "cannot read trace",
             "trace.jsonl.zst": "zstd-compressed"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TraceError, match=words[name]):
            load_trace(tmp_path / name)


def test_prefix_semantics_and_token_counting() -> None:
    tr = load_trace(FIXTURES / "mooncake_small.jsonl")
    r = simulate(tr, "lru", one_tier(100))
    # req1 hits [0,1]; req2 hits all 4; req4 hits [0,1,4]
    assert r.hit_blocks == 2 + 4 + 3
    assert r.hit_tokens == 1024 + 2000 + 1536  # partial last blocks count their tokens
    assert r.total_tokens == 1800 + 1100 + 2000 + 600 + 1536


def test_lookup_stops_at_first_miss() -> None:
    # head first (the reference order), capacity 2: after [1,2,3] LRU holds {2,3}; [1,2,3]
    # then misses at 1 -> no hit at all (the store's order keeps the head: test_replay_order)
    r = simulate(tiny([[1, 2, 3], [1, 2, 3]]), "lru", one_tier(2, Order.REFERENCE))
    assert r.hit_blocks == 0


def test_belady_next_use_and_bypass() -> None:
    tr = tiny([[1], [2], [1], [3], [1], [2]])
    assert next_use_index(tr) == [2.0, 5.0, 4.0, float("inf"), float("inf"), float("inf")]
    # one slot, head first (the reference order: the block just inserted may be the
    # victim): belady keeps 1 (used again soonest), never lets 2 or 3 displace it
    assert simulate(tr, "belady", one_tier(1, Order.REFERENCE)).hit_blocks == 2
    assert simulate(tr, "lru", one_tier(1, Order.REFERENCE)).hit_blocks == 0
    # the store's order writes every block of a request (no bypass): nothing stays
    assert simulate(tr, "belady", one_tier(1)).hit_blocks == 0


def test_cost_trims_chains_from_the_tail() -> None:
    # 4 slots: after [1,2,3,4] and the one-off [5,6], cost has cut chains from their tails,
    # so the shared prefix [1,2] is still there for the third request
    r = simulate(tiny([[1, 2, 3, 4], [5, 6], [1, 2, 3, 4]]), "cost", one_tier(4))
    assert r.hit_blocks >= 2
    assert r.orphans_dropped == 0  # leaves went first: nothing was orphaned


def test_orphans_are_dropped_when_a_parent_leaves_every_tier() -> None:
    # head first (the reference order), LRU may evict a parent before its child inside one
    # long request; the child is then unreachable and must not keep occupying a slot
    r = simulate(tiny([[1, 2, 3, 4, 5]]), "lru", one_tier(3, Order.REFERENCE))
    assert r.orphans_dropped > 0
    # tail first (the store's order) LRU shortens the chain from its tail: no orphan
    assert simulate(tiny([[1, 2, 3, 4, 5]]), "lru", one_tier(3)).orphans_dropped == 0


def test_two_tiers_demote_promote_and_admission() -> None:
    config = SimConfig(tiers=(TierSpec("cpu", 2, 25e9), TierSpec("nvme", 10, 3e9)))
    tr = tiny([[1, 2], [3, 4], [1, 2]])
    r = simulate(tr, "lru", config)
    cpu, nvme = r.tiers
    assert nvme.hit_blocks == 2 and cpu.hit_blocks == 0  # 1,2 came back from nvme
    assert nvme.bytes_written > 0 and cpu.evictions >= 2
    gated = SimConfig(
        tiers=config.tiers,
        admission=lambda tier: SecondHitAdmission() if tier == "nvme" else AlwaysAdmit(),
    )
    r2 = simulate(tr, "lru", gated)
    assert r2.tiers[1].rejected > 0 and r2.tiers[1].hit_blocks == 0


def test_reuse_buckets_count_references_since_the_previous_use() -> None:
    # references: 1 2 1 3 4 5 6 7 8 2 ; capacity 2 -> bucket bounds 1, 2, 4, 8, 16, 32 refs
    tr = tiny([[1], [2], [1], [3], [4], [5], [6], [7], [8], [2]])
    b = reuse_buckets(tr, 2)
    assert b[:2] == [-1, -1] and b[3:9] == [-1] * 6  # first uses
    assert b[2] == 1  # block 1 again 2 references later: <= 1 capacity
    assert b[9] == 3  # block 2 again 8 references later: 4 capacities, the <= 4 bucket
    assert len(REUSE_EDGES) == 6


def test_reuse_breakdown_lru_hits_every_reuse_within_one_capacity() -> None:
    # capacity 3; block 1 reused after 3 references (<= 1 capacity: an LRU hit), block 2
    # reused after 7 (> 2 capacities: an LRU miss); Belady keeps 2 by bypassing one-offs
    tr = tiny([[1], [2], [3], [1], [4], [5], [6], [7], [2]])
    lru = simulate(tr, "lru", one_tier(3), reuse_breakdown=True)
    bel = simulate(tr, "belady", one_tier(3), reuse_breakdown=True)
    assert lru.reuses_by_distance == bel.reuses_by_distance == [0, 1, 0, 1, 0, 0, 0]
    assert lru.hits_by_distance == [0, 1, 0, 0, 0, 0, 0]
    assert bel.hits_by_distance == [0, 1, 0, 1, 0, 0, 0]
    assert sum(lru.hits_by_distance) == lru.hit_blocks
    plain = simulate(tr, "lru", one_tier(3))
    assert plain.reuses_by_distance == [] and plain.hit_blocks == lru.hit_blocks


def test_belady_is_compared_on_block_hits_where_it_is_a_bound() -> None:
    # One slot, 512-token blocks: block 1 is used by two full requests, block 2 by a full
    # one and then a 1-token one. Belady keeps block 2 (used sooner) and saves 1 token for
    # it; keeping block 1 instead finds as many blocks and saves 512 tokens.
    sizes = [(1, 512), (1, 512), (2, 512), (2, 1), (1, 512)]
    tr = Trace(tuple(Request(arrival_s=float(i), input_tokens=n, output_tokens=1, blocks=(b,))
                     for i, (b, n) in enumerate(sizes)), 512, TraceFormat.MOONCAKE)
    bel = simulate(tr, "belady", one_tier(1))
    assert (bel.hit_blocks, bel.hit_tokens) == (2, 513)
    keeper = replace(bel, policy="keeper", hit_tokens=1024)  # hits requests 1 and 4
    rec = to_record(keeper, [keeper, bel])
    assert rec["vs_belady"] == 1.0  # block hits: not 2.0, which would "beat the bound"
    head, rows = table_rows([keeper, bel])
    assert "blk vs belady" in head and "vs belady" not in head
    assert rows[0][head.index("blk vs belady")] == "1.00"
    assert "not tokens saved" in belady_note([keeper, bel])
    two = replace(bel, tiers=[*bel.tiers, *bel.tiers])
    assert "reference, not a bound" in belady_note([two])
    for policy in ("lru", "lfu", "cost"):  # no policy finds more blocks with one tier
        assert simulate(tr, policy, one_tier(1)).hit_blocks <= bel.hit_blocks


def test_cli_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["replay", str(FIXTURES / "mooncake_small.jsonl"), "--policy", "lru", "cost",
                   "belady", "--capacity-fraction", "0.5", "--json"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["policy"] for x in lines] == ["lru", "cost", "belady"]
    for rec in lines:
        assert {"policy", "capacity_fraction", "token_hit_rate", "block_hit_rate",
                "ttft_mean_s", "ttft_p99_s", "vs_belady"} <= rec.keys()
        assert rec["capacity_fraction"] == 0.5
    assert lines[2]["vs_belady"] == 1.0
    rc = cli.main(["replay", str(FIXTURES / "mooncake_small.jsonl"), "--policy", "lru",
                   "--capacity-fraction", "0.5", "--json", "--reuse-breakdown"])
    rec = json.loads(capsys.readouterr().out)
    buckets = rec["reuse_distance"]
    assert [b["max_capacities"] for b in buckets] == [*REUSE_EDGES, None]
    assert sum(b["hits"] for b in buckets) == round(rec["block_hit_rate"] * rec["block_references"])
    assert all(0 <= b["hits"] <= b["reuses"] for b in buckets)
    rc = cli.main(["replay", str(FIXTURES / "mooncake_small.jsonl"), "--policy", "lru", "cost",
                   "--capacity-fraction", "0.5", "--reuse-breakdown"])
    out = capsys.readouterr().out
    assert rc == 0 and "share of reuses hit, by reuse distance" in out and "<=0.5" in out
    rc = cli.main(["replay", str(FIXTURES / "bailian_small.jsonl"), "--tier", "cpu=2",
                   "--tier", "nvme=4", "--policy", "cost", "--prefetch", "best_effort"])
    out = capsys.readouterr().out
    assert rc == 0 and "cpu hit" in out and "nvme hit" in out


def test_cli_errors_are_exit_code_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_plot_needs_matplotlib_or_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hit.png"
    rc = cli.main(["replay", str(FIXTURES / "mooncake_small.jsonl"), "--policy", "lru",
                   "--capacity-fraction", "0.3", "0.6", "--plot", str(out)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 2 and "matplotlib" in capsys.readouterr().err
    else:
        assert rc == 0 and out.stat().st_size > 0
