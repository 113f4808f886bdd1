"""Redis Cluster resharding under the Redis tier (3 real masters): slots moved from one
master to another with CLUSTER SETSLOT and MIGRATE, as ``redis-cli --cluster reshard``
does. While a slot is being migrated its moved keys answer ASK and new keys are written at
the new owner; once it has moved, the old owner answers MOVED. The tier follows both, so
no block misses and no write is dropped for it, every read is exact, and the slot map is
reloaded after a MOVED. A redirect is followed only to a member of the cluster."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_resp import ConnOptions, ErrorReply, NodeAddr
from kvtier.tiers.redis_route import Router, _member_addrs
from tests.integration.test_redis_cluster_failover import (
    BLOCK,
    CLUSTER_ARGS,
    LAYOUT_FP,
    NS,
    blocks_by_key,
    make_blocks,
    read_each,
    running,
    slot_of,
    store_all,
)
from tests.support.redis_servers import LocalCluster, RedisServer, _node_id, running_cluster

REFRESH_BOUND_S = 10.0   # the slot map is reloaded in the background after a MOVED


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path / "cluster", 3, extra_args=CLUSTER_ARGS) as c:
        yield c


def rkey(key: bytes) -> bytes:
    return b"kvtier:" + key.hex().encode()


def keys_in_slots(slots: set[int], n: int) -> list[bytes]:
    """``n`` fresh block keys whose Redis keys fall in ``slots``."""
    rng = np.random.default_rng(11)
    found: list[bytes] = []
    for _ in itertools.count():
        key = rng.bytes(16)
        if slot_of(key) in slots:
            found.append(key)
            if len(found) == n:
                return found
    raise AssertionError("unreachable")


def migrate(src: RedisServer, dst: RedisServer, keys: list[bytes]) -> None:
    with contextlib.closing(src.client()) as c:
        for key in keys:
            c.execute_command("MIGRATE", "127.0.0.1", dst.port, key, 0, 5000)


def held_while_importing(node: RedisServer, key: bytes) -> bool:
    """Whether ``node`` holds ``key`` of a slot it is importing (asked behind an ASKING)."""
    with contextlib.closing(node.client()) as c:
        pipe = c.pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.execute_command("EXISTS", key)
        return bool(pipe.execute()[1])


def start_migration(cluster: LocalCluster, src: RedisServer, dst: RedisServer,
                    keys: list[bytes]) -> tuple[list[bytes], set[int]]:
    """Mark the slots of ``keys`` held by ``src`` migrating to ``dst`` (importing there) and
    move the first half of those keys: (the keys of ``src``, their slots)."""
    moving = [k for k in keys if cluster.master_of_slot(slot_of(k)) is src]
    slots = {slot_of(k) for k in moving}
    src_id, dst_id = _node_id(src), _node_id(dst)
    with contextlib.closing(src.client()) as cs, contextlib.closing(dst.client()) as cd:
        for slot in slots:
            cd.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            cs.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    migrate(src, dst, [rkey(k) for k in moving[: len(moving) // 2]])
    return moving, slots


async def read_chain(tier: RedisTier, keys: list[bytes], data: dict[bytes, bytes]) -> int:
    """One get of the whole chain (the muxed reader); every block filled must be exact."""
    outs = [memoryview(bytearray(BLOCK)) for _ in keys]
    got = await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP)
    for key, out in zip(keys[:got], outs[:got], strict=True):
        assert bytes(out) == data[key], "a read returned wrong bytes"
    return got


async def test_slots_moving_between_masters_are_followed_never_wrong(
        cluster: LocalCluster) -> None:
    keys, data = blocks_by_key(60)
    # (once, in a fresh-clone CI run, the read right after the slots' move missed 36 of
    # 60 blocks: not a stall but Redis itself, which deleted block 24, in the first slot
    # moved, when the move came before the new cluster's epochs had settled; the cluster
    # helpers now wait for them: tests/integration/test_redis_cluster_reshard_race.py).
    # A 5 s op timeout, as the redis-cli reshard test's: a margin on a loaded CI machine
    async with running(cluster.url, op_timeout_s=5.0) as tier:
        await store_all(tier, data)
        assert await read_chain(tier, keys, data) == len(keys)

        src = cluster.master_of_slot(slot_of(keys[0]))
        dst = next(n for n in cluster.nodes if n is not src)
        moving, slots = start_migration(cluster, src, dst, keys)
        moved_half = moving[: len(moving) // 2]

        # mid-migration: the moved keys answer ASK at the old owner; followed, not missed
        assert await read_chain(tier, keys, data) == len(keys)
        assert all(await read_each(tier, keys, data))
        assert await tier.exists_prefix(keys, namespace=NS) == len(keys)
        asked = tier.redirects
        assert asked >= len(moved_half)
        # new blocks of migrating slots are written at the new owner (ASK), none dropped
        fresh_keys = keys_in_slots(slots, 4)
        fresh = {k: np.random.default_rng(i).bytes(BLOCK) for i, k in enumerate(fresh_keys)}
        await store_all(tier, fresh)
        assert tier.counters.dropped_writes == 0
        assert all(held_while_importing(dst, rkey(k)) for k in fresh_keys)
        assert all(await read_each(tier, fresh_keys, fresh))

        # the migration ends: every key of the slots moves, the slots change owner
        with contextlib.closing(src.client()) as cs:
            for slot in slots:
                while batch := cs.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                    migrate(src, dst, batch)
        dst_id = _node_id(dst)
        for node in cluster.nodes:
            with contextlib.closing(node.client()) as c:
                for slot in slots:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        moved_at = time.monotonic()
        # at once: the old owner answers MOVED, followed; nothing misses
        assert await read_chain(tier, keys, data) == len(keys)
        assert all(await read_each(tier, list(fresh), fresh))
        # and the slot map is reloaded: reads stop being redirected
        settled = None
        while time.monotonic() - moved_at < REFRESH_BOUND_S:
            before = tier.redirects
            assert await read_chain(tier, keys, data) == len(keys)
            if tier.redirects == before:
                settled = time.monotonic() - moved_at
                break
            await asyncio.sleep(0.05)
        assert settled is not None, "the slot map was not reloaded after MOVED replies"
        print(f"\nreshard: {len(slots)} slots moved; {tier.redirects} redirects followed, "
              f"slot map reloaded {settled:.2f} s after the move")

        # writes after the move go to the new owner directly
        more = blocks_by_key(70)[1]
        late = {k: more[k] for k in list(more)[60:]}
        await store_all(tier, late)
        assert all(await read_each(tier, list(late), late))
        stats = tier.stats_extra()
        assert stats["redirects"] == tier.redirects and stats["unserved_slots"] == 0
        assert tier.counters.checksum_failures == 0 and tier.counters.dropped_writes == 0
        assert tier.counters.errors == 0, tier.last_error


def test_a_redirect_is_followed_only_to_a_member_of_the_cluster() -> None:
    seed = NodeAddr("127.0.0.1", 7000)
    router = Router(seed, ConnOptions(connect_timeout_s=1.0, op_timeout_s=1.0), cluster=True,
                    pool_size=1)
    assert router.redirect(ErrorReply("MOVED 3999 127.0.0.1:7000")) == (seed, False)
    assert router.redirect(ErrorReply("ASK 3999 127.0.0.1:7000")) == (seed, True)
    for reply in ("MOVED 3999 10.9.8.7:7000",     # not a member: never connected to
                  "ASK 3999 127.0.0.1:7001",
                  "MOVED 3999 :7000",              # no host named
                  "MOVED x 127.0.0.1:7000", "MOVED 3999", "ERR wrong 127.0.0.1:7000",
                  "CLUSTERDOWN The cluster is down"):
        assert router.redirect(ErrorReply(reply)) is None, reply
    router.mark_failed(seed)
    assert router.redirect(ErrorReply("MOVED 3999 127.0.0.1:7000")) is None


async def test_slots_moving_to_a_master_just_added_are_followed(cluster: LocalCluster) -> None:
    """The usual reshard: a master is added, then slots move to it. The tier has not met it
    (it owns no slot, so no slot map named it): the first ASK towards it has the members
    listed again (CLUSTER NODES), and from then on it is followed like any other."""
    keys, data = blocks_by_key(40)
    async with running(cluster.url, op_timeout_s=5.0) as tier:   # (as above)
        await store_all(tier, data)
        new = cluster.add_master()
        assert await read_chain(tier, keys, data) == len(keys)   # nothing to redirect yet
        assert tier.redirects == 0

        src = cluster.master_of_slot(slot_of(keys[0]))
        moving, slots = start_migration(cluster, src, new, keys)

        assert await read_chain(tier, keys, data) == len(keys)   # the first ASKs followed
        assert tier.redirects >= len(moving) // 2 and tier.up
        # and writes of new blocks of those slots land on the new master
        fresh_keys = keys_in_slots(slots, 3)
        fresh = {k: np.random.default_rng(i).bytes(BLOCK) for i, k in enumerate(fresh_keys)}
        await store_all(tier, fresh)
        assert tier.counters.dropped_writes == 0
        assert all(held_while_importing(new, rkey(k)) for k in fresh_keys)
        assert tier.counters.checksum_failures == 0 and tier.counters.errors == 0


async def test_redis_cli_reshard_to_a_new_master_under_traffic(cluster: LocalCluster) -> None:
    """The real tool: ``redis-cli --cluster reshard`` moves 2000 slots to a master just
    added while the tier reads a 200-block chain and writes new blocks without pause.
    (With the tier's redirect-following turned off, 72 of 109 reads were complete in one
    run, and writes were dropped.)"""
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli not installed (Debian's redis-tools, with redis-server)")
    keys, data = blocks_by_key(200)
    async with running(cluster.url, op_timeout_s=5.0) as tier:   # (no stall of a busy CI machine)
        await store_all(tier, data)
        assert tier.counters.dropped_writes == 0
        new = cluster.add_master()
        src = cluster.nodes[0]
        proc = await asyncio.create_subprocess_exec(
            cli, "--cluster", "reshard", f"127.0.0.1:{src.port}",
            "--cluster-from", _node_id(src), "--cluster-to", _node_id(new),
            "--cluster-slots", "2000", "--cluster-yes",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        more, more_payloads = make_blocks(1400)
        written: dict[bytes, bytes] = {}
        rounds = complete = 0
        while proc.returncode is None:
            for key, payload in zip(more[200 + 2 * rounds:202 + 2 * rounds],
                                    more_payloads[200 + 2 * rounds:202 + 2 * rounds],
                                    strict=True):
                tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
                written[key] = payload
            complete += await read_chain(tier, keys, data) == len(keys)
            rounds += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.001)
        _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()[-500:]
        assert await tier.flush(timeout=20)
        with contextlib.closing(new.client()) as c:
            assert c.dbsize() > 0   # the reshard moved blocks
        print(f"\nredis-cli reshard of 2000 slots: {complete} of {rounds} chain reads complete "
              f"while it ran, {len(written)} blocks written, {tier.redirects} redirects "
              f"followed, {tier.counters.errors} errors")
        assert complete >= 0.95 * rounds and rounds > 0
        assert tier.counters.dropped_writes == 0
        assert await read_chain(tier, keys, data) == len(keys)
        assert await read_chain(tier, list(written), written) == len(written)
        assert tier.counters.checksum_failures == 0


def test_cluster_nodes_members_are_parsed_with_their_addresses() -> None:
    nodes = (b"07c3 127.0.0.1:30004@31004 slave e7d1 0 1426238317239 4 connected\n"
             b"67ed 127.0.0.1:30002@31002,node-2.example master - 0 1426238316232 2 "
             b"connected 5461-10922\n"
             b"292f :30003@31003 myself,master - 0 0 3 connected 10923-16383\n"
             b"6ec2 [::1]:30005@31005 master - 0 1426238316232 5 connected\n"
             b"824f 127.0.0.1:0@0 master,noaddr - 1426238317741 1426238316796 0 disconnected\n"
             b"9a1b 10.0.0.9:30006@31006 handshake - 0 0 0 connected\n"
             b"\n")
    assert _member_addrs(nodes, "10.1.1.1") == [
        NodeAddr("127.0.0.1", 30004), NodeAddr("127.0.0.1", 30002),
        NodeAddr("10.1.1.1", 30003), NodeAddr("::1", 30005)]
