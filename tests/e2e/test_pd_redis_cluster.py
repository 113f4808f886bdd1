"""Prefill/decode disaggregation through kvtier and a Redis Cluster, end to end.

Two "nodes": two ``kvtier serve`` daemons with their own data directories and arenas, both
attached to one Redis Cluster of 3 masters and 3 replicas (started here from the test
redis-server). A producer vLLM engine (``kv_role: kv_producer``) on node A prefills the
prompts (one token each, as a P/D proxy asks); right after each request returns, node B's
prefix-locality endpoint must already see every prompt block in Redis. A consumer engine
(``kv_consumer``) on node B then decodes: its tokens equal a single engine's without kvtier
exactly, it computes only what the producer did not save (``num_cached_tokens``), and it
saves nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Zygote
from tests.e2e.pd_support import role_config, run_pd_engine
from tests.e2e.vllm_engine import MAX_TOKENS, TOKENS_PER_BLOCK, prompt
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import LocalCluster, start_cluster

pytestmark = pytest.mark.e2e

P1 = prompt(21, 300)                                   # 4 whole blocks and a tail
P2 = prompt(22, 4 * TOKENS_PER_BLOCK)                  # exactly 4 blocks
P3 = P1[: 2 * TOKENS_PER_BLOCK] + prompt(23, 90)       # shares 2 blocks; never prefilled


def cluster_with_replicas(workdir: Path) -> LocalCluster:
    """3 masters with one replica each."""
    return start_cluster(workdir, 3, replicas=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = cluster_with_replicas(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def nodes(cluster: LocalCluster,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, ...]]:
    made = [DaemonProcess(tmp_path_factory.mktemp(f"node-{name}"), cpu_bytes="64MiB",
                          nvme_bytes="0", extra_args=["--redis-url", cluster.url],
                          env={"KVTIER_REDIS_WRITE_THROUGH": "false",
                               # the consumer's lookups must not give up on a loaded machine
                               "KVTIER_REDIS_LOOKUP_BUDGET_S": "2.0"})
            for name in ("a", "b")]
    try:
        yield tuple(d.start() for d in made)
    finally:
        for d in made:
            d.kill()


def test_consumer_decodes_exactly_from_the_producers_kv(
        tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, cluster: LocalCluster,
        nodes: tuple[DaemonProcess, DaemonProcess], zygote: Zygote) -> None:
    node_a, node_b = nodes
    base, _ = run_pd_engine(tmp_path_factory.mktemp("baseline"), tiny_model, None,
                            [P1, P2, P3], MAX_TOKENS, zygote=zygote)
    baseline = [row[0] for row in base]

    # prefill on node A: every prompt block is in Redis when the request returns
    prod, prod_counters = run_pd_engine(tmp_path_factory.mktemp("producer"), tiny_model,
                                        role_config(node_a, "kv_producer"), [P1, P2], 1,
                                        probe=node_b, zygote=zygote)
    for (tokens, cached, _s, seen), p, want in zip(prod, [P1, P2], baseline[:2], strict=True):
        assert tokens == want[:1] and cached == 0
        assert seen == len(p) // TOKENS_PER_BLOCK, "blocks not in Redis at request end"
    assert prod_counters.get("redis_sync_gave_up", 0) == 0
    in_redis = cluster.keys_held()
    assert in_redis == 2 * 4   # 4 blocks of each prompt, nothing else

    # decode on node B: exact tokens, only what the producer did not save is computed
    cons, _ = run_pd_engine(tmp_path_factory.mktemp("consumer"), tiny_model,
                            role_config(node_b, "kv_consumer"), [P1, P2, P3], MAX_TOKENS,
                            zygote=zygote)
    assert [row[0] for row in cons] == baseline
    assert [row[1] for row in cons] == [4 * TOKENS_PER_BLOCK, len(P2) - 1,
                                        2 * TOKENS_PER_BLOCK]
    stats_b = node_b.stats()
    assert stats_b["requests"]["put_blocks"] == 0          # a consumer never saves
    assert cluster.keys_held() == in_redis
    synced = node_a.stats()["daemon"]["redis_sync"]
    assert synced["commits"] >= 2 and synced["blocks"] >= 8 and synced["gave_up"] == 0
