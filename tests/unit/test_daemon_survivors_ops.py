# ruff: noqa: F811  (the fixtures of tests/support/store.py are imported by name)
"""Survivors of the request-handling mutation round: the control ops' checks and reply
fields (``kvtier.daemon.ops``), in-process over a real store and arena (no socket, no
process), as in tests/unit/test_control_leases.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvtier.daemon.ops import MAX_CONN_NAMESPACES, Connection
from kvtier.errors import ProtocolError, UnknownNamespace
from kvtier.keys import MAX_NAME_CHARS, Namespace, block_keys
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


async def test_register_layout_checks_the_salts_type_and_the_names_lengths(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """``register_layout``'s ``cache_salt`` is a string or nil (a ProtocolError otherwise,
    not a TypeError from measuring it), and ``model_id`` is at most ``MAX_NAME_CHARS``
    characters (that many are taken). Mutants that survived: the salt's type check dropped
    (ops-salttype) and the name's bound one past ``MAX_NAME_CHARS`` (ops-modelid-len)."""
    srv = server(store, arena, tmp_path)
    conn = connection(srv)
    msg = {"layout": LAYOUT.to_dict(), "model_id": "test/salt"}
    with pytest.raises(ProtocolError, match="cache_salt"):
        await srv._register_layout(conn, {**msg, "cache_salt": 5})
    with pytest.raises(ProtocolError, match="model_id"):
        await srv._register_layout(conn, {**msg, "model_id": "m" * (MAX_NAME_CHARS + 1)})
    reply = await srv._register_layout(conn, {**msg, "model_id": "m" * MAX_NAME_CHARS})
    assert reply["ns"] == Namespace("m" * MAX_NAME_CHARS, LAYOUT).digest


async def test_register_layout_says_how_many_keys_a_request_may_name(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """The reply's ``max_keys`` is the daemon's context bound in this layout's blocks,
    the same bound its requests are refused beyond (a client splits by it). Mutant it
    kills (not run against the rest of the suite; ops-maxkeys-reply): one more than the
    bound, so a client's largest request was refused."""
    srv = server(store, arena, tmp_path, max_context_tokens=10 * LAYOUT.tokens_per_block)
    reply = await srv._register_layout(connection(srv), {"layout": LAYOUT.to_dict(),
                                                         "model_id": "test/max"})
    assert reply["max_keys"] == 10


@pytest.mark.parametrize("bad", [True, -1, 1.0])
async def test_a_put_prepares_depth_is_a_count(
        store: TieredStore, arena: Arena, client: ArenaMapping, tmp_path: Path,
        bad: object) -> None:
    """``put_prepare``'s ``depth`` (the chain position of its first key) is a
    non-negative int, not a bool: anything else is a ProtocolError and no lease is
    opened. Mutant that survived (ops-depthbool): ``True`` taken as depth 1."""
    srv = server(store, arena, tmp_path)
    conn = connection(srv)
    with pytest.raises(ProtocolError, match="depth"):
        await srv._put_prepare(conn, {**request(chain(1)), "depth": bad})
    assert store.leases.count(conn.id) == 0


async def test_a_commits_redis_sync_wait_is_at_most_an_hour(
        store: TieredStore, arena: Arena, client: ArenaMapping, tmp_path: Path) -> None:
    """``put_commit``'s ``redis_sync_s`` is a number of seconds in [0, 3600] or nil: a
    longer wait is a ProtocolError before the lease is touched (it can still be
    committed). Mutant that survived (ops-syncrange): no upper bound."""
    srv = server(store, arena, tmp_path)
    conn = connection(srv)
    lease = (await srv._put_prepare(conn, request(chain(1))))["lease"]
    with pytest.raises(ProtocolError, match="redis_sync_s"):
        await srv._put_commit(conn, {"lease": lease, "redis_sync_s": 3601})
    assert (await srv._put_commit(conn, {"lease": lease}))["stored"] == 1


async def test_a_negative_copy_time_is_not_passed_on(
        store: TieredStore, arena: Arena, client: ArenaMapping, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_release``'s optional ``copy_s`` (the client's copy time, fed to the tiers'
    bandwidth estimate) is dropped unless a non-negative number. Mutant that survived
    (ops-copys-neg): a negative time was passed on."""
    srv = server(store, arena, tmp_path)
    seen: list[float | None] = []

    async def release_get(owner: int, lease: int, *, copy_s: float | None = None) -> None:
        seen.append(copy_s)

    monkeypatch.setattr(store, "release_get", release_get)
    conn = connection(srv)
    for copy_s in (-0.5, 0.25):
        await srv._get_release(conn, {"lease": 1, "copy_s": copy_s})
    assert seen == [None, 0.25]


async def test_a_get_that_just_fits_its_processs_room_is_not_capped(
        store: TieredStore, arena: Arena, client: ArenaMapping, tmp_path: Path) -> None:
    """A process pins at most ``client_get_bytes`` in get leases: a get of exactly that
    many stored blocks is whole and not counted as capped; one block more is cut to the
    room. Mutants it kills (not run against the rest of the suite): a get that just fit
    counted as capped (ops-getroom-eq) and a capped get given one block beyond its room
    (ops-getroom-plus1)."""
    keys = chain(3)
    await put(store, client, keys)
    srv = server(store, arena, tmp_path, client_get_bytes=2 * LAYOUT.block_bytes)
    conn = connection(srv)
    whole = await srv._get_prepare(conn, request(keys[:2]))
    assert len(whole["offsets"]) == 2 and srv.counters.capped_gets == 0
    await srv._get_release(conn, {"lease": whole["lease"]})
    cut = await srv._get_prepare(conn, request(keys))
    assert len(cut["offsets"]) == 2 and srv.counters.capped_gets == 1


def test_a_connections_namespaces_are_bounded_and_the_oldest_forgotten_first() -> None:
    """A connection remembers at most ``MAX_CONN_NAMESPACES`` registered digests; beyond,
    the one registered (or registered again) longest ago is forgotten. Mutants it kills
    (not run against the rest of the suite): no bound (ops-nsbound) and a digest
    registered again kept its first place, so an engine's namespace in use was forgotten
    first (ops-nsrefresh)."""
    conn = Connection(1, os.getpid(), os.getuid())
    digests = [i.to_bytes(16, "big") for i in range(MAX_CONN_NAMESPACES + 1)]
    for d in digests[:MAX_CONN_NAMESPACES]:
        conn.registered(d)
    conn.registered(digests[0])   # in use again
    conn.registered(digests[-1])
    assert len(conn.namespaces) == MAX_CONN_NAMESPACES
    assert digests[0] in conn.namespaces and digests[1] not in conn.namespaces


class _Sink:
    """A connection's writer that keeps what is written (its buffer always empty)."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.transport = self

    def write(self, data: bytes) -> None:
        self.data.append(data)

    def get_write_buffer_size(self) -> int:
        return 0


async def test_an_op_that_is_not_a_string_is_a_protocol_error(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """A request whose ``op`` is not a string names no op: a ProtocolError reply (counted
    under "protocol"), as an unknown op name is. Mutant that survived (ctl-unknown-op):
    such a request was answered as a ping."""
    srv = server(store, arena, tmp_path)
    sink = _Sink()
    await srv._dispatch(connection(srv), {"id": 1, "op": 5}, sink,  # type: ignore[arg-type]
                        asyncio.Lock())
    assert srv.limit_stats()["errors"] == {"protocol": 1} and len(sink.data) == 1

