"""Shadow caches: exact capacity and hit accounting, sizing, the curve, and the switching
rule (mutation review of kvtier.policy.shadow)."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.policy.base import EvictionPolicy, Key
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.shadow import (
    MAX_RATE,
    MRC_SCALES,
    ShadowCache,
    TierShadows,
    sampling_rate,
)


class MRU:
    """Evicts the most recently used block (the hit prefix, touched last, goes first)."""

    name = "mru"

    def __init__(self) -> None:
        self.order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, *, nbytes: int = 0, parent: Key | None = None, depth: int = 0,
               now: float = 0.0, block_tokens: int = 0) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def touch(self, key: Key, *, now: float = 0.0) -> None:
        if key in self.order:
            self.order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.order.pop(key, None)

    def victim(self) -> Key | None:
        return next(reversed(self.order), None)

    def set_pinned(self, key: Key, pinned: bool) -> None:
        pass

    def __contains__(self, key: object) -> bool:
        return key in self.order

    def __len__(self) -> int:
        return len(self.order)


def _chain(keys: Sequence[int], tokens: int = 1) -> list[tuple[Key, int, int]]:
    return [(k, d, tokens) for d, k in enumerate(keys)]


def _lru(mode: str) -> EvictionPolicy:
    return LRUPolicy()


# ------------------------------------------------------------------ ShadowCache


def test_a_chain_longer_than_the_shadow_keeps_exactly_its_capacity() -> None:
    """A shadow never holds more blocks than its slots (its head, inserted last, stays)."""
    pol = LRUPolicy()
    cache = ShadowCache(pol, 3)
    cache.access(_chain(range(1, 6)), 0.0, 5)
    assert cache.resident == {1, 2, 3} and len(pol) == 3


def test_a_full_shadow_makes_room_before_it_inserts() -> None:
    """Room is made before the new blocks reach the policy (the store allocates first), so
    a block of the request is never its own victim and the shadow stays exactly full."""
    pol = MRU()
    cache = ShadowCache(pol, 3)
    cache.access(_chain([1, 2, 3]), 0.0, 3)
    cache.access(_chain([7]), 0.0, 1)   # MRU: head 1 goes, and its chain with it
    assert cache.resident == {7} and set(pol.order) == {7}
    cache.access(_chain([8, 9]), 0.0, 2)
    assert cache.resident == {7, 8, 9} and cache.hits == 0


def test_evicted_orphans_leave_the_policy_and_the_residency() -> None:
    pol = MRU()
    cache = ShadowCache(pol, 3)
    cache.access(_chain([1, 2, 3]), 0.0, 3)
    cache.access(_chain([5, 6]), 0.0, 2)
    assert cache.resident == set(pol.order) == {5, 6}


def test_blocks_behind_an_evicted_hit_prefix_are_not_written() -> None:
    """When making room takes the hit prefix's last block, the rest would be orphans at
    birth: they are not inserted (the store's put finds no parent)."""
    pol = MRU()
    cache = ShadowCache(pol, 2)
    cache.access(_chain([1, 2]), 0.0, 2)
    cache.access(_chain([1, 9]), 0.0, 2)   # 1 hits, is touched (most recent) and evicted
    assert cache.hits == 1
    assert cache.resident == set() and len(pol) == 0


def test_only_the_resident_prefix_hits() -> None:
    """A block behind a missing one is no hit (a prefix cache serves a prefix only)."""
    cache = ShadowCache(LRUPolicy(), 8)
    cache.access(_chain([1, 2, 3], 10), 0.0, 30)
    cache.access(_chain([1, 5, 3], 10), 0.0, 30)
    assert cache.hits == 10 and cache.tokens == 60


def test_a_zero_slot_shadow_still_holds_one_block() -> None:
    cache = ShadowCache(LRUPolicy(), 0)
    assert cache.capacity == 1
    cache.access(_chain([1]), 0.0, 1)
    cache.access(_chain([1]), 0.0, 1)
    assert cache.hits == 1


# ------------------------------------------------------------------ TierShadows sizing


def test_sampling_rate_for_an_unknown_size_is_the_highest() -> None:
    assert sampling_rate(0) == sampling_rate(-5) == MAX_RATE


def test_the_rate_and_the_curve_sizes_model_the_cumulative_cache() -> None:
    """Tier j at scale s is a cache of (tiers above) + s x (tier j) blocks, sampled at the
    rate of the cumulative size."""
    sh = TierShadows(_lru, capacity_blocks=20_000, above_blocks=60_000, modes=("a", "b"))
    assert sh.rate == sampling_rate(80_000)
    for s, c in sh.sizes.items():
        assert c.capacity == round(sh.rate * (60_000 + s * 20_000)), s
    assert sh.ones["a"].capacity == round(sh.rate * 80_000)
    assert set(sh.sizes) == set(MRC_SCALES) - {1.0}


def test_re_sizing_the_tier_above_alone_restarts_the_shadows() -> None:
    sh = TierShadows(_lru, capacity_blocks=100, modes=("a",), rate=1.0)
    sh.on_request(list(range(10)), lambda _d: 1, 0.0)
    assert sh.sampled == 10
    sh.set_capacity(100, 50)
    assert sh.above_blocks == 50 and sh.ones["a"].capacity == 150
    assert sh.sampled == 0 and sh.tokens == 0.0 and sh.hit_rates() == {}


def test_references_count_before_the_shadows_are_sized() -> None:
    sh = TierShadows(_lru, modes=("a",))
    sh.on_request([1, 2, 3], lambda _d: 1, 0.0)
    assert sh.references == 3 and not sh.active


def test_an_epoch_is_a_turnover_of_the_1x_shadow_in_sampled_blocks() -> None:
    """The comparison runs every max(256, 1x slots) sampled references (not requests): a
    256-block epoch ends with the second 128-block request, a 1000-slot one does not."""
    small = TierShadows(_lru, capacity_blocks=256, modes=("a",), rate=1.0)
    big = TierShadows(_lru, capacity_blocks=1000, modes=("a",), rate=1.0)
    for sh in (small, big):
        for _ in range(2):
            sh.on_request(list(range(128)), lambda _d: 1, 0.0)
    assert small.ones["a"].recent == 0.0      # compared: the epoch's hits were counted
    assert big.ones["a"].recent == 128.0      # still in its first epoch


def test_the_curve_of_a_stack_policy_is_monotone_and_complete() -> None:
    """Under LRU (a stack policy: a larger cache holds a superset) each larger size hits
    at least as much; every size has seen the references, so every point is exported."""
    rng = random.Random(3)
    sh = TierShadows(_lru, capacity_blocks=200, modes=("lru",), rate=1.0)
    for _ in range(6000):
        k = int(rng.paretovariate(0.8)) % 5000
        sh.on_request([k], lambda _d: 1, 0.0)
    curve = sh.curve()
    assert [s for s, _ in curve] == list(MRC_SCALES)
    rates = [h for _, h in curve]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    assert dict(curve)[1.0] == sh.hit_rates()["lru"]


# ------------------------------------------------------------------ the switching rule

EPOCH_TOKENS = 1000.0


def _rule(*modes: str) -> TierShadows:
    return TierShadows(_lru, capacity_blocks=64, modes=modes, rate=1.0)


def _epoch(sh: TierShadows, rates: dict[str, float]) -> None:
    """End one epoch in which each mode's 1x shadow hit ``rates[mode]`` of the tokens."""
    sh._epoch_tokens += EPOCH_TOKENS
    for m, c in sh.ones.items():
        c.recent = rates[m] * EPOCH_TOKENS
    sh._compare()


def _switch_epoch(sh: TierShadows, seq: Sequence[dict[str, float]]) -> int | None:
    """The 1-based epoch of ``seq`` after which the live mode changed (None: never)."""
    start = len(sh.switches)
    for i, rates in enumerate(seq, 1):
        _epoch(sh, rates)
        if len(sh.switches) > start:
            return i
    return None


def test_a_lead_below_the_hysteresis_never_switches() -> None:
    """A challenger steadily 0.4% (relative) ahead is noise-free but too small a gain."""
    sh = _rule("a", "b")
    assert _switch_epoch(sh, [{"a": 0.500, "b": 0.502}] * 60) is None


def test_a_noisy_lead_is_not_significant() -> None:
    """A lead of 10% on average whose epochs disagree (z < 3) does not switch: no
    flapping on noise."""
    sh = _rule("a", "b")
    seq = [{"a": 0.5, "b": 0.7}, {"a": 0.5, "b": 0.4}] * 40
    assert _switch_epoch(sh, seq) is None


def test_a_steady_lead_switches_after_half_a_window_and_not_before() -> None:
    """Eight epochs of evidence (WINDOW_EPOCHS / 2), then the switch; the steady lead
    with a little noise is significant at once (its variance is around the mean)."""
    sh = _rule("a", "b")
    sh.references, sh.sampled = 12_345, 99
    seq = [{"a": 0.5, "b": 0.60}, {"a": 0.5, "b": 0.62}] * 20
    assert _switch_epoch(sh, seq) == 8
    assert sh.mode == "b" and sh.switches[0].old == "a" and sh.switches[0].new == "b"
    assert sh.switches[0].at_reference == 12_345
    assert sh.snapshot()["switches"] == 1


def test_the_most_significant_challenger_wins() -> None:
    """Two challengers qualify: the one with the larger z takes over, whatever its place
    in the modes."""
    sh = _rule("a", "c", "b")
    seq = [{"a": 0.5, "c": 0.70, "b": 0.60}, {"a": 0.5, "c": 0.71, "b": 0.65}] * 10
    assert _switch_epoch(sh, seq) == 8 and sh.mode == "c"


def test_a_switch_back_needs_fresh_evidence() -> None:
    """After a switch the comparison restarts: the old mode's lead is counted from the
    switch, again for half a window, against the new live mode."""
    sh = _rule("a", "b")
    up = [{"a": 0.5, "b": 0.60}, {"a": 0.5, "b": 0.62}] * 4
    assert _switch_epoch(sh, up) == 8 and sh.mode == "b"
    down = [{"a": 0.60, "b": 0.5}, {"a": 0.62, "b": 0.5}] * 10
    assert _switch_epoch(sh, down) == 8 and sh.mode == "a"
    assert len(sh.switches) == 2 and sh.snapshot()["switches"] == 2


def test_old_evidence_is_forgotten_within_the_window() -> None:
    """A challenger that lagged for long and now leads takes over within about a window
    (16 epochs), not after as many epochs as it lagged (100)."""
    sh = _rule("a", "b")
    lag = [{"a": 0.6, "b": 0.5}, {"a": 0.62, "b": 0.5}] * 50
    assert _switch_epoch(sh, lag) is None
    lead = [{"a": 0.5, "b": 0.6}, {"a": 0.5, "b": 0.62}] * 20
    n = _switch_epoch(sh, lead)
    assert n is not None and n <= 30


def test_a_switch_starts_the_new_mode_s_curve_empty() -> None:
    """The curve's other sizes restart under the new live mode: until they have seen a
    reference the curve shows only the 1x point (not 0% at every other size)."""
    sh = _rule("a", "b")
    sh.on_request(list(range(10)), lambda _d: 1, 0.0)
    assert len(sh.curve()) == len(MRC_SCALES)
    seq = [{"a": 0.5, "b": 0.60}, {"a": 0.5, "b": 0.62}] * 4
    assert _switch_epoch(sh, seq) == 8
    assert [s for s, _ in sh.curve()] == [1.0]
    sh.on_request([1], lambda _d: 1, 0.0)
    assert [s for s, _ in sh.curve()] == list(MRC_SCALES)


def test_each_epoch_is_judged_on_its_own_hits() -> None:
    """Per-epoch hit rates, not running totals: the shadows' recent hits and the epoch's
    tokens restart at each comparison (fed through on_request)."""
    sh = TierShadows(_lru, capacity_blocks=256, modes=("a", "b"), rate=1.0)
    for _ in range(8):
        sh.on_request(list(range(128)), lambda _d: 1, 0.0)
    assert all(c.recent == 0.0 for c in sh.ones.values())
    assert sh._epoch_tokens == 0.0
    assert sh._base / sh._weight > 0.7   # 3 of 4 epochs hit every token, one half


def test_after_a_switch_the_lead_is_weighed_on_the_new_epochs_alone() -> None:
    """The evidence's weight restarts with its sums at a switch: a steady lead over the new
    live mode (twice its noise) takes over again after half a window, not diluted by the
    epochs before the switch."""
    sh = _rule("a", "b")
    lag = [{"a": 0.6, "b": 0.5}, {"a": 0.62, "b": 0.5}] * 20
    lead = [{"a": 0.5, "b": 0.6}, {"a": 0.5, "b": 0.62}] * 20
    assert _switch_epoch(sh, lag) is None and _switch_epoch(sh, lead) is not None
    assert sh.mode == "b"
    back = [{"a": 0.65, "b": 0.5}, {"a": 0.55, "b": 0.5}] * 10
    assert _switch_epoch(sh, back) == 8 and sh.mode == "a"


def test_a_third_mode_s_record_against_the_old_live_mode_is_forgotten_at_a_switch() -> None:
    """Each lead is over the live mode: after a switch a challenger that lagged the mode
    that left, and now leads the new live mode steadily, takes over after half a window
    (its old deficit is not held against it)."""
    sh = _rule("a", "b", "c")
    first = [{"a": 0.5, "b": 0.70, "c": 0.20}, {"a": 0.5, "b": 0.72, "c": 0.21}] * 4
    assert _switch_epoch(sh, first) == 8 and sh.mode == "b"
    after = [{"a": 0.5, "b": 0.6, "c": 0.70}, {"a": 0.5, "b": 0.6, "c": 0.72}] * 10
    assert _switch_epoch(sh, after) == 8 and sh.mode == "c"


def test_re_sizing_forgets_the_evidence_of_the_old_size() -> None:
    """A re-size starts the comparison afresh: a challenger's lead measured at the old size
    does not count toward a switch at the new one (its decayed weight and sums went with
    the epoch count, which alone was reset before)."""
    sh = _rule("lru", "lfu")
    for _ in range(6):
        _epoch(sh, {"lru": 0.1, "lfu": 0.5})
    assert sh._weight > 0 and sh._base > 0
    sh.set_capacity(128)
    assert (sh._weight, sh._base, sh._epoch_tokens, sh._epochs) == (0.0, 0.0, 0.0, 0)
