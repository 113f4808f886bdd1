"""The daemon's presence filter seen by real clients (daemon subprocess, real files): it
follows puts, deletes and evictions; it is not used where a "no" would be wrong (a Redis
tier, a daemon gone); a lookup never finds more than the bound says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import KVTierClient, connect
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=16)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "d", cpu_bytes="8MiB", nvme_bytes="0",
                       env={"KVTIER_POLICY_EVICTION": "lru"}) as d:
        yield d


def chain(ns: Namespace, seed: int, blocks: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return block_keys(ns, rng.integers(1, 30000, blocks * LAYOUT.tokens_per_block))


def fill(n: int) -> list[np.ndarray]:
    return [np.full(LAYOUT.block_bytes, i % 251, np.uint8) for i in range(n)]


def test_bound_follows_puts_deletes_and_evictions(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    view = c._ops.presence
    assert view is not None and view.exact
    keys = chain(ns, 0, 8)
    assert c.leading_bound(keys) == 0
    assert c.put(ns, keys[:6], fill(6)) == 6
    assert c.leading_bound(keys) == 6 and c.lookup(ns, keys).hits == 6
    c.delete(ns, keys[2:6])
    assert c.lookup(ns, keys).hits == 2 and c.leading_bound(keys) == 2
    # fill the 8 MiB arena several times over (LRU): the first chain is evicted, and
    # with it gone from the index its keys leave the filter
    rounds = (64 << 20) // (LAYOUT.block_bytes * 16)
    for r in range(rounds):
        c.put(ns, chain(ns, 100 + r, 16), fill(16))
    assert c.lookup(ns, keys).hits == 0 and c.leading_bound(keys) == 0
    # the bound is an upper bound of every lookup, and a "no" is never wrong
    for seed in range(100 + rounds - 4, 100 + rounds):
        ks = chain(ns, seed, 16)
        bound = c.leading_bound(ks)
        assert bound is not None and c.lookup(ns, ks).hits <= bound
    c.close()


def test_no_bound_once_the_daemon_is_gone(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = chain(ns, 1, 4)
    assert c.leading_bound(keys) == 0
    daemon.kill()
    assert c.leading_bound(keys) is None      # its filter says nothing about a new daemon
    c.close()


def test_clients_of_one_daemon_share_what_it_holds(daemon: DaemonProcess) -> None:
    a, b = connect(daemon.socket), connect(daemon.socket)
    ns_a, ns_b = a.register_layout(LAYOUT, "m"), b.register_layout(LAYOUT, "m")
    keys = chain(ns_a, 2, 4)
    assert b.leading_bound(keys) == 0
    a.put(ns_a, keys, fill(4))
    assert b.leading_bound(keys) == 4 and b.lookup(ns_b, keys).hits == 4
    a.close()
    b.close()


def test_a_daemon_with_redis_announces_no_exact_filter(tmp_path: Path,
                                                       redis_server: RedisServer) -> None:
    """Blocks may continue in Redis beyond the local index: no "no" from the filter."""
    d = DaemonProcess(tmp_path / "d", cpu_bytes="8MiB", nvme_bytes="0",
                      extra_args=["--redis-url", redis_server.url]).start()
    try:
        c: KVTierClient = connect(d.socket)
        ns = c.register_layout(LAYOUT, "m")
        assert c._ops.presence is not None and not c._ops.presence.exact
        assert c.leading_bound(chain(ns, 3, 4)) is None
        c.close()
    finally:
        d.kill()


def test_a_warm_restart_rebuilds_the_filter_with_the_blocks(daemon: DaemonProcess) -> None:
    """Blocks adopted from the arena after a crash are in the new daemon's filter; a client
    of the dead daemon stops using the old one."""
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = chain(ns, 5, 6)
    assert c.put(ns, keys, fill(6)) == 6
    daemon.wait_journal_commits(6)
    daemon.crash()                     # SIGKILL: the arena and its journal stay in shm
    assert c.leading_bound(keys) is None
    c.close()
    daemon.start()
    fresh = connect(daemon.socket)
    ns2 = fresh.register_layout(LAYOUT, "m")
    hits = fresh.lookup(ns2, keys).hits
    assert hits == 6                   # adopted warm
    assert fresh.leading_bound(keys) == hits
    fresh.close()



def test_a_taken_filter_name_leaves_the_daemon_serving_without_it(tmp_path: Path) -> None:
    """Another user may take names in a shared /dev/shm: the filter is only an
    optimization, so the daemon starts and serves, and clients ask it for every lookup."""
    d = DaemonProcess(tmp_path / "d", cpu_bytes="8MiB", nvme_bytes="0")
    taken = Path(f"{d.arena_path}.presence")
    taken.unlink(missing_ok=True)
    taken.symlink_to(tmp_path / "elsewhere")
    try:
        d.start()
        c = connect(d.socket)
        ns = c.register_layout(LAYOUT, "m")
        assert c._ops.presence is None
        keys = chain(ns, 11, 2)
        assert c.leading_bound(keys) is None
        assert c.put(ns, keys, fill(2)) == 2 and c.lookup(ns, keys).hits == 2
        assert "no presence filter" in d.log()
        c.close()
    finally:
        d.kill()
        taken.unlink(missing_ok=True)
    assert not (tmp_path / "elsewhere").exists()
