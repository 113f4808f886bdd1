"""Miss explanations: each first-miss reason, produced by a real store's own drop paths.

A TieredStore in-process (real shared-memory arena, real nvme files under tmp_path), the
MissLog hooked in as the daemon does; every test makes one reason happen the way it does in
production and reads it back from the ring.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import RedisConfig
from kvtier.errors import LayoutMismatch
from kvtier.explain import MissLog, MissReason
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.policy.admission import TierAdmission, WriteBudget
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.slab import PAGE
from tests.support.arena import temp_arena
from tests.support.store import nvme_corrupt_payload

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=128)
BLOCK = LAYOUT.block_bytes
NS = Namespace("test/model", LAYOUT)
FP = LAYOUT.fingerprint


def chain(n: int, start: int = 0) -> list[bytes]:
    tokens = list(range(start * 10_000, start * 10_000 + n * LAYOUT.tokens_per_block))
    return block_keys(NS, tokens)


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(4 * BLOCK, BLOCK) as a:
        yield a


@pytest.fixture
def client(arena: Arena) -> Iterator[ArenaMapping]:
    m = ArenaMapping(str(arena.path), arena.size)
    yield m
    m.close()


def make_store(arena: Arena, **kwargs: Any) -> TieredStore:
    s = TieredStore(arena, eviction="lru", prefetch_wait="wait", **kwargs)
    s.register_namespace(LAYOUT, "test/model", 0, 1, None)
    s.explain = MissLog(policies={"cpu": s.cpu_policy.name, "nvme": s.nvme_policy.name})
    return s


@pytest.fixture
async def store(arena: Arena) -> AsyncIterator[TieredStore]:
    s = make_store(arena)
    yield s
    await s.drain(s.clock() + 5)


async def put(store: TieredStore, client: ArenaMapping, keys: list[bytes]) -> None:
    lease, offsets = await store.prepare_put(1, NS.digest, FP, keys)
    for off in offsets:
        if off is not None:
            client.view(off, BLOCK, writable=True)[:] = memoryview(b"\x07" * BLOCK)
    await store.commit_put(1, lease)


def miss_log(store: TieredStore) -> MissLog:
    """The store's explain log (``make_store`` set it)."""
    log = store.explain
    assert isinstance(log, MissLog)
    return log


def last(store: TieredStore) -> dict[str, Any]:
    return miss_log(store).recent(1, namespaces={NS.digest: {"model_id": "test/model"}})[0]


