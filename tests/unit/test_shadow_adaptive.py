"""Shadow caches, the adaptive policy and the miss-ratio-curve readers (no processes)."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.daemon.metrics import KVTierCollector
from kvtier.policy.adaptive import AdaptivePolicy, ShadowObserver
from kvtier.policy.base import EvictionPolicy, Key, make_eviction_policy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.mrc import plan_lines, predict, render_table, sizing_notes
from kvtier.policy.shadow import (
    MAX_RATE,
    MIN_RATE,
    MRC_SCALES,
    ShadowCache,
    TierShadows,
    digest_hashes,
    key_hash,
    sampling_rate,
)


class MRUPolicy:
    """Evicts the most recently used block: a deliberately bad mode for recency workloads."""

    name = "mru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, *, nbytes: int = 0, parent: Key | None = None, depth: int = 0,
               now: float = 0.0, block_tokens: int = 0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key, *, now: float = 0.0) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self) -> Key | None:
        return next(reversed(self._order), None)

    def set_pinned(self, key: Key, pinned: bool) -> None:
        pass

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


def _make(mode: str) -> EvictionPolicy:
    return MRUPolicy() if mode == "mru" else LRUPolicy()


def _sliding(n: int) -> list[list[int]]:
    """Requests of the 20 blocks before block ``i`` then block ``i`` (fresh): LRU hits all
    of them with 32 slots, MRU keeps old blocks and misses the recent ones."""
    return [[j * 7919 + 1 for j in range(max(0, i - 20), i)] + [i * 7919 + 1]
            for i in range(n)]


def test_key_hash_is_stable_and_uniform() -> None:
    assert key_hash(12345) == key_hash(12345)
    assert key_hash(b"\x01" * 16) == key_hash(b"\x01" * 16)
    n = 20_000
    under = sum(key_hash(i) < (1 << 24) // 10 for i in range(n))
    assert abs(under / n - 0.1) < 0.01  # sequential ids sample at the rate


def test_a_chain_of_digests_is_hashed_at_once_as_key_by_key() -> None:
    """The daemon's 16-byte keys take the numpy path (digest_hashes); the same hashes and
    the same sampled sub-chain as key_hash, one key at a time; other chains do not."""
    rng = random.Random(7)
    digests = [rng.randbytes(16) for _ in range(5000)]
    hashes = digest_hashes(digests)
    assert hashes is not None and hashes.tolist() == [key_hash(k) for k in digests]
    shadows = TierShadows(make_eviction_policy, capacity_blocks=64, modes=("lru",), rate=0.1)
    sampled = shadows.sample(digests, lambda d: 16)
    th = int(0.1 * (1 << 24))
    assert sampled == [(k, d, 16) for d, k in enumerate(digests) if key_hash(k) < th]
    assert 350 < len(sampled) < 650
    assert digest_hashes(list(range(5000))) is None                 # replay's int keys
    assert digest_hashes([*digests[:99], b"\x00" * 8, b"\x00" * 24]) is None
    assert digest_hashes(digests[:10]) is None                      # short: key by key


def test_sampling_rate_follows_capacity_within_bounds() -> None:
    assert sampling_rate(10) == MAX_RATE
    assert sampling_rate(10**9) == MIN_RATE
    assert MIN_RATE < sampling_rate(20_000) < MAX_RATE


def test_shadow_cache_hits_the_longest_resident_prefix_and_drops_orphans() -> None:
    """The store's order: the hit prefix is touched tail first (its head the most recent),
    room is made for the new blocks, which are then inserted tail first; LRU shortens a
    chain from its tail and keeps its root."""
    cache = ShadowCache(LRUPolicy(), 3)
    cache.access([(1, 0, 10), (2, 1, 10), (3, 2, 10)], 0.0, 30)
    assert cache.hits == 0
    cache.access([(1, 0, 10), (9, 1, 10)], 0.0, 20)  # 1 hits; 9 pushes out 3 (the LRU block)
    assert cache.hits == 10
    assert 3 not in cache.policy and cache.resident == {1, 2, 9}
    cache.access([(1, 0, 10), (2, 1, 10), (3, 2, 10)], 0.0, 30)  # 1 and 2 hit
    assert cache.hits == 30 and cache.hit_rate == pytest.approx(30 / 80)
    assert cache.resident == {1, 2, 3}
    # a policy that evicts a chain's head (MRU: the head is the most recent) orphans the
    # rest of its chain, which leaves with it
    mru_policy = MRUPolicy()
    mru = ShadowCache(mru_policy, 3)
    mru.access([(1, 0, 10), (2, 1, 10), (3, 2, 10)], 0.0, 30)
    mru.access([(5, 0, 10), (6, 1, 10)], 0.0, 20)  # room for 2: 1 goes, 2 and 3 with it
    assert mru.resident == {5, 6} and not {1, 2, 3} & set(mru_policy._order)


def test_shadows_switch_to_the_mode_that_hits_more() -> None:
    sh = TierShadows(_make, capacity_blocks=32, modes=("mru", "lru"), rate=1.0)
    assert sh.mode == "mru"
    for keys in _sliding(3000):
        sh.on_request(keys, lambda _d: 1, 0.0)
    assert sh.mode == "lru" and len(sh.switches) == 1
    assert sh.hit_rates()["lru"] > 0.8 > 0.5 > sh.hit_rates()["mru"]
    assert [s for s, _ in sh.curve()] == list(MRC_SCALES)
    # the curve is the live mode's: its other sizes were rebuilt under lru at the switch
    assert all(isinstance(c.policy, LRUPolicy) for c in sh.sizes.values())


def test_shadows_do_not_flap_between_equal_modes() -> None:
    sh = TierShadows(_make, capacity_blocks=32, modes=("a", "b"), rate=1.0)
    for keys in _sliding(3000):
        sh.on_request(keys, lambda _d: 1, 0.0)
    assert sh.switches == []


def test_adaptive_policy_follows_its_shadows_and_keeps_residency() -> None:
    sh = TierShadows(_make, capacity_blocks=32, modes=("mru", "lru"), rate=1.0)
    pol = AdaptivePolicy(_make, sh)
    hits = total = 0
    for i, keys in enumerate(_sliding(3000)):
        if i >= 2000:
            total += len(keys)
            hits += sum(k in pol for k in keys)
        sh.on_request(keys, lambda _d: 1, 0.0)
        for k in keys:
            if k in pol:
                pol.touch(k)
            else:
                pol.insert(k, nbytes=1)
            while len(pol) > 32:
                v = pol.victim()
                assert v is not None
                pol.remove(v)
    assert pol.mode == "lru"
    assert hits / total > 0.8  # after the switch the live tier hits like LRU
    pol.set_pinned(keys[0], True)
    for _ in range(40):  # a pinned block is never the victim, across a rebuild too
        v = pol.victim()
        assert v != keys[0]
        pol.remove(v)
    assert keys[0] in pol and len(pol) == 1


def test_adaptive_policy_sizes_its_shadows_from_bytes_or_first_eviction() -> None:
    pol = make_eviction_policy("adaptive", capacity_bytes=64 * 1024)
    assert isinstance(pol, AdaptivePolicy) and not pol.shadows.active
    pol.insert(b"k" * 16, nbytes=1024)
    assert pol.shadows.capacity_blocks == 64
    other = AdaptivePolicy(_make, TierShadows(_make, modes=("lru", "mru")))
    for k in range(10):
        other.insert(k, nbytes=1)
    other.victim()
    assert other.shadows.capacity_blocks == 10


def test_observer_feeds_every_tier_and_forwards() -> None:
    seen: list[int] = []

    class Inner:
        def on_lookup(self, keys: Sequence[Key], hit_blocks: int, *, now: float) -> None:
            seen.append(len(keys))

    sh = TierShadows(_make, capacity_blocks=8, modes=("lru",), rate=1.0)
    obs = ShadowObserver({"cpu": sh}, inner=Inner(), block_tokens=16)
    obs.on_lookup([1, 2, 3], 0, now=0.0)
    obs.on_lookup([1, 2, 3], 3, now=0.0)
    assert seen == [3, 3] and sh.references == 6
    snap = obs.snapshot()["cpu"]
    assert snap["mode"] == "lru" and snap["sampled_references"] == 6
    mrc = snap["mrc"]
    assert isinstance(mrc, list)
    assert {p["scale"]: p["hit_rate"] for p in mrc}[1.0] == pytest.approx(0.5)


STATS = {
    "tiers": {"cpu": {"capacity_bytes": 8 * 2**30}},
    "policy": {"eviction": "adaptive", "tiers": {"cpu": {
        "mode": "cost", "switches": 1, "modes": {"cost": 0.3, "lru": 0.25, "lfu": 0.28},
        "mrc": [{"scale": 0.25, "hit_rate": 0.10}, {"scale": 0.5, "hit_rate": 0.2},
                {"scale": 1.0, "hit_rate": 0.3}, {"scale": 2.0, "hit_rate": 0.4},
                {"scale": 4.0, "hit_rate": 0.45}]}}},
}


def test_predict_interpolates_in_log_scale() -> None:
    curve = [(0.5, 0.2), (1.0, 0.3), (2.0, 0.4)]
    assert predict(curve, 1.0) == pytest.approx(0.3)
    assert predict(curve, 2**0.5) == pytest.approx(0.35)
    assert predict(curve, 8.0) is None and predict([], 1.0) is None


def test_plan_doctor_and_stats_read_the_curve() -> None:
    lines = plan_lines(STATS)
    assert "a cpu tier of 16.0 GiB (2x) would raise its token hit rate from 30.0% to 40.0%" \
        in lines[2]
    notes = sizing_notes(STATS)
    assert len(notes) == 1 and notes[0].startswith("cpu tier too small")
    flat = {**STATS, "policy": {"tiers": {"cpu": {"mrc": [
        {"scale": 0.5, "hit_rate": 0.299}, {"scale": 1.0, "hit_rate": 0.3},
        {"scale": 2.0, "hit_rate": 0.3}]}}}}
    assert sizing_notes(flat)[0].startswith("cpu tier larger than its hit rate needs")
    table = render_table(STATS)
    assert "cost" in table and "40.0%" in table


def test_metrics_export_the_curve_and_the_mode() -> None:
    fams = {m.name: m for m in KVTierCollector(lambda: STATS).collect()}
    mrc = {s.labels["scale"]: s.value for s in fams["kvtier_policy_mrc_hit_rate"].samples}
    assert mrc == {"0.25": 0.1, "0.5": 0.2, "1": 0.3, "2": 0.4, "4": 0.45}
    modes = {s.labels["mode"]: s.value for s in fams["kvtier_policy_mode"].samples}
    assert modes == {"cost": 1.0, "lru": 0.0, "lfu": 0.0}


def _cli(module: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    import argparse
    import importlib

    parser = argparse.ArgumentParser(prog="kvtier")
    importlib.import_module(module).add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    code = args.func(args)
    return code, capsys.readouterr().out


def test_plan_and_doctor_read_a_saved_live_curve(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    import json

    path = tmp_path / "stats.json"
    path.write_text(json.dumps({**STATS, "daemon": {}, "requests": {}, "connector": {}}))
    code, out = _cli("kvtier.plan.cli", capsys, "plan", "--model", "llama-2-13b",
                     "--live-stats", str(path))
    assert code == 0
    assert "a cpu tier of 16.0 GiB (2x) would raise its token hit rate from 30.0% to 40.0%" \
        in " ".join(out.split())
    _, out = _cli("kvtier.doctor.cli", capsys, "doctor", "--stats", str(path))
    assert "cpu tier too small for this workload" in " ".join(out.split())


def test_stats_table_shows_the_mode_and_curve() -> None:
    from kvtier.cli import render_stats

    text = render_stats(STATS)
    assert "policy adaptive" in text and "cost" in text and "45.0%" in text


def test_a_switch_rebuilds_deep_chains() -> None:
    def make(mode: str) -> EvictionPolicy:
        return make_eviction_policy(mode)

    pol = AdaptivePolicy(make, TierShadows(make, modes=("lru", "cost")))
    n = 5000  # deeper than Python's recursion limit
    for d in range(n):
        pol.insert(d, nbytes=1, parent=d - 1 if d else None, depth=d)
    for d in reversed(range(n)):  # the store's order: tail first, the head most recent
        pol.touch(d)
    pol.shadows.mode = "cost"
    assert pol.victim() == n - 1  # cost evicts leaves only: the chain's tail
    assert pol.mode == "cost" and len(pol) == n


def test_a_switch_keeps_the_recency_of_a_chain_touched_tail_first() -> None:
    """A rebuild inserts the resident blocks in recency order, children before their
    parents where the store touched them so: a switch to ``lru`` still evicts the chain's
    tail first (inserted parents first, the root would be the least recent again)."""
    def make(mode: str) -> EvictionPolicy:
        return make_eviction_policy(mode)

    pol = AdaptivePolicy(make, TierShadows(make, modes=("cost", "lru")))
    for d in reversed(range(10)):  # tail first, as kvtier/store/cpu.py ready_many does
        pol.insert(d, nbytes=1, parent=d - 1 if d else None, depth=d)
    pol.shadows.mode = "lru"
    assert pol.victim() == 9 and pol.mode == "lru"
