"""Prometheus histograms: difference of two scrapes, mean and quantiles.

A quantile is interpolated linearly inside its bucket, as PromQL's
``histogram_quantile`` does, so doctor and a Grafana panel agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative bucket counts by upper bound (the last bound is +Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    total: float
    count: float

    def minus(self, older: Histogram) -> Histogram:
        """Observations made between ``older`` and this scrape (a counter reset gives self)."""
        if older.bounds != self.bounds or older.count > self.count:
            return self
        return Histogram(self.bounds,
                         tuple(a - b for a, b in zip(self.counts, older.counts, strict=True)),
                         self.total - older.total, self.count - older.count)

    def plus(self, other: Histogram) -> Histogram:
        """Merge two series with the same buckets (e.g. two engines); else keep self."""
        if other.bounds != self.bounds:
            return self
        return Histogram(self.bounds,
                         tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
                         self.total + other.total, self.count + other.count)

    def mean(self) -> float | None:
        """Mean observation, or None when nothing was observed."""
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) by linear interpolation within the bucket."""
        if self.count <= 0 or not self.bounds:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.counts, strict=True):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower  # beyond the last finite bucket: report its bound
                in_bucket = cumulative - below
                if in_bucket <= 0:
                    return bound
                return lower + (bound - lower) * (rank - below) / in_bucket
            lower, below = bound, cumulative
        return lower
