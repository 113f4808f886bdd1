"""The simulator's accounting pinned on tiny traces worked out by hand (mutation review of
kvtier/replay/simulator.py): exact TTFTs, bytes per tier, evictions, late prefetches and
lower tiers that keep their size, plus invariants checked after every request of random
traces (no tier over capacity, no resident block without its parent)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, cast

import pytest

from kvtier.policy.base import EvictionPolicy, Key
from kvtier.policy.costmodel import BlockCosts
from kvtier.policy.prefetch import PrefetchWait
from kvtier.policy.stats import WorkloadStats
from kvtier.replay import simulator
from kvtier.replay.simulator import Order, SimConfig, TierSpec, make_policy, simulate
from kvtier.replay.trace import Request, Trace, TraceFormat

BT = 4              # tokens per block of these traces
BPT = 131072        # SimConfig's default bytes per token
SLOT = BT * BPT     # bytes of one block slot
CPU_BW, NVME_BW = 25e9, 3e9
PREFILL = BlockCosts(block_tokens=BT, block_bytes=SLOT).prefill  # the simulator's default


def trace(*reqs: tuple[list[int], int]) -> Trace:
    """Requests one second apart: (block ids, input tokens)."""
    return Trace(tuple(Request(float(i), n, 1, tuple(b)) for i, (b, n) in enumerate(reqs)),
                 BT, TraceFormat.MOONCAKE)


def two_tiers(cpu: int = 2, nvme: int = 10, nvme_bw: float = NVME_BW,
              prefetch: PrefetchWait = PrefetchWait.WAIT) -> SimConfig:
    return SimConfig(tiers=(TierSpec("cpu", cpu, CPU_BW), TierSpec("nvme", nvme, nvme_bw)),
                     prefetch=prefetch)


# A = [1, 2] holds 6 tokens (its last block is partial), B = [3, 4] holds 8. With cpu=2
# in the store's order: A is written; B demotes A to nvme; A comes back from nvme (promoted,
# B demoted); A hits cpu (it is in both tiers now); B comes back, and A, already in nvme,
# is evicted from cpu without a second write.
A, B = ([1, 2], 6), ([3, 4], 8)
ABABA = trace(A, B, A, A, B)


def test_ttft_is_the_reload_time_of_the_real_tokens_plus_the_prefill_left() -> None:
    """TTFT = prefetch wait (each promoted block at the lower tier's bandwidth, a partial
    block at its real size) + top-tier loads at the top tier's bandwidth + the prefill of
    the tokens not hit. A mutant that dropped the wait, loaded from the wrong tier, charged
    whole blocks or prefilled from zero changed what TTFT saved reports."""
    r = simulate(ABABA, "lru", two_tiers())
    assert r.ttft_s == pytest.approx([
        PREFILL.seconds(0, 6),
        PREFILL.seconds(0, 8),
        6 * BPT / NVME_BW + PREFILL.seconds(6, 6),   # served by nvme, 4 + 2 tokens
        6 * BPT / CPU_BW + PREFILL.seconds(6, 6),    # served by cpu (highest tier holding it)
        8 * BPT / NVME_BW + PREFILL.seconds(8, 8),
    ], rel=1e-12)
    one = simulate(trace(A, A), "lru", SimConfig(tiers=(TierSpec("cpu", 4, CPU_BW),)))
    assert one.ttft_s == pytest.approx([PREFILL.seconds(0, 6),
                                        6 * BPT / CPU_BW + PREFILL.seconds(6, 6)], rel=1e-12)


def test_bytes_hits_and_evictions_per_tier() -> None:
    """Per-tier counters of the same replay: a hit is served by the highest tier holding
    the block; bytes read are real tokens x bytes per token; cpu writes count new blocks
    and promotions once each; nvme writes a demoted block only if it is not there yet."""
    r = simulate(ABABA, "lru", two_tiers())
    cpu, nvme = r.tiers
    assert (cpu.hit_blocks, nvme.hit_blocks) == (2, 4)
    assert (cpu.hit_tokens, nvme.hit_tokens) == (6, 14)
    assert (cpu.bytes_read, nvme.bytes_read) == (6 * BPT, 14 * BPT)
    assert cpu.bytes_written == 8 * SLOT    # A and B written, then A and B promoted
    assert nvme.bytes_written == 4 * SLOT   # A and B demoted once each, never twice
    assert (cpu.evictions, nvme.evictions) == (6, 0)
    assert (r.hit_blocks, r.references, r.requests) == (6, 10, 5)
    assert (r.hit_tokens, r.total_tokens) == (20, 34)


def test_late_prefetches_are_misses_under_best_effort() -> None:
    """best_effort does not wait: nvme blocks are late, not hits (neither in the totals nor
    in the reuse breakdown), and the request pays no wait."""
    r = simulate(ABABA, "lru", two_tiers(prefetch=PrefetchWait.BEST_EFFORT),
                 reuse_breakdown=True)
    assert r.late_blocks == 2 + 2           # A's and B's returns from nvme
    assert r.hit_blocks == 2 and r.tiers[1].hit_blocks == 0
    assert sum(r.hits_by_distance) == r.hit_blocks
    assert r.ttft_s[2] == pytest.approx(PREFILL.seconds(0, 6), rel=1e-12)


def test_a_timeout_grants_each_block_the_slowest_tiers_transfer_time() -> None:
    """The timeout's grace is base + blocks x (slot / slowest bandwidth): a slow nvme's
    promotions arrive in time. Granting per block the top tier's transfer time instead made
    every nvme block late."""
    r = simulate(trace(A, B, A), "lru", two_tiers(nvme_bw=1e6, prefetch=PrefetchWait.TIMEOUT))
    assert r.late_blocks == 0 and r.tiers[1].hit_blocks == 2


def test_a_lower_tier_keeps_its_capacity() -> None:
    """cpu=1, nvme=1: block 1 goes down when 2 arrives, and is evicted from nvme when 2
    follows it there; it cannot hit afterwards (a lower tier never grows past its size).
    When 1 is written again, 3 goes down and 2 leaves nvme."""
    r = simulate(trace(([1], 4), ([2], 4), ([3], 4), ([1], 4)), "lru", two_tiers(1, 1))
    assert r.hit_blocks == 0
    assert (r.tiers[0].evictions, r.tiers[1].evictions) == (3, 2)


def test_one_tier_counts_its_evictions() -> None:
    r = simulate(trace(([1], 4), ([2], 4), ([3], 4)), "lru",
                 SimConfig(tiers=(TierSpec("cpu", 1, CPU_BW),)))
    assert r.tiers[0].evictions == 2


def test_whole_blocks_count_when_a_record_gives_no_input_length() -> None:
    """input_length 0 (absent from the record): every block counts its full size."""
    r = simulate(trace(([1, 2], 0), ([1, 2], 0)), "lru",
                 SimConfig(tiers=(TierSpec("cpu", 4, CPU_BW),)))
    assert (r.total_tokens, r.hit_tokens, r.references) == (16, 8, 4)


def test_reuse_distance_is_in_total_capacities_and_counts_the_nearest_bucket() -> None:
    """Reuse distances are in multiples of the capacity of all tiers together (cpu 1 +
    nvme 3 = 4 here), and a reuse within half a capacity is counted too."""
    tr = trace(([1], 4), ([1], 4), ([2], 4), ([3], 4), ([4], 4), ([1], 4))
    r = simulate(tr, "lru", two_tiers(1, 3), reuse_breakdown=True)
    # block 1 reused 1 reference later (<= 0.5 x 4) and 4 later (<= 1 x 4)
    assert r.reuses_by_distance == [1, 1, 0, 0, 0, 0, 0]
    assert r.hits_by_distance == [1, 1, 0, 0, 0, 0, 0]


class Refuse:
    """Admission that admits ``keys`` once, then refuses them; admits any other key."""

    def __init__(self, keys: set[Key]) -> None:
        self.keys = keys
        self.seen: set[Key] = set()

    def admit(self, key: Key, *, tier: str, nbytes: int, now: float) -> bool:
        if key not in self.keys:
            return True
        first = key not in self.seen
        self.seen.add(key)
        return first


@pytest.mark.parametrize("order", list(Order))
def test_a_block_refused_by_the_top_tier_still_parents_its_new_child(order: Order) -> None:
    """Block 1 is demoted to nvme, and cpu's admission refuses it from then on: each
    refusal is counted, and
    its new child 2 is still written to cpu (its parent is in the hierarchy), so the next
    request finds both. Treating the refused parent as gone lost the child's hits."""
    config = SimConfig(tiers=(TierSpec("cpu", 1, CPU_BW), TierSpec("nvme", 10, NVME_BW)),
                       admission=lambda tier: Refuse({1} if tier == "cpu" else set()), order=order)
    r = simulate(trace(([1], 4), ([5], 4), ([1, 2], 8), ([1, 2], 8)), "lru", config)
    assert r.tiers[0].rejected == 2          # block 1, at requests 3 and 4
    assert r.ttft_s[3] < r.ttft_s[2]
    assert (r.tiers[0].hit_blocks, r.tiers[1].hit_blocks) == (1, 2)


