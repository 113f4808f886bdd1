"""A reshard right after the cluster's epochs changed (regression: a fresh-clone CI run of
test_redis_cluster_reshard missed 36 of 60 blocks right after the slots' move).

Not a fault of the tier: Redis itself lost the slot. CLUSTER SETSLOT ... NODE at the
destination bumps its config epoch only above the greatest epoch it knows of, and not at
all when it believes it holds that one. Right after a cluster forms its epochs are still
being settled by gossip (every master starts at 0), so the destination's view can be
stale: the source, which claims the slot until its own SETSLOT, then holds the greater
epoch, and its next ping wins the slot back at the destination. The destination deletes
the slot's keys (no longer its slot's), and from then on each master answers MOVED to the
other: no client reads the block again (the tier follows one redirect and misses). In the
CI run it was the first slot the test moves (block 24's), the one the destination takes
before it hears of the greater epoch; the later ones bump it. The cluster helpers
therefore wait for settled epochs (``tests.support.redis_servers._wait_cluster``). This
test makes the stale view on purpose (CLUSTER BUMPEPOCH at the source just before the
move) and stretches the source's window past a ping, as a loaded machine does: without
that wait the block is deleted (5 runs of 5), with it every block stays readable."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_redis_cluster_failover import (
    CLUSTER_ARGS,
    NS,
    blocks_by_key,
    running,
    slot_of,
    store_all,
)
from tests.integration.test_redis_cluster_reshard import read_chain, rkey, start_migration
from tests.support.redis_servers import LocalCluster, RedisServer, _node_id, running_cluster

# every node pings each other at least every cluster-node-timeout / 2 (1 s here)
PING_WITHIN_S = 1.5


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path / "cluster", 3, extra_args=CLUSTER_ARGS) as c:
        yield c


def config_epoch(node: RedisServer) -> int:
    with contextlib.closing(node.client()) as c:
        info = c.execute_command("CLUSTER INFO")
    if isinstance(info, bytes):
        info = dict(line.split(":", 1) for line in info.decode().split())
    return int({str(k): str(v) for k, v in info.items()}["cluster_my_epoch"])


def bump_epoch(node: RedisServer) -> None:
    with contextlib.closing(node.client()) as c:
        c.execute_command("CLUSTER", "BUMPEPOCH")


async def test_a_reshard_after_an_epoch_change_waits_for_the_epochs_to_settle(
        cluster: LocalCluster) -> None:
    keys, data = blocks_by_key(60)
    async with running(cluster.url) as tier:
        await store_all(tier, data)
        assert await read_chain(tier, keys, data) == len(keys)

        # the destination holds the greatest epoch, known to all; then the source takes a
        # greater one, which the destination has not heard of yet
        dst = max(cluster.nodes, key=config_epoch)
        bump_epoch(dst)   # (no change when it holds the greatest already)
        cluster.wait_settled()
        # one slot moves (one block): the destination takes it while it still believes
        # its epoch the greatest, and is told otherwise only by the source's next ping
        block = next(k for k in keys if cluster.master_of_slot(slot_of(k)) is not dst)
        src = cluster.master_of_slot(slot_of(block))
        moving, slots = start_migration(cluster, src, dst, [block])
        with contextlib.closing(src.client()) as cs:
            cs.execute_command("MIGRATE", "127.0.0.1", dst.port, rkey(block), 0, 5000)
        dst_id = _node_id(dst)
        # the order redis-cli uses: the destination, the source, then the others
        order = [dst, src, *(n for n in cluster.nodes if n not in (src, dst))]
        with contextlib.ExitStack() as stack:
            clients = [stack.enter_context(contextlib.closing(n.client())) for n in order]
            for c in clients:
                c.ping()   # (connected before: the destination must not hear of the bump)
            clients[1].execute_command("CLUSTER", "BUMPEPOCH")
            cluster.wait_settled()   # as the cluster helpers do: without it Redis loses a slot
            for i, c in enumerate(clients):
                for slot in slots:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
                if i == 0:   # the source claims the slots until its turn: a window that a
                    time.sleep(PING_WITHIN_S)   # loaded machine stretches, past a ping here

        with contextlib.closing(dst.client()) as c:   # Redis kept every moved block
            held = sum(c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) for slot in slots)
        assert held == len(moving), f"{len(moving) - held} moved blocks deleted by Redis"
        assert await read_chain(tier, keys, data) == len(keys)
        assert await tier.exists_prefix(keys, namespace=NS) == len(keys)
        assert tier.counters.checksum_failures == 0 and tier.counters.dropped_writes == 0
        assert all(cluster.master_of_slot(slot) is dst for slot in slots)

