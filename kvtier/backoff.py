"""Capped exponential backoff with jitter: the one retry schedule of kvtier.

Used wherever a part of the daemon waits before trying something that just failed again:
the redis tier's reconnect loop and the nvme tier's space probe while it is degraded.
Attempt ``n`` (0-based) waits ``min(base_s * factor**n, cap_s)`` scaled by a uniform draw
from ``[1 - jitter, 1]``, so many waiters that failed together do not retry together, and
no wait ever exceeds ``cap_s``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvtier.errors import ConfigError

__all__ = ["Backoff", "BackoffPolicy"]


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """The schedule: first ceiling ``base_s``, times ``factor`` per attempt, at most ``cap_s``;
    each wait is the ceiling times a uniform draw from ``[1 - jitter, 1]``."""

    base_s: float
    cap_s: float
    factor: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_s) and math.isfinite(self.cap_s)
                and 0 < self.base_s <= self.cap_s):
            raise ConfigError(f"backoff needs 0 < base ({self.base_s} s) <= cap "
                              f"({self.cap_s} s)")
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ConfigError(f"backoff factor must be >= 1, got {self.factor}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ConfigError(f"backoff jitter must be within [0, 1], got {self.jitter}")

    def ceiling(self, attempt: int) -> float:
        """The longest wait of attempt ``attempt`` (0-based): the capped exponential."""
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        try:
            return min(self.base_s * self.factor ** attempt, self.cap_s)
        except OverflowError:   # factor**attempt past float range: long since capped
            return self.cap_s

    def delay(self, attempt: int, rng: random.Random) -> float:
        """One jittered wait for attempt ``attempt``, drawn from ``rng``."""
        return self.ceiling(attempt) * rng.uniform(1.0 - self.jitter, 1.0)


class Backoff:
    """The state of one retry loop: ``next_delay()`` after each failure, ``reset()`` after a
    success. Not thread-safe (each loop owns its own)."""

    __slots__ = ("_rng", "attempts", "policy")

    def __init__(self, policy: BackoffPolicy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.attempts = 0
        self._rng = rng if rng is not None else random.Random()

    def next_delay(self) -> float:
        """Seconds to wait before the next try; each call moves one attempt further."""
        delay = self.policy.delay(self.attempts, self._rng)
        self.attempts += 1
        return delay

    def reset(self) -> None:
        """Start over from ``base_s`` (the thing being retried worked)."""
        self.attempts = 0
