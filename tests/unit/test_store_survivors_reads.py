"""The store's read/write/lease core (``kvtier.store.leasing``, ``reads``, ``writes``,
``blocks``, ``kvtier.leases``, ``kvtier.checksum``), pinned where a mutation review found no
test noticing a check broken: quarantined slots freed once only, a delete never touching a
slot being written, a put that could never fit refused before it evicts, a failed load never
handed out (nor left pinned), and the lease table's per-owner books (bytes held, expired ids
reported once, of their own kind, and bounded)."""

from __future__ import annotations

import asyncio

import pytest

import kvtier.leases as leases_mod
from kvtier.checksum import header_for, verify
from kvtier.errors import CapacityError, ChecksumError, KVTierError, LeaseError, LeaseExpired
from kvtier.index import BlockMeta, SlotState
from kvtier.layout import KVLayout
from kvtier.leases import LeaseKind, LeaseTable, Quarantine
from kvtier.store import TieredStore
from kvtier.store.demotion import Demoter
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.nvme import NvmeTier
from tests.support.store import (
    ARENA_BLOCKS,
    BLOCK,
    CLIENT,
    DIGEST,
    FP,
    OTHER_CLIENT,
    TTL,
    FakeClock,
    chain,
    get,
    payload,
    put,
)


def _meta(key: bytes, nbytes: int) -> BlockMeta:
    return BlockMeta(key, b"ns", 0, nbytes, None, 0)


# -- quarantine ------------------------------------------------------------------------------

def test_an_owners_quarantine_is_handed_back_once() -> None:
    """Pins ``Quarantine.take_owner`` popping the owner (mutant: ``by_owner.get``): the
    offsets it returns are freed by the caller, so a second call must find none."""
    q = Quarantine()
    q.add(CLIENT, 7, 4096, 100)
    q.add(CLIENT, 8, 8192, 100)
    assert sorted(q.take_owner(CLIENT)) == [4096, 8192]
    assert q.take_owner(CLIENT) == [] and q.owner_bytes(CLIENT) == 0
    assert q.bytes == 0 and q.slots == 0


async def test_a_quarantine_freed_twice_frees_its_slots_once(
        store: TieredStore, client: ArenaMapping) -> None:
    """A connection the daemon closed (``may_write``) keeps its put's slots quarantined until
    its process exits; ``free_quarantine`` called again (a second exit notice) frees nothing,
    instead of freeing the slots a second time, by then maybe another client's blocks
    (mutant: ``Quarantine.take_owner`` not forgetting the owner: a double free)."""
    await store.prepare_put(CLIENT, DIGEST, FP, chain(2))
    store.release_owner(CLIENT, may_write=True)
    assert store.quarantine.slots == 2
    assert store.free_quarantine(CLIENT) == 2
    keys = chain(2, start=1)
    await put(store, client, keys, owner=OTHER_CLIENT)
    assert store.free_quarantine(CLIENT) == 0
    assert await get(store, client, keys, owner=OTHER_CLIENT) == [payload(k) for k in keys]
    assert store.arena.used_bytes == 2 * BLOCK


# -- the lease table's books -----------------------------------------------------------------

@pytest.mark.parametrize("kind", list(LeaseKind))
def test_the_bytes_an_owner_holds_drop_by_the_lease_taken(kind: LeaseKind) -> None:
    """Pins ``LeaseTable._forget`` lowering the owner's held bytes when other leases stay
    open (mutant: ``held[owner] = left + lease.nbytes``): the per-process limits count them."""
    table = LeaseTable(TTL, FakeClock())
    a = table.open(kind, CLIENT, [_meta(b"a", 100)])
    table.open(kind, CLIENT, [_meta(b"b", 30), _meta(b"c", 20)])
    held = table.put_bytes if kind is LeaseKind.PUT else table.get_bytes
    assert held(CLIENT) == 150
    table.take(CLIENT, a.id, kind)
    assert held(CLIENT) == 50


def test_an_expired_id_is_reported_expired_once() -> None:
    """Pins ``LeaseTable.take`` forgetting an expired id once it said so (mutant: no
    ``del mine[lease_id]``): a second commit of the same id is an unknown lease."""
    now = FakeClock()
    table = LeaseTable(TTL, now)
    lease = table.open(LeaseKind.PUT, CLIENT, [])
    now.advance(TTL)
    assert [x.id for x in table.take_expired()] == [lease.id]
    with pytest.raises(LeaseExpired):
        table.take(CLIENT, lease.id, LeaseKind.PUT)
    with pytest.raises(LeaseError) as info:
        table.take(CLIENT, lease.id, LeaseKind.PUT)
    assert type(info.value) is LeaseError


