"""Traces and options that used to be misread or crash: each is now refused in one line
(or read right), checked on tiny traces built here."""

from __future__ import annotations

import gzip
import io
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from kvtier.policy.stats import WorkloadStats
from kvtier.replay import cli, report
from kvtier.replay.simulator import SimConfig, TierSpec, simulate
from kvtier.replay.trace import TraceError, TraceFormat, load_trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
MOONCAKE = FIXTURES / "mooncake_small.jsonl"


def rec(ts: object, ids: list[int], inp: object = None, **extra: object) -> str:
    """One Mooncake line, input_length one 512-token block per id unless given."""
    length = len(ids) * 512 if inp is None else inp
    return json.dumps({"timestamp": ts, "input_length": length, "output_length": 1,
                       "hash_ids": ids, **extra})


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def replay(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["replay", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_ids_that_are_not_prefix_chained_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, rec(0, [1, 2]), rec(1, [3, 2]))
    with pytest.raises(TraceError) as info:
        load_trace(path)
    msg = str(info.value)
    assert "t.jsonl:2: block id 2 follows 3 here but 1 on line 1" in msg
    assert "prefix-chained" in msg and "\n" not in msg
    with pytest.raises(TraceError, match="block id 5 opens the request here but follows 4"):
        load_trace(write(tmp_path, rec(0, [4, 5]), "", rec(1, [5])))


def test_the_length_rule_holds_on_the_fixtures_and_a_wrong_block_size_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load_trace(MOONCAKE)
    load_trace(FIXTURES / "bailian_small.jsonl")
    # the Bailian fixture without its chat fields looks like Mooncake: 512-token blocks
    lines = [json.loads(x) for x in (FIXTURES / "bailian_small.jsonl").read_text().split("\n")
             if x]
    bare = [json.dumps({k: r[k] for k in ("timestamp", "input_length", "output_length",
                                          "hash_ids")}) for r in lines]
    path = write(tmp_path, *bare)
    with pytest.raises(TraceError, match=r"t\.jsonl:1: 3 block ids for input_length 40 "
                       r"contradict 512-token blocks .*--block-tokens.*--format"):
        load_trace(path)
    assert load_trace(path, fmt=TraceFormat.BAILIAN).block_tokens == 16
    assert load_trace(path, block_tokens=16, check_lengths=True).n_references == 16
    code, out, err = replay(capsys, str(path), "--policy", "lru", "--block-tokens", "8")
    assert code == 2 and out == "" and "8-token blocks" in err
    assert len(err.strip().splitlines()) == 1


def test_a_corrupt_gzip_stream_is_one_line(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    packed = bytearray(gzip.compress(MOONCAKE.read_bytes() * 20))
    packed[12:40] = b"\xff" * 28  # inside the deflate data: zlib.error, not an OSError
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(bytes(packed))
    with pytest.raises(TraceError, match=r"cannot read trace .*t\.jsonl\.gz"):
        load_trace(path)
    code, _, err = replay(capsys, str(path), "--policy", "lru")
    assert code == 2 and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("line", "needle"), [
    (rec(True, [1]), "'timestamp' must be a number, got True"),
    (rec("12", [1]), "'timestamp' must be a number, got '12'"),
    (rec(0, [1, 2], inp=1024.7), "'input_length' must be a whole number"),
    (rec(0, [1], inp=False), "'input_length'"),
    (rec(0, [1], inp="512"), "'input_length'"),
    (json.dumps({"timestamp": 0, "input_length": 512, "output_length": 2.5,
                 "hash_ids": [1]}), "'output_length'"),
])
def test_integer_fields_refuse_booleans_strings_and_fractions(
        tmp_path: Path, line: str, needle: str) -> None:
    with pytest.raises(TraceError, match=r"t\.jsonl:1: ") as info:
        load_trace(write(tmp_path, line))
    assert needle in str(info.value)


def test_whole_floats_still_read(tmp_path: Path) -> None:
    t = load_trace(write(tmp_path, rec(1.5, [1, 2], inp=1024.0)))
    assert t.requests[0].input_tokens == 1024 and t.requests[0].arrival_s == 0.0015


@pytest.mark.parametrize("argv", [
    ["--flops", "1e-300"],
    ["--bandwidth", "cpu=1e-300"],
    ["--model-params", "1e308"],
])
def test_json_never_prints_infinity(capsys: pytest.CaptureFixture[str],
                                    argv: list[str]) -> None:
    code, out, err = replay(capsys, str(MOONCAKE), "--policy", "lru", "--json", *argv)
    assert code == 2 and out == "" and "Infinity" not in out
    assert "overflows" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("name", "needle"), [
    ("plot.txt", "must end in one of"),
    ("plot", "must end in one of"),
    (".", "is a directory"),
])
def test_a_plot_that_cannot_be_written_is_refused_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, needle: str) -> None:
    code, out, err = replay(capsys, str(MOONCAKE), "--policy", "lru",
                            "--plot", str(tmp_path / name))
    assert code == 2 and out == "" and needle in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "plot.png").exists()


