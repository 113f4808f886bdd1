"""Hostile trace files: each is refused with a TraceError naming the file, line and field
(``kvtier replay`` prints it as one line, exit 2), never a crash or a silent misreading."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.replay import cli
from kvtier.replay.trace import TraceError, load_trace

OK = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'
BAILIAN = ('{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 16, '
           '"output_length": 1, "turn": 1, "hash_ids": [1]}')


def trace(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("lines", "needle"), [
    (["[" * 100_000], "nested too deeply"),
    ([OK, "[" * 100_000], ":2: "),
    (['{"a": ' * 50_000 + "1" + "}" * 50_000], "nested too deeply"),
    (['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [' + "9" * 5000
      + "]}"], "too long"),
    (['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1.5]}'],
     "hash_ids"),
    (['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [true]}'],
     "hash_ids"),
    (['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["7"]}'],
     "hash_ids"),
    (['{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [1]}'],
     "timestamp"),
    (['{"timestamp": Infinity, "input_length": 1, "output_length": 1, "hash_ids": [1]}'],
     "timestamp"),
    (['{"timestamp": 0, "input_length": Infinity, "output_length": 1, "hash_ids": [1]}'],
     "input_length"),
    (['{"timestamp": 0, "input_length": NaN, "output_length": 1, "hash_ids": [1]}'],
     "input_length"),
    ([BAILIAN.replace('"chat_id": 1', '"chat_id": "abc"')], "chat_id"),
    ([BAILIAN.replace('"turn": 1', '"turn": [1]')], "turn"),
    ([BAILIAN.replace('"parent_chat_id": -1', '"parent_chat_id": 2.5')], "parent_chat_id"),
])
def test_a_hostile_trace_is_a_trace_error(tmp_path: Path, lines: list[str],
                                          needle: str) -> None:
    path = trace(tmp_path, *lines)
    with pytest.raises(TraceError, match=r"t\.jsonl") as info:
        load_trace(path)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_huge_lengths_are_refused(tmp_path: Path) -> None:
    path = trace(tmp_path, OK.replace('"input_length": 1024', '"input_length": 1e30'))
    with pytest.raises(TraceError, match="input_length"):
        load_trace(path)


def test_the_cli_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = trace(tmp_path, "[" * 100_000)
    assert cli.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier replay:") and len(err.strip().splitlines()) == 1


def test_a_clean_trace_still_reads(tmp_path: Path) -> None:
    t = load_trace(trace(tmp_path, OK, OK.replace('"timestamp": 0', '"timestamp": 5.5')))
    assert [r.blocks for r in t.requests] == [(1, 2), (1, 2)]
    b = load_trace(trace(tmp_path, BAILIAN))
    assert b.requests[0].chat_id == 1 and b.requests[0].parent_chat_id is None


def test_a_plot_nowhere_to_go_is_refused_before_the_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = trace(tmp_path, OK)
    assert cli.main(["replay", str(path), "--policy", "lru",
                     "--plot", str(tmp_path / "no" / "such" / "dir" / "x.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--plot" in captured.err
    assert len(captured.err.strip().splitlines()) == 1
