"""Trace reading pinned where a mutation went unnoticed (mutation review of
kvtier/replay/trace.py and tracefile.py): format detection by any Bailian field, length
bounds, optional fields, the --limit shortcut, re-blocking and refusals that must be a
TraceError naming the problem, never a traceback or a silent misreading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.replay.trace import MAX_TOKENS, TraceError, TraceFormat, load_trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
MOONCAKE = FIXTURES / "mooncake_small.jsonl"


def line(ts: object = 0, ids: tuple[int, ...] = (1,), /, **fields: object) -> str:
    """One record: ``input_length`` one 512-token block per id unless given."""
    rec: dict[str, object] = {"timestamp": ts, "input_length": 512 * len(ids),
                              "output_length": 1, "hash_ids": list(ids)}
    rec.update(fields)
    return json.dumps({k: v for k, v in rec.items() if v is not None})


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("field", ["chat_id", "parent_chat_id", "turn"])
def test_any_bailian_field_makes_a_bailian_trace(tmp_path: Path, field: str) -> None:
    """Any one of Bailian's own fields picks Bailian (seconds, 16-token blocks); missing it,
    the trace was read as Mooncake (milliseconds, 512-token blocks): a time 1000x too short
    and a length rule that refused the trace."""
    t = load_trace(write(tmp_path, line(2, input_length=16, **{field: 3})))
    assert t.format is TraceFormat.BAILIAN and t.block_tokens == 16
    assert t.requests[0].arrival_s == 2.0


def test_a_parent_chat_id_of_zero_is_a_parent(tmp_path: Path) -> None:
    """Only a negative parent_chat_id means "none": chat 0 is a chat like any other."""
    t = load_trace(write(tmp_path, line(1, input_length=16, chat_id=5, parent_chat_id=0),
                         line(2, input_length=16, chat_id=6, parent_chat_id=-1)))
    assert [r.parent_chat_id for r in t.requests] == [0, None]


def test_a_boolean_chat_field_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"t\.jsonl:1: field 'chat_id' must be an integer"):
        load_trace(write(tmp_path, line(input_length=16, chat_id=True)))


@pytest.mark.parametrize("field", ["input_length", "output_length"])
def test_token_counts_are_bounded_on_both_sides(tmp_path: Path, field: str) -> None:
    """A negative count or one past MAX_TOKENS is refused; MAX_TOKENS itself reads."""
    for bad in (-512, MAX_TOKENS + 1):
        with pytest.raises(TraceError, match=rf"t\.jsonl:1: field '{field}' must be a whole"):
            load_trace(write(tmp_path, line(**{field: bad})), block_tokens=512)
    t = load_trace(write(tmp_path, line(**{field: MAX_TOKENS})), block_tokens=512)
    assert getattr(t.requests[0], field.replace("length", "tokens")) == MAX_TOKENS


def test_a_record_without_input_length_is_not_length_checked(tmp_path: Path) -> None:
    """The length rule needs input_length: without it the record reads (0 tokens, which
    the replay counts as whole blocks)."""
    t = load_trace(write(tmp_path, line(0, (1, 2, 3), input_length=None)))
    assert t.requests[0].input_tokens == 0 and t.requests[0].blocks == (1, 2, 3)


def test_the_length_rule_counts_a_started_block(tmp_path: Path) -> None:
    """ceil(input_length / block): 513 tokens take two 512-token blocks, not one."""
    assert load_trace(write(tmp_path, line(0, (1, 2), input_length=513))).n_references == 2
    with pytest.raises(TraceError, match="1 block ids for input_length 513"):
        load_trace(write(tmp_path, line(0, (1,), input_length=513)))


def test_a_callers_block_size_may_reblock_a_trace() -> None:
    """An explicit block size is not length-checked unless asked (re-blocking on purpose);
    zero or a negative size is refused."""
    t = load_trace(MOONCAKE, block_tokens=256)
    assert t.block_tokens == 256 and t.n_references == 16
    with pytest.raises(TraceError, match="contradict 256-token blocks"):
        load_trace(MOONCAKE, block_tokens=256, check_lengths=True)
    for size in (0, -16):
        with pytest.raises(TraceError, match="block size must be positive"):
            load_trace(MOONCAKE, block_tokens=size)


def test_a_nested_timestamp_does_not_fool_the_limit_shortcut(tmp_path: Path) -> None:
    """After the first ``limit`` requests a line is skipped by its timestamp alone only
    when that is the record's own: here a nested "timestamp" of 99 comes first, and the
    record (at 5 ms, the earliest) must still be read."""
    nested = '{"meta": {"timestamp": 99}, ' + line(5, (3,))[1:]
    path = write(tmp_path, line(10, (1,)), line(20, (2,)), nested)
    assert [r.blocks for r in load_trace(path, limit=2).requests] == [(3,), (1,)]


def test_a_trace_without_requests_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"trace .*t\.jsonl holds no requests"):
        load_trace(write(tmp_path, "", "   "))


@pytest.mark.parametrize("text", ["[1, 2]", "7", '"x"', "null"])
def test_a_line_that_is_not_an_object_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(TraceError, match=r"t\.jsonl:2: expected a JSON object per line"):
        load_trace(write(tmp_path, line(), text))


def test_a_device_is_refused_by_name() -> None:
    """A character device holds no trace: refused before reading (/dev/zero would be read
    until the line limit, /dev/null would look like an empty trace)."""
    with pytest.raises(TraceError, match="/dev/null is a device or a socket, not a file"):
        load_trace("/dev/null")


def test_a_directory_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=str(tmp_path)):
        load_trace(tmp_path)