def test_an_expired_get_named_as_a_put_is_not_expired() -> None:
    """Pins the kind check on expired ids (mutant: ``lease_id in mine``): a commit naming an
    expired get lease is an unknown put lease, and the get's own release still learns it
    expired (its bytes may be wrong)."""
    now = FakeClock()
    table = LeaseTable(TTL, now)
    lease = table.open(LeaseKind.GET, CLIENT, [])
    now.advance(TTL)
    table.take_expired()
    with pytest.raises(LeaseError) as info:
        table.take(CLIENT, lease.id, LeaseKind.PUT)
    assert type(info.value) is LeaseError
    with pytest.raises(LeaseExpired):
        table.take(CLIENT, lease.id, LeaseKind.GET)


def test_expired_ids_are_remembered_up_to_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins ``EXPIRED_IDS_PER_OWNER`` as the exact bound, oldest forgotten first (mutant:
    ``> EXPIRED_IDS_PER_OWNER + 1``)."""
    monkeypatch.setattr(leases_mod, "EXPIRED_IDS_PER_OWNER", 2)
    now = FakeClock()
    table = LeaseTable(TTL, now)
    ids = [table.open(LeaseKind.GET, CLIENT, []).id for _ in range(3)]
    now.advance(TTL)
    assert len(table.take_expired()) == 3
    with pytest.raises(LeaseError) as info:
        table.take(CLIENT, ids[0], LeaseKind.GET)
    assert type(info.value) is LeaseError
    for lease_id in ids[1:]:
        with pytest.raises(LeaseExpired):
            table.take(CLIENT, lease_id, LeaseKind.GET)


async def test_a_closed_connections_open_gets_leave_the_bandwidth_books(
        store: TieredStore, client: ArenaMapping) -> None:
    """Pins ``release_owner`` calling ``bandwidth.get_abandoned`` (mutant: dropped): a get
    its connection never released is no measurement, and no entry left behind."""
    keys = chain(1)
    await put(store, client, keys)
    lease, _ = await store.prepare_get(OTHER_CLIENT, DIGEST, FP, keys)
    assert lease in store.bandwidth._open
    store.release_owner(OTHER_CLIENT)
    assert lease not in store.bandwidth._open


# -- a delete and a put in progress ----------------------------------------------------------

async def test_a_delete_never_frees_a_slot_being_written(
        store: TieredStore, client: ArenaMapping) -> None:
    """A delete of keys a put is still writing skips them; freed, their slots would go to
    another put while the first client still writes into them. Two checks guard it, each
    alone surviving its mutant (``Blocks.in_use`` without WRITING; ``Blocks.remove`` dropping
    any ``meta.cpu``, not only READY): this pins the pair, failing with both broken."""
    keys = chain(2)
    lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, keys)
    assert await store.delete(DIGEST, FP, keys) == 0
    assert all(store.index[k].cpu_state is SlotState.WRITING for k in keys)
    other = chain(2, start=1)
    other_offsets = await put(store, client, other, owner=OTHER_CLIENT)
    assert not set(offsets) & set(other_offsets)
    for key, off in zip(keys, offsets, strict=True):
        assert off is not None
        client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    assert await store.commit_put(CLIENT, lease) == 2
    assert await get(store, client, keys) == [payload(k) for k in keys]
    assert await get(store, client, other) == [payload(k) for k in other]


# -- puts that could never fit ---------------------------------------------------------------

async def test_a_put_of_more_new_blocks_than_the_arena_holds_evicts_nothing(
        store: TieredStore, client: ArenaMapping) -> None:
    """Pins ``Writer._check_fits``'s count of new blocks (mutant: ``> size + slot``): one
    block more than the arena holds fails fast, the blocks stored before stay in cpu."""
    kept = chain(2, start=9)
    await put(store, client, kept)
    with pytest.raises(CapacityError):
        await store.prepare_put(CLIENT, DIGEST, FP, chain(ARENA_BLOCKS + 1))
    assert all(store.index[k].in_cpu for k in kept)
    assert len(store.index) == 2 and not store.leases


async def test_a_block_larger_than_the_arena_evicts_nothing(
        store: TieredStore, client: ArenaMapping) -> None:
    """Pins ``Writer._check_fits``'s block-size check (mutant: never true): a namespace whose
    block outgrows the arena is refused before anything is evicted for it."""
    kept = chain(2, start=9)
    await put(store, client, kept)
    big = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
                   tokens_per_block=128 * (ARENA_BLOCKS + 1))
    ns = store.register_namespace(big, "test/big", 0, 1, None)
    with pytest.raises(CapacityError, match="larger than the cpu tier"):
        await store.prepare_put(CLIENT, ns.digest, big.fingerprint, [b"k" * 16])
    assert all(store.index[k].in_cpu for k in kept)
    assert len(store.index) == 2 and not store.leases


# -- a load that fails -----------------------------------------------------------------------

async def test_a_block_whose_load_failed_is_never_handed_out_nor_left_pinned(
        store: TieredStore, client: ArenaMapping, nvme: NvmeTier,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A transient nvme read error leaves the block on nvme and in the index, not in the
    arena: the get stops before it (mutant: the ready check without ``meta.in_cpu`` hands
    out its ``cpu`` of None) and unpins it and every block after it (mutant: no unpin of the
    blocks past the ready prefix: pinned for good)."""
    keys = chain(ARENA_BLOCKS)
    await put(store, client, keys)
    await put(store, client, chain(ARENA_BLOCKS, start=1))   # keys demoted to nvme
    assert all(store.index[k].cpu_state is SlotState.NONE and store.index[k].in_nvme
               for k in keys)

    async def failing_read(*args: object, **kwargs: object) -> None:
        raise KVTierError("injected transient read error")

    monkeypatch.setattr(nvme, "read_into", failing_read)
    lease, offsets = await store.prepare_get(CLIENT, DIGEST, FP, keys)
    assert offsets == []
    await store.release_get(CLIENT, lease)
    for k in keys:
        meta = store.index[k]
        assert meta.readers == 0 and meta.in_nvme and meta.cpu is None
    monkeypatch.undo()
    assert await get(store, client, keys[:1]) == [payload(keys[0])]


