"""Operator tools on a malformed or hostile peer: ``kvtier stats``, ``plan --live-stats``,
``doctor`` and ``explain`` answer in one typed line, never a traceback, and never print a
peer's control characters or rich markup raw (found by review)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvtier.cli import render_stats
from kvtier.doctor import add_parser
from kvtier.doctor.engine import parse_engine
from kvtier.doctor.errors import DoctorError
from kvtier.explain_cli import MalformedLookup, render
from kvtier.policy.mrc import LiveStatsError, live_plan, plan_lines, render_table, sizing_notes
from kvtier.statsdoc import MalformedStats
from tests.support.cli import run_subcommand

ESC = "\x1b[2J\x1b]0;PWNED\x07evil"
CURVE = [{"scale": 0.5, "hit_rate": 0.1}, {"scale": 1.0, "hit_rate": 0.2},
         {"scale": 2.0, "hit_rate": 0.6}]


def _stats(policy_tier: Any = None, tiers: Any = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"daemon": {"uptime_s": 5}, "requests": {}, "connector": {},
                           "tiers": {"cpu": {"capacity_bytes": 1000}} if tiers is None
                           else tiers}
    doc["policy"] = {"tiers": {"cpu": {"mode": "lru", "switches": 0, "mrc": CURVE}
                               if policy_tier is None else policy_tier}}
    return doc


def _doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_subcommand(capsys, add_parser, "doctor", *argv)


@pytest.mark.parametrize("key", ["switches", "mode"])
def test_stats_table_shows_a_null_mode_or_switches(key: str) -> None:
    """A null was a TypeError in render_table's format (found by review)."""
    tier = {"mode": "lru", "switches": 3, "mrc": [{"scale": 1.0, "hit_rate": 0.5}], key: None}
    table = render_table(_stats(tier))
    row = table.splitlines()[-1]
    assert row.startswith("cpu") and "50.0%" in row
    assert render_stats(_stats(tier))   # kvtier stats' own renderer, end to end


@pytest.mark.parametrize(("doc", "field"), [
    (_stats(tiers=[1, 2]), "tiers is a list"),
    (_stats(tiers={"cpu": "big"}), "tiers.cpu is a str"),
    (_stats(tiers={"cpu": {"capacity_bytes": "lots"}}), "tiers.cpu.capacity_bytes is a str"),
    (_stats(tiers={"cpu": {"capacity_bytes": 10**400}}), "tiers.cpu.capacity_bytes"),
    (_stats(tiers={"cpu": {"capacity_bytes": 1e300}}), "tiers.cpu.capacity_bytes"),
    (_stats({"mrc": [{"scale": 0, "hit_rate": 0.1}, {"scale": 2.0, "hit_rate": 0.5}]}),
     "policy.tiers.cpu.mrc.scale is 0"),
])
def test_live_plan_names_the_malformed_field(tmp_path: Path, doc: dict[str, Any],
                                             field: str) -> None:
    """AttributeError, ValueError, OverflowError and a math domain error before."""
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(LiveStatsError, match="is not kvtier stats") as got:
        live_plan(str(path))
    assert field in str(got.value) and "\n" not in str(got.value)


def test_sizing_notes_refuse_a_scale_of_zero_and_doctor_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _stats({"mrc": [{"scale": 0, "hit_rate": 0.1}, {"scale": 2.0, "hit_rate": 0.5}]})
    with pytest.raises(MalformedStats, match="scale is 0"):
        sizing_notes(doc)
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(doc))
    code, out, err = _doctor(capsys, "--stats", str(path))
    assert "Traceback" not in out + err
    assert "tier sizing skipped" in out and code in (0, 1)


def test_tier_names_are_cleaned_in_plan_and_doctor(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tier named with ESC sequences reached the terminal raw (found by review)."""
    tier = {"name": ESC, "up": False, "capacity_bytes": 1000, "used_bytes": 1000,
            "allocation_failures": 50, "evictions": {"capacity": 100}, "errors": 5}
    doc = _stats(tiers={ESC: tier})
    doc["policy"] = {"tiers": {ESC: {"mode": "lru", "switches": 0, "mrc": CURVE}}}
    doc["requests"] = {"lookup_tokens": 100, "hit_tokens": 1}
    shown = [*plan_lines(doc), *sizing_notes(doc), render_table(doc)]
    assert all("\x1b" not in s and "\x07" not in s for s in shown)
    assert "?[2J?]0;PWNED?evil tier of" in shown[0]
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(doc))
    _, out, err = _doctor(capsys, "--stats", str(path))
    assert "PWNED" in out and "\x1b" not in out + err and "\x07" not in out + err


PROM = """# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{le="%s"} 1.0
vllm:request_prompt_tokens_bucket{le="+Inf"} 2.0
vllm:request_prompt_tokens_sum 3.0
vllm:request_prompt_tokens_count 2.0
# TYPE other_seconds histogram
other_seconds_bucket{le="%s"} 1.0
other_seconds_bucket{le="+Inf"} 1.0
other_seconds_sum 1.0
other_seconds_count 1.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="%s"} 1.0
"""


def test_engine_scrape_with_a_bucket_bound_that_is_not_a_number() -> None:
    """float(le) outside the try was a ValueError traceback (found by review)."""
    with pytest.raises(DoctorError, match="request_prompt_tokens has a bucket le='abc'"):
        parse_engine(PROM % ("abc", "10", "100"), "s.prom")
    got = parse_engine(PROM % ("10", "abc", "100"), "s.prom")   # not read: skipped
    assert got.histograms["other_seconds"].bounds == (float("inf"),)
    assert got.kv_capacity_tokens == 1600


def test_engine_scrape_with_an_absurd_kv_pool() -> None:
    """4000 digits overflowed a float in the sizing rule (found by review)."""
    with pytest.raises(DoctorError, match="num_gpu_blocks is an int of"):
        parse_engine(PROM % ("10", "10", "9" * 4000), "s.prom")
    assert parse_engine(PROM % ("10", "10", "None"), "s.prom").kv_capacity_tokens is None


def _row(**over: Any) -> dict[str, Any]:
    row = {"model_id": "m", "namespace": "abcdefgh12", "reason": "evicted", "first_miss": 3,
           "blocks": 5, "hits": {"cpu": 1, "nvme": 0, "redis": 0}, "at": 1.0,
           "removed": {"tier": "cpu", "age_s": 2.0}}
    row.update(over)
    return row


def _render(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    render(rows, Console(file=buf, width=200), now=10.0)
    return buf.getvalue()


@pytest.mark.parametrize("row", [_row(blocks="[/oops]"),
                                 _row(hits={"cpu": "[/x]", "nvme": 0, "redis": 0})])
def test_explain_shows_markup_from_the_daemon_as_text(row: dict[str, Any]) -> None:
    """A cell of "[/x]" was a rich MarkupError (found by review)."""
    assert "[/" in _render([row])


@pytest.mark.parametrize("age", [10**400, float("nan"), float("inf")])
def test_explain_refuses_an_age_out_of_range(age: float) -> None:
    """An integer age_s too large for a float was an OverflowError (found by review)."""
    with pytest.raises(MalformedLookup, match="age_s is out of range"):
        _render([_row(removed={"tier": "cpu", "age_s": age})])
