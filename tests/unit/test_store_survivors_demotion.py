"""Mutation-review survivors of the store's eviction paths (kvtier/store/alloc.py,
kvtier/store/demotion.py): decisions no other test noticed broken. Each docstring names
the decision and the mutant that survived without it; races are simulated by setting a
block's state or patching the store's alloc, free and transfers (restored after)."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.index import BlockMeta, SlotState
from kvtier.policy.lru import LRUPolicy
from kvtier.store import TieredStore
from kvtier.store.alloc import MAX_EVICTIONS_PER_ALLOC, allocate_with_eviction
from kvtier.store.demotion import Demoter
from kvtier.tiers.arena_mapping import ArenaMapping
from tests.support.store import chain, put

# --------------------------------------------------------------------------- alloc


def test_alloc_evictions_bounded_exactly_also_with_batches() -> None:
    """One allocation evicts at most ``MAX_EVICTIONS_PER_ALLOC`` blocks, the last batch cut
    to what is left (mutants: a whole batch past the bound; the bound counting batches)."""
    pol = LRUPolicy()
    for i in range(MAX_EVICTIONS_PER_ALLOC + 100):
        pol.insert(i)
    evicted: list[object] = []

    async def evict(key: object) -> None:
        evicted.append(key)
        pol.remove(key)

    assert asyncio.run(allocate_with_eviction(lambda: None, pol, evict, batch=3)) is None
    assert evicted == list(range(MAX_EVICTIONS_PER_ALLOC))


# --------------------------------------------------------------------------- demotion


class _UpRedis:
    """All ``Demoter._to_redis`` asks of a Redis tier."""

    up = True


class _Alloc:
    """Stands in for ``NvmeResidency.alloc``: records calls, returns ``slot``."""

    def __init__(self, slot: object = None, then: object = None) -> None:
        self.calls: list[int] = []
        self.slot = slot
        self.then = then

    def install(self, store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
        async def alloc(_: object, nbytes: int) -> object:
            self.calls.append(nbytes)
            if callable(self.then):
                self.then()
            return self.slot
        monkeypatch.setattr(type(store.demoter.nvme), "alloc", alloc)


async def _in_cpu(store: TieredStore, client: ArenaMapping) -> BlockMeta:
    keys = chain(1)
    await put(store, client, keys)
    return store.index[keys[0]]


async def test_evict_cpu_keeps_a_block_whose_nvme_write_is_in_flight(
        store: TieredStore, client: ArenaMapping) -> None:
    """A cpu victim that is ``cpu_pinned`` (its nvme write in flight) stays in the arena
    (mutant: the ``cpu_pinned`` check removed: persist refuses it, the slot is dropped)."""
    meta = await _in_cpu(store, client)
    meta.nvme_busy = True
    try:
        await store.demoter.evict_cpu(meta.key)
        assert meta.in_cpu
    finally:
        meta.nvme_busy = False


async def test_evict_cpu_counts_an_unused_prefetched_block_as_wasted(
        store: TieredStore, client: ArenaMapping) -> None:
    """A prefetched block evicted before any use counts in ``prefetch.wasted`` (mutant:
    the count removed)."""
    meta = await _in_cpu(store, client)
    meta.prefetched = True
    await store.demoter.evict_cpu(meta.key)
    assert not meta.in_cpu
    assert store.prefetch.wasted == 1


async def test_evict_cpu_of_a_key_the_arena_lacks_removes_it_from_the_policy(
        store: TieredStore) -> None:
    """A victim not in the arena leaves the cpu policy, or it is offered at every
    allocation (mutant: the ``remove`` left out)."""
    stray = b"s" * 16
    store.cpu.policy.insert(stray, nbytes=1, parent=None, depth=0, now=0.0)
    await store.demoter.evict_cpu(stray)
    assert stray not in store.cpu.policy


async def test_persist_to_a_degraded_nvme_allocates_nothing(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full or failing disk refuses the write before allocating (which would evict nvme
    blocks for nothing), counted as refused (mutant: the ``degraded`` check removed)."""
    meta = await _in_cpu(store, client)
    nvme = store.demoter.nvme
    assert nvme is not None
    alloc = _Alloc()
    alloc.install(store, monkeypatch)
    monkeypatch.setattr(type(nvme.tier), "degraded", property(lambda self: True))
    dropped = nvme.tier.counters.dropped_writes
    assert await store.demoter.persist(meta) is False
    assert alloc.calls == []
    assert nvme.tier.counters.dropped_writes == dropped + 1


