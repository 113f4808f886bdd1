"""Redis Cluster failover under the Redis tier: 3 masters + 3 replicas (real servers), a
master SIGKILLed mid-run. Its replica is promoted; the tier reloads the slot map and serves
those slots again on its own. Meanwhile only the lost master's keys miss (the tier stays
up), and nothing read is ever wrong: every read is a miss or the exact bytes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
from redis.crc import key_slot

from kvtier.config import RedisConfig
from kvtier.tiers.redis import RedisTier
from tests.support.redis_servers import LocalCluster, RedisServer, running_cluster

NS = bytes(range(16))
LAYOUT_FP = 0x0F0F_1234
BLOCK = 16 * 1024
NODE_TIMEOUT_MS = 500          # cluster-node-timeout: how fast a dead master is declared failed
HEAL_BOUND_S = 30.0            # generous for a loaded 2-core machine; failing means "never"
CLUSTER_ARGS = ("--cluster-require-full-coverage", "no")  # the documented operator setting


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path / "cluster", 3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS,
                         extra_args=CLUSTER_ARGS) as c:
        yield c


@contextlib.asynccontextmanager
async def running(url: str, op_timeout_s: float = 1.0) -> AsyncIterator[RedisTier]:
    cfg = RedisConfig(enabled=True, url=url, connect_timeout_s=0.5, op_timeout_s=op_timeout_s)
    tier = RedisTier(dataclasses.replace(cfg))
    await tier.start()
    try:
        yield tier
    finally:
        await tier.close()


async def store_all(tier: RedisTier, data: dict[bytes, bytes], *, chunk: int = 50) -> None:
    """Write every block and wait until Redis holds them: ``chunk`` at a time (the
    write-behind queue drops the oldest beyond its bound)."""
    items = list(data.items())
    for lo in range(0, len(items), chunk):
        for key, payload in items[lo:lo + chunk]:
            tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
        assert await tier.flush(timeout=20)


def make_blocks(n: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(5)
    keys = [rng.bytes(16) for _ in range(n)]
    return keys, [rng.standard_normal(BLOCK // 2).astype(np.float16).tobytes() for _ in keys]


def blocks_by_key(n: int) -> tuple[list[bytes], dict[bytes, bytes]]:
    """``make_blocks(n)``: the keys, and each key's payload."""
    keys, payloads = make_blocks(n)
    return keys, dict(zip(keys, payloads, strict=True))


def slot_of(key: bytes) -> int:
    return key_slot(b"kvtier:" + key.hex().encode())


async def read_each(tier: RedisTier, keys: list[bytes], data: dict[bytes, bytes]) -> list[bool]:
    """Read every key on its own; hit or miss per key; a hit must be the exact bytes."""
    hits = []
    for key in keys:
        out = memoryview(bytearray(BLOCK))
        got = await tier.get_into([key], [out], namespace=NS, layout_fp=LAYOUT_FP)
        assert got == 0 or bytes(out) == data[key], "a read returned wrong bytes"
        hits.append(got == 1)
    return hits


