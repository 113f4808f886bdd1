"""Rate-limited logs, the retry backoff, the reload-bandwidth estimate and the terminal
helpers pinned where a mutation review found them unwatched."""

from __future__ import annotations

import io
import logging
import math
import random

import pytest
from rich.console import Console

from kvtier import ui
from kvtier.backoff import Backoff, BackoffPolicy
from kvtier.bandwidth import CLIENT, MAX_OPEN_GETS, BandwidthTracker, Ewma
from kvtier.errors import ConfigError
from kvtier.lograte import LogRate

LOGGER = "kvtier.test.survivors.lograte"


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- LogRate ------------------------------------------------------------------------------

def test_the_interval_is_measured_from_the_last_line_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """A kind logs again exactly every_s after its last line, and each line restarts the
    interval: an event every second logs one line per 10 s, not one per second."""
    clock = Clock()
    rate = LogRate(logging.getLogger(LOGGER), every_s=10.0, clock=clock)
    logged = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for t in range(31):
            clock.now = 100.0 + t
            logged.append(rate.warning("k", "event"))
    assert [t for t, ok in enumerate(logged) if ok] == [0, 10, 20, 30]
    assert [r.getMessage() for r in caplog.records][1:] == [
        "event (and 9 more like it in the last 10 s, not logged)"] * 3


def test_kinds_are_limited_separately(caplog: pytest.LogCaptureFixture) -> None:
    rate = LogRate(logging.getLogger(LOGGER), every_s=10.0, clock=Clock())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert rate.warning("a", "a") and rate.warning("b", "b")
        assert not rate.warning("a", "a") and not rate.warning("b", "b")


