"""What README.md, docs/operations.md, docs/adaptive-policy.md and the alert rules say about
doctor, plan and the adaptive policy agrees with the code. Each was found wrong by review:
README listed 8 of doctor's "ten" patterns; the fragmentation alert fired under 80% used
while doctor's pattern 5 (and the docs) say 90%; the ``doctor --env`` example had 10 of 12
rows; the README's ``kvtier plan --trace`` example failed (``--model`` is required);
adaptive-policy.md named a counter without its ``_total``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

from kvtier.config import load_config
from kvtier.daemon.metrics import KVTierCollector
from kvtier.doctor.env import Host, run_checks
from kvtier.doctor.patterns import Pattern, Thresholds
from kvtier.plan.cli import add_parser as add_plan
from tests.support.cli import run_subcommand

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
NUMBERS = {8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}


def pattern_rows(doc: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"^\| (\d+) \| .*$", doc, re.M)}


def test_readme_lists_every_doctor_pattern_it_counts() -> None:
    n = len(Pattern)
    assert sorted(pattern_rows(README)) == list(range(1, n + 1))
    assert f"reports each of {NUMBERS[n]} KV failure patterns" in " ".join(README.split())
    assert sorted(pattern_rows(OPERATIONS)) == list(range(1, n + 1))
    assert f"The {NUMBERS[n]} patterns" in OPERATIONS


def test_one_tier_full_threshold_in_doctor_docs_and_alerts() -> None:
    """Allocation failures split at ``tier_full``: below it fragmentation (5), at or above
    a pinned full tier (9), in doctor, both docs and both alerts alike."""
    pct = f"{Thresholds().tier_full:.0%}"
    for doc in (README, OPERATIONS):
        rows = pattern_rows(doc)
        assert f"allocation failures on a tier under {pct} used" in rows[5]
        assert f"allocation failures on a tier >= {pct} used" in rows[9]
    rules = {r["alert"]: r for g in yaml.safe_load(
        (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]}
    for name in ("KVTierFragmentation", "KVTierAllocationFailures"):
        limits = re.findall(r"kvtier_tier_capacity_bytes < ([0-9.]+)", rules[name]["expr"])
        assert limits and all(float(x) == Thresholds().tier_full for x in limits), name
    assert f"under {pct} used" in rules["KVTierFragmentation"]["annotations"]["summary"]
    assert "unless on" in rules["KVTierAllocationFailures"]["expr"]   # 9's, not 5's


def test_doctor_env_example_has_every_check_of_a_node_without_a_gpu(tmp_path: Path) -> None:
    """The example in operations.md ("Checking a node") is a run with the defaults on a
    machine without a GPU: the same rows run_checks gives there, and counts that add up."""
    block = OPERATIONS.split("$ kvtier doctor --env --no-daemon\n", 1)[1].split("```", 1)[0]
    shown = re.findall(r"^│ (\S[^│]*?)\s*│ (OK|WARN|FAIL|SKIP)\s*│", block, re.M)
    cfg = load_config(None, env={}, overrides={"daemon.data_dir": str(tmp_path / "d")})
    host = Host(gpu=lambda: (False, "no driver"), kvikio_mode=lambda: None,
                o_direct=lambda d: None)
    assert [name for name, _ in shown] == [c.name for c in run_checks(cfg, host)]
    summary = re.search(r"^ok (\d+) warn (\d+) fail (\d+) skip (\d+)$", block, re.M)
    assert summary is not None
    counts = dict(zip(("OK", "WARN", "FAIL", "SKIP"), map(int, summary.groups()), strict=True))
    assert counts == {v: sum(1 for _, got in shown if got == v) for v in counts}
    table = re.findall(r"^\| ([a-z][a-zA-Z_ ]+?) \| ", OPERATIONS.split(
        "## Checking a node", 1)[1].split("Exit status", 1)[0], re.M)
    assert {name for name, _ in shown} <= set(table)


def test_adaptive_policy_doc_names_the_exported_metrics() -> None:
    doc = (ROOT / "docs" / "adaptive-policy.md").read_text()
    named = set(re.findall(r"`(kvtier_policy_\w+)\{", doc))
    stats = {"policy": {"tiers": {"cpu": {"mode": "lru", "switches": 2, "modes": {"lru": 0.5},
                                          "mrc": [{"scale": 1.0, "hit_rate": 0.5}]}}}}
    exported = {s.name for m in KVTierCollector(lambda: stats).collect()
                if m.name.startswith("kvtier_policy_") for s in m.samples}
    assert named and named <= exported, named - exported
    assert "kvtier_policy_mode_switches_total" in named


@pytest.mark.parametrize("command", sorted({" ".join(c.split()) for c in re.findall(
    r"`(kvtier plan [^`]*--trace[^`]*)`", README)}))
def test_readme_plan_trace_examples_run(capsys: pytest.CaptureFixture[str], command: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    code, out, err = run_subcommand(capsys, add_plan, *command.split()[1:])
    assert code == 0, err
    assert "recommended kvtier tiers" in out


def test_readme_stats_columns_match_its_text() -> None:
    """README: hits in blocks and tokens, misses in blocks: the columns `kvtier stats`
    shows (its miss tokens are in --json only)."""
    from kvtier.cli import render_stats

    shown = render_stats({"daemon": {"uptime_s": 1}, "requests": {"prefix_hit_rate": 0},
                          "tiers": {"cpu": {"capacity_bytes": 1, "used_bytes": 0,
                                            "evictions": {}, "bytes_read": 0,
                                            "bytes_written": 0}}})
    header = shown.splitlines()[1]
    assert "hit blk" in header and "hit tok" in header and "miss" in header
    assert "miss tok" not in header
    assert "hits (blocks and tokens), misses (blocks)," in " ".join(README.split())