class NoNvme:
    """Admission that refuses every write to nvme."""

    def admit(self, key: Key, *, tier: str, nbytes: int, now: float) -> bool:
        return tier != "nvme"


def test_a_block_dropped_from_every_tier_takes_its_descendants_and_counts_them() -> None:
    """Head first with cpu=3 and an nvme that takes nothing: inserting block 4 evicts the
    root 1, nvme refuses it, so 1 leaves the hierarchy and 2, 3 and 4 (unreachable now)
    go with it, each counted; 5, whose parent is gone, is not written."""
    config = SimConfig(tiers=(TierSpec("cpu", 3, CPU_BW), TierSpec("nvme", 10, NVME_BW)),
                       admission=lambda tier: NoNvme(), order=Order.REFERENCE)
    r = simulate(trace(([1, 2, 3, 4, 5], 20)), "lru", config)
    assert r.orphans_dropped == 3
    assert (r.tiers[0].evictions, r.tiers[1].rejected) == (1, 1)
    assert r.tiers[0].bytes_written == 4 * SLOT


class Recording:
    """An LRU tier policy that records the depth of each insert."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.depths: dict[Key, int] = {}

    def insert(self, key: Key, **kw: Any) -> None:
        self.depths[key] = kw["depth"]
        self.inner.insert(key, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner


def test_a_demoted_block_keeps_its_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier below learns a demoted block's position in its chain (what cost's
    recompute estimate reads), not depth 0 or one more."""
    made: list[Recording] = []

    def recording(name: str, i: int, config: SimConfig,
                  stats: WorkloadStats | None) -> EvictionPolicy:
        made.append(Recording(make_policy(name, i, config, stats)))
        return cast(EvictionPolicy, made[-1])

    monkeypatch.setattr(simulator, "make_policy", recording)
    simulate(trace(([1, 2, 3], 12), ([7, 8, 9], 12)), "lru", two_tiers(3, 10))
    assert made[1].depths == {1: 0, 2: 1, 3: 2}


