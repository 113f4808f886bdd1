"""``kvtier explain``'s client side pinned where a mutation review found it unwatched: the
query it sends, the rows it refuses, what each table cell shows and how it fails (no
process, no socket: httpget.get is replaced)."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from kvtier import explain_cli, httpget
from kvtier.cli import main
from kvtier.explain_cli import MalformedLookup, fetch_recent, render


def _row(**over: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model_id": "m", "namespace": "abcdefgh12", "reason": "evicted", "first_miss": 3,
        "blocks": 9, "hits": {"cpu": 1, "nvme": 2, "redis": 3}, "at": 1.0,
        "removed": {"tier": "cpu", "policy": "lru", "age_s": 2.0}}
    row.update(over)
    return row


def _render(rows: list[dict[str, Any]], now: float = 10.0) -> str:
    buf = io.StringIO()
    render(rows, Console(file=buf, width=300), now=now)
    return buf.getvalue()


def _cells(out: str) -> list[str]:
    """The cells of the table's one data row."""
    line = next(ln for ln in out.splitlines() if "block" in ln or " - " in ln)
    return [c.strip() for c in line.split("│")[1:-1]]


def _get_returns(monkeypatch: pytest.MonkeyPatch, body: bytes) -> list[str]:
    """httpget.get answers ``body``; the list collects the URLs asked."""
    asked: list[str] = []

    def get(url: str, *, deadline_s: float = 0.0, max_bytes: int = 0) -> bytes:
        asked.append(url)
        return body

    monkeypatch.setattr(httpget, "get", get)
    return asked


def test_the_query_carries_limit_and_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """--limit and --misses reach the daemon: dropped, the table shows 20 rows of hits."""
    asked = _get_returns(monkeypatch, b'{"lookups": []}')
    assert fetch_recent("http://h:1/", 7, True) == []
    assert fetch_recent("http://h:1", 3, False) == []
    assert asked == ["http://h:1/v1/lookups/recent?limit=7&misses=1",
                     "http://h:1/v1/lookups/recent?limit=3&misses=0"]


def test_lookups_that_are_not_objects_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _get_returns(monkeypatch, b'{"lookups": [{}, 1]}')
    with pytest.raises(ValueError, match="not a list of lookups"):
        fetch_recent("http://h:1", 1, False)


@pytest.mark.parametrize("row", [_row(blocks=True), _row(at=False),
                                 _row(hits={"cpu": True, "nvme": 0, "redis": 0})])
def test_a_boolean_is_not_a_number(row: dict[str, Any]) -> None:
    """JSON true is a Python int: shown, it would read 'True' blocks / 1.0 s ago."""
    with pytest.raises(MalformedLookup, match="wrong type"):
        _render([row])


def test_the_hit_columns_are_cpu_nvme_redis_in_order() -> None:
    cells = _cells(_render([_row()]))
    assert cells[2:6] == ["9", "1", "2", "3"], cells


def test_ago_is_never_negative_and_turns_to_minutes_past_two() -> None:
    """A row stamped after the local clock reads 0.0s; under 120 s in seconds, then whole
    minutes."""
    assert _cells(_render([_row(at=15.0)], now=10.0))[0] == "0.0s"
    assert _cells(_render([_row(at=10.0)], now=70.0))[0] == "60.0s"
    assert _cells(_render([_row(at=10.0)], now=610.0))[0] == "10m"


def test_the_namespace_is_cut_to_eight_and_a_missing_model_is_a_question_mark() -> None:
    cells = _cells(_render([_row(model_id=None)]))
    assert cells[1] == "? abcdefgh"
    assert "salt#" in _cells(_render([_row(salt_id="ab12")]))[1]


def test_a_removal_without_policy_shows_no_empty_brackets() -> None:
    detail = _cells(_render([_row(removed={"tier": "nvme", "age_s": 2.0})]))[7]
    assert detail == "left nvme 2.0s before"


def test_unprintable_characters_from_the_peer_are_replaced() -> None:
    """An ESC sequence in a model id or a hint would drive the operator's terminal."""
    out = _render([_row(model_id="m\x1b[2J", hint="grow\x07 it")])
    assert "\x1b[2J" not in out and "\x07" not in out
    assert "m?[2J" in out and "grow? it" in out


@pytest.mark.parametrize("field", ["model_id", "hint"])
def test_markup_in_a_name_or_hint_is_shown_as_text(field: str) -> None:
    """'[/x]' from the daemon in the namespace or detail cell was a rich MarkupError."""
    assert "[/x]" in _render([_row(**{field: "[/x]"})])


def _explain(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["explain", "--url", "http://127.0.0.1:9", *argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_no_daemon_is_said_as_such_and_with_json_on_stdout(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 2 and one line; with --json the line is an {"error"} object on stdout."""
    def get(url: str, **kw: Any) -> bytes:
        raise httpget.Unreachable("connection refused")

    monkeypatch.setattr(explain_cli.httpget, "get", get)
    code, out, err = _explain(capsys)
    assert code == 2 and out == "" and "no daemon answered" in err
    code, out, err = _explain(capsys, "--json")
    assert code == 2 and err == "" and '"error"' in out and "no daemon answered" in out


def test_a_miss_is_yellow_and_a_hit_green() -> None:
    """The colour is how a miss stands out in a long table."""
    miss = explain_cli._cells(1, _row(), 10.0)[6]
    hit = explain_cli._cells(1, _row(reason="none"), 10.0)[6]
    assert miss == "[yellow]block 3: evicted[/yellow]" and hit == "[green]-[/green]"
