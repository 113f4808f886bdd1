"""Mutation-review survivors of the eviction/admission policy code (kvtier/policy/):
decisions no other test noticed broken (the store's eviction paths:
test_store_survivors_demotion.py).

Each docstring names the decision and the mutant that survived without it. Some read a
policy's private state where the decision is internal (``CostPolicy._schedule``'s inlined
value against ``CostPolicy.value``).
"""

from __future__ import annotations

import pytest

from kvtier.policy.admission import SecondHitAdmission, WriteBudget
from kvtier.policy.base import make_eviction_policy, register_eviction_policy
from kvtier.policy.cost import CostPolicy
from kvtier.policy.costmodel import BlockCosts, PrefillModel
from kvtier.policy.lfu import LFUPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.prefix import PrefixForest
from kvtier.policy.stats import WorkloadStats

MB = 1 << 20
SAVED0 = BlockCosts().recompute_s(0) / MB   # saved seconds per byte of a depth-0 block


def _placed_value(pol: CostPolicy, key: str) -> float:
    """The value ``_schedule`` placed ``key`` with (no eviction since its last use)."""
    return (pol._entries[key].prio - pol._level) * pol._unit


def _insert(pol: CostPolicy, key: str, depth: int = 0, parent: str | None = None) -> None:
    pol.insert(key, nbytes=MB, parent=parent, depth=depth)


# --------------------------------------------------------------------------- cost


def test_cost_schedule_value_matches_value_and_clamps_late_reuse() -> None:
    """A reuse expected later than the eviction age counts ``life/gap`` of a hit, in
    ``value()`` and in the priority (mutants: ``gap > life`` flipped in ``_schedule`` or
    ``_value``; ``* life`` dropped from the inlined hit density)."""
    pol = CostPolicy(stats=WorkloadStats(horizon=1000, prior=0.5))  # unknown: gap 500
    _insert(pol, "k")
    life = 2.0                                   # nothing evicted yet: len + 1
    p = 0.5 * life / 500.0
    expected = SAVED0 * p * life / (p * life + (1.0 - p) * life)
    assert pol.value("k") == pytest.approx(expected, rel=1e-9, abs=0)
    assert _placed_value(pol, "k") == pytest.approx(expected, rel=1e-9, abs=0)


def test_cost_value_without_stats_is_half_the_saving_as_placed() -> None:
    """Without stats the reuse estimate is 0.5, in ``value()`` and in the priority
    (mutants: ``1.0 * saved`` in ``_value``; in ``_schedule``)."""
    pol = CostPolicy()
    _insert(pol, "k", depth=3)
    saved = BlockCosts().recompute_s(3) / MB
    assert pol.value("k") == pytest.approx(0.5 * saved, rel=1e-9, abs=0)
    assert _placed_value(pol, "k") == pytest.approx(0.5 * saved, rel=1e-9, abs=0)


def test_cost_eviction_age_is_a_slow_moving_mean_of_victims_ages() -> None:
    """The eviction age starts at the first victim's age (references since its last use)
    and moves 1/64 of the way to each next one; a late reuse's value is linear in it
    (mutants: ``_life = age``; never learned; ``at`` not stamped at insert)."""
    stats = WorkloadStats(horizon=1 << 16, prior=0.5)
    pol = CostPolicy(stats=stats)
    stats.on_lookup([f"w{i}" for i in range(5)], 0)     # tick 5
    _insert(pol, "a")
    stats.on_lookup([f"x{i}" for i in range(10)], 0)    # tick 15: a's age 10
    assert pol.victim() == "a"
    pol.remove("a")
    _insert(pol, "b")
    stats.on_lookup([f"y{i}" for i in range(74)], 0)    # b's age 74
    assert pol.victim() == "b"
    pol.remove("b")
    life = 10.0 + (74.0 - 10.0) / 64.0
    _insert(pol, "probe")   # unknown key: p 0.5, gap horizon/2 > life: value = saved p T/gap
    assert pol.value("probe") == pytest.approx(SAVED0 * 0.5 * life / (1 << 15), rel=1e-9,
                                               abs=0)


def test_cost_water_level_ages_out_a_valuable_block_nobody_uses() -> None:
    """GreedyDual: every eviction raises the level, so an unused valuable block goes after
    enough cheap ones (mutants: the level left out of the priority; never raised)."""
    pol = CostPolicy()
    _insert(pol, "late", depth=400)                  # worth several depth-0 blocks
    gone = None
    for i in range(10_000):
        _insert(pol, f"e{i}")
        gone = pol.victim()
        pol.remove(gone)
        if gone == "late":
            break
    assert gone == "late"
    assert i > 2