async def test_persist_of_a_block_already_being_written_starts_no_second_write(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block whose nvme write is in flight gets no second one, and the writer's busy
    flag is not cleared under it (mutant: the ``nvme_busy`` check removed)."""
    meta = await _in_cpu(store, client)
    alloc = _Alloc()
    alloc.install(store, monkeypatch)
    meta.nvme_busy = True
    try:
        assert await store.demoter.persist(meta) is False
        assert alloc.calls == [] and meta.nvme_busy
    finally:
        meta.nvme_busy = False


async def test_persist_frees_the_slot_of_a_block_that_left_the_arena_meanwhile(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block that left the arena while its nvme slot was allocated is not written and
    the slot goes back (mutant: the slot leaks)."""
    meta = await _in_cpu(store, client)
    nvme = store.demoter.nvme
    assert nvme is not None
    slot = object()
    freed: list[object] = []
    _Alloc(slot, lambda: setattr(meta, "cpu_state", SlotState.NONE)).install(store,
                                                                           monkeypatch)
    monkeypatch.setattr(type(nvme.tier), "free", lambda self, s: freed.append(s))
    try:
        assert await store.demoter.persist(meta) is False
        assert freed == [slot]
        assert not meta.in_nvme
    finally:
        meta.cpu_state = SlotState.READY


def test_no_redis_demotion_when_every_commit_is_written_through() -> None:
    """With write-through every block is in Redis already: a victim is not sent again
    (mutant: the ``redis_write_through`` check removed)."""
    def demoter(through: bool) -> Demoter:
        return Demoter(None, None, None, _UpRedis(), None, None,  # type: ignore[arg-type]
                       lambda: 0.0, redis_write_through=through)
    assert demoter(True)._to_redis(None) is False  # type: ignore[arg-type]
    assert demoter(False)._to_redis(None) is True  # type: ignore[arg-type]


async def _on_nvme(store: TieredStore, client: ArenaMapping) -> BlockMeta:
    meta = await _in_cpu(store, client)
    assert await store.demoter.persist(meta)
    return meta


async def test_evict_nvme_of_a_busy_block_pins_it_in_the_nvme_policy(
        store: TieredStore, client: ArenaMapping) -> None:
    """A busy nvme victim is pinned in the nvme policy so the allocation moves on (mutant:
    the early return removed: the block stays but is offered again and again)."""
    meta = await _on_nvme(store, client)
    nvme = store.demoter.nvme
    assert nvme is not None
    meta.nvme_busy = True
    try:
        await store.demoter.evict_nvme(meta.key)
        assert meta.in_nvme
        assert nvme.policy.victim() != meta.key
    finally:
        nvme.unbusy(meta)


async def test_evict_nvme_keeps_a_block_that_became_busy_during_its_redis_copy(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block that became busy while its Redis copy was awaited stays on nvme (mutant:
    only ``in_nvme`` checked after the copy)."""
    meta = await _on_nvme(store, client)
    moves: list[object] = []

    class _Transfers:
        async def move(self, *args: object, **kwargs: object) -> None:
            moves.append(args)
            meta.nvme_busy = True      # a read of it started meanwhile

    monkeypatch.setattr(store.demoter, "redis", _UpRedis())
    monkeypatch.setattr(store.demoter, "transfers", _Transfers())
    try:
        await store.demoter.evict_nvme(meta.key)
        assert len(moves) == 1
        assert meta.in_nvme
    finally:
        meta.nvme_busy = False
