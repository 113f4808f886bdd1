"""The store's counters and namespace registry (``kvtier.store.stats``, ``namespaces``,
``reads``, ``writes``, ``coordinator``), pinned where a mutation review found no test
noticing a check broken: each lookup counts its hits and misses once, in the tier that
answered; a re-registered namespace is the most recently used; a block whose recorded
layout is not the caller's is a miss."""

from __future__ import annotations

from kvtier.index import SlotState
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.store.stats import BytesMoved, RequestCounters, count_redis_lookup
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.base import TierCounters, TierName
from kvtier.tiers.nvme import NvmeTier
from tests.support.store import DIGEST, FP, LAYOUT, FakeClock, chain, put

TPB = LAYOUT.tokens_per_block


def _counts(store: TieredStore) -> tuple[int, int, int, int, int, int, int, int]:
    assert store.nvme is not None
    cpu, nvme = store.cpu.counters, store.nvme.counters
    return (cpu.hit_blocks, cpu.miss_blocks, cpu.hit_tokens, cpu.miss_tokens,
            nvme.hit_blocks, nvme.miss_blocks, nvme.hit_tokens, nvme.miss_tokens)


async def _split_chain(store: TieredStore, client: ArenaMapping) -> list[bytes]:
    """chain(4) with its first two blocks in the arena and its last two on nvme only."""
    keys = chain(4)
    await put(store, client, keys, durable=True)
    for k in keys[2:]:
        await store.demoter.evict_cpu(k)
    assert [store.index[k].in_cpu for k in keys] == [True, True, False, False]
    assert all(store.index[k].in_nvme for k in keys)
    return keys


async def test_a_lookup_counts_each_block_once_in_the_tier_that_answered(
        store: TieredStore, client: ArenaMapping) -> None:
    """Two blocks in cpu, two on nvme, a fifth nowhere: cpu hits 2 and misses 3 (the two
    found below it and the one that stopped the walk), nvme hits 2 and misses 1; tokens
    follow blocks (mutants: hit tokens counted for every key asked, nvme hits counted as
    every local hit, the stopping block not counted as an nvme miss)."""
    keys = await _split_chain(store, client)
    before = _counts(store)
    req_before = (store.requests.lookup_tokens, store.requests.hit_tokens)
    res = await store.lookup(DIGEST, FP, chain(5), prefetch=False)
    assert res.hits == 4 and res.tiers == ["cpu", "cpu", "nvme", "nvme"]
    delta = [a - b for a, b in zip(_counts(store), before, strict=True)]
    assert delta == [2, 3, 2 * TPB, 3 * TPB, 2, 1, 2 * TPB, 1 * TPB]
    assert (store.requests.lookup_tokens - req_before[0],
            store.requests.hit_tokens - req_before[1]) == (5 * TPB, 4 * TPB)
    assert chain(5)[:4] == keys


async def test_a_whole_hit_counts_no_miss_in_any_tier(
        store: TieredStore, client: ArenaMapping) -> None:
    """A lookup whose every block is local stops nowhere: no miss in cpu (beyond the blocks
    found on nvme) nor on nvme (mutant: the stopping block counted on every lookup)."""
    keys = await _split_chain(store, client)
    before = _counts(store)
    assert (await store.lookup(DIGEST, FP, keys, prefetch=False)).hits == 4
    delta = [a - b for a, b in zip(_counts(store), before, strict=True)]
    assert delta == [2, 2, 2 * TPB, 2 * TPB, 2, 0, 2 * TPB, 0]
    before = _counts(store)
    assert (await store.lookup(DIGEST, FP, keys[:2], prefetch=False)).hits == 2
    delta = [a - b for a, b in zip(_counts(store), before, strict=True)]
    assert delta == [2, 0, 2 * TPB, 0, 0, 0, 0, 0]


def test_request_counters_count_hit_tokens_of_the_hits_only() -> None:
    """``hit_tokens`` follows the blocks found, ``lookup_tokens`` those asked, and the
    prefix hit rate is their block ratio (mutant: hit tokens of every block asked)."""
    r = RequestCounters()
    r.lookup(4, 1, 16)
    r.lookup(2, 0, 16)
    assert (r.lookups, r.lookup_blocks, r.hit_blocks) == (2, 6, 1)
    assert (r.lookup_tokens, r.hit_tokens) == (96, 16)
    assert r.prefix_hit_rate == 1 / 6


def test_a_redis_probe_answering_more_than_asked_counts_only_what_was_asked() -> None:
    """A probe's answer is clamped to the blocks asked: a tier reporting more (a bug, or a
    stale count) cannot inflate the hits (mutant: only the lower bound kept)."""
    c = TierCounters()
    count_redis_lookup(c, 2, 5, 16)
    assert (c.hit_blocks, c.hit_tokens, c.miss_blocks) == (2, 32, 0)
    count_redis_lookup(c, 3, -1, 16)
    assert (c.hit_blocks, c.miss_blocks, c.miss_tokens) == (2, 1, 16)


def test_bytes_moved_add_up_per_pair() -> None:
    """Two moves between the same tiers add up (mutant: the last move overwrote the sum)."""
    moved = BytesMoved()
    moved.add(TierName.CPU, TierName.NVME, 100)
    moved.add(TierName.CPU, TierName.NVME, 50)
    moved.add(TierName.NVME, TierName.CPU, 7)
    assert moved.rows() == [{"src": "cpu", "dst": "nvme", "bytes": 150},
                            {"src": "nvme", "dst": "cpu", "bytes": 7}]


def test_a_re_registered_namespace_is_the_most_recently_used(
        arena: Arena, nvme: NvmeTier, clock: FakeClock) -> None:
    """Registering a known namespace again (a client reconnecting) marks it used: with
    room for two, A, B, A again, then C forgets B and keeps A (mutant: the registration
    kept A's old place, and the live client's namespace was forgotten under it)."""
    s = TieredStore(arena, nvme=nvme, clock=clock, max_namespaces=2)
    a = s.register_namespace(LAYOUT, "m/a", 0, 1, None)
    b = s.register_namespace(LAYOUT, "m/b", 0, 1, None)
    assert s.register_namespace(LAYOUT, "m/a", 0, 1, None) == a
    c = s.register_namespace(LAYOUT, "m/c", 0, 1, None)
    assert list(s.namespaces) == [a.digest, c.digest]
    assert s.touch_namespace(b.digest) is None and s.namespaces_evicted == 1


async def test_a_block_recorded_under_another_layout_is_a_miss(
        store: TieredStore, client: ArenaMapping) -> None:
    """A block of the caller's namespace and block size whose recorded layout fingerprint
    is another (a frame from an older layout) is a counted miss, never served (mutant: only
    the block size compared)."""
    keys = chain(2)
    await put(store, client, keys)
    other = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16",
                     tokens_per_block=128)
    assert other.block_bytes == LAYOUT.block_bytes and other.fingerprint != FP
    store.index[keys[0]].layout_fp = other.fingerprint
    assert (await store.lookup(DIGEST, FP, keys)).hits == 0
    lease, offsets = await store.prepare_get(1, DIGEST, FP, keys)
    assert offsets == []
    await store.release_get(1, lease)
    assert store.requests.layout_mismatch == 2
    assert store.index[keys[1]].cpu_state is SlotState.READY
