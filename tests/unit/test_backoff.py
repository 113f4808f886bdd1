"""kvtier.backoff: capped exponential waits with jitter, the one retry schedule."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.backoff import Backoff, BackoffPolicy
from kvtier.errors import ConfigError
from kvtier.tiers.redis import RECONNECT_BACKOFF


def test_ceilings_double_from_base_up_to_the_cap() -> None:
    policy = BackoffPolicy(base_s=0.05, cap_s=5.0)
    assert [policy.ceiling(n) for n in range(9)] == pytest.approx(
        [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    assert policy.ceiling(10_000) == 5.0            # no overflow far past the cap


def test_waits_are_jittered_below_the_ceiling_and_reset_starts_over() -> None:
    backoff = Backoff(BackoffPolicy(base_s=1.0, cap_s=8.0, jitter=0.5), random.Random(3))
    waits = [backoff.next_delay() for _ in range(6)]
    for n, wait in enumerate(waits):
        ceiling = min(2.0 ** n, 8.0)
        assert ceiling * 0.5 <= wait <= ceiling
    assert len(set(waits)) == len(waits)            # jittered, not a fixed ladder
    assert backoff.attempts == 6
    backoff.reset()
    assert backoff.attempts == 0 and 0.5 <= backoff.next_delay() <= 1.0


def test_seeded_waits_repeat_and_no_jitter_is_exact() -> None:
    policy = BackoffPolicy(base_s=0.1, cap_s=1.0)
    a = Backoff(policy, random.Random(7))
    b = Backoff(policy, random.Random(7))
    assert [a.next_delay() for _ in range(5)] == [b.next_delay() for _ in range(5)]
    exact = Backoff(BackoffPolicy(base_s=0.1, cap_s=1.0, factor=3.0, jitter=0.0))
    assert [exact.next_delay() for _ in range(4)] == pytest.approx([0.1, 0.3, 0.9, 1.0])


@pytest.mark.parametrize("kwargs", [
    {"base_s": 0.0, "cap_s": 1.0},
    {"base_s": 2.0, "cap_s": 1.0},
    {"base_s": float("nan"), "cap_s": 1.0},
    {"base_s": 0.1, "cap_s": float("inf")},
    {"base_s": 0.1, "cap_s": 1.0, "factor": 0.5},
    {"base_s": 0.1, "cap_s": 1.0, "jitter": 1.5},
])
def test_bad_policies_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        BackoffPolicy(**kwargs)


def test_the_redis_reconnect_schedule_is_unchanged() -> None:
    """0.05 s doubling to 5 s, each wait drawn from [half, all] of its ceiling (as before)."""
    assert BackoffPolicy(base_s=0.05, cap_s=5.0, factor=2.0, jitter=0.5) == RECONNECT_BACKOFF


@given(base=st.floats(1e-3, 10.0), cap_mult=st.floats(1.0, 1e3), factor=st.floats(1.0, 4.0),
       jitter=st.floats(0.0, 1.0), seed=st.integers(0, 2**32 - 1))
def test_waits_never_exceed_the_cap_and_ceilings_never_shrink(
        base: float, cap_mult: float, factor: float, jitter: float, seed: int) -> None:
    policy = BackoffPolicy(base, base * cap_mult, factor, jitter)
    backoff = Backoff(policy, random.Random(seed))
    last = 0.0
    for n in range(80):
        ceiling = policy.ceiling(n)
        assert last <= ceiling <= policy.cap_s
        wait = backoff.next_delay()
        assert ceiling * (1.0 - jitter) - 1e-12 <= wait <= ceiling
        last = ceiling
