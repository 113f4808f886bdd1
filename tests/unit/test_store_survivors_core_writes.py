"""The store's write side and its coordinator (``kvtier.store.writes``, ``coordinator``),
pinned where a mutation review found no test noticing a check broken: a put lease records
its namespace (what a synchronous Redis commit checks), a commit counts the bytes it
stores and reports the chain to the workload observer, and a delete counts itself."""

from __future__ import annotations

from collections.abc import Container, Sequence

import pytest

from kvtier.errors import UnknownNamespace
from kvtier.policy.base import Key
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.nvme import NvmeTier
from tests.support.store import (
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    LAYOUT,
    FakeClock,
    chain,
    put,
)


class RecordingObserver:
    """A workload observer that records what the store reports."""

    def __init__(self) -> None:
        self.lookups: list[tuple[int, int]] = []
        self.stored: list[tuple[list[Key], int | None]] = []

    def on_lookup(self, keys: Sequence[Key], hit_blocks: int, *, now: float) -> None:
        self.lookups.append((len(keys), hit_blocks))

    def on_stored(self, keys: Sequence[Key], *, output_tokens: int | None,
                  now: float) -> None:
        self.stored.append((list(keys), output_tokens))


async def test_a_put_lease_records_the_callers_namespace(store: TieredStore) -> None:
    """The put lease carries the namespace it was taken in: a synchronous Redis commit
    (kvtier.daemon.ops) checks and resends the chain under it (mutant: left empty, the
    sync looked the chain up under no namespace)."""
    keys = chain(2)
    lease_id, _ = await store.prepare_put(CLIENT, DIGEST, FP, keys)
    lease = store.leases.get(lease_id)
    assert lease is not None
    assert lease.namespace == DIGEST and list(lease.chain) == keys
    store.abort_put(CLIENT, lease_id)


async def test_a_commit_counts_the_bytes_it_stores(
        store: TieredStore, client: ArenaMapping) -> None:
    """A commit counts its blocks and their bytes written to cpu; a second put of the same
    keys stores nothing and counts no bytes (mutant: ``bytes_written`` never counted)."""
    keys = chain(2)
    written0 = store.cpu.counters.bytes_written
    await put(store, client, keys)
    assert store.cpu.counters.bytes_written - written0 == 2 * BLOCK
    assert (store.requests.puts, store.requests.put_blocks) == (1, 2)
    await put(store, client, keys)
    assert store.cpu.counters.bytes_written - written0 == 2 * BLOCK
    assert (store.requests.puts, store.requests.put_blocks) == (2, 2)


async def test_a_commit_reports_the_chain_to_the_observer(
        arena: Arena, nvme: NvmeTier, clock: FakeClock, client: ArenaMapping) -> None:
    """A commit tells the workload observer which chain was stored and how many tokens the
    engine generated after it (mutant: an observer without sliced reports never told, and
    reuse never learnt)."""
    obs = RecordingObserver()
    s = TieredStore(arena, nvme=nvme, clock=clock, observer=obs)
    s.register_namespace(LAYOUT, "test/model", 0, 1, None)
    try:
        keys = chain(2)
        lease, offsets = await s.prepare_put(CLIENT, DIGEST, FP, keys)
        assert None not in offsets
        assert await s.commit_put(CLIENT, lease, output_tokens=17) == 2
        assert obs.stored == [(keys, 17)]
        await s.lookup(DIGEST, FP, chain(3), prefetch=False)
        assert obs.lookups == [(3, 2)]
    finally:
        await s.drain(clock() + 5)


async def test_a_delete_counts_itself_and_the_blocks_it_removed(
        store: TieredStore, client: ArenaMapping) -> None:
    """A delete answers how many of its blocks it removed and counts one delete (mutants:
    the count of blocks asked rather than removed; the delete not counted)."""
    keys = chain(2)
    await put(store, client, keys)
    assert await store.delete(DIGEST, FP, [*keys, *chain(1, start=9)]) == 2
    assert store.requests.deletes == 1 and all(k not in store.index for k in keys)
    assert await store.delete(DIGEST, FP, keys) == 0
    assert store.requests.deletes == 2


