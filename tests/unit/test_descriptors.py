"""The daemon's open-file budget (kvtier.daemon.descriptors): the soft limit is raised to
fit the configured connections, or the control connections are cut to what fits."""

from __future__ import annotations

import logging
import resource

import pytest

from kvtier.daemon.descriptors import MIN_CONNECTIONS, RESERVED_FDS, fit_connections
from kvtier.errors import StartupError

INF = resource.RLIM_INFINITY


class Limit:
    """A fake RLIMIT_NOFILE: what was asked, and the hard limit's rule."""

    def __init__(self, soft: int, hard: int) -> None:
        self.now = (soft, hard)
        self.asked: list[tuple[int, int]] = []

    def get(self) -> tuple[int, int]:
        return self.now

    def set(self, lim: tuple[int, int]) -> None:
        self.asked.append(lim)
        soft, hard = lim
        if hard != INF and soft > hard:
            raise ValueError("not allowed to raise maximum limit")
        self.now = lim


def test_a_limit_that_fits_is_left_alone() -> None:
    lim = Limit(100_000, 100_000)
    assert fit_connections(1024, 272, get=lim.get, set_=lim.set) == 1024
    assert lim.asked == []


@pytest.mark.parametrize("hard", [1 << 20, INF])
def test_a_shell_s_soft_limit_is_raised_as_far_as_the_connections_need(hard: int) -> None:
    """A shell's 1024 is below the default max_connections alone (found by review: idle
    connections ran the daemon out of descriptors before the limit refused any)."""
    lim = Limit(1024, hard)
    assert fit_connections(1024, 272, get=lim.get, set_=lim.set) == 1024
    assert lim.now == (1024 + 272 + RESERVED_FDS, hard)


def test_a_low_hard_limit_cuts_the_control_connections_and_says_how_to_fix_it(
        caplog: pytest.LogCaptureFixture) -> None:
    lim = Limit(1024, 1024)
    with caplog.at_level(logging.WARNING, "kvtier.daemon"):
        fit = fit_connections(1024, 272, get=lim.get, set_=lim.set)
    assert fit == 1024 - 272 - RESERVED_FDS
    assert "fits 496 of daemon.max_connections=1024" in caplog.text
    assert "ulimit -n 1552" in caplog.text


def test_a_limit_that_leaves_no_room_is_one_startup_error() -> None:
    lim = Limit(300, 300)
    with pytest.raises(StartupError) as err:
        fit_connections(1024, 272, get=lim.get, set_=lim.set)
    assert "ulimit -n" in str(err.value) and "\n" not in str(err.value)
    assert 300 - 272 - RESERVED_FDS < MIN_CONNECTIONS