async def test_master_killed_replica_promoted_tier_heals_on_its_own(
        cluster: LocalCluster) -> None:
    keys, data = blocks_by_key(60)
    async with running(cluster.url) as tier:
        assert tier.up and tier.stats_extra()["unserved_slots"] == 0
        await store_all(tier, data)
        for master in cluster.nodes:  # every write reached the replicas: reads after the
            with contextlib.closing(master.client()) as c:     # failover can be exact
                assert c.execute_command("WAIT", 1, 5000) == 1

        victim: RedisServer = cluster.master_of_slot(slot_of(keys[0]))
        lost = [k for k in keys if cluster.master_of_slot(slot_of(k)) is victim]
        kept = [k for k in keys if k not in lost]
        assert lost and kept
        assert all(await read_each(tier, keys, data))

        victim.kill()
        killed_at = time.monotonic()
        # right away: the other masters' keys are all hits, the tier stays up
        assert all(await read_each(tier, kept, data))
        assert tier.up

        healed_at = None
        while time.monotonic() - killed_at < HEAL_BOUND_S:
            assert tier.up, "the tier went down as a whole while one master was lost"
            assert all(await read_each(tier, kept, data)), "a key of a live master missed"
            if all(await read_each(tier, lost, data)):
                healed_at = time.monotonic()
                break
            await asyncio.sleep(0.05)
        assert healed_at is not None, f"lost slots not served again within {HEAL_BOUND_S} s"
        print(f"\nfailover: master :{victim.port} killed; its {len(lost)} keys served again "
              f"(exact) after {healed_at - killed_at:.2f} s "
              f"(cluster-node-timeout {NODE_TIMEOUT_MS} ms)")

        stats = tier.stats_extra()
        assert tier.counters.errors >= 1 and stats["unserved_slots"] == 0
        assert tier.counters.checksum_failures == 0
        # writes go to the promoted replica too
        more, more_data = make_blocks(70)
        fresh = dict(zip(more[60:], more_data[60:], strict=True))
        await store_all(tier, fresh)
        assert all(await read_each(tier, list(fresh), fresh))


async def test_a_tier_started_while_its_first_startup_node_is_dead_uses_another(
        cluster: LocalCluster) -> None:
    """The URL named one startup node: a daemon started while it was down kept the tier
    down, though its replica had taken over and the cluster served every slot. A URL may
    name several now, and any that answers gives the slot map."""
    dead = cluster.nodes[0]
    dead.kill()
    deadline = time.monotonic() + HEAL_BOUND_S
    while True:   # the replica is promoted: every slot served again
        try:
            if all(cluster.master_of_slot(s) is not dead for s in (0, 8000, 16383)) and \
                    len(cluster.live_masters()) == 3:
                break
        except RuntimeError:
            pass
        assert time.monotonic() < deadline, "the replica was not promoted"
        await asyncio.sleep(0.1)
    live = cluster.nodes[1]
    keys, data = blocks_by_key(30)
    async with running(f"redis+cluster://127.0.0.1:{dead.port}") as alone:
        assert not alone.up                          # the one named node is gone
    url = f"redis+cluster://127.0.0.1:{dead.port},127.0.0.1:{live.port}"
    async with running(url) as tier:
        assert tier.up and tier.stats_extra()["unserved_slots"] == 0
        await store_all(tier, data)
        assert all(await read_each(tier, keys, data))


async def test_hung_master_its_keys_miss_fast_the_rest_is_served(tmp_path: Path) -> None:
    """A master that hangs (SIGSTOP; no failover: long node timeout): its keys are misses
    answered without a connection attempt once it failed one bounded wait, a mixed batch
    stops exactly at the first of them, the stats name the server and the unserved slots,
    and once it answers again the tier routes to it again on its own."""
    keys, data = blocks_by_key(40)
    with running_cluster(tmp_path / "cluster", 3, node_timeout_ms=60_000) as cluster:
        async with running(cluster.url) as tier:
            await store_all(tier, data)
            victim = cluster.master_of_slot(slot_of(keys[0]))
            lost = [k for k in keys if cluster.master_of_slot(slot_of(k)) is victim]
            kept = [k for k in keys if k not in lost]
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()  # the first lost key waits at most op_timeout_s
                assert await read_each(tier, lost[:1], data) == [False]
                assert time.monotonic() - t0 < 1.0 + 1.0
                stats = tier.stats_extra()
                assert stats["failed_servers"] == [f"127.0.0.1:{victim.port}"]
                assert 0 < stats["unserved_slots"] < 16384
                t0 = time.monotonic()
                assert await read_each(tier, lost, data) == [False] * len(lost)
                assert time.monotonic() - t0 < 0.5, "unserved keys must miss without waiting"
                assert all(await read_each(tier, kept, data)) and tier.up
                order = [kept[0], lost[0], kept[1]]
                outs = [memoryview(bytearray(BLOCK)) for _ in order]
                assert await tier.get_into(order, outs, namespace=NS, layout_fp=LAYOUT_FP) == 1
                assert await tier.exists_prefix(order) == 1
            finally:
                victim.proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + HEAL_BOUND_S
            while tier.stats_extra()["unserved_slots"]:
                assert time.monotonic() < deadline, "the server answers again but is not used"
                await asyncio.sleep(0.05)
            assert all(await read_each(tier, keys, data))


def test_two_daemons_master_killed_mid_run_no_request_fails(tmp_path: Path) -> None:
    """Two daemons (two "nodes") on one 3+3 cluster: node A writes prompts through, a master
    is killed, node B keeps answering every request (hits or misses, exact bytes), its
    Redis tier never goes down, and after the replica takes over B reads whole prompts
    from Redis again."""
    from kvtier.client import connect
    from kvtier.keys import block_keys
    from kvtier.layout import KVLayout
    from tests.support.daemon import DaemonProcess

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                      tokens_per_block=64)  # 32 KiB blocks
    prompts, per = 8, 8
    with running_cluster(tmp_path / "cluster", 3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS,
                         extra_args=CLUSTER_ARGS) as cluster:
        env = {"KVTIER_REDIS_WRITE_THROUGH": "true", "KVTIER_REDIS_OP_TIMEOUT_S": "1.0",
               "KVTIER_REDIS_CONNECT_TIMEOUT_S": "0.5", "KVTIER_POLICY_PREFETCH_WAIT": "wait"}
        nodes = [DaemonProcess(tmp_path / name, extra_args=["--redis-url", cluster.url],
                               env=env).start() for name in ("a", "b")]
        ca, cb = connect(nodes[0].socket), connect(nodes[1].socket)
        try:
            ns_a = ca.register_layout(layout, "model")
            ns_b = cb.register_layout(layout, "model")
            chains = [block_keys(ns_a, np.arange(per * 64) + 100_000 * p)
                      for p in range(prompts)]
            rng = np.random.default_rng(1)
            data = {bytes(k): rng.integers(0, 255, layout.block_bytes, np.uint8)
                    for chain in chains for k in chain}
            for chain in chains:
                assert ca.put(ns_a, chain, [data[bytes(k)] for k in chain]) == per
            deadline = time.monotonic() + 20
            admin = [m.client() for m in cluster.nodes]
            while sum(c.dbsize() for c in admin) < prompts * per:
                assert time.monotonic() < deadline, "write-through did not reach Redis"
                time.sleep(0.05)
            for c in admin:
                assert c.execute_command("WAIT", 1, 5000) == 1
                c.close()

            def read(p: int) -> int:
                outs = [np.zeros(layout.block_bytes, np.uint8) for _ in chains[p]]
                cb.lookup(ns_b, chains[p])
                got = cb.get(ns_b, chains[p], outs)
                for k, out in zip(chains[p][:got], outs, strict=False):
                    assert np.array_equal(out, data[bytes(k)]), "a wrong block was served"
                return got

            assert read(0) == per
            victim = cluster.master_of_slot(slot_of(bytes(chains[1][0])))
            victim.kill()
            killed_at = time.monotonic()
            for p in (1, 2, 3):  # right away: answers (hits or misses), never an error
                read(p)
            assert nodes[1].stats()["tiers"]["redis"]["up"]
            while nodes[1].stats()["tiers"]["redis"]["unserved_slots"] or \
                    nodes[1].stats()["tiers"]["redis"]["failed_servers"]:
                assert nodes[1].stats()["tiers"]["redis"]["up"], "tier went down as a whole"
                assert time.monotonic() - killed_at < HEAL_BOUND_S, "slot map never healed"
                time.sleep(0.05)
            healed = time.monotonic() - killed_at
            assert all(read(p) == per for p in range(4, prompts))
            print(f"\ndaemon failover: master :{victim.port} killed; node B serving every "
                  f"slot again after {healed:.2f} s; requests failed: 0")
        finally:
            ca.close()
            cb.close()
            for node in nodes:
                node.kill()
