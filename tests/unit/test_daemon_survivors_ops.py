# ruff: noqa: F811  (the fixtures of tests/support/store.py are imported by name)
"""Survivors of the request-handling mutation round: the control ops' checks and reply
fields (``kvtier.daemon.ops``), in-process over a real store and arena (no socket, no
process), as in tests/unit/test_control_leases.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.daemon.ops import Connection
from kvtier.errors import ProtocolError, UnknownNamespace
from kvtier.keys import Namespace, block_keys
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from tests.support.control import connection, request, server
from tests.support.store import (  # noqa: F401 - fixtures
    DIGEST,
    FP,
    LAYOUT,
    TTL,
    arena,
    chain,
    client,
    clock,
    nvme,
    put,
    store,
)


async def test_a_tp_rank_must_be_below_the_tp_size(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """``register_layout`` takes ranks 0..tp_size-1: a rank equal to the size names no
    worker of the group and is a ProtocolError, nothing registered; the last rank is
    taken. Mutant that survived: the rank's bound was ``tp_size`` (one past the last)."""
    srv = server(store, arena, tmp_path)
    conn = connection(srv)
    msg = {"layout": LAYOUT.to_dict(), "model_id": "test/tp", "tp_size": 2}
    with pytest.raises(ProtocolError, match="tp_rank"):
        await srv._register_layout(conn, {**msg, "tp_rank": 2})
    assert store.namespaces_named("test/tp", None, 2, 2) == []
    reply = await srv._register_layout(conn, {**msg, "tp_rank": 1})
    assert reply["ns"] == Namespace("test/tp", LAYOUT, 1, 2).digest


@pytest.mark.parametrize("bad", [-1, True, "7", 1.5])
async def test_a_commits_output_tokens_must_be_a_count(
        store: TieredStore, arena: Arena, client: ArenaMapping, tmp_path: Path,
        bad: object) -> None:
    """``put_commit``'s ``output_tokens`` (fed to the cost policy's reuse estimate) is a
    non-negative int or nil: anything else is a ProtocolError before the lease is touched,
    so the put can still be committed with a valid value. Mutant that survived: the check
    removed (a negative count or a string reached the policy)."""
    srv = server(store, arena, tmp_path)
    conn = connection(srv)
    keys = chain(2)
    lease = (await srv._put_prepare(conn, request(keys)))["lease"]
    with pytest.raises(ProtocolError, match="output_tokens"):
        await srv._put_commit(conn, {"lease": lease, "output_tokens": bad})
    assert (await srv._put_commit(conn, {"lease": lease, "output_tokens": 3}))["stored"] == 2


async def test_a_get_says_its_lease_holds_no_longer_than_an_idle_connection_lives(
        store: TieredStore, arena: Arena, client: ArenaMapping, tmp_path: Path) -> None:
    """A get's ``ttl_s`` is how long its lease surely holds: the lease TTL, or the idle
    timeout when that is shorter (dropping an idle connection releases its leases). A
    client skips the release's reply within a share of it (``RELEASE_SAFE_SHARE``), so a
    ttl_s beyond the idle timeout lets it trust bytes of slots already given back.
    Mutant that survived: ``ttl_s`` was the lease TTL whatever the idle timeout."""
    keys = chain(1)
    await put(store, client, keys)
    short = server(store, arena, tmp_path, idle_timeout_s=TTL / 10)
    assert (await short._get_prepare(connection(short), request(keys)))["ttl_s"] == TTL / 10
    unbounded = server(store, arena, tmp_path, idle_timeout_s=0)
    assert (await unbounded._get_prepare(connection(unbounded), request(keys)))["ttl_s"] == TTL


async def test_a_connection_probes_a_salted_namespace_it_registered_by_digest(
        store: TieredStore, arena: Arena, client: ArenaMapping, tmp_path: Path) -> None:
    """``prefix_locality`` on the control socket may name a salted namespace by its digest
    when this connection registered it (with the salt): the connection's namespaces are
    the proof of the salt that a digest alone is not. Another connection naming the same
    digest is refused. Mutant that survived: the connection's namespaces were not passed
    to the probe, so an engine could not probe its own salted namespace."""
    srv = server(store, arena, tmp_path)
    conn = connection(srv)
    salted = Namespace("test/salted", LAYOUT, cache_salt="tenant-a")
    reply = await srv._register_layout(conn, {"layout": LAYOUT.to_dict(),
                                              "model_id": salted.model_id,
                                              "cache_salt": "tenant-a"})
    assert reply["ns"] == salted.digest
    keys = block_keys(salted, range(2 * LAYOUT.tokens_per_block))
    probe = {"ns": salted.digest, "keys": b"".join(keys), "redis": False}
    result = (await srv._prefix_locality(conn, probe))["results"][0]
    assert result["prompt_blocks"] == 2 and result["hit_blocks"] == 0
    stranger = Connection(2, os.getpid(), os.getuid())
    with pytest.raises(UnknownNamespace):
        await srv._prefix_locality(stranger, probe)