def test_nothing_left_out_adds_no_count(caplog: pytest.LogCaptureFixture) -> None:
    """A kind that was quiet for an interval logs its plain line again."""
    clock = Clock()
    rate = LogRate(logging.getLogger(LOGGER), every_s=5.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rate.warning("k", "disk %s slow", "sda")
        clock.now += 60.0
        rate.warning("k", "disk %s slow", "sdb")
        clock.now += 2.0
        rate.warning("k", "disk %s slow", "sdc")
        clock.now += 4.5
        rate.warning("k", "disk %s slow", "sdd")
    assert [r.getMessage() for r in caplog.records] == [
        "disk sda slow", "disk sdb slow",
        "disk sdd slow (and 1 more like it in the last 6 s, not logged)"]


# -- backoff ------------------------------------------------------------------------------

def test_attempt_zero_waits_up_to_base_and_each_attempt_multiplies() -> None:
    p = BackoffPolicy(base_s=0.5, cap_s=100.0, factor=3.0, jitter=0.0)
    assert [p.ceiling(n) for n in range(4)] == [0.5, 1.5, 4.5, 13.5]
    assert p.ceiling(10_000) == 100.0   # past float range: capped, never the base
    b = Backoff(p)
    assert [b.next_delay() for _ in range(3)] == [0.5, 1.5, 4.5]
    b.reset()
    assert b.attempts == 0 and b.next_delay() == 0.5


def test_a_jittered_wait_spans_the_whole_documented_range() -> None:
    """Waits are the ceiling times U[1 - jitter, 1]: never above it, and down to half."""
    p = BackoffPolicy(base_s=1.0, cap_s=1.0, jitter=0.5)
    rng = random.Random(7)
    waits = [p.delay(0, rng) for _ in range(2000)]
    assert all(0.5 <= w <= 1.0 for w in waits)
    assert min(waits) < 0.55 and max(waits) > 0.95


@pytest.mark.parametrize("kwargs", [
    {"base_s": 0.0, "cap_s": 1.0}, {"base_s": 2.0, "cap_s": 1.0},
    {"base_s": 1.0, "cap_s": math.inf}, {"base_s": 1.0, "cap_s": 2.0, "factor": 0.5},
    {"base_s": 1.0, "cap_s": 2.0, "factor": math.inf},
    {"base_s": 1.0, "cap_s": 2.0, "factor": math.nan},
    {"base_s": 1.0, "cap_s": 2.0, "jitter": 1.5}, {"base_s": 1.0, "cap_s": 2.0, "jitter": -0.1},
])
def test_policies_outside_the_documented_bounds_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        BackoffPolicy(**kwargs)


def test_the_edges_of_the_bounds_are_accepted() -> None:
    BackoffPolicy(base_s=1.0, cap_s=1.0, factor=1.0, jitter=0.0)
    BackoffPolicy(base_s=1.0, cap_s=1.0, jitter=1.0)
    with pytest.raises(ValueError):
        BackoffPolicy(base_s=1.0, cap_s=1.0).ceiling(-1)


# -- bandwidth ----------------------------------------------------------------------------

def test_the_first_sample_is_the_average_and_later_ones_weigh_alpha() -> None:
    e = Ewma(alpha=0.25)
    e.add(100.0)
    assert e.value == 100.0
    e.add(200.0)
    assert e.value == 0.25 * 200.0 + 0.75 * 100.0


def test_bad_samples_are_ignored() -> None:
    """Under 4096 bytes (latency, not bandwidth), or no positive finite duration: no
    sample (a NaN would poison the average and /v1/stats' JSON, an infinity make it 0)."""
    bw = BandwidthTracker()
    bw.observe("nvme", "cpu", 4095, 1.0)
    for bad in (0.0, -1.0, math.nan, math.inf):
        bw.observe("nvme", "cpu", 1 << 20, bad)
    assert bw.leg("nvme", "cpu") is None and bw.stats() == {}
    bw.observe("nvme", "cpu", 4096, 1.0)   # the smallest sample that counts
    assert bw.leg("nvme", "cpu") == 4096.0
    with pytest.raises(ValueError):
        BandwidthTracker(alpha=0.0)


def test_a_get_is_timed_from_grant_to_release_on_its_own_tier() -> None:
    clock = Clock(10.0)
    bw = BandwidthTracker(alpha=1.0, clock=clock)
    bw.get_started(1, 1 << 20, tier="hbm")
    clock.now = 12.0
    bw.get_finished(1, copy_s=8.0)   # a copy longer than the hold: the hold counts
    assert bw.leg("hbm", CLIENT) == (1 << 20) / 2.0
    assert bw.reload_bandwidth() == {"hbm": (1 << 20) / 2.0}
    bw.get_started(2, 1 << 20)
    clock.now = 14.0
    bw.get_finished(2, copy_s=-1.0)   # a nonsense copy time: the hold counts
    assert bw.leg("cpu", CLIENT) == (1 << 20) / 2.0


def test_the_oldest_open_get_is_forgotten_first() -> None:
    clock = Clock(0.0)
    bw = BandwidthTracker(alpha=1.0, clock=clock)
    for lease in range(MAX_OPEN_GETS + 1):
        bw.get_started(lease, 1 << 20)
    clock.now = 1.0
    bw.get_finished(0)                  # the oldest was dropped: nothing measured
    assert bw.leg("cpu", CLIENT) is None
    bw.get_finished(1)                  # the second oldest is still there
    bw.get_finished(MAX_OPEN_GETS)      # and the newest
    assert bw.leg("cpu", CLIENT) == float(1 << 20)


def test_redis_reload_is_its_promotion_in_series_with_the_serve_leg() -> None:
    bw = BandwidthTracker(alpha=1.0)
    bw.observe("redis", "cpu", 1 << 20, 1.0)
    bw.observe("cpu", CLIENT, 1 << 20, 1.0)
    assert bw.reload_bandwidth()["redis"] == pytest.approx((1 << 20) / 2.0)
    assert bw.stats() == {"cpu->client": 1048576.0, "redis->cpu": 1048576.0}
    bw.observe("nvme", "cpu", 3 * 4096, 7.0)
    assert bw.stats()["nvme->cpu"] == round(3 * 4096 / 7.0, 1)


# -- ui -----------------------------------------------------------------------------------

def test_a_piped_console_is_plain_and_200_wide() -> None:
    c = ui.console(io.StringIO())
    assert c.width == ui.PIPE_WIDTH and c.no_color and not c.is_terminal


def test_table_right_aligns_only_the_numeric_columns_and_keeps_markup() -> None:
    buf = io.StringIO()
    Console(file=buf, width=80).print(ui.table(["[name]", "n"], [["a", "1"], ["bbbbbb", "22"]],
                                               right=[1]))
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("[name]")
    assert lines[1].endswith(" 1") and lines[2].endswith("22")
    assert lines[1].startswith("a ") and "│" not in buf.getvalue()


def test_a_long_cell_is_not_wrapped() -> None:
    buf = io.StringIO()
    Console(file=buf, width=20).print(ui.table(["k", "v"], [["key", "word " * 8]]))
    assert len(buf.getvalue().splitlines()) == 2   # header and one line: greppable


def test_progress_goes_to_stderr_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """stdout is for the command's result (--json): the bar never lands there."""
    with ui.progress(3, "copy", enabled=True) as advance:
        advance(3)
    out, err = capsys.readouterr()
    assert out == "" and "3/3" in err


def test_progress_advances_by_n_on_its_own_stream() -> None:
    err = io.StringIO()
    with ui.progress(10, "copy", enabled=True, file=err) as advance:
        advance(4)
        advance(6)
    assert "10/10" in err.getvalue()
    with ui.progress(0, "empty", enabled=True, file=err) as advance:
        advance(1)
    assert "1/1" in err.getvalue()