def test_belady_demotes_with_the_next_use_of_each_victim() -> None:
    """Two tiers under Belady: when a put takes several victims at once, each goes down
    with its own next use (not "never"), so the tier below keeps the one used again and
    drops the one-offs. Here 1 and 2 are used at the fourth request, 3 and 4 never."""
    tr = trace(([1, 2], 8), ([3, 4], 8), ([5, 6], 8), ([1, 2], 8))
    r = simulate(tr, "belady", two_tiers(2, 2))
    assert r.tiers[1].hit_blocks == 2


def chains(n: int, seed: int) -> Trace:
    """Random prefix-chained requests: a prefix of an earlier request plus fresh blocks."""
    rng = random.Random(seed)
    made: list[list[int]] = []
    fresh = 1
    reqs = []
    for i in range(n):
        base = rng.choice(made)[:rng.randint(0, 5)] if made and rng.random() < 0.7 else []
        tail = list(range(fresh, fresh + rng.randint(1, 4)))
        fresh += len(tail)
        made.append(base + tail)
        reqs.append(Request(float(i), BT * len(made[-1]) - rng.randint(0, BT - 1), 1,
                            tuple(made[-1])))
    return Trace(tuple(reqs), BT, TraceFormat.MOONCAKE)


def checker(made: list[EvictionPolicy], caps: tuple[int, ...],
            parent: dict[int, int | None]) -> Callable[[int], None]:
    """A progress callback that checks the tiers' policies after each request."""
    def check(_: int) -> None:
        for pol, cap in zip(made, caps, strict=True):
            assert len(pol) <= cap
        held = {b for b in parent if any(b in pol for pol in made)}
        assert all(parent[b] is None or parent[b] in held for b in held)

    return check


@pytest.mark.timeout(60)  # a policy left holding a dropped block loops in make_room
@pytest.mark.parametrize("order", list(Order))
@pytest.mark.parametrize("policy", ["lru", "lfu", "cost", "belady"])
def test_no_tier_over_capacity_and_no_resident_orphan(
        monkeypatch: pytest.MonkeyPatch, policy: str, order: Order) -> None:
    """After every request of random traces, with one tier and with two: each tier's policy
    holds at most its capacity, and every block held in some tier has its parent held in
    some tier (an orphan is unreachable: it must neither be written nor stay)."""
    made: list[EvictionPolicy] = []

    def recording(name: str, i: int, config: SimConfig,
                  stats: WorkloadStats | None) -> EvictionPolicy:
        made.append(make_policy(name, i, config, stats))
        return made[-1]

    monkeypatch.setattr(simulator, "make_policy", recording)
    for seed in range(4):
        tr = chains(60, seed)
        parent = {b: (r.blocks[d - 1] if d else None)
                  for r in tr.requests for d, b in enumerate(r.blocks)}
        for caps in ((5,), (3, 4), (4, 2)):
            made.clear()
            config = SimConfig(tiers=tuple(TierSpec(f"t{j}", c, 1e9 / (j + 1))
                                           for j, c in enumerate(caps)), order=order)

            simulate(tr, policy, config, progress=checker(made, caps, parent))
