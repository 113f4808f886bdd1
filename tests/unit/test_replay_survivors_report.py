"""What ``kvtier replay`` prints, pinned where a mutation went unnoticed (mutation review of
kvtier/replay/report.py, results.py and cli.py): each JSON field holds its own counter,
comparisons pick the run of the same capacity, percentiles and labels are exact, and the
CLI's flags reach the replay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.policy.costmodel import BlockCosts, PrefillModel
from kvtier.replay import cli
from kvtier.replay.report import (
    belady_note,
    format_reuse_breakdown,
    table_rows,
    to_record,
)
from kvtier.replay.results import ReplayResult, TierResult
from kvtier.replay.simulator import SimConfig, TierSpec, simulate
from kvtier.replay.trace import load_trace

MOONCAKE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "mooncake_small.jsonl"


def result(policy: str, fraction: float | None = 0.1, hit_blocks: int = 10,
           hit_tokens: int = 100, caps: tuple[int, ...] = (5,)) -> ReplayResult:
    r = ReplayResult(policy=policy, capacity_fraction=fraction, requests=4, references=40,
                     total_tokens=400, hit_tokens=hit_tokens, hit_blocks=hit_blocks,
                     orphans_dropped=3, late_blocks=7)
    r.tiers = [TierResult(f"t{i}", c) for i, c in enumerate(caps)]
    return r


def test_every_json_field_reads_its_own_counter() -> None:
    r = result("lru", caps=(5, 9))
    r.tiers[0] = TierResult("cpu", 5, hit_tokens=60, hit_blocks=6, bytes_read=11,
                            bytes_written=12, evictions=13, rejected=14)
    r.tiers[1] = TierResult("nvme", 9, hit_tokens=40, hit_blocks=4, bytes_read=21,
                            bytes_written=22, evictions=23, rejected=24)
    r.ttft_s = [1.0, 2.0, 6.0]
    rec = to_record(r)
    assert rec["block_references"] == 40 and rec["requests"] == 4
    assert rec["block_hit_rate"] == 10 / 40 and rec["token_hit_rate"] == 100 / 400
    assert rec["token_hit_rate_by_tier"] == {"cpu": 60 / 400, "nvme": 40 / 400}
    assert rec["bytes_read_by_tier"] == {"cpu": 11, "nvme": 21}
    assert rec["bytes_written_by_tier"] == {"cpu": 12, "nvme": 22}
    assert rec["evictions_by_tier"] == {"cpu": 13, "nvme": 23}
    assert rec["admission_rejects_by_tier"] == {"cpu": 14, "nvme": 24}
    assert (rec["orphans_dropped"], rec["prefetch_late_blocks"]) == (3, 7)
    assert rec["ttft_mean_s"] == 3.0


def test_p99_is_the_nearest_rank() -> None:
    """p99 of 1..100 is 99 (nearest rank), not the maximum nor p90."""
    r = result("lru")
    r.ttft_s = [float(v) for v in range(100, 0, -1)]
    assert to_record(r)["ttft_p99_s"] == 99.0
    r.ttft_s = [4.0]
    assert to_record(r)["ttft_p99_s"] == 4.0


def test_comparisons_pick_the_run_of_the_same_capacity_fraction() -> None:
    """Two fractions may round to the same number of blocks on a small trace: vs_belady
    (block hits) and vs_lru (tokens) must still compare with the run of the same fraction."""
    runs = [result("belady", 0.1, hit_blocks=40), result("lru", 0.1, hit_tokens=50),
            result("belady", 0.2, hit_blocks=20), result("lru", 0.2, hit_tokens=200),
            result("cost", 0.2, hit_blocks=10, hit_tokens=100)]
    rec = to_record(runs[-1], runs)
    assert rec["vs_belady"] == 10 / 20 and rec["vs_lru"] == 100 / 200


def test_table_columns_and_labels() -> None:
    """Tier runs are labelled by their sizes (cpu+nvme), per-tier columns follow the tiers,
    tokens saved are in millions."""
    r = result("lru", None, hit_tokens=2_500_000, caps=(2, 4))
    r.total_tokens = 10_000_000
    r.tiers[0].hit_tokens, r.tiers[1].hit_tokens = 2_000_000, 500_000
    head, rows = table_rows([r])
    row = dict(zip(head, rows[0], strict=True))
    assert row["capacity"] == "2+4"
    assert (row["t0 hit"], row["t1 hit"]) == ("0.2000", "0.0500")
    assert row["saved Mtok"] == "2.5"


def test_the_belady_note_calls_one_tier_a_bound() -> None:
    note = belady_note([result("belady")])
    assert "bounds block hits" in note and "not a bound" not in note


def test_the_reuse_table_has_one_count_row_per_capacity_and_dashes_for_empty_buckets() -> None:
    runs = []
    for policy in ("lru", "cost"):
        r = result(policy)
        r.reuses_by_distance = [2, 0, 0, 0, 0, 0, 4]
        r.hits_by_distance = [1, 0, 0, 0, 0, 0, 0]
        runs.append(r)
    lines = format_reuse_breakdown(runs).splitlines()
    assert [x.split()[1] for x in lines[2:]] == ["reuses", "lru", "cost"]
    assert lines[3].split()[2:] == ["0.500", "-", "-", "-", "-", "-", "0.000"]


def replay_json(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert cli.main(["replay", str(MOONCAKE), "--policy", "lru", "--json", *argv]) == 0
    return [json.loads(x) for x in capsys.readouterr().out.splitlines()]


def test_the_model_and_bandwidth_flags_reach_the_replay(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--layers, --hidden, --model-params, --flops, --bytes-per-token and --bandwidth give
    the TTFT a direct replay computes with the same model (swapped or dropped flags differ)."""
    (rec,) = replay_json(capsys, "--tier", "cpu=3", "--tier", "nvme=20", "--layers", "2",
                         "--hidden", "8192", "--model-params", "1e9", "--flops", "1e14",
                         "--bytes-per-token", "1000", "--bandwidth", "cpu=1e6",
                         "--bandwidth", "nvme=2e5")
    trace = load_trace(MOONCAKE)
    costs = BlockCosts(block_tokens=512, block_bytes=512 * 1000,
                       prefill=PrefillModel(params=1e9, layers=2, hidden=8192,
                                            flops_per_s=1e14))
    config = SimConfig(tiers=(TierSpec("cpu", 3, 1e6), TierSpec("nvme", 20, 2e5)),
                       costs=costs, bytes_per_token=1000)
    want = simulate(trace, "lru", config)
    assert rec["ttft_mean_s"] == pytest.approx(sum(want.ttft_s) / len(want.ttft_s), rel=1e-9)
    assert rec["bytes_read_by_tier"] == {t.name: t.bytes_read for t in want.tiers}
    assert rec["bytes_written_by_tier"] == {t.name: t.bytes_written for t in want.tiers}


