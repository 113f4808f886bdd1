"""Each doctor fixture shows one KV failure pattern; doctor must name exactly that one."""

from __future__ import annotations

import json

import pytest

from kvtier.doctor import add_parser
from kvtier.doctor.collect import Request, collect
from kvtier.doctor.rules import Pattern, diagnose
from kvtier.doctor.signals import derive
from tests.support.cli import run_subcommand
from tests.support.doctor_scenarios import files, scenario_argv

EXPECTED = {
    "long_prompts": Pattern.LONG_PROMPTS_KV_FULL,
    "decode_slows": Pattern.DECODE_SLOWS_WITH_CONTEXT,
    "memory_bound": Pattern.DECODE_MEMORY_BOUND,
    "low_hit_rate": Pattern.LOW_PREFIX_HIT_RATE,
    "fragmentation": Pattern.FRAGMENTATION,
    "preemption": Pattern.PREEMPTION,
    "agent_chain": Pattern.AGENT_CHAIN_TTFT,
    "undersized_p99": Pattern.SIZED_BELOW_P99,
    "tier_pinned": Pattern.TIER_PINNED,
    "tier_down": Pattern.TIER_DOWN,
}


def doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_subcommand(capsys, add_parser, "doctor", *argv)


def test_every_pattern_has_a_fixture() -> None:
    assert set(EXPECTED.values()) == set(Pattern)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_shows_exactly_its_pattern(capsys: pytest.CaptureFixture[str],
                                           name: str) -> None:
    code, out, err = doctor(capsys, *scenario_argv(name), "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["status"] == "findings"
    assert [f["pattern"] for f in doc["findings"]] == [EXPECTED[name].value]
    finding = doc["findings"][0]
    assert finding["number"] == EXPECTED[name].number
    assert finding["evidence"] and finding["cause"] and len(finding["actions"]) >= 2


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_text_report_shows_symptom_evidence_cause_and_change(
        capsys: pytest.CaptureFixture[str], name: str) -> None:
    code, out, _ = doctor(capsys, *scenario_argv(name))
    assert code == 1
    pattern = EXPECTED[name]
    assert f"[{pattern.number}] " in out and f"({pattern.value})" in out
    for label in ("symptom", "evidence", "cause", "change"):
        assert f"    {label} " in out
    others = [p for p in Pattern if p is not pattern]
    assert not any(f"({p.value})" in out for p in others)


def test_healthy_snapshot_reports_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = doctor(capsys, *scenario_argv("healthy"))
    assert code == 0
    assert out.startswith("kvtier doctor: healthy")
    code, out, _ = doctor(capsys, *scenario_argv("healthy"), "--json")
    assert code == 0 and json.loads(out)["findings"] == []


def test_memory_bound_from_gpu_counters_alone() -> None:
    """One scrape with DCGM counters: busy memory, idle tensor cores is enough."""
    got = collect(Request(stats=(), engine=(files("memory_bound", "engine")[-1],),
                          gpu=(files("memory_bound", "gpu")[-1],)))
    found = diagnose(derive(got.engine, got.stats, got.interval_s))
    assert [f.pattern for f in found] == [Pattern.DECODE_MEMORY_BOUND]
    assert "tensor cores busy" in found[0].evidence[0]


def test_memory_bound_from_throughput_alone() -> None:
    """Three scrapes, no GPU counters: the batch doubles, tokens/s does not move."""
    got = collect(Request(stats=(), engine=tuple(files("memory_bound", "engine")),
                          interval_s=10.0))
    found = diagnose(derive(got.engine, got.stats, got.interval_s))
    assert [f.pattern for f in found] == [Pattern.DECODE_MEMORY_BOUND]
    assert any("tokens/s" in e for e in found[0].evidence)


@pytest.mark.parametrize(("name", "pattern"), [
    ("fragmentation", Pattern.FRAGMENTATION),
    ("preemption", Pattern.PREEMPTION),
    ("low_hit_rate", Pattern.LOW_PREFIX_HIT_RATE),
])
def test_kvtier_stats_alone_are_enough_for_its_own_patterns(
        capsys: pytest.CaptureFixture[str], name: str, pattern: Pattern) -> None:
    code, out, _ = doctor(capsys, "--stats", *files(name, "stats"), "--json")
    assert code == 1
    assert [f["pattern"] for f in json.loads(out)["findings"]] == [pattern.value]


def test_healthy_stats_alone_are_healthy(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = doctor(capsys, "--stats", *files("healthy", "stats"))
    assert code == 0


def test_one_sample_skips_trends_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    # The preemption scenario needs a rate: one scrape cannot show it.
    code, out, _ = doctor(capsys, "--engine-metrics", files("preemption", "engine")[-1])
    assert "one sample only" in out
    assert "(preemption)" not in out
    assert code in (0, 1)


def test_interval_from_daemon_uptime(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = doctor(capsys, "--engine-metrics", *files("preemption", "engine"),
                          "--stats", *files("preemption", "stats"), "--json")
    assert code == 1
    assert json.loads(out)["signals"]["interval_s"] == pytest.approx(10.0)

