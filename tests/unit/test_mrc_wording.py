"""``kvtier plan --live-stats`` says what each size does to the hit rate: raise, lower, or
keep it. Found by review: "a cpu tier of 64.0 MiB (0.25x) would raise its token hit rate
from 13.4% to 13.4%" (it said "raise" whenever the rate did not drop)."""

from __future__ import annotations

from typing import Any

from kvtier.policy.mrc import plan_lines


def stats(curve: list[tuple[float, float]]) -> dict[str, Any]:
    return {"tiers": {"cpu": {"capacity_bytes": 256 * 2**20}},
            "policy": {"tiers": {"cpu": {"mrc": [{"scale": s, "hit_rate": h}
                                                 for s, h in curve]}}}}


def test_equal_lower_and_higher_rates_are_worded_as_they_are() -> None:
    lines = plan_lines(stats([(0.25, 0.134), (0.5, 0.1340004), (1.0, 0.134), (2.0, 0.2),
                              (4.0, 0.1)]))
    assert lines == [
        "a cpu tier of 64.0 MiB (0.25x) would keep its token hit rate at 13.4% on this "
        "node's live workload",
        "a cpu tier of 128.0 MiB (0.5x) would keep its token hit rate at 13.4% on this "
        "node's live workload",
        "a cpu tier of 512.0 MiB (2x) would raise its token hit rate from 13.4% to 20.0% on "
        "this node's live workload",
        "a cpu tier of 1.0 GiB (4x) would lower its token hit rate from 13.4% to 10.0% on "
        "this node's live workload",
    ]
    assert not any("from 13.4% to 13.4%" in line for line in lines)