def test_cost_water_level_never_falls_when_a_cheap_parent_goes_after_its_child() -> None:
    """Evicting a parent whose priority lies below the level (no candidate while its
    child was resident) does not lower it (mutant: level = every victim's priority)."""
    pol = CostPolicy()
    _insert(pol, "a0")
    _insert(pol, "a1", depth=50, parent="a0")   # dear: raises the level
    assert pol.victim() == "a1"
    pol.remove("a1")
    _insert(pol, "y")
    assert pol.victim() == "a0"
    pol.remove("a0")
    _insert(pol, "x")                           # same value as y, newer
    assert pol.victim() == "y"


def test_cost_only_victims_raise_the_water_level() -> None:
    """A block removed for another reason (deleted) does not raise the level (mutant:
    every removal taken for the victim's eviction)."""
    pol = CostPolicy()
    _insert(pol, "y", depth=20)
    _insert(pol, "h", depth=80)
    assert pol.victim() == "y"      # named, but h is deleted instead
    pol.remove("h")
    _insert(pol, "x")               # cheap, at level 0
    assert pol.victim() == "x"


def test_cost_reinsert_of_a_resident_block_is_a_touch() -> None:
    """Inserting a resident key re-prioritises it (mutant: a re-insert of a block already
    in the heap does nothing)."""
    pol = CostPolicy()
    _insert(pol, "a")
    _insert(pol, "b")
    assert pol.victim() == "a"
    _insert(pol, "a")
    assert pol.victim() == "b"


def test_cost_pins_hide_blocks_through_touch_leaf_and_unpin() -> None:
    """Pinned blocks are never victims: a touched pinned leaf (mutant: ``_place`` pushes
    pinned leaves); a pinned parent whose last child left (mutant: ``remove`` pushes it
    unchecked); an unpinned parent with a resident child (mutant: ``set_pinned(False)``
    pushes it whatever its children)."""
    pol = CostPolicy()
    _insert(pol, "a0")
    _insert(pol, "a1", depth=1, parent="a0")
    pol.set_pinned("a0", True)
    pol.set_pinned("a0", False)
    pol.set_pinned("a1", True)
    pol.touch("a1")
    _insert(pol, "a1", depth=1, parent="a0")
    assert pol.victim() is None
    pol.set_pinned("a0", True)
    pol.remove("a1")
    assert pol.victim() is None
    pol.set_pinned("a0", False)
    assert pol.victim() == "a0"


def test_cost_parent_arriving_after_two_children_counts_the_one_still_resident() -> None:
    """Children are counted per parent key before the parent arrives (a chain demoted
    tail-first): two, one leaves, the parent arrives and is no leaf (mutant: the count
    dropped when it falls to 1 instead of 0)."""
    pol = CostPolicy()
    _insert(pol, "c1", depth=1, parent="p")
    _insert(pol, "c2", depth=1, parent="p")
    pol.remove("c1")
    _insert(pol, "p")
    pol.set_pinned("c2", True)
    assert pol.victim() is None
    pol.set_pinned("c2", False)
    assert pol.victim() == "c2"


def test_costmodel_refuses_zero_bandwidth_and_zero_or_nan_throughput() -> None:
    """No (or a negative) bandwidth reloads in infinite seconds, not ZeroDivisionError or
    a negative time (mutant: only ``None`` checked); a throughput of 0 or NaN is refused
    (mutant: only negatives refused)."""
    costs = BlockCosts()
    assert costs.reload_s(MB, 0) == costs.reload_s(MB, -1.0) == float("inf")
    for bad in (0.0, float("nan")):
        with pytest.raises(ValueError):
            PrefillModel(flops_per_s=bad)


# --------------------------------------------------------------------------- admission


def test_second_hit_ghost_list_is_lru_by_last_sighting() -> None:
    """A key seen again moves to the young end of the ghost list; the bound drops the one
    sighted longest ago (mutant: no ``move_to_end``)."""
    adm = SecondHitAdmission(ghost=2)
    for key in ("a", "b", "a", "c"):   # c drops b, not a
        adm.seen(key)
    assert adm.admit("a", tier="nvme", nbytes=1, now=0.0)
    assert not adm.admit("b", tier="nvme", nbytes=1, now=0.0)


