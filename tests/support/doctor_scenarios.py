"""The doctor fixtures (tests/fixtures/doctor/SCENARIO/{engine,stats,gpu}-*) as command-line
arguments."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"


def files(scenario: str, kind: str) -> list[str]:
    return sorted(str(p) for p in (FIXTURES / scenario).glob(f"{kind}-*"))


def scenario_argv(name: str) -> list[str]:
    argv = ["--engine-metrics", *files(name, "engine"), "--stats", *files(name, "stats"),
            "--interval", "10"]
    if files(name, "gpu"):
        argv += ["--gpu-metrics", *files(name, "gpu")]
    return argv