async def test_a_delete_does_not_count_the_blocks_it_skipped(
        store: TieredStore, client: ArenaMapping) -> None:
    """Blocks under a read lease are skipped by a delete, and not counted removed (mutant:
    every block of the caller's counted, a client told its blocks were gone while they
    are still served)."""
    keys = chain(2)
    await put(store, client, keys)
    lease, offsets = await store.prepare_get(CLIENT, DIGEST, FP, keys[:1])
    assert len(offsets) == 1
    assert await store.delete(DIGEST, FP, keys) == 1
    assert keys[0] in store.index and keys[1] not in store.index
    await store.release_get(CLIENT, lease)


async def test_a_drain_counts_only_the_blocks_it_saved(
        store: TieredStore, client: ArenaMapping, clock: FakeClock) -> None:
    """A drain persists the blocks in the arena only and answers how many it saved; blocks
    already on nvme are not counted again (mutant: every block in the arena counted)."""
    durable, volatile = chain(1, start=1), chain(2, start=2)
    await put(store, client, durable, durable=True)
    await put(store, client, volatile)
    assert await store.drain(clock() + 5) == 2
    assert all(store.index[k].in_nvme for k in (*durable, *volatile))


async def test_a_released_get_measures_the_serve_bandwidth(
        store: TieredStore, client: ArenaMapping) -> None:
    """Releasing a get lease closes its measurement: the client's copy of its bytes over
    the copy time (at most the hold time) becomes the cpu -> client leg (mutant: never
    measured, the reload estimates lookups return had no serve leg)."""
    keys = chain(2)
    await put(store, client, keys)
    lease, offsets = await store.prepare_get(CLIENT, DIGEST, FP, keys)
    assert len(offsets) == 2
    assert "cpu->client" not in store.bandwidth.stats()
    await store.release_get(CLIENT, lease, copy_s=0.25)
    assert store.bandwidth.stats()["cpu->client"] > 0


async def test_stats_count_namespaces_and_blocks_apart(
        store: TieredStore, client: ArenaMapping) -> None:
    """``/v1/stats`` reports registered namespaces and indexed blocks each from its own
    count (mutant: the namespaces counted from the index)."""
    await put(store, client, chain(3))
    out = store.stats()
    assert (out["namespaces"], out["index_blocks"]) == (1, 3)


class RecordingMissLog:
    """A ``MissLogPort`` that records the lookups and rejections it is told of."""

    def __init__(self) -> None:
        self.lookups: list[tuple[bytes, int, int]] = []
        self.rejections: list[tuple[bytes, int, str]] = []

    def rejected(self, digest: bytes, n_keys: int, code: str) -> None:
        self.rejections.append((digest, n_keys, code))

    def lookup(self, digest: bytes, keys: list[bytes], hits: int, n_cpu: int, n_local: int,
               index: Container[bytes], lower_tier_down: bool) -> None:
        self.lookups.append((digest, len(keys), hits))

    def removed(self, key: bytes, reason: str, tier: str) -> None:
        pass

    def refused(self, key: bytes, tier: str) -> None:
        pass


async def test_the_miss_log_hears_of_every_lookup_and_rejection(
        store: TieredStore, client: ArenaMapping) -> None:
    """Setting ``explain`` wires the miss log into the read path: a lookup reports its
    hits, one under an unknown namespace its rejection (mutants: the reader left out of
    the wiring; rejections not reported)."""
    log = RecordingMissLog()
    store.explain = log
    await put(store, client, chain(1))
    await store.lookup(DIGEST, FP, chain(2), prefetch=False)
    assert log.lookups == [(DIGEST, 2, 1)]
    with pytest.raises(UnknownNamespace):
        await store.lookup(b"\x00" * 16, FP, chain(2))
    assert log.rejections == [(b"\x00" * 16, 2, UnknownNamespace.code)]


async def test_a_delete_answers_after_its_nvme_erases_are_on_disk(
        store: TieredStore, client: ArenaMapping, nvme: NvmeTier,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete of blocks on nvme waits for their frames' erase before it answers: a crash
    right after the reply must not bring a deleted block back (mutant: answered with the
    erases still queued)."""
    keys = chain(2)
    await put(store, client, keys, durable=True)
    waited: list[bool] = []
    real = nvme.erased

    async def erased() -> None:
        await real()
        waited.append(True)

    monkeypatch.setattr(nvme, "erased", erased)
    assert await store.delete(DIGEST, FP, keys) == 2
    assert waited == [True]
