"""OPTgen's labels against a brute-force reference, its bounded memory, and the workload
statistics' counting rules (mutation review of kvtier.policy.hindsight and .stats)."""

from __future__ import annotations

import random

import pytest

from kvtier.policy.hindsight import BUCKETS_PER_CAPACITY, HindsightStats
from kvtier.policy.stats import (
    FRESH_BEHIND_HIT,
    FRESH_NO_HIT,
    HIT,
    OUT_UNKNOWN,
    WorkloadStats,
    output_bucket,
)


class RefOptgen:
    """OPTgen with an unbounded occupancy map: the labels the sliding vector must give."""

    def __init__(self, cap: int, window_caps: float) -> None:
        self.cap = cap
        self.window = max(1, int(window_caps * cap))
        self.q = max(1, cap // BUCKETS_PER_CAPACITY)
        self.occ: dict[int, int] = {}

    def hit(self, last: int, tick: int) -> bool:
        if tick - last > self.window:
            return False
        buckets = range(last // self.q, tick // self.q)
        if any(self.occ.get(b, 0) >= self.cap for b in buckets):
            return False
        for b in buckets:
            self.occ[b] = self.occ.get(b, 0) + 1
        return True


@pytest.mark.parametrize("cap, window_caps", [(3, 4.0), (256, 2.0), (1000, 2.5), (40, 1.0)])
def test_optgen_labels_as_an_unbounded_occupancy_map_does(cap: int, window_caps: float) -> None:
    """Through many slides of the vector, every label is the brute-force one (a vector
    too short, or slid by one bucket too few or too many, loses or keeps room wrongly),
    and the vector never grows."""
    rng = random.Random(cap)
    s = HindsightStats(capacity_blocks=cap, window_capacities=window_caps)
    ref = RefOptgen(cap, window_caps)
    size = len(s._occ)
    tick = 0
    for _ in range(4000):
        tick += rng.randint(1, max(1, cap // 3))
        last = tick - rng.randint(0, int(window_caps * cap * 1.2) + 1)
        assert s.opt_hit(max(last, 0), tick) == ref.hit(max(last, 0), tick), tick
    assert tick > 20 * window_caps * cap and len(s._occ) == size


def test_optgen_window_is_the_given_number_of_capacities() -> None:
    s = HindsightStats(capacity_blocks=100, window_capacities=2.5)
    assert s.opt_hit(0, 250) and not s.opt_hit(0, 251)


def test_optgen_quantum_is_a_128th_of_the_capacity() -> None:
    """At 256 blocks a bucket is 2 references: 256 intervals over ten references fill the
    cache over them, and one more overlapping them is no hit."""
    s = HindsightStats(capacity_blocks=256, window_capacities=4)
    assert all(s.opt_hit(0, 10) for _ in range(256))
    assert not s.opt_hit(2, 8)
    assert s.opt_hit(10, 12)


def test_telling_the_same_capacity_again_keeps_the_vector() -> None:
    s = HindsightStats(capacity_blocks=1, window_capacities=1000)
    assert s.opt_hit(0, 4)
    s.set_capacity(1)
    assert not s.opt_hit(1, 3)   # the cache of one block is still taken over [0, 4)


def test_the_history_of_learned_keys_is_bounded() -> None:
    """However many distinct blocks go by, the records kept stay within ``history``."""
    s = HindsightStats(capacity_blocks=64, horizon=1000, history=100)
    for i in range(50):
        s.on_lookup(list(range(i * 30, i * 30 + 30)), 0)
    assert len(s) == 100


# ------------------------------------------------------------------ WorkloadStats


def _cls(stats: WorkloadStats, key: int) -> int:
    return stats._hist[key].cls


def _hit_of(cls: int) -> int:
    return cls // 8 % 4


def test_the_hit_feature_splits_at_the_hit_prefix() -> None:
    """The first ``hit_blocks`` keys are hits, those behind them fresh behind a hit; a
    request that hit nothing is fresh without a hit."""
    s = WorkloadStats()
    s.on_lookup([1, 2, 3], 2)
    assert [_hit_of(_cls(s, k)) for k in (1, 2, 3)] == [HIT, HIT, FRESH_BEHIND_HIT]
    s.on_lookup([4, 5], 0)
    assert [_hit_of(_cls(s, k)) for k in (4, 5)] == [FRESH_NO_HIT, FRESH_NO_HIT]


def test_output_buckets() -> None:
    assert output_bucket(None) == output_bucket(-1) == OUT_UNKNOWN
    assert output_bucket(0) == 0 and output_bucket(1) == 1 and output_bucket(3) == 2
    assert output_bucket(10**9) == OUT_UNKNOWN - 1


def test_a_store_after_its_lookup_is_not_counted_twice() -> None:
    """on_stored after on_lookup refines the reference once; a second store report of the
    same chain is a new reference (the request came back), counted once."""
    s = WorkloadStats()
    s.on_lookup([1, 2], 0)
    s.on_stored([1, 2], output_tokens=5, now=0.0)
    assert s.tick == 2 and s.uses(1) == 1
    assert _cls(s, 1) // (5 * 4 * 8) % 16 == output_bucket(5)
    s.on_stored([1, 2], output_tokens=5, now=0.0)
    assert s.tick == 4 and s.uses(1) == 2


def test_a_store_refines_the_class_counts_it_moves() -> None:
    """The reference moved to its refined class leaves the coarse one's access count."""
    a, b = WorkloadStats(), WorkloadStats()
    a.on_lookup([1, 2, 3], 1)
    a.on_stored([1, 2, 3], output_tokens=100, now=0.0)
    b.on_request([1, 2, 3], 1, output_tokens=100)
    assert a._access == pytest.approx(b._access, abs=1e-9)
    assert [a._hist[k].cls for k in (1, 2, 3)] == [b._hist[k].cls for k in (1, 2, 3)]


def test_on_request_with_a_chain_longer_than_the_history_takes_the_two_calls() -> None:
    a, b = WorkloadStats(history=4), WorkloadStats(history=4)
    keys = list(range(6))
    a.on_request(keys, 2, output_tokens=7)
    b.on_lookup(keys, 2)
    b.on_stored(keys, output_tokens=7)
    assert a.tick == b.tick and a._access == b._access and list(a._hist) == list(b._hist)


def test_uses_bucket_three_to_four() -> None:
    s = WorkloadStats()
    for _ in range(4):
        s.on_lookup([1], 0)
    assert _cls(s, 1) // (16 * 5 * 4 * 8) == 2
    s.on_lookup([1], 0)
    assert _cls(s, 1) // (16 * 5 * 4 * 8) == 3


def test_a_key_s_own_record_counts_every_resolved_reference() -> None:
    """A key reused every time has tried == reused (its estimate near 1), and one reused
    past the horizon has tried > 0 with no reuse."""
    s = WorkloadStats(horizon=10, half_life=1e12)
    for _ in range(5):
        s.on_lookup([1], 0)
    rec = s._hist[1]
    assert rec.tried == pytest.approx(4.0) and rec.reused == pytest.approx(4.0)
    p = s.reuse_probability(1)
    k = 2.0
    cls_p = s.class_probability(rec.cls)
    assert p == pytest.approx((4.0 + k * cls_p) / (4.0 + k))


def test_the_horizon_is_inclusive() -> None:
    s = WorkloadStats(horizon=3, half_life=1e12)
    s.on_lookup([1, 2, 3], 0)
    s.on_lookup([1], 0)   # 3 references later: within the horizon
    assert s._hist[1].reused == pytest.approx(1.0)


def test_an_unknown_key_is_the_prior_at_half_the_horizon() -> None:
    s = WorkloadStats(horizon=1000, prior=0.3)
    assert s.reuse_estimate(42) == (0.3, 500.0)


def test_a_hot_key_stays_in_the_history() -> None:
    """The history is an LRU of records: a key referenced again moves to its recent end."""
    s = WorkloadStats(history=3)
    s.on_lookup([1], 0)
    s.on_lookup([2], 0)
    s.on_lookup([1], 0)
    s.on_lookup([3], 0)
    s.on_lookup([4], 0)
    assert list(s._hist) == [1, 3, 4]


@pytest.mark.parametrize("kw", [{"key_strength": 0.0}, {"strength": -1.0}, {"horizon": 0},
                                {"prior": 1.5}, {"prior": -0.1}])
def test_bad_parameters_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        WorkloadStats(**kw)  # type: ignore[arg-type]


def test_a_prior_of_zero_or_one_is_a_probability() -> None:
    assert WorkloadStats(prior=0.0).prior == 0.0 and WorkloadStats(prior=1.0).prior == 1.0


def test_estimates_survive_the_scale_renormalisation() -> None:
    """The counts' growing scale is renormalised past 1e200, each key's weight with them
    (else an old key's reuse adds a weight 1e200 times too large: a rate above 1)."""
    s = WorkloadStats(half_life=1.0)
    s.on_lookup([1, 2], 0)
    for i in range(1000):   # 2 ** 700 > 1e200: renormalised
        s.on_lookup([1000 + i], 0)
    assert s._scale < 1e200 and s._hist[2].w < 1e-100
    s.on_lookup([2], 0)
    cls = s._hist[2].cls
    assert 0.0 <= s.reuse_probability(2) <= 1.0
    assert all(0.0 <= s.class_probability(c) <= 1.0 for c in (cls, s._hist[1].cls))
