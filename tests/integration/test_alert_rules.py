"""deploy/prometheus/alerts.yml through the real promtool (Debian's `prometheus` package).

`promtool check rules` parses every expression; `promtool test rules` replays synthetic
series per alert: each alert must fire on its failure and stay quiet on the healthy
variant (alerts.test.yml, generated from the cases in gen_alert_tests.py). That the metric
names exist in a real daemon's /metrics is checked in test_prometheus_dashboard.py.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
TESTS = ROOT / "deploy" / "prometheus" / "alerts.test.yml"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: `make test` installs it (apt-get install prometheus)")
    return path


def test_rules_parse() -> None:
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    n = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert f"SUCCESS: {n} rules found" in out.stdout


def test_every_alert_fires_on_its_failure_and_not_when_healthy() -> None:
    out = subprocess.run([promtool(), "test", "rules", TESTS.name], cwd=TESTS.parent,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    tests = yaml.safe_load(TESTS.read_text())["tests"]
    cases = [t["alert_rule_test"][0] for t in tests]
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"]}
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == alerts
    assert {c["alertname"] for c in cases if not c["exp_alerts"]} == alerts


def test_alert_tests_are_generated_from_the_current_rules() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_alert_tests", ROOT / "deploy" / "prometheus" / "gen_alert_tests.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen   # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(gen)
    finally:
        del sys.modules[spec.name]
    assert gen.build() == TESTS.read_text(), \
        "alerts.test.yml is stale: run python deploy/prometheus/gen_alert_tests.py"


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """promtool really compares: a quiet case that expects the alert must fail."""
    doc = yaml.safe_load(TESTS.read_text())
    firing = next(t for t in doc["tests"] if t["alert_rule_test"][0]["exp_alerts"])
    firing["alert_rule_test"][0]["exp_alerts"] = []
    doc["tests"] = [firing]
    shutil.copy(RULES, tmp_path / "alerts.yml")
    (tmp_path / "t.yml").write_text(yaml.safe_dump(doc))
    out = subprocess.run([promtool(), "test", "rules", "t.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr
