"""put_commit with ``redis_sync_s`` against a real Redis: the commit answers once the put's
whole chain is visible in Redis, so a second node that asks right after finds it; and when
it cannot be (Redis down, writes stalled), the commit still answers within its bound and
the give-up is counted."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import KVTierClient, connect
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer, start_cluster

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)


@pytest.fixture
def node(redis_server: RedisServer,
         daemon_factory: Callable[..., DaemonProcess]) -> Callable[..., DaemonProcess]:
    def make(name: str, write_through: bool = False) -> DaemonProcess:
        env = {"KVTIER_REDIS_WRITE_THROUGH": "true" if write_through else "false",
               "KVTIER_REDIS_OP_TIMEOUT_S": "0.5"}
        return daemon_factory(name, extra_args=["--redis-url", redis_server.url],
                              env=env).start()
    return make


def write(c: KVTierClient, ns: Namespace, keys: list[bytes],
          sync_s: float | None) -> tuple[int, int | None, bool | None, float]:
    """prepare_put, fill, commit (with sync when asked): (stored, visible, synced, seconds)."""
    lease = c.prepare_put(ns, keys)
    for i, view in enumerate(lease.views):
        if view is not None:
            view[:] = i % 251
    t0 = time.monotonic()
    stored = lease.commit(redis_sync_s=sync_s)
    return stored, lease.redis_visible, lease.redis_synced, time.monotonic() - t0


def sync_stats(node: DaemonProcess) -> dict:
    return node.stats()["daemon"]["redis_sync"]


@pytest.mark.parametrize("write_through", [False, True])
def test_synced_commit_is_visible_to_another_node_at_once(
        redis_server: RedisServer, node: Callable[..., DaemonProcess],
        write_through: bool) -> None:
    a, b = node("a", write_through), node("b")
    ca, cb = connect(a.socket), connect(b.socket)
    ns = ca.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(10 * 64))
    stored, visible, synced, _ = write(ca, ns, keys, 5.0)
    assert (stored, visible, synced) == (10, 10, True)
    # no waiting: the other node finds the whole chain in Redis right after the commit
    assert redis_server.client().dbsize() == 10
    assert cb.prefix_locality(ns, np.arange(10 * 64)).redis_blocks == 10
    assert cb.lookup(cb.register_layout(LAYOUT, "m"), keys, prefetch=False).hits == 10
    assert sync_stats(a)["commits"] == 1 and sync_stats(a)["gave_up"] == 0
    ca.close()
    cb.close()


def test_a_synced_chain_longer_than_the_write_queue_keeps_its_head(
        redis_server: RedisServer, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """The write queue holds ``redis.write_queue_blocks`` and drops its oldest when full; a
    synchronous write-through of a longer chain waits for room instead (before: a
    300-block chain, visible 0 of 300), while a plain write-through still drops."""
    env = {"KVTIER_REDIS_WRITE_THROUGH": "true", "KVTIER_REDIS_WRITE_QUEUE_BLOCKS": "16"}
    a = daemon_factory("a", extra_args=["--redis-url", redis_server.url], env=env).start()
    with connect(a.socket) as ca:
        ns = ca.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(200 * 64))
        assert write(ca, ns, keys, 10.0)[:3] == (200, 200, True)
        assert redis_server.client().dbsize() == 200
        assert a.stats()["tiers"]["redis"]["dropped_writes"] == 0
        assert sync_stats(a)["gave_up"] == 0
        more = block_keys(ns, np.arange(200 * 64, 400 * 64))
        assert write(ca, ns, more, None)[0] == 200   # write-behind semantics: may drop
        assert ca.lookup(ns, keys + more, prefetch=False).hits == 400   # (all local)


def test_blocks_stored_before_are_sent_too(redis_server: RedisServer,
                                          node: Callable[..., DaemonProcess]) -> None:
    a = node("a", write_through=False)
    c = connect(a.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(8 * 64))
    assert write(c, ns, keys[:5], None)[:3] == (5, None, None)    # local only
    assert redis_server.client().dbsize() == 0
    # the producer's next put of the prompt: 5 blocks are skipped at prepare, 3 are new
    stored, visible, synced, _ = write(c, ns, keys, 5.0)
    assert (stored, visible, synced) == (3, 8, True)
    assert redis_server.client().dbsize() == 8
    c.close()


def test_a_sync_of_another_namespaces_keys_checks_and_sends_only_its_own(
        redis_server: RedisServer, node: Callable[..., DaemonProcess]) -> None:
    """A client that puts another tenant's keys (stored already, so skipped at prepare)
    with a synchronous commit: before, the commit took the namespace of whichever block
    the index held under the chain's first key, so it checked the victim's chain in Redis,
    sent the victim's blocks there and said how many Redis held (found by review). Now it
    is the put's own namespace: nothing of the victim is sent or told."""
    a = node("a", write_through=False)
    with connect(a.socket) as victim, connect(a.socket) as thief:
        vns = victim.register_layout(LAYOUT, "m", cache_salt="victim")
        keys = block_keys(vns, np.arange(6 * 64))
        assert write(victim, vns, keys[:3], 5.0)[:3] == (3, 3, True)   # 3 of 6 in Redis
        assert write(victim, vns, keys[3:], None)[0] == 3                # 3 more local only
        tns = thief.register_layout(LAYOUT, "m", cache_salt="thief")
        stored, visible, synced, _ = write(thief, tns, keys, 1.0)
        assert (stored, visible, synced) == (0, 0, False)
        assert redis_server.client().dbsize() == 3   # the victim's local blocks stay local
        victim_own = write(victim, vns, keys, 5.0)   # the victim's own sync sends them
        assert victim_own[:3] == (0, 6, True)
        assert redis_server.client().dbsize() == 6


def test_down_or_stalled_redis_bounds_the_commit_and_counts(
        redis_server: RedisServer, node: Callable[..., DaemonProcess]) -> None:
    a = node("a")
    c = connect(a.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(12 * 64))
    # writes stalled (CLIENT PAUSE WRITE): the sync gives up at its bound, the put stands
    admin = redis_server.client()
    admin.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
    try:
        stored, visible, synced, took = write(c, ns, keys[:4], 0.5)
    finally:
        with contextlib.suppress(Exception):
            admin.execute_command("CLIENT", "UNPAUSE")
    assert stored == 4 and synced is False and visible == 0
    assert took < 2.5, f"a 0.5 s sync took {took:.2f} s"
    assert c.lookup(ns, keys[:4]).hits == 4
    # Redis gone: answered at once, counted
    redis_server.kill()
    stored, visible, synced, took = write(c, ns, keys[4:8], 2.0)
    # at once, not at its 2 s bound: nothing can be written while the tier is down
    assert stored == 4 and synced is False and took < 1.0, took
    stats = sync_stats(a)
    assert stats["commits"] == 2 and stats["gave_up"] == 2
    assert sum(stats["gave_up_by_reason"].values()) == 2
    c.close()


def test_synced_commit_over_a_cluster_with_replicas(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """The same through a Redis Cluster of 3 masters and 3 replicas (keys of one chain
    spread over every master)."""
    cluster = start_cluster(tmp_path / "cluster", 3, replicas=1)
    try:
        env = {"KVTIER_REDIS_LOOKUP_BUDGET_S": "2.0"}   # a cold cluster client's first ask
        a, b = (daemon_factory(n, extra_args=["--redis-url", cluster.url], env=env).start()
                for n in ("a", "b"))
        ca, cb = connect(a.socket), connect(b.socket)
        ns = ca.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(24 * 64))
        assert write(ca, ns, keys, 5.0)[:3] == (24, 24, True)
        assert cluster.keys_held() == 24
        assert cb.prefix_locality(ns, np.arange(24 * 64)).redis_blocks == 24
        ca.close()
        cb.close()
    finally:
        cluster.stop()


def getranges(server: RedisServer) -> int:
    """GETRANGE calls the server has answered (a namespace-checked probe is GETRANGEs)."""
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_getrange", {}).get("calls", 0))


@pytest.mark.parametrize("write_through", [False, True])
def test_own_writes_confirm_the_sync_without_a_probe(
        redis_server: RedisServer, node: Callable[..., DaemonProcess],
        write_through: bool) -> None:
    """A commit's fresh blocks are confirmed by the replies to their own SETs: no drain of
    the queue and no probe of Redis after them. Blocks stored before the put, whose last
    write ended before the commit began, are asked of Redis: one deleted there meanwhile
    is found missing and sent again."""
    a = node("a", write_through)
    c = connect(a.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(10 * 64))
    before = getranges(redis_server)
    assert write(c, ns, keys[:6], 5.0)[:3] == (6, 6, True)
    assert getranges(redis_server) == before, "fresh blocks were probed after their SETs"
    assert redis_server.client().dbsize() == 6

    # the next put of the prompt: 6 blocks stored before (asked of Redis), 4 new ones
    admin = redis_server.client()
    gone = b"kvtier:" + bytes(keys[3]).hex().encode()
    assert admin.delete(gone) == 1                       # e.g. evicted by Redis's maxmemory
    before = getranges(redis_server)
    stored, visible, synced, _ = write(c, ns, keys, 5.0)
    assert (stored, visible, synced) == (4, 10, True)
    assert getranges(redis_server) > before              # the old blocks were asked about
    assert admin.exists(gone) == 1 and admin.dbsize() == 10   # and the missing one re-sent
    b = node("b")
    cb = connect(b.socket)
    assert cb.prefix_locality(ns, np.arange(10 * 64)).redis_blocks == 10
    cb.close()
    c.close()


def test_a_sync_that_meets_a_dead_master_waits_for_the_failover(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A master dies between two synchronous commits: the next commit's SETs to it fail,
    the tier takes it out of the routing and reloads the slot map, and the commit waits
    for its replica's promotion (within its bound) and sends again: the whole chain is in
    Redis when it answers, nothing given up."""
    from tests.support.redis_servers import running_cluster

    with running_cluster(tmp_path / "cluster", 3, replicas=1, node_timeout_ms=500,
                         extra_args=("--cluster-require-full-coverage", "no")) as cluster:
        env = {"KVTIER_REDIS_OP_TIMEOUT_S": "1.0", "KVTIER_REDIS_CONNECT_TIMEOUT_S": "0.5",
               "KVTIER_REDIS_LOOKUP_BUDGET_S": "2.0"}
        a = daemon_factory("a", extra_args=["--redis-url", cluster.url], env=env).start()
        c = connect(a.socket)
        ns = c.register_layout(LAYOUT, "m")
        first = block_keys(ns, np.arange(12 * 64))
        assert write(c, ns, first, 10.0)[:3] == (12, 12, True)
        for master in cluster.nodes:   # the first chain is on the replicas too
            with contextlib.closing(master.client()) as admin:
                assert admin.execute_command("WAIT", 1, 5000) == 1
        cluster.nodes[0].kill()
        second = block_keys(ns, np.arange(24 * 64) + 10_000_000)   # over every master
        stored, visible, synced, took = write(c, ns, second, 20.0)
        assert (stored, visible, synced) == (24, 24, True), (visible, took)
        stats = sync_stats(a)
        assert stats["gave_up"] == 0 and stats["commits"] == 2
        assert cluster.keys_held() == 12 + 24
        print(f"\nsync commit across a failover: {took:.2f} s (cluster-node-timeout 500 ms)")
        c.close()


def test_a_slot_lost_for_good_costs_one_sync_its_bound_not_every_sync(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A master without a replica dies: its slots stay unserved. The first commit that
    meets it waits for a heal that never comes (its whole bound, reason "timeout"); later
    commits during the same outage give up at once ("missing") instead of each paying the
    bound again."""
    from tests.support.redis_servers import running_cluster

    with running_cluster(tmp_path / "cluster", 3, node_timeout_ms=500,
                         extra_args=("--cluster-require-full-coverage", "no")) as cluster:
        env = {"KVTIER_REDIS_OP_TIMEOUT_S": "1.0", "KVTIER_REDIS_CONNECT_TIMEOUT_S": "0.5"}
        a = daemon_factory("a", extra_args=["--redis-url", cluster.url], env=env).start()
        c = connect(a.socket)
        ns = c.register_layout(LAYOUT, "m")
        assert write(c, ns, block_keys(ns, np.arange(12 * 64)), 10.0)[:3] == (12, 12, True)
        cluster.nodes[0].kill()
        second = block_keys(ns, np.arange(24 * 64) + 10_000_000)   # over every master
        stored, _, synced, took = write(c, ns, second, 1.5)
        assert stored == 24 and synced is False and took >= 1.4, took
        third = block_keys(ns, np.arange(24 * 64) + 20_000_000)
        stored, _, synced, took = write(c, ns, third, 1.5)
        assert stored == 24 and synced is False and took < 0.75, took
        reasons = sync_stats(a)["gave_up_by_reason"]
        assert reasons == {"timeout": 1, "missing": 1}, reasons
        c.close()


def test_a_stored_block_that_lost_a_stripe_is_sent_again(
        redis_server: RedisServer, node: Callable[..., DaemonProcess]) -> None:
    """A synchronous commit counted a striped block Redis held only in part (a stripe
    evicted or expired: the head outlives it) as visible: the consumer was promised a
    chain whose first block it could not read. Such a block is sent again."""
    big = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16",
                   tokens_per_block=256)                     # 8 MiB blocks: striped
    a = node("a", write_through=True)
    admin = redis_server.client()
    with connect(a.socket) as c:
        ns = c.register_layout(big, "m")
        keys = block_keys(ns, np.arange(3 * 256))
        assert write(c, ns, keys[:2], 5.0)[:3] == (2, 2, True)
        head = b"kvtier:" + keys[0].hex().encode()
        stripes = admin.keys(head + b":*")
        assert stripes                                       # the block is striped
        admin.delete(stripes[0])                             # as an eviction would
        assert write(c, ns, keys, 5.0)[:3] == (1, 3, True)
        again = admin.keys(head + b":*")                     # block 0 was sent again,
        assert len(again) == len(stripes) and not set(again) & set(stripes)   # a new version
        assert all(admin.exists(k) for k in again)
