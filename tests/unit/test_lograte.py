"""LogRate: a peer's events logged at most once per interval per kind, with the count left out."""

from __future__ import annotations

import logging

import pytest

from kvtier.lograte import LogRate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_kind_per_interval_then_the_count_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rate = LogRate(logging.getLogger("kvtier.test.lograte"), every_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvtier.test.lograte"):
        assert rate.warning("a", "event %d", 1)
        assert not any(rate.warning("a", "event %d", i) for i in range(2, 50))
        assert rate.warning("b", "other %s", "x")        # kinds are separate
        clock.now += 10.0
        assert rate.warning("a", "event %d", 50)
        clock.now += 3.0
        assert not rate.warning("a", "event %d", 51)
    assert [r.getMessage() for r in caplog.records] == [
        "event 1", "other x", "event 50 (and 48 more like it in the last 10 s, not logged)"]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
