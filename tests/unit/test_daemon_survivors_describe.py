# ruff: noqa: F811  (the fixtures of tests/support/store.py are imported by name)
"""What the daemon says about itself and its small helpers: the stats document's client
counts and key schemes, the banner, recent lookups' tenant ids, the open-file budget's
edges, the hello's labels and descriptors, a sync's time (found by a mutation review)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.config import Config, load_config
from kvtier.daemon import describe, descriptors
from kvtier.daemon.descriptors import RESERVED_FDS, connections_that_fit, fit_connections
from kvtier.daemon.greeting import Greeter, _label
from kvtier.daemon.loop_lag import LoopLag
from kvtier.daemon.ops import Connection
from kvtier.daemon.redis_sync import RedisSync
from kvtier.errors import StartupError
from kvtier.explain import salt_id
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from tests.support.control import server
from tests.support.store import arena, clock, nvme, store  # noqa: F401 - fixtures
from tests.unit.test_descriptors import Limit


def small_config(tmp_path: Path, **extra: object) -> Config:
    return load_config(env={}, overrides={
        "daemon.data_dir": tmp_path / "data", "daemon.socket": tmp_path / "kvtier.sock",
        "http.port": 0, "cpu.bytes": "16MiB", "cpu.prefault": False, "nvme.bytes": "16MiB",
        "cpu.warm_restart": False, **extra})


def test_stats_count_connected_clients_and_name_a_silent_scheme_unknown(
        store: TieredStore, arena: Arena, tmp_path: Path) -> None:
    """``clients`` are the registered connections (``kvtier_clients``); a client that
    named no key scheme is ``unknown``, and an adaptive policy's dropped lookups are
    reported beside its curves."""
    srv = server(store, arena, tmp_path)
    srv.connections[1] = Connection(1, os.getpid(), os.getuid())
    named = Connection(2, os.getpid(), os.getuid())
    named.key_scheme = "v1-mine"
    srv.connections[2] = named
    store.observer = SimpleNamespace(
        snapshot=lambda: {"cpu": {"mode": "lru"}}, dropped_lookups=3)
    lag = LoopLag(lambda _s: None)
    lag.worst_s, lag.ticks = 0.25, 7
    http = SimpleNamespace(guard=SimpleNamespace(stats=lambda: {"refused": 4}))
    doc = describe.stats_document(small_config(tmp_path), store, time.time() - 1.25,
                                  control=srv, gc=None, loop_lag=lag, explain=None,
                                  http=http)  # type: ignore[arg-type]
    assert doc["daemon"]["loop"] == {"lag_worst_s": 0.25, "lag_ticks": 7}
    assert doc["http"] == {"refused": 4}
    assert 1.2 < doc["daemon"]["uptime_s"] < 5 and doc["daemon"]["uptime_s"] != 1
    assert doc["daemon"]["clients"] == 2
    assert doc["daemon"]["key_schemes"] == {"unknown": 1, "v1-mine": 1}
    assert doc["policy"]["tiers"] == {"cpu": {"mode": "lru"}}
    assert doc["policy"]["lookups_dropped"] == 3


def test_the_banner_says_what_was_rebuilt_and_what_adopted(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    arena = SimpleNamespace(size=2**30, path=Path("/dev/shm/kvtier-x"))
    text = describe.banner(cfg, arena, 8080, hbm=None, nvme=None,  # type: ignore[arg-type]
                           redis=None, rebuilt=3, adopted=5)
    assert "rebuilt 3 blocks from nvme, adopted 5 from the arena" in text


def test_recent_lookups_show_a_salt_id_never_the_salt() -> None:
    """/v1/lookups/recent names a tenant by its keyed id: the salt itself is a secret
    that separates tenants' caches."""
    asked: list[dict[bytes, dict[str, Any]]] = []

    def recent(limit: int, *, misses_only: bool,
               namespaces: dict[bytes, dict[str, Any]]) -> list[dict[str, Any]]:
        asked.append(namespaces)
        return [{"limit": limit, "misses_only": misses_only}]

    ns = SimpleNamespace(model_id="m", cache_salt="tenant-secret", tp_rank=1)
    store = SimpleNamespace(namespaces={b"d": SimpleNamespace(namespace=ns)})
    explain = SimpleNamespace(recent=recent)
    out = describe.recent_lookups(explain, store, 5, True)  # type: ignore[arg-type]
    assert out == [{"limit": 5, "misses_only": True}]
    assert asked == [{b"d": {"model_id": "m", "salt_id": salt_id("tenant-secret"),
                             "tp_rank": 1}}]
    assert "tenant-secret" not in repr(asked)
    assert describe.recent_lookups(explain, None, 5, False) == []  # type: ignore[arg-type]


def test_a_limit_of_exactly_what_is_needed_is_left_alone() -> None:
    lim = Limit(100 + 20 + RESERVED_FDS, 100 + 20 + RESERVED_FDS)
    assert fit_connections(100, 20, get=lim.get, set_=lim.set) == 100
    assert lim.asked == []