def test_write_budget_clock_going_back_refills_nothing() -> None:
    """The budget refills from the latest time seen, so a ``now`` that goes back cannot
    refill twice (mutant: ``_t = now``)."""
    wb = WriteBudget(bytes_per_s=100.0, burst_bytes=1000.0)
    assert wb.admit("a", tier="nvme", nbytes=1000, now=10.0)   # empty at t=10
    assert not wb.admit("b", tier="nvme", nbytes=100, now=5.0)
    assert wb.available_at(10.0) == 0.0
    assert not wb.admit("c", tier="nvme", nbytes=100, now=10.5)   # 50 bytes refilled
    assert wb.available_bytes == pytest.approx(50.0)
    with pytest.raises(ValueError):   # a bucket that never holds a write (mutant: < 0)
        WriteBudget(bytes_per_s=1.0, burst_bytes=0.0)


# --------------------------------------------------------------------------- prefix, lru, lfu


def test_prefix_forest_keeps_the_first_parent_and_drops_empty_child_sets() -> None:
    """Adding a present key changes nothing, not even its parent (mutant: the early
    return removed: it also becomes a child of the new parent); no empty child set is
    kept per parent ever seen (mutant: never deleted)."""
    forest = PrefixForest()
    forest.add("c", "p1")
    forest.add("c", "p2")
    assert forest.parent("c") == "p1"
    assert forest.n_children("p2") == 0
    forest.add("p1", None)   # the last child leaving drops the set (mutant: kept, leaks)
    assert forest.discard("c") == []
    assert forest._children == {}


def test_lru_reinsert_pin_and_unpin_order() -> None:
    """LRU: a re-insert is a touch (mutant: no ``move_to_end``); a pinned key re-put stays
    hidden (mutant: ``insert`` ignores the pin); an unpinned key re-enters as the most
    recent (mutant: at the least-recent end)."""
    pol = LRUPolicy()
    pol.insert("a")
    pol.insert("b")
    pol.insert("a")
    assert pol.victim() == "b"
    pol.set_pinned("b", True)
    pol.insert("b")
    assert pol.victim() == "a"
    pol.set_pinned("a", True)
    assert pol.victim() is None
    pol.set_pinned("b", False)
    pol.set_pinned("a", False)
    assert pol.victim() == "b"
    assert len(pol) == 2


def test_lfu_count_resumes_from_history_on_reinsert() -> None:
    """An evicted block's count is remembered: back in the tier it outranks a block with
    fewer uses (mutant: a re-insert starts from one use)."""
    pol = LFUPolicy(half_life_uses=1000.0, history=16)
    for _ in range(10):
        pol.insert("a")
    pol.remove("a")
    for _ in range(3):
        pol.insert("b")
    pol.insert("a")            # 11 uses against b's 3
    assert pol.victim() == "b"


def test_lfu_default_half_life_ages_old_counts() -> None:
    """Without ``half_life_uses`` the half-life is twice the population at the first
    victim, so recent uses soon outweigh many old ones (mutant: no aging)."""
    pol = LFUPolicy()
    for _ in range(64):
        pol.insert("a")        # all before the half-life is known
    pol.insert("b")
    assert pol.victim() == "b"  # half-life := 2 x 2 blocks = 4 uses
    for _ in range(8):
        pol.touch("b")
    assert pol.victim() == "a"


def test_lfu_history_bound_forgets_the_oldest_evicted_count() -> None:
    """The bounded history drops the count evicted longest ago (mutant: the newest)."""
    pol = LFUPolicy(half_life_uses=1000.0, history=1)
    for key in ("a", "b"):
        for _ in range(5):
            pol.insert(key)
    pol.remove("a")
    pol.remove("b")            # history holds b's count only
    for _ in range(3):
        pol.insert("c")
    pol.insert("a")            # forgotten: one use
    pol.insert("b")            # remembered: six uses
    assert pol.victim() == "a"


def test_lfu_removing_a_pinned_block_forgets_its_pin() -> None:
    """A block removed while pinned comes back unpinned (mutant: the pin survives the
    removal and hides it for good)."""
    pol = LFUPolicy(half_life_uses=1000.0)
    pol.insert("a")
    pol.set_pinned("a", True)
    pol.remove("a")
    pol.insert("a")
    assert pol.victim() == "a"


def test_registering_an_eviction_policy_name_twice_is_refused() -> None:
    """A second policy under a taken name is an error (mutant: the check removed)."""
    with pytest.raises(ValueError, match="twice"):
        register_eviction_policy("lru")(LRUPolicy)
    assert isinstance(make_eviction_policy("lru"), LRUPolicy)
