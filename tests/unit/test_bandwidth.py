"""The daemon's reload-bandwidth tracker (pure bookkeeping, fake clock)."""

from __future__ import annotations

import pytest

from kvtier.bandwidth import CLIENT, MAX_OPEN_GETS, MIN_SAMPLE_BYTES, BandwidthTracker

MB = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_unmeasured_tiers_are_absent() -> None:
    assert BandwidthTracker().reload_bandwidth() == {}


def test_tiny_transfers_are_not_samples() -> None:
    bw = BandwidthTracker()
    bw.observe("nvme", "cpu", MIN_SAMPLE_BYTES - 1, 1e-6)
    bw.observe("nvme", "cpu", 10 * MB, 0.0)
    assert bw.leg("nvme", "cpu") is None


def test_ewma_weighs_the_newest_sample() -> None:
    bw = BandwidthTracker(alpha=0.5)
    bw.observe("nvme", "cpu", 100 * MB, 1.0)
    assert bw.leg("nvme", "cpu") == pytest.approx(100 * MB)
    bw.observe("nvme", "cpu", 300 * MB, 1.0)
    assert bw.leg("nvme", "cpu") == pytest.approx(200 * MB)


def test_promoted_tiers_compose_with_the_serve_leg_in_series() -> None:
    bw = BandwidthTracker()
    bw.observe("redis", "cpu", 100 * MB, 1.0)
    assert bw.reload_bandwidth() == {"redis": pytest.approx(100 * MB)}
    bw.observe("cpu", CLIENT, 100 * MB, 1.0)
    bw.observe("nvme", "cpu", 300 * MB, 1.0)
    rates = bw.reload_bandwidth()
    assert rates["cpu"] == pytest.approx(100 * MB)
    assert rates["nvme"] == pytest.approx(75 * MB)      # 1 / (1/300 + 1/100)
    assert rates["redis"] == pytest.approx(50 * MB)
    assert bw.stats()["nvme->cpu"] == pytest.approx(300 * MB)


def test_served_gets_measure_the_copy_or_the_hold_time() -> None:
    clock = Clock()
    bw = BandwidthTracker(alpha=1.0, clock=clock)
    bw.get_started(1, 10 * MB)
    clock.now = 2.0
    bw.get_finished(1)                                   # hold time
    assert bw.leg("cpu", CLIENT) == pytest.approx(5 * MB)
    bw.get_started(2, 10 * MB)
    clock.now = 4.0
    bw.get_finished(2, copy_s=0.5)                       # the client's own copy time
    assert bw.leg("cpu", CLIENT) == pytest.approx(20 * MB)
    bw.get_started(3, 10 * MB)
    clock.now = 5.0
    bw.get_finished(3, copy_s=100.0)                     # never longer than held
    assert bw.leg("cpu", CLIENT) == pytest.approx(10 * MB)


def test_abandoned_and_unknown_gets_measure_nothing() -> None:
    clock = Clock()
    bw = BandwidthTracker(clock=clock)
    bw.get_started(1, 10 * MB, "hbm")
    clock.now = 1.0
    bw.get_abandoned(1)
    bw.get_finished(1)
    bw.get_finished(99)
    assert bw.reload_bandwidth() == {}


def test_open_gets_are_bounded() -> None:
    bw = BandwidthTracker()
    for i in range(MAX_OPEN_GETS + 10):
        bw.get_started(i, MB)
    assert len(bw._open) == MAX_OPEN_GETS