def test_room_for_fewer_than_min_connections_is_a_startup_error() -> None:
    """Room for a handful of control connections (here 5) is no daemon worth starting."""
    lim = Limit(5 + 20 + RESERVED_FDS, 5 + 20 + RESERVED_FDS)
    with pytest.raises(StartupError, match="leaves room for 5 control connections"):
        fit_connections(100, 20, get=lim.get, set_=lim.set)


@pytest.mark.parametrize(("redis", "cluster", "other"), [
    (False, False, 0), (True, False, 7), (True, True, 56)])
def test_redis_connections_are_budgeted_per_cluster_master(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis: bool, cluster: bool,
        other: int) -> None:
    """Redis holds up to ``redis.max_connections`` per server (8 masters in a cluster),
    none when it is off; HTTP's are counted too."""
    seen: list[tuple[int, int]] = []
    def fit(n: int, other_fds: int) -> int:
        seen.append((n, other_fds))
        return n

    monkeypatch.setattr(descriptors, "fit_connections", fit)
    cfg = small_config(tmp_path, **{"redis.enabled": redis, "redis.cluster": cluster,
                                    "redis.max_connections": 7,
                                    "http.max_connections": 11,
                                    "daemon.max_connections": 100})
    assert connections_that_fit(cfg) == 100
    assert seen == [(100, 11 + other)]


def test_a_clients_labels_are_cut_at_64_characters() -> None:
    assert _label("x" * 100) == "x" * 64 and _label("short") == "short"


def test_descriptors_go_only_to_a_hello_that_asks_with_true() -> None:
    """``arena_fd`` must be ``true``: any other value opens nothing (no descriptor sent
    unasked, none leaked)."""
    opened: list[int] = []

    def open_arena() -> int:
        fd = os.open("/dev/null", os.O_RDONLY)
        opened.append(fd)
        return fd

    g = Greeter({"path": "/nonexistent", "size": 1}, open_arena=open_arena)
    assert g._descriptors({"arena_fd": 1}, {}) == [] and opened == []
    fds = g._descriptors({"arena_fd": True}, {})
    assert fds == opened
    for fd in fds:
        os.close(fd)


def test_a_full_socket_buffer_sends_nothing_with_the_descriptors() -> None:
    """When the kernel takes none of the hello reply, nothing counts as sent: the whole
    reply then goes through the transport (else the client waited for it forever)."""
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        while True:
            try:
                a.send(b"\0" * 65536)
            except BlockingIOError:
                break
        writer = SimpleNamespace(get_extra_info=lambda name: a)
        fd = os.open("/dev/null", os.O_RDONLY)
        try:
            sent = Greeter._send_with_fds(writer, b"reply", [fd])  # type: ignore[arg-type]
        finally:
            os.close(fd)
        assert sent == 0
    finally:
        a.close()
        b.close()


class _SlowRedis:
    up = True
    healing_since = None

    async def written(self, keys: list[bytes], since: float) -> list[bool | None]:
        await asyncio.sleep(0.03)
        return [True] * len(keys)


async def test_a_syncs_seconds_add_up_over_commits() -> None:
    """``seconds`` is the total time commits waited (``daemon.redis_sync``), not the last
    one's."""
    rs = RedisSync(SimpleNamespace(redis=_SlowRedis(),  # type: ignore[arg-type]
                                   redis_write_through=True))
    for _ in range(2):
        done = await rs.sync(b"d", [b"k"], [], 5.0, time.monotonic())
        assert done.complete
    stats = rs.stats()
    assert stats["commits"] == 2 and stats["blocks"] == 2 and stats["seconds"] >= 0.055


async def test_the_hello_reply_offers_the_hbm_pool_and_closes_what_it_passed() -> None:
    """Every hello reply carries the HBM pool's handle when the daemon has one; the
    descriptors passed with it are the daemon's copies, closed once sent."""
    a, b = socket.socketpair()
    opened: list[int] = []

    def open_arena() -> int:
        fd = os.open("/dev/null", os.O_RDONLY)
        opened.append(fd)
        return fd

    written: list[bytes] = []

    async def drain() -> None:
        return None

    async def read() -> dict[str, Any]:
        return {"op": "hello", "version": 1, "id": 3, "arena_fd": True}

    writer = SimpleNamespace(get_extra_info=lambda name: a, write=written.append,
                             drain=drain)
    g = Greeter({"path": "/nonexistent", "size": 1}, hbm={"handle": "h"},
                open_arena=open_arena)
    try:
        await g.greet(Connection(1, os.getpid(), os.getuid()), read,
                      writer)  # type: ignore[arg-type]
        assert len(opened) == 1
        with pytest.raises(OSError):
            os.fstat(opened[0])          # the daemon's copy is closed once sent
        data, fds, _flags, _addr = socket.recv_fds(b, 65536, 4)
        for fd in fds:
            os.close(fd)
        assert len(fds) == 1 and b"handle" in data + b"".join(written)
    finally:
        a.close()
        b.close()
