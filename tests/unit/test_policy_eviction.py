"""LFU, cost, prefix bookkeeping and admission on hand-made sequences with known answers."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.policy import EvictionPolicy, FakeClock, eviction_policy_names, make_eviction_policy
from kvtier.policy.admission import SecondHitAdmission, TierAdmission, WriteBudget
from kvtier.policy.cost import CostPolicy
from kvtier.policy.costmodel import BlockCosts, PrefillModel
from kvtier.policy.lfu import LFUPolicy
from kvtier.policy.prefix import PrefixForest
from kvtier.policy.stats import WorkloadStats

MB = 1 << 20


def chain(pol: EvictionPolicy, keys: list[str], now: float = 0.0) -> None:
    """Insert ``keys`` as one prefix chain, parent first."""
    parent = None
    for depth, key in enumerate(keys):
        pol.insert(key, nbytes=MB, parent=parent, depth=depth, now=now)
        parent = key


def lfu(**kwargs: Any) -> LFUPolicy:
    """The registry's ``lfu`` policy as its own class (its calls' defaults, no ``now``)."""
    pol = make_eviction_policy("lfu", **kwargs)
    assert isinstance(pol, LFUPolicy)
    return pol


def cost(**kwargs: Any) -> CostPolicy:
    """The registry's ``cost`` policy as its own class (``value`` is not the interface's)."""
    pol = make_eviction_policy("cost", **kwargs)
    assert isinstance(pol, CostPolicy)
    return pol


def test_registry_knows_all_three() -> None:
    assert {"lru", "lfu", "cost"} <= set(eviction_policy_names())
    for name in ("lru", "lfu", "cost"):
        assert isinstance(make_eviction_policy(name), EvictionPolicy)


# ------------------------------------------------------------------ lfu
def test_lfu_evicts_least_frequent_and_ages() -> None:
    pol = lfu(half_life_uses=2.0)
    for k in "abc":
        pol.insert(k, nbytes=1, parent=None, depth=0)
    for _ in range(3):
        pol.touch("a")
    pol.touch("b")
    assert pol.victim() == "c"
    pol.remove("c")
    assert pol.victim() == "b"
    # the clock counts uses: b's two newest uses now outweigh a's three older, decayed ones
    pol.touch("b")
    pol.touch("b")
    assert pol.victim() == "a"


def test_lfu_counts_outlive_residency() -> None:
    pol = lfu(half_life_uses=100.0)
    pol.insert("hot", nbytes=1)
    for _ in range(4):
        pol.touch("hot")
    pol.insert("x", nbytes=1)
    assert pol.victim() == "x"
    pol.remove("hot")  # evicted (say, by a pin elsewhere): its count is remembered
    pol.insert("y", nbytes=1)
    pol.insert("hot", nbytes=1)  # comes back with five uses behind it, not one
    assert pol.victim() in {"x", "y"}
    forgetful = lfu(half_life_uses=100.0, history=0)
    forgetful.insert("hot", nbytes=1)
    for _ in range(4):
        forgetful.touch("hot")
    forgetful.remove("hot")
    forgetful.insert("y", nbytes=1)
    forgetful.touch("y")
    forgetful.insert("hot", nbytes=1)
    assert forgetful.victim() == "hot"  # no history: back to a single use
    with pytest.raises(ValueError):
        make_eviction_policy("lfu", half_life_uses=0.0)


def test_lfu_ties_go_to_the_deeper_block_and_pins_are_skipped() -> None:
    pol = make_eviction_policy("lfu")
    chain(pol, ["r", "m", "leaf"])
    assert pol.victim() == "leaf"
    pol.set_pinned("leaf", True)
    assert pol.victim() == "m"
    pol.set_pinned("leaf", False)
    assert pol.victim() == "leaf"


# ------------------------------------------------------------------ cost
def test_cost_ties_go_to_the_oldest_use_so_chains_leave_one_at_a_time() -> None:
    # equal values (no stats, flat prefill cost): cost must order like LRU among leaves. A
    # parent that becomes a leaf keeps the age of its last use, so the older chain leaves
    # whole before the newer one loses anything (not one tail block from each in turn)
    flat = BlockCosts(block_tokens=256, block_bytes=MB, prefill=PrefillModel(layers=0))
    pol = make_eviction_policy("cost", costs=flat)
    chain(pol, ["a0", "a1", "a2"])
    chain(pol, ["b0", "b1", "b2"])
    order = []
    while (v := pol.victim()) is not None:
        order.append(v)
        pol.remove(v)
    assert order == ["a2", "a1", "a0", "b2", "b1", "b0"]


def test_cost_evicts_leaves_before_parents() -> None:
    pol = make_eviction_policy("cost")
    chain(pol, ["a0", "a1", "a2"])
    chain(pol, ["b0", "b1"], now=1.0)
    # the root a0 is the oldest block, but it has a resident child: a leaf goes first
    order = []
    while len(pol):
        v = pol.victim()
        assert v is not None
        order.append(v)
        pol.remove(v)
    assert order.index("a2") < order.index("a1") < order.index("a0")
    assert order.index("b1") < order.index("b0")


def test_cost_skips_pinned_leaves_and_their_ancestors() -> None:
    pol = make_eviction_policy("cost")
    chain(pol, ["a0", "a1"])
    pol.set_pinned("a1", True)
    assert pol.victim() is None  # a1 pinned, a0 has a resident child
    pol.set_pinned("a1", False)
    assert pol.victim() == "a1"


def test_cost_prefers_to_keep_blocks_the_workload_reuses() -> None:
    stats = WorkloadStats(horizon=100)
    pol = cost(stats=stats)
    # teach the stats: 'hot' prompts come back, one-off prompts never do
    for i in range(50):
        stats.on_lookup([f"hot{i % 5}"], 1 if i >= 5 else 0)
        stats.on_lookup([f"once{i}"], 0)
    stats.on_lookup(["hot0"], 1)
    stats.on_lookup(["once-new"], 0)
    pol.insert("hot0", nbytes=MB, parent=None, depth=0, now=0.0)
    pol.insert("once-new", nbytes=MB, parent=None, depth=0, now=0.0)
    # the one-off block was inserted last (LRU would keep it) but is worth less
    assert pol.value("hot0") > pol.value("once-new")
    assert pol.victim() == "once-new"


def test_cost_values_late_chunks_of_long_prompts_more() -> None:
    costs = BlockCosts(block_tokens=512, block_bytes=512 * 131072, prefill=PrefillModel())
    assert costs.recompute_s(100) > 2 * costs.recompute_s(0)
    pol = cost(costs=costs)
    pol.insert("early", nbytes=costs.block_bytes, parent=None, depth=0, now=0.0)
    pol.insert("late", nbytes=costs.block_bytes, parent=None, depth=100, now=0.0)
    assert pol.value("late") > pol.value("early")
    assert pol.victim() == "early"


def test_cost_block_cheaper_to_reload_than_recompute_is_worth_nothing() -> None:
    costs = BlockCosts(block_tokens=16, block_bytes=16 * 131072)
    # the tier below reloads at 1 TB/s: recomputing 16 early tokens is slower? no: faster
    pol = cost(costs=costs, reload_bandwidth=1e15)
    pol.insert("k", nbytes=costs.block_bytes, parent=None, depth=0, now=0.0)
    assert pol.value("k") > 0
    slow = cost(costs=costs, reload_bandwidth=1e6)
    slow.insert("k", nbytes=costs.block_bytes, parent=None, depth=0, now=0.0)
    assert slow.value("k") == 0.0  # reloading from below costs more than recomputing


# ------------------------------------------------------------------ prefix forest
def test_prefix_forest_reports_orphaned_descendants() -> None:
    forest = PrefixForest()
    forest.add("r", None)
    forest.add("a", "r")
    forest.add("a1", "a")
    forest.add("a2", "a")
    forest.add("b", "r")
    assert forest.n_children("a") == 2
    assert sorted(forest.discard("a"), key=str) == ["a1", "a2"]
    assert "a1" not in forest and "b" in forest and forest.n_children("r") == 1
    assert forest.discard("a") == []
    assert forest.discard("r") == ["b"]
    assert len(forest) == 0


# ------------------------------------------------------------------ admission
def test_second_hit_admission() -> None:
    adm = SecondHitAdmission(ghost=2)
    assert not adm.admit("a", tier="nvme", nbytes=1, now=0.0)
    assert adm.admit("a", tier="nvme", nbytes=1, now=0.0)
    adm.admit("b", tier="nvme", nbytes=1, now=0.0)
    adm.admit("c", tier="nvme", nbytes=1, now=0.0)  # the ghost list forgets a
    assert not adm.admit("a", tier="nvme", nbytes=1, now=0.0)


def test_write_budget_refills_with_the_fake_clock() -> None:
    clock = FakeClock()
    adm = WriteBudget(bytes_per_s=100.0, burst_bytes=200.0)
    assert adm.admit("a", tier="nvme", nbytes=150, now=clock())
    assert not adm.admit("b", tier="nvme", nbytes=100, now=clock())  # 50 left
    clock.advance(0.5)  # +50
    assert adm.admit("b", tier="nvme", nbytes=100, now=clock())
    clock.advance(100.0)  # refills only up to the burst
    assert adm.available_bytes == pytest.approx(0.0)
    assert adm.admit("c", tier="nvme", nbytes=200, now=clock())
    assert adm.rejected == 1


def test_write_budget_reports_the_level_refilled_to_now_and_the_bytes_it_refused() -> None:
    adm = WriteBudget(bytes_per_s=100.0, burst_bytes=200.0)
    assert adm.admit("a", tier="nvme", nbytes=180, now=0.0)
    assert not adm.admit("b", tier="nvme", nbytes=50, now=0.1)      # 30 left
    assert adm.refused_bytes == 50
    assert adm.available_at(0.1) == pytest.approx(30.0)
    assert adm.available_at(1.1) == pytest.approx(130.0)            # refilled, spends nothing
    assert adm.available_at(100.0) == 200.0                         # up to the burst
    assert adm.available_at(0.0) == pytest.approx(30.0)             # never backward
    assert adm.admit("b", tier="nvme", nbytes=50, now=1.1)
    assert adm.available_at(1.1) == pytest.approx(80.0)
    inner = WriteBudget(0.0, 100.0, inner=SecondHitAdmission())
    assert not inner.admit("x", tier="nvme", nbytes=60, now=0.0)     # the inner policy's
    assert inner.rejected == 1 and inner.refused_bytes == 0


def test_write_budget_with_inner_policy_spends_only_on_admitted_writes() -> None:
    adm = WriteBudget(0.0, 100.0, inner=SecondHitAdmission())
    assert not adm.admit("a", tier="nvme", nbytes=60, now=0.0)  # first sight
    assert adm.available_bytes == 100.0
    assert adm.admit("a", tier="nvme", nbytes=60, now=0.0)
    assert not adm.admit("a", tier="nvme", nbytes=60, now=0.0)  # budget exhausted


def test_a_block_larger_than_the_burst_is_written_from_a_full_bucket_and_paid_back() -> None:
    """A 160 MiB block (512 tokens of a 70B model) under a 64 MiB burst: refused forever
    when the bucket had to hold it whole. Admitted from a full bucket, it leaves a debt the
    refill pays back before the next write, so the long-run rate still holds."""
    mib = 2**20
    adm = WriteBudget.per_second(10 * mib)             # burst: 64 MiB, not 10
    assert adm.available_at(0.0) == 64 * mib
    assert adm.admit("first", tier="nvme", nbytes=65 * mib, now=0.0)      # from full
    assert adm.available_at(0.0) == -1 * mib                              # in debt
    assert not adm.admit("one", tier="nvme", nbytes=1, now=0.05)          # debt first
    assert not adm.admit("big", tier="nvme", nbytes=160 * mib, now=1.0)   # 9 MiB: not full
    assert adm.refused_bytes == 160 * mib + 1
    assert adm.admit("big", tier="nvme", nbytes=160 * mib, now=6.5)       # full again
    assert adm.available_at(6.5) == pytest.approx(-96 * mib)
    assert not adm.admit("one", tier="nvme", nbytes=mib, now=16.0)        # -1 MiB
    assert adm.admit("one", tier="nvme", nbytes=mib, now=16.3)            # +2 MiB
    assert WriteBudget.per_second(100 * mib).available_at(0.0) == 100 * mib   # one second


def test_tier_admission_dispatches_by_tier() -> None:
    adm = TierAdmission({"nvme": SecondHitAdmission()})
    assert adm.admit("a", tier="cpu", nbytes=1, now=0.0)
    assert not adm.admit("a", tier="nvme", nbytes=1, now=0.0)


# ------------------------------------------------------------------ workload stats
def test_stats_learns_the_output_feature_from_on_stored() -> None:
    stats = WorkloadStats(horizon=50, history=1000)
    # brief answers are followed up (their chain comes back), long answers end the session
    for i in range(200):
        brief, long_ = [f"b{i}"], [f"l{i}"]
        for keys, out in ((brief, 10), (long_, 2000)):
            stats.on_lookup(keys, 0)
            stats.on_stored(keys, output_tokens=out)
        if i:
            stats.on_lookup([f"b{i - 1}"], 1)
    stats.on_lookup(["b-new"], 0)
    stats.on_stored(["b-new"], output_tokens=12)
    stats.on_lookup(["l-new"], 0)
    stats.on_stored(["l-new"], output_tokens=1800)
    assert stats.reuse_probability("b-new") > 0.8
    assert stats.reuse_probability("l-new") < 0.2
    # the cost policy bypasses the block it expects never to see again
    pol = make_eviction_policy("cost", stats=stats)
    pol.insert("b-new", nbytes=MB, parent=None, depth=0, now=0.0)
    pol.insert("l-new", nbytes=MB, parent=None, depth=0, now=0.0)
    assert pol.victim() == "l-new"


def test_stats_on_stored_after_lookup_refines_without_counting_twice() -> None:
    stats = WorkloadStats()
    stats.on_lookup(["a", "b"], 0)
    assert stats.tick == 2 and stats.uses("a") == 1
    stats.on_stored(["a", "b"], output_tokens=100)
    assert stats.tick == 2 and stats.uses("a") == 1  # the same reference, refined
    stats.on_stored(["a", "b"], output_tokens=None)  # a put with no lookup: a new reference
    assert stats.tick == 4 and stats.uses("b") == 2
    stats.on_stored(["c"], output_tokens=None)
    assert stats.uses("c") == 1 and len(stats) == 3


def test_stats_on_request_is_on_lookup_then_on_stored_in_one_pass() -> None:
    """The replay's one-pass call learns what the two calls learn: the same references,
    classes and records (estimates equal up to float rounding), also for chains that repeat
    a key or outgrow the history (those take the two calls)."""
    import random

    rng = random.Random(7)
    one = WorkloadStats(horizon=60, history=50)
    two = WorkloadStats(horizon=60, history=50)
    for _ in range(2000):
        n = rng.choice((1, 3, 8, 60))  # 60: longer than the history
        keys = [f"k{rng.randrange(120)}" for _ in range(n)]
        hit = rng.randrange(n + 1)
        out = rng.choice((None, 3, 300, 3000))
        one.on_request(keys, hit, output_tokens=out)
        two.on_lookup(keys, hit)
        two.on_stored(keys, output_tokens=out)
    assert one.tick == two.tick and len(one) == len(two)
    for i in range(120):
        key = f"k{i}"
        assert one.uses(key) == two.uses(key)
        p1, g1 = one.reuse_estimate(key)
        p2, g2 = two.reuse_estimate(key)
        assert p1 == pytest.approx(p2, rel=1e-9) and g1 == pytest.approx(g2, rel=1e-9)


def test_stats_feature_without_signal_changes_nothing() -> None:
    import random

    rng = random.Random(3)
    stats = WorkloadStats(horizon=40, history=10_000)
    for _ in range(3000):
        keys = [f"k{rng.randrange(300)}"]
        stats.on_lookup(keys, 0)
        stats.on_stored(keys, output_tokens=rng.choice((5, 50, 500, 5000)))
    probe = []
    for out in (5, 50, 500, 5000):
        stats.on_lookup([f"new{out}"], 0)
        stats.on_stored([f"new{out}"], output_tokens=out)
        probe.append(stats.reuse_probability(f"new{out}"))
    assert max(probe) - min(probe) < 0.1


def test_stats_reject_bad_parameters() -> None:
    with pytest.raises(ValueError):
        WorkloadStats(horizon=0)
    with pytest.raises(ValueError):
        WorkloadStats(prior=1.5)


def test_cost_water_level_makes_it_lru_when_values_are_equal() -> None:
    pol = make_eviction_policy("cost")
    for k in "abcd":
        pol.insert(k, nbytes=MB, parent=None, depth=0, now=0.0)
    pol.touch("a", now=1.0)
    order = []
    for new in "efg":
        v = pol.victim()
        assert v is not None
        order.append(v)
        pol.remove(v)
        pol.insert(new, nbytes=MB, parent=None, depth=0, now=2.0)
    assert order == ["b", "c", "d"]
    assert pol.victim() == "a"


def test_stats_a_key_own_reuses_count_before_the_horizon_has_passed() -> None:
    """A young daemon (far less than one horizon of references): the open references of
    one-off blocks weigh on every class, but a prefix that keeps coming back is known by
    its own record, and its short reuse gap makes it worth keeping over fresh blocks."""
    stats = WorkloadStats(horizon=65536, history=65536)
    hot = ["h0", "h1", "h2", "h3"]
    for turn in range(6):
        keys = [*hot, f"q{turn}"]
        stats.on_lookup(keys, 4 if turn else 0)
        stats.on_stored(keys, output_tokens=8)
    for i in range(12):
        keys = [f"o{i}.{d}" for d in range(4)]
        stats.on_lookup(keys, 0)
        stats.on_stored(keys, output_tokens=500)
    p_hot, gap_hot = stats.reuse_estimate("h3")
    p_new, _ = stats.reuse_estimate("o11.3")
    assert p_hot > 3 * p_new and gap_hot < 10
    pol = cost(stats=stats)
    pol.insert("h3", nbytes=MB, parent=None, depth=3, now=0.0)
    pol.insert("o11.3", nbytes=MB, parent=None, depth=3, now=0.0)
    assert pol.value("h3") > 4 * pol.value("o11.3")
    assert pol.victim() == "o11.3"


@pytest.mark.parametrize("name", ["cost", "lru", "lfu", "adaptive"])
def test_a_chain_arriving_tail_first_still_leaves_from_its_tail(name: str) -> None:
    """A lower tier receives a chain as the tier above demotes it, leaves first, and the
    store touches a chain tail first (``touch_chain``): the head is evicted last (review of
    2026-12-06: it went first, and its whole chain was dropped with it)."""
    from kvtier.policy.base import touch_chain

    p = make_eviction_policy(name)
    chain = [(b"A", None), (b"B", b"A"), (b"C", b"B")]
    for depth, (key, parent) in reversed(list(enumerate(chain))):
        p.insert(key, nbytes=65536, parent=parent, depth=depth, now=0.0)
    touch_chain(p, [k for k, _ in chain], 1.0)
    order = []
    while (victim := p.victim()) is not None:
        order.append(victim)
        p.remove(victim)
    assert order == [b"C", b"B", b"A"]


def test_the_budget_gauge_shows_zero_not_a_debt() -> None:
    """/v1/stats and the ``available_bytes`` gauge say what the budget can admit: nothing
    while a block larger than the burst is paid back, never a negative byte count."""
    from kvtier.daemon.metrics import admission_stats

    budget = WriteBudget.per_second(2**20)
    assert budget.admit("big", tier="nvme", nbytes=2**27, now=0.0)
    out = admission_stats(TierAdmission({"nvme": budget}), 2**20, 1.0)
    assert out["nvme_write_budget"]["available_bytes"] == 0.0
    assert budget.available_at(1.0) < 0
