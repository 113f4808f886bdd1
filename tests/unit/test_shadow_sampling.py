"""The shadows' sample treats every key alike (found by review: ``key_hash(0) == 0``, below
every sampling threshold, so block id 0, in a replayed trace usually the root of the most
popular prompt, was always sampled: 40-71% of the sampled references of RAG, phase and
drift traces, and shadow hit rates above Belady's)."""

from __future__ import annotations

import random

import numpy as np

from kvtier.policy.base import EvictionPolicy, make_eviction_policy
from kvtier.policy.shadow import MAX_RATE, TierShadows, digest_hashes, key_hash
from kvtier.replay.simulator import SimConfig, TierSpec, simulate
from kvtier.replay.trace import Request, Trace, TraceFormat

SHIFT = 1_000_003


def _shares(chains: list[list[int]], shift: int) -> float:
    """The share of the block references the shadows sample at the highest rate."""
    sh = TierShadows(make_eviction_policy, capacity_blocks=64, modes=("lru",), rate=MAX_RATE)
    refs = sampled = 0
    for chain in chains:
        keys = [k + shift for k in chain]
        refs += len(keys)
        sampled += len(sh.sample(keys, lambda _d: 1))
    return sampled / refs


def rag_like(n: int = 3000, docs: int = 600, seed: int = 9) -> Trace:
    """The review's ``rag09`` in small: a 3-block system prompt (ids 0-2, so id 0 opens
    every request) + a Zipf(0.9)-popular document of 4-15 blocks + a fresh question block
    (shorter documents than the review's 4-39 blocks: 83k references instead of 364k, id
    0 as large a share of a buggy sample, 57% instead of 40%)."""
    rng = np.random.default_rng(seed)
    nxt = 3
    doc_ids = []
    for length in rng.integers(4, 16, size=docs):
        doc_ids.append(list(range(nxt, nxt + int(length))))
        nxt += int(length)
    p = 1.0 / np.arange(1, docs + 1) ** 0.9
    picks = rng.choice(docs, size=n, p=p / p.sum())
    reqs = []
    for i, d in enumerate(picks):
        blocks = (0, 1, 2, *doc_ids[d], nxt)
        nxt += 1
        reqs.append(Request(float(i), len(blocks) * 512 - 37, 300, blocks))
    return Trace(tuple(reqs), 512, TraceFormat.MOONCAKE)


def test_id_0_is_sampled_like_any_other_key() -> None:
    """A trace whose every request opens with id 0, and the same trace with every id
    shifted: the same share of the references in the sample (each hot root is one key,
    in the sample or not as its hash says, like any key; neither is here)."""
    assert key_hash(0) != 0
    rng = random.Random(4)
    chains, nxt = [], 1
    for _ in range(2000):
        k = rng.randint(4, 40)
        chains.append([0, *range(nxt, nxt + k)])
        nxt += k
    orig, shifted = _shares(chains, 0), _shares(chains, SHIFT)
    assert abs(orig - shifted) < 0.01, (orig, shifted)
    assert abs(orig - MAX_RATE) < 0.01   # the fresh blocks sample at the rate


def test_the_sampled_hashes_agree_for_ints_and_digests() -> None:
    """``sample``'s inlined hash of replay's ints and ``digest_hashes`` of the daemon's
    digests are ``key_hash``, offset included."""
    sh = TierShadows(make_eviction_policy, capacity_blocks=64, modes=("lru",), rate=0.5)
    keys = [0, 1, 2, SHIFT, -5, 2**70, *range(100, 300)]
    th = int(0.5 * (1 << 24))
    assert [k for k, _, _ in sh.sample(keys, lambda _d: 1)] == [
        k for k in keys if key_hash(k) < th]
    digests = [bytes(16), *(random.Random(2).randbytes(16) for _ in range(99))]
    hashes = digest_hashes(digests)
    assert hashes is not None and hashes.tolist() == [key_hash(k) for k in digests]
    assert key_hash(bytes(16)) == key_hash(0) != 0


def test_shadow_estimates_stay_at_or_below_belady_on_a_rag_trace() -> None:
    """Review's rag09 at 40%: the shadows said 0.919 (hindsight) where the replay hit 0.759
    and Belady 0.819, id 0 being 40% of their sample. On a small trace of that shape each
    mode's 1x estimate stays at or below Belady's hit rate at the same size (with id 0
    always sampled: 0.77-0.78 over Belady's 0.725 at 10%, 0.87 over 0.823 at 40%).

    This checks the bias of id 0, not the sample's variance: a hot root that the hash puts
    in the sample still inflates the estimate (the review's rag09 with its ids shifted by
    1,000,003: 0.58 at 1% against a replay's 0.35). Here ids 0-2 are out of the sample."""
    trace = rag_like()

    def make(mode: str) -> EvictionPolicy:
        return make_eviction_policy(mode)

    for fraction in (0.1, 0.4):
        cap = int(trace.n_unique_blocks * fraction)
        cfg = SimConfig(tiers=(TierSpec("cpu", cap, 25e9),))
        belady = simulate(trace, "belady", cfg).token_hit_rate
        sh = TierShadows(make, capacity_blocks=cap, modes=("lru", "lfu"))
        for r in trace.requests:
            def tokens(d: int, n: int = r.input_tokens) -> int:
                return max(0, min(512, n - 512 * d))

            sh.on_request(r.blocks, tokens, r.arrival_s)
        rates = sh.hit_rates()
        assert sh.sampled > 1000 and max(rates.values()) <= belady, (fraction, rates, belady)