def test_capacity_fractions_round_down_and_one_is_allowed(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The fixture has 7 unique blocks: 0.5 is 3 blocks (rounded down), 1.0 all 7."""
    recs = replay_json(capsys, "--capacity-fraction", "0.5", "1")
    assert [r["capacity_blocks"] for r in recs] == [{"cpu": 3}, {"cpu": 7}]


def test_limit_replays_only_the_earliest_requests(capsys: pytest.CaptureFixture[str]) -> None:
    (rec,) = replay_json(capsys, "--capacity-fraction", "0.5", "--limit", "2")
    assert rec["requests"] == 2


@pytest.mark.parametrize(("argv", "needle"), [
    (["--capacity-fraction", "0"], "--capacity-fraction must be in (0, 1]"),
    (["--tier", "=5"], "NAME=VALUE"),
    (["--tier", f"cpu={cli.MAX_BLOCKS + 1}"], "--tier"),
    (["--tier", "cpu=2", "--capacity-fraction", "0.5"], "not both"),
    (["--tier", "cpu=2", "--tier", "cpu=3", "--tier", "cpu=4"], "given 3 times"),
    (["--tier", "cpu=2", "--tier", "nvme=4", "--bandwidth", "nvme=1e-300"], "overflows"),
])
def test_meaningless_options_are_one_line_errors(
        capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    """Each is refused with exit 2 and one line, before any replay (a modelled time that
    overflows is checked against the slowest tier, not the fastest)."""
    try:
        code = main(["replay", str(MOONCAKE), "--policy", "lru", "--json", *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and needle in err
    assert len([x for x in err.splitlines() if x.strip()]) == 1, err


def test_the_largest_tier_size_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    (rec,) = replay_json(capsys, "--tier", f"cpu={cli.MAX_BLOCKS}")
    assert rec["capacity_blocks"] == {"cpu": cli.MAX_BLOCKS}


def test_the_format_flag_reads_a_trace_as_told(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A Bailian trace without its chat fields looks like Mooncake; --format bailian reads
    it with 16-token blocks."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 1, "input_length": 20, "output_length": 1,
                                "hash_ids": [1, 2]}) + "\n")
    code = cli.main(["replay", str(path), "--policy", "lru", "--format", "bailian",
                     "--capacity-fraction", "1", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["prefill_tokens_total"] == 20


def test_the_header_counts_requests_references_and_unique_blocks(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", str(MOONCAKE), "--policy", "lru",
                     "--capacity-fraction", "0.5"]) == 0
    assert ("5 requests, 16 block references, 7 unique blocks of 512 tokens"
            in capsys.readouterr().out)


@pytest.mark.parametrize(("admission", "rejects"), [("always", 0), ("second-hit", 7)])
def test_nvme_admission_applies_to_the_nvme_tier_only(
        capsys: pytest.CaptureFixture[str], admission: str, rejects: int) -> None:
    """second-hit refuses the nvme writes of blocks seen once (7 of the run's 12
    demotions), also under a write budget (it is the budget's inner policy); cpu always
    admits."""
    for budget in ([], ["--nvme-write-budget", "1e12"]):
        (rec,) = replay_json(capsys, "--tier", "cpu=1", "--tier", "nvme=10",
                             "--nvme-admission", admission, *budget)
        assert rec["admission_rejects_by_tier"] == {"cpu": 0, "nvme": rejects}


def test_a_write_budget_below_one_block_per_second_still_writes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Replay's budget is the daemon's (``WriteBudget.per_second``): a 50 MB/s budget
    writes a 64 MiB Mooncake block now and then. Its burst was max(rate, 1 byte), which
    never held one block, and replay reported that nothing would ever be written."""
    (rec,) = replay_json(capsys, "--tier", "cpu=1", "--tier", "nvme=10",
                         "--nvme-write-budget", "5e7")
    assert rec["bytes_written_by_tier"]["nvme"] > 0


def test_an_adaptive_row_names_each_tiers_mode_and_all_switches() -> None:
    r = result("adaptive", caps=(2, 4))
    r.shadows = [{"mode": "lru", "switches": 2}, {"mode": "lfu", "switches": 3}]
    _, rows = table_rows([r])
    assert rows[0][1] == "adaptive(lru/lfu,5sw)"


def test_the_prefetch_flag_reaches_the_replay(capsys: pytest.CaptureFixture[str]) -> None:
    """best_effort does not wait for nvme promotions (late blocks); wait does."""
    argv = ("--tier", "cpu=2", "--tier", "nvme=20", "--prefetch")
    (wait,) = replay_json(capsys, *argv, "wait")
    (best,) = replay_json(capsys, *argv, "best_effort")
    assert wait["prefetch_late_blocks"] == 0 < best["prefetch_late_blocks"]


def test_the_plot_draws_each_policy_by_increasing_capacity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fractions given out of order are drawn left to right (a line, not a zigzag), and a
    file that cannot be written is a KVTierError, not a traceback."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from kvtier.errors import KVTierError
    from kvtier.replay.plot import plot_hit_rates

    drawn: list[list[float]] = []
    real = Axes.plot

    def spy(self: Axes, xs: list[float], *args: Any, **kwargs: Any) -> Any:
        drawn.append(list(xs))
        return real(self, xs, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    runs = [result("lru", f) for f in (0.4, 0.1, 0.2)]
    assert plot_hit_rates(runs, tmp_path / "p.png").stat().st_size > 0
    assert drawn == [[10.0, 20.0, 40.0]]

    def refuse(self: Figure, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Figure, "savefig", refuse)
    with pytest.raises(KVTierError, match=r"cannot write plot .*Permission denied"):
        plot_hit_rates(runs, tmp_path / "q.png")


@pytest.mark.parametrize("argv", [["--nvme-write-budget", "1e8"],
                                  ["--nvme-admission", "second-hit"],
                                  ["--tier", "cpu=4", "--nvme-write-budget", "1e8"]])
def test_nvme_flags_without_an_nvme_tier_are_refused(
        capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """--capacity-fraction replays one cpu tier: an nvme admission flag there changed
    nothing, and the report looked as if the budget had been simulated."""
    assert cli.main(["replay", str(MOONCAKE), "--policy", "lru", *argv]) != 0
    assert "act on a tier named nvme: add --tier nvme=BLOCKS" in capsys.readouterr().err