# -- checksum --------------------------------------------------------------------------------

def test_a_short_payload_fails_on_its_length() -> None:
    """Pins ``kvtier.checksum.verify``'s exact length check (mutant: ``size >``): a payload
    shorter than its header says is refused as such, before any hashing."""
    header = header_for(b"n" * 16, b"k" * 16, 1, b"abcdef")
    verify(header, b"abcdef")
    with pytest.raises(ChecksumError, match="length 5 differs"):
        verify(header, b"abcde")


# -- two puts of one key, both evicting for room ---------------------------------------------

async def test_two_puts_racing_for_a_key_on_a_full_arena_give_it_one_slot(
        store: TieredStore, client: ArenaMapping) -> None:
    """Both puts await an eviction for the key's slot; the one served second finds the key
    indexed by the first and gives its slot back (mutant: no ``k in index`` re-check after
    the await: it replaces the first's block in the index, whose commit then stores nothing;
    mutant: no ``arena.free`` of that slot: leaked for good)."""
    await put(store, client, chain(ARENA_BLOCKS, start=1))   # a full arena
    key = chain(1)[0]
    (a, a_off), (b, b_off) = await asyncio.gather(
        store.prepare_put(CLIENT, DIGEST, FP, [key]),
        store.prepare_put(OTHER_CLIENT, DIGEST, FP, [key]))
    assert sorted([a_off[0] is None, b_off[0] is None]) == [False, True]
    owner, lease, off = (CLIENT, a, a_off[0]) if a_off[0] is not None else (
        OTHER_CLIENT, b, b_off[0])
    assert off is not None and store.index[key].cpu == off
    client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    assert await store.commit_put(owner, lease) == 1
    store.release_owner(CLIENT)
    store.release_owner(OTHER_CLIENT)
    assert await get(store, client, [key]) == [payload(key)]
    in_cpu = sum(1 for m in store.index.values() if m.cpu is not None)
    assert store.arena.used_bytes == in_cpu * BLOCK


async def test_a_durable_commit_below_an_ancestor_not_written_counts_nothing(
        store: TieredStore, client: ArenaMapping, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nvme write of the chain's head (an ancestor, arena only) fails: a cold start would
    erase the child's frame, so the durable commit of the child counts 0 though the child
    itself is on nvme (mutant: ``_persist_chain`` checking reachability only, not that every
    ancestor is on nvme)."""
    head, child = chain(2)
    await put(store, client, [head])
    real = Demoter.persist

    async def refuse_head(self: Demoter, meta: BlockMeta, *, sync: bool = False) -> bool:
        return False if meta.key == head else await real(self, meta, sync=sync)

    monkeypatch.setattr(Demoter, "persist", refuse_head)
    lease, offsets = await store.prepare_put(CLIENT, DIGEST, FP, [child], parent=head, depth=1)
    assert offsets[0] is not None
    client.view(offsets[0], BLOCK, writable=True)[:] = memoryview(payload(child))
    assert await store.commit_put(CLIENT, lease, durable=True) == 0
    assert store.index[child].in_nvme and not store.index[head].in_nvme
