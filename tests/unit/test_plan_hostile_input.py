"""``kvtier plan`` on input beyond any deployment: a one-line error (exit 2), never a
traceback, an unbounded read or an absurd plan (found by review)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.plan import PlanError, add_parser
from kvtier.plan import model as model_mod
from kvtier.plan.model import load_model
from kvtier.plan.presets import find_preset
from kvtier.plan.workload import read_trace
from tests.support.cli import run_subcommand


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_subcommand(capsys, add_parser, "plan", *argv)


@pytest.mark.parametrize(("argv", "says"), [
    (["--gpus", "4097"], "at most 4096"),
    (["--gpus", "10000000000"], "at most 4096"),
    (["--block-size", str((1 << 20) + 16)], "--block-size must be positive and at most"),
    (["--tokens-per-block", str(16 << 30)], "at most 1,048,576"),
    (["--max-output", str(10**15)], "--max-output must be from 0 to"),
])
def test_bounds_no_deployment_exceeds(capsys: pytest.CaptureFixture[str], argv: list[str],
                                      says: str) -> None:
    """--gpus 10**10 printed 6e24 GB tiers (found by review)."""
    code, out, err = plan(capsys, "--model", "llama-3-8b", *argv)
    assert code == 2 and out == "" and says in err and err.count("\n") == 1


def test_a_trace_without_tokens_is_refused(tmp_path: Path) -> None:
    """It planned "0 sequences fit" (found by review)."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp":0,"input_length":0,"output_length":0,"hash_ids":[]}\n' * 3)
    with pytest.raises(PlanError, match="no request has any token"):
        read_trace(path)


def test_a_model_config_is_read_within_a_cap(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole file was read: 1.5 GB took 3 GB of memory (found by review)."""
    monkeypatch.setattr(model_mod, "MAX_CONFIG_BYTES", 4096)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**(find_preset("llama-3-8b") or {}), "pad": "x" * 8192}))
    with pytest.raises(PlanError, match="larger than"):
        load_model(str(path))


@pytest.mark.parametrize("name", ["p.txt", "p", "."])
def test_plot_name_is_checked_before_the_plan(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              name: str) -> None:
    """p.txt was a matplotlib traceback; DIR and p silently became DIR.png, p.png."""
    target = tmp_path / name
    code, _, err = plan(capsys, "--model", "llama-3-8b", "--plot", str(target))
    assert code == 2 and "--plot" in err and err.count("\n") == 1
    assert not list(tmp_path.glob("*.png"))


def test_a_model_name_is_no_mathtext_and_no_escape(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A config's _name_or_path went into the title as mathtext (ValueError) and to the
    terminal raw (found by review)."""
    pytest.importorskip("matplotlib")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**(find_preset("llama-3-8b") or {}),
                               "_name_or_path": "evil$\\undefinedcmd{$\x1b[2J"}))
    out_png = tmp_path / "kv.png"
    code, out, err = plan(capsys, "--model", str(cfg), "--plot", str(out_png))
    assert code == 0, err
    assert out_png.stat().st_size > 0 and "\x1b" not in out + err
