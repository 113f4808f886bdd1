# ruff: noqa: F811  (the fixtures of tests/support/store.py are imported by name)
"""The control server's lease rules, in-process over a real store and arena.

- a prepare still running when its connection is taken back (the server waits a bounded
  time for a closed connection's requests) opens a lease nobody will ever use: it is
  voided at once, so its slots and pins never outlive the connection;
- one client process holds at most ``max_leases_per_client`` leases: a lease costs the
  daemon memory and sweep work even when it holds no block;
- the lease table sweeps expired leases oldest first and finds a connection's own without
  looking at anyone else's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.daemon.ops import Connection
from kvtier.errors import LimitExceeded
from kvtier.index import BlockMeta
from kvtier.leases import LeaseKind, LeaseTable
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from tests.support.control import connection, request, server
from tests.support.store import (  # noqa: F401 - fixtures
    BLOCK,
    DIGEST,
    FP,
    FakeClock,
    arena,
    chain,
    client,
    clock,
    nvme,
    put,
    store,
)


@pytest.mark.parametrize("dropped", [False, True])
async def test_a_put_prepared_after_its_connection_was_released_is_aborted(
        store: TieredStore, arena: Arena, tmp_path: Path, dropped: bool) -> None:
    srv = server(store, arena, tmp_path)
    conn = connection(srv)
    conn.dropped = dropped            # the daemon closed it, or the client left
    prepare = store.prepare_put

    async def outlived(*args: Any, **kwargs: Any) -> Any:
        srv._release(conn)            # the connection is taken back while this runs
        return await prepare(*args, **kwargs)

    store.prepare_put = outlived      # type: ignore[method-assign]
    reply = await srv._put_prepare(conn, request(chain(3)))
    assert sum(off is not None for off in reply["offsets"]) == 3
    assert len(store.leases) == 0 and store.held_put_bytes(conn.id) == 0
    assert store.quarantine.slots == 0 and store.arena.used_bytes == 0
    assert len(store.index) == 0


async def test_a_get_prepared_after_its_connection_was_released_is_released(
        store: TieredStore, arena: Arena, client: ArenaMapping, tmp_path: Path) -> None:
    keys = chain(3)
    await put(store, client, keys)
    srv = server(store, arena, tmp_path)
    conn = connection(srv)
    prepare = store.prepare_get

    async def outlived(*args: Any, **kwargs: Any) -> Any:
        srv._release(conn)
        return await prepare(*args, **kwargs)

    store.prepare_get = outlived      # type: ignore[method-assign]
    reply = await srv._get_prepare(conn, request(keys))
    assert len(reply["offsets"]) == 3
    assert len(store.leases) == 0 and store.held_get_bytes(conn.id) == 0
    assert all(store.index[k].readers == 0 for k in keys)   # evictable again


async def test_a_client_process_holds_at_most_its_limit_of_leases(
        store: TieredStore, arena: Arena, client: ArenaMapping, tmp_path: Path) -> None:
    keys = chain(1)
    await put(store, client, keys)
    srv = server(store, arena, tmp_path, max_leases_per_client=3)
    first, second = connection(srv, 1), connection(srv, 2)   # one process, two connections
    leases = [(await srv._get_prepare(first, request([])))["lease"],
              (await srv._get_prepare(second, request(keys)))["lease"],
              (await srv._put_prepare(second, request(chain(1, start=5))))["lease"]]
    for op, conn, ask in ((srv._get_prepare, first, keys), (srv._put_prepare, second, [])):
        with pytest.raises(LimitExceeded, match="max_leases_per_client 3"):
            await op(conn, request(ask))
    assert srv.counters.refused_leases == 2 and len(store.leases) == 3
    await store.release_get(1, leases[0])     # one given back: room for one more
    assert (await srv._get_prepare(first, request(keys)))["offsets"]


async def test_a_dropped_connections_quarantined_slots_count_against_its_process(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """A connection the daemon dropped while it held put slots leaves them quarantined
    until its process exits (the process may still write into them). They stay part of
    what that process holds for writing: another connection of the same process gets no
    fresh share of the arena (else a client could take the whole arena by getting itself
    dropped again and again), while another process still can."""
    srv = server(store, arena, tmp_path, client_put_bytes=2 * BLOCK)
    first = connection(srv, 1)
    assert sum(o is not None for o in
               (await srv._put_prepare(first, request(chain(2))))["offsets"]) == 2
    first.dropped = True
    srv._release(first)                        # dropped: its slots stay quarantined
    assert srv.orphans == {1: os.getpid()} and store.held_put_bytes(1) == 2 * BLOCK
    second = connection(srv, 2)                # the same process, a new connection
    reply = await srv._put_prepare(second, request(chain(2, start=5)))
    assert all(o is None for o in reply["offsets"]) and srv.counters.capped_puts == 1
    other = Connection(3, os.getpid() + 1, os.getuid())   # another process
    other.registered(DIGEST)
    srv.connections[other.id] = other
    assert sum(o is not None for o in
               (await srv._put_prepare(other, request(chain(2, start=9))))["offsets"]) == 2


def _meta(i: int) -> BlockMeta:
    return BlockMeta(bytes([i]) * 16, DIGEST, FP, 4096, None, 0)


def test_the_sweep_takes_exactly_the_expired_leases_oldest_first() -> None:
    clock = FakeClock()
    table = LeaseTable(10.0, clock)
    old = [table.open(LeaseKind.GET, owner, [_meta(owner)]) for owner in (1, 2, 1)]
    clock.advance(5)
    young = [table.open(LeaseKind.PUT, owner, []) for owner in (2, 3)]
    taken = table.take(1, old[0].id, LeaseKind.GET)        # a release out of order
    assert taken is old[0]
    clock.advance(5)                                        # the first three are due
    assert table.take_expired() == old[1:]
    assert table.count(1) == 0 and table.count(2) == 1 and table.get_bytes(2) == 0
    table.ttl_s = 1.0                                       # a shorter TTL from now on
    short = table.open(LeaseKind.GET, 3, [])
    clock.advance(1)                                        # due before the older two
    assert table.take_expired() == [short]
    clock.advance(4)
    assert table.take_expired() == young and len(table) == 0


def test_a_connection_takes_back_its_own_leases_only() -> None:
    table = LeaseTable(10.0, FakeClock())
    mine = [table.open(LeaseKind.GET, 7, [_meta(1)]), table.open(LeaseKind.PUT, 7, [])]
    theirs = table.open(LeaseKind.GET, 8, [_meta(2)])
    assert table.take_owner(7) == mine
    assert list(table.values()) == [theirs] and table.count(7) == 0
    assert table.get_bytes(8) == 4096 and table.get_bytes(7) == 0