async def test_full_hit_and_never_stored(store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(3)
    await put(store, client, keys[:2])
    await store.lookup(NS.digest, FP, keys[:2])
    assert last(store)["reason"] == "none" and last(store)["hits"]["cpu"] == 2
    await store.lookup(NS.digest, FP, keys)
    row = last(store)
    assert (row["reason"], row["first_miss"], row["blocks"]) == ("never_stored", 2, 3)
    assert "first time" in row["hint"]


async def test_evicted_names_the_policy_and_when(store: TieredStore,
                                                 client: ArenaMapping) -> None:
    old = chain(2, start=1)
    await put(store, client, old)
    await put(store, client, chain(4, start=2))   # the arena holds 4: old goes (lru)
    await store.lookup(NS.digest, FP, old)
    row = last(store)
    assert row["reason"] == "evicted"
    assert row["removed"]["tier"] == "cpu" and row["removed"]["policy"] == "lru"
    assert row["removed"]["age_s"] >= 0
    assert miss_log(store).stats()["first_miss"]["evicted"] == 1


async def test_dropped_by_admission(arena: Arena, client: ArenaMapping, tmp_path: Path) -> None:
    nvme = NvmeTier(tmp_path / "nvme", 16 * (PAGE + BLOCK), direct="off", io_threads=1)
    nvme.open()
    budget = WriteBudget(0, burst_bytes=BLOCK)   # one block of budget, never refilled
    s = make_store(arena, nvme=nvme, admission=TierAdmission({"nvme": budget}))
    try:
        # a chain leaves the arena tail first (its head is the most recent block), so
        # the one block the budget lets through is first's, which is one block long
        first, second = chain(1, start=1), chain(2, start=3)
        await put(s, client, first)
        await put(s, client, second)
        await put(s, client, chain(4, start=4))   # evicts 3: one written, two refused
        await s.lookup(NS.digest, FP, second)
        assert last(s)["reason"] == "dropped_by_admission"
        assert "write budget" in last(s)["hint"]
        await s.lookup(NS.digest, FP, first)
        assert last(s)["hits"]["nvme"] == 1     # the one block the budget let through
    finally:
        await s.drain(s.clock() + 5)
        nvme.close()


async def test_checksum_failure(arena: Arena, client: ArenaMapping, tmp_path: Path) -> None:
    nvme = NvmeTier(tmp_path / "nvme", 16 * (PAGE + BLOCK), direct="off", io_threads=1)
    nvme.open()
    s = make_store(arena, nvme=nvme)
    try:
        old = chain(1, start=1)
        await put(s, client, old)
        await put(s, client, chain(4, start=2))   # old is demoted to nvme
        nvme_corrupt_payload(nvme, s, old[0])
        await s.prepare_get(1, NS.digest, FP, old)   # the read finds the bad frame
        await s.lookup(NS.digest, FP, old)
        row = last(s)
        assert row["reason"] == "checksum_failure" and row["removed"]["tier"] == "nvme"
    finally:
        await s.drain(s.clock() + 5)
        nvme.close()


async def test_lease_lost_and_in_flight(store: TieredStore) -> None:
    keys = chain(2)
    lease, _ = await store.prepare_put(1, NS.digest, FP, keys)
    await store.lookup(NS.digest, FP, keys)
    assert last(store)["reason"] == "in_flight"
    store.abort_put(1, lease)
    await store.lookup(NS.digest, FP, keys)
    assert last(store)["reason"] == "lease_lost"


async def test_deleted(store: TieredStore, client: ArenaMapping) -> None:
    keys = chain(2)
    await put(store, client, keys)
    await store.delete(NS.digest, FP, keys)
    await store.lookup(NS.digest, FP, keys)
    assert last(store)["reason"] == "deleted"


async def test_namespace_mismatch_and_sibling_hint(store: TieredStore,
                                                   client: ArenaMapping) -> None:
    with pytest.raises(LayoutMismatch):
        await store.lookup(NS.digest, FP + 1, chain(1))
    row = last(store)
    assert row["reason"] == "namespace_mismatch" and row["error"] == "layout_mismatch"
    salted = store.register_namespace(LAYOUT, "test/model", 0, 1, "tenant-b")
    await store.lookup(salted.digest, FP, block_keys(salted, list(range(128))))
    names = {d: {"model_id": e.namespace.model_id} for d, e in store.namespaces.items()}
    row = miss_log(store).recent(1, namespaces=names)[0]
    assert row["reason"] == "never_stored" and "other namespace" in row["hint"]


async def test_tier_down(arena: Arena) -> None:
    from kvtier.tiers.redis import RedisTier

    redis = RedisTier(RedisConfig(enabled=True, url="redis://127.0.0.1:1/0",
                                  connect_timeout_s=0.2, op_timeout_s=0.2))
    await redis.start()
    s = make_store(arena, redis=redis)
    try:
        assert not redis.up
        await s.lookup(NS.digest, FP, chain(2))
        assert last(s)["reason"] == "tier_down"
    finally:
        await redis.close()


def test_a_block_evicted_from_nvme_into_redis_says_redis_dropped_it() -> None:
    log = MissLog(policies={"nvme": "lru"}, redis_tier=True)
    key = b"k" * 16
    log.removed(key, "capacity", "nvme")
    log.lookup(b"n" * 16, [key], 0, 0, 0, set(), False)
    row = log.recent(1)[0]
    assert row["reason"] == "evicted" and "redis" in row["hint"]
    plain = MissLog(policies={"nvme": "lru"})
    plain.removed(key, "capacity", "nvme")
    plain.lookup(b"n" * 16, [key], 0, 0, 0, set(), False)
    assert "redis" not in plain.recent(1)[0]["hint"]


def test_records_are_bounded_and_misses_filter() -> None:
    log = MissLog(ring=3, removals=2)
    keys = [bytes([i]) * 16 for i in range(5)]
    for k in keys:
        log.removed(k, "capacity", "cpu")
    assert log.removal(keys[0]) is None and log.removal(keys[4]) is not None
    for i in range(5):
        hits = 5 if i % 2 else 0
        log.lookup(b"n" * 16, keys, hits, hits, hits, set(), False)
    assert len(log) == 3
    # keys[0] aged out of the removal record (2 kept): its miss reads as never stored
    assert [r["reason"] for r in log.recent(10, misses_only=True)] == ["never_stored"] * 2
    log.lookup(b"n" * 16, keys, 4, 4, 4, set(), False)
    assert log.recent(1)[0]["reason"] == "evicted"
    assert log.stats()["first_miss"][MissReason.NONE.value] == 2
    with pytest.raises(ValueError):
        MissLog(ring=0)


async def test_a_block_of_another_namespace_is_a_namespace_mismatch_not_in_flight(
        store: TieredStore, client: ArenaMapping) -> None:
    """The same keys looked up under another namespace: committed, so not in flight (it
    said in_flight); the store counts it as a namespace mismatch, and so does explain."""
    keys = chain(2)
    await put(store, client, keys)
    salted = store.register_namespace(LAYOUT, "test/model", 0, 1, "tenant-b")
    before = store.requests.namespace_mismatch
    await store.lookup(salted.digest, FP, keys)
    assert store.requests.namespace_mismatch == before + 1
    row = miss_log(store).recent(1)[0]
    assert row["reason"] == "namespace_mismatch" and row["first_miss"] == 0
    assert "error" not in row and "another namespace" in row["hint"]
    assert "register_layout" not in row["hint"]
    await store.lookup(NS.digest, FP, keys)   # the owner still hits
    assert last(store)["reason"] == "none"