def test_a_plot_of_tier_runs_is_refused(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = replay(capsys, str(MOONCAKE), "--policy", "lru", "--tier", "cpu=2",
                            "--plot", str(tmp_path / "p.png"))
    assert code == 2 and out == "" and "--tier" in err


def test_standard_input_reads_compressed_or_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = load_trace(MOONCAKE)
    for data in (MOONCAKE.read_bytes(), gzip.compress(MOONCAKE.read_bytes())):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        got = load_trace("-")
        assert got.requests == plain.requests and got.block_tokens == 512


def test_a_pipe_is_read_once(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    data = gzip.compress(MOONCAKE.read_bytes())
    got: list[object] = []

    def read() -> None:
        try:
            got.append(len(load_trace(fifo).requests))
        except TraceError as exc:
            got.append(str(exc))

    # daemon threads: a reader that opened the pipe twice would wait for a writer forever
    threading.Thread(target=fifo.write_bytes, args=(data,), daemon=True).start()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert got == [5]


def test_capacity_labels_tell_fractions_apart(capsys: pytest.CaptureFixture[str]) -> None:
    fractions = ["0.015", "0.02", "0.004", "0.001"]
    assert [report.fraction_label(float(f)) for f in fractions] == ["1.5%", "2%", "0.4%", "0.1%"]
    assert report.fraction_label(0.1) == "10%" and report.fraction_label(0.07) == "7%"
    code, out, _ = replay(capsys, str(MOONCAKE), "--policy", "lru",
                          "--capacity-fraction", *fractions)
    assert code == 0
    for label in ("1.5%", "2%", "0.4%", "0.1%"):
        assert any(line.split()[:1] == [label] for line in out.splitlines())


def test_limit_keeps_the_earliest_requests_of_an_unsorted_trace(tmp_path: Path) -> None:
    path = write(tmp_path, rec(50, [1]), rec(30, [2]), rec(10, [3]), rec(20, [4]))
    assert [r.blocks for r in load_trace(path, limit=2).requests] == [(3,), (4,)]


def test_limit_stops_parsing_a_sorted_trace(tmp_path: Path) -> None:
    # the third line is never parsed: its timestamp alone shows it comes after the first two
    path = write(tmp_path, rec(10, [1]), rec(20, [1, 2]), '{"timestamp": 30, "hash_ids": 7}')
    assert len(load_trace(path, limit=2).requests) == 2
    with pytest.raises(TraceError, match=":3: "):
        load_trace(path)


def test_policies_that_ignore_the_statistics_do_not_feed_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    trace = load_trace(MOONCAKE)
    config = SimConfig(tiers=(TierSpec("cpu", 3, 25e9),))

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("statistics updated for a policy that never reads them")

    monkeypatch.setattr(WorkloadStats, "on_request", boom)
    for policy in ("lru", "lfu", "belady"):
        assert simulate(trace, policy, config).requests == 5
    with pytest.raises(AssertionError):
        simulate(trace, "cost", config)


def test_a_line_longer_than_the_limit_is_refused_by_number(tmp_path: Path) -> None:
    """Bytes without a newline were read into memory whole (1.2 GB/s from /dev/zero); a
    line is now read at most MAX_LINE_CHARS at a time, plain or compressed."""
    from kvtier.replay.tracefile import MAX_LINE_CHARS

    long = '{"timestamp": 1, "pad": "' + "x" * MAX_LINE_CHARS + '"}'
    for name, data in (("t.jsonl", (rec(0, [1]) + "\n" + long + "\n").encode()),
                       ("t.jsonl.gz", gzip.compress((rec(0, [1]) + "\n" + long).encode()))):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(TraceError, match=rf"{name}:2: line longer than 1,048,576"):
            load_trace(path)
    exact = tmp_path / "exact.jsonl"          # a line of exactly the limit is read
    line = rec(0, [1])
    exact.write_text(line + " " * (MAX_LINE_CHARS - len(line)) + "\n")
    assert len(load_trace(exact).requests) == 1

