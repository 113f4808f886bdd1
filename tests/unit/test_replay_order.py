"""The order in which a replayed request's blocks reach the policy (``SimConfig.order``).

kvtier's store touches a request's hits tail first (the lookup's ``touch_chain``), makes
room for its new blocks before they reach the policy, and inserts them tail first
(kvtier/store/cpu.py ``ready_many``): a chain's head is the most recent of its hits, and
the new blocks are more recent than the hits. ``simulate`` does the same by default
(``store``) and head first on request (``reference``, the semantics of the reference
figures in shared/traces/README.md). Found by review: head first, LRU evicted a chain's
root and orphaned the chain (a chat trace at 1%: 0.290 of the tokens head first, 0.321 in
the store's order), and ``kvtier replay`` said so of kvtier.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import block_keys
from kvtier.policy.base import EvictionPolicy, Key
from kvtier.policy.prefix import PrefixForest
from kvtier.policy.stats import WorkloadStats
from kvtier.replay import cli
from kvtier.replay.simulator import (
    PUT_EVICT_BATCH,
    Order,
    SimConfig,
    TierSpec,
    make_policy,
    simulate,
)
from kvtier.replay.trace import Request, Trace, TraceFormat
from kvtier.store import TieredStore
from kvtier.store.alloc import EVICT_BATCH
from tests.support.arena import temp_arena
from tests.support.store import BLOCK, DIGEST, FP, LAYOUT, NAMESPACE

POLICIES = ("lru", "lfu", "cost", "hindsight", "adaptive", "belady")


def tiny(blocks: list[list[int]]) -> Trace:
    return Trace(tuple(Request(float(i), 4 * len(b), 1, tuple(b)) for i, b in enumerate(blocks)),
                 4, TraceFormat.MOONCAKE)


def one_tier(cap: int, order: Order = Order.STORE) -> SimConfig:
    return SimConfig(tiers=(TierSpec("cpu", cap, 25e9),), order=order)


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    """Token lists: a Zipf-popular shared prefix of 1-5 blocks (or none) + 1-3 fresh
    blocks, some requests extending the previous one of their prefix (a conversation)."""
    rng = random.Random(seed)
    bt = LAYOUT.tokens_per_block
    heads = [list(range(bt * rng.randint(1, 5))) for _ in range(8)]
    for i, h in enumerate(heads):
        heads[i] = [t + 1_000_000 * (i + 1) for t in h]
    last: dict[int, list[int]] = {}
    fresh = 50_000_000
    out = []
    for _ in range(n):
        k = rng.randint(1, 3)
        tail = list(range(fresh, fresh + bt * k))
        fresh += bt * k
        if rng.random() < 0.2:
            out.append(tail)
            continue
        i = min(7, int(rng.paretovariate(1.0)) - 1)
        base = last.get(i, heads[i]) if rng.random() < 0.5 else heads[i]
        last[i] = base + tail
        out.append(base + tail)
    return out


def test_the_store_order_keeps_a_chain_head_where_head_first_loses_it() -> None:
    tr = tiny([[1, 2, 3], [1, 2, 3]])
    assert simulate(tr, "lru", one_tier(2, Order.REFERENCE)).hit_blocks == 0
    # tail first the head is the most recent: a chain too long for the tier keeps its head
    store = simulate(tr, "lru", one_tier(2))
    assert store.hit_blocks == 2 and store.orphans_dropped == 0
    assert store.order == "store" and simulate(tr, "lru", one_tier(2, Order.REFERENCE)
                                               ).order == "reference"
    assert SimConfig(tiers=(), order="reference").order is Order.REFERENCE  # type: ignore[arg-type]


def test_a_request_is_written_whole_before_anything_is_evicted() -> None:
    """A put makes room before its blocks reach the policy, so a frequent old block goes
    before the request's new one (head first, the new block is LFU's victim at once)."""
    tr = tiny([[1], [1], [1], [2], [1]])
    assert simulate(tr, "lfu", one_tier(1, Order.REFERENCE)).hit_blocks == 3
    assert simulate(tr, "lfu", one_tier(1)).hit_blocks == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_takes_a_child_before_its_parent(policy: str) -> None:
    """A chain inserted tail first (the store's order) leaves tail first, under every
    policy (belady: every block used next at once; a parent is never used after its child)."""
    cfg = one_tier(64)
    stats = WorkloadStats() if policy in ("cost", "hindsight", "adaptive") else None
    pol: EvictionPolicy = make_policy(policy, 0, cfg, stats)
    n = 12
    for d in reversed(range(n)):
        if policy == "belady":
            pol.next_use = 100 + d  # type: ignore[attr-defined]
        pol.insert(d, nbytes=1, parent=d - 1 if d else None, depth=d, now=0.0)
    order: list[Key] = []
    while (v := pol.victim()) is not None:
        order.append(v)
        pol.remove(v)
    assert order == list(reversed(range(n)))


@pytest.mark.parametrize("policy", POLICIES)
def test_store_order_replays_are_deterministic_and_bounded_by_belady(policy: str) -> None:
    rng = random.Random(3)
    heads = [list(range(100 * i, 100 * i + rng.randint(1, 6))) for i in range(1, 30)]
    fresh = 10_000
    reqs = []
    for _ in range(1500):
        h = heads[min(28, int(rng.paretovariate(0.8)) - 1)]
        reqs.append(h + list(range(fresh, fresh + rng.randint(1, 4))))
        fresh += 4
    tr = tiny(reqs)
    for cap in (20, 60):
        a = simulate(tr, policy, one_tier(cap))
        b = simulate(tr, policy, one_tier(cap))
        assert (a.hit_blocks, a.hit_tokens, a.orphans_dropped, a.tiers[0].evictions) == (
            b.hit_blocks, b.hit_tokens, b.orphans_dropped, b.tiers[0].evictions)
        assert a.hit_blocks <= simulate(tr, "belady", one_tier(cap)).hit_blocks


def test_two_tiers_in_the_store_order() -> None:
    """Two tiers in the store's order: the top tier's victims go down and come back as
    hits of the tier below; nothing is lost or orphaned."""
    tr = tiny([[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6]])
    cfg = SimConfig(tiers=(TierSpec("cpu", 3, 25e9), TierSpec("nvme", 10, 3e9)))
    r = simulate(tr, "lru", cfg)
    assert r.hit_blocks == 6 and r.orphans_dropped == 0
    assert r.tiers[0].evictions == 9 and r.tiers[1].hit_blocks == 6


async def test_lru_replay_in_the_store_order_hits_what_the_store_hits() -> None:
    """The real store (lookup, then put, per request; LRU; a 24-block arena) and the
    replay of the same chains hit the same blocks in the store's order (the lookup touches
    its hits tail first, the put evicts for its new blocks PUT_EVICT_BATCH at a time, the
    commit inserts them tail first); head first, the replay hits fewer."""
    blocks = 24
    ids: dict[bytes, int] = {}
    reqs = []
    store_hits = []
    with temp_arena(blocks * BLOCK, BLOCK) as arena:
        store = TieredStore(arena, eviction="lru", prefetch_wait="wait",
                            forest=PrefixForest())  # (the daemon's: orphans go)
        assert store.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
        for i, tokens in enumerate(prompts(400)):
            keys = block_keys(NAMESPACE, np.array(tokens))
            store_hits.append((await store.lookup(DIGEST, FP, keys)).hits)
            lease, _ = await store.prepare_put(1, DIGEST, FP, keys)
            await store.commit_put(1, lease)
            reqs.append(Request(float(i), len(keys) * LAYOUT.tokens_per_block, 1,
                                tuple(ids.setdefault(bytes(k), len(ids)) for k in keys)))
        assert store.cpu.resident == blocks
    trace = Trace(tuple(reqs), LAYOUT.tokens_per_block, TraceFormat.MOONCAKE)
    store_order = simulate(trace, "lru", one_tier(blocks))
    assert store_order.hit_blocks == sum(store_hits) and store_order.orphans_dropped > 0
    head_first = simulate(trace, "lru", one_tier(blocks, Order.REFERENCE))
    assert head_first.hit_blocks < sum(store_hits)


def test_a_put_evicts_as_many_victims_at_a_time_as_the_store() -> None:
    assert PUT_EVICT_BATCH == EVICT_BATCH


def test_the_cli_replays_in_the_store_order_unless_told(
        capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(Path(__file__).resolve().parents[1] / "fixtures" / "traces"
                / "mooncake_small.jsonl")
    for argv, order in (([], "store"), (["--order", "reference"], "reference")):
        assert cli.main(["replay", trace, "--policy", "lru", "--capacity-fraction", "0.3",
                         "--json", *argv]) == 0
        assert f'"order": "{order}"' in capsys.readouterr().out
