"""``kvtier replay --policy adaptive``: the live-curve table says what its columns hold and
keeps them aligned (its "rate" was the shadows' sample rate under a title about hit rates,
and a ``--tier`` capacity overflowed its 8-character column)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.replay import cli

TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "mooncake_small.jsonl"


def _curve_table(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    assert cli.main(["replay", str(TRACE), "--policy", "adaptive", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("live miss-ratio curve"))
    return out[start:]


@pytest.mark.parametrize("argv", [("--capacity-fraction", "0.5"),
                                  ("--tier", "cpu=1000000", "--tier", "nvme=20000000")])
def test_the_curve_table_names_the_sample_rate_and_stays_aligned(
        capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]) -> None:
    title, head, *rows = _curve_table(capsys, *argv)
    assert "sampled: the share of block references the shadows follow" in title
    assert head.split() == ["capacity", "tier", "mode", "sampled", "0.25x", "0.5x", "1x",
                            "2x", "4x"]
    assert rows and all(len(row.split()) == len(head.split()) for row in rows)
    for name in ("capacity", "sampled", "4x"):   # right-aligned: each ends where its head does
        end = head.index(name) + len(name)
        assert all(row[end - 1] != " " and row[end:end + 1] in ("", " ") for row in rows), name
    if "--tier" in argv:
        assert all(row.startswith("1000000+20000000  ") for row in rows)
