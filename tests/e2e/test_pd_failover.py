"""Prefill/decode through kvtier while Redis Cluster masters die, end to end.

Two "nodes" (two ``kvtier serve`` daemons) on one Redis Cluster of 3 masters and 3
replicas, a producer vLLM engine (CPU) on node A and a consumer engine on node B, as in
test_pd_redis_cluster.py. A master is SIGKILLed in the middle of the producer's run and
another in the middle of the consumer's run, each between two of the engine's requests
(the engine waits at a gate while the test kills). What must hold:

- no request fails: both engine processes run every prompt to the end;
- no wrong token: the consumer's tokens equal a single engine's without kvtier exactly,
  whatever it found in Redis during the failover (hits, misses or failed loads, which
  vLLM recomputes);
- each node's Redis tier is up again on its own once the replica takes over: every slot
  served, a synchronous write-through of a chain spread over every slot succeeds on node A
  and node B reads the whole chain back exactly (times printed).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.keys import block_keys
from tests.e2e.conftest import Zygote
from tests.e2e.pd_support import LAYOUT, PdEngine, Rows, role_config, run_pd_engine
from tests.e2e.vllm_engine import MAX_TOKENS, TOKENS_PER_BLOCK, prompt
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import LocalCluster, RedisServer, running_cluster

pytestmark = pytest.mark.e2e

NODE_TIMEOUT_MS = 500       # cluster-node-timeout: how fast a dead master is declared failed
HEAL_BOUND_S = 30.0         # generous for a loaded 2-core machine; failing means "never"
PROMPTS = [prompt(40 + i, 300) for i in range(6)]   # 4 whole blocks and a tail each
WHOLE = 4 * TOKENS_PER_BLOCK
PAUSE_AFTER = 2


def redis_stats(node: DaemonProcess) -> dict[str, Any]:
    stats: dict[str, Any] = node.stats()["tiers"]["redis"]
    return stats


def replicate(cluster: LocalCluster) -> None:
    """Every write so far reached the live masters' replicas (WAIT), so what a killed
    master held is on its promoted replica: the test then knows what must survive."""
    for master in cluster.live_masters():
        with contextlib.closing(master.client()) as c:
            if c.execute_command("ROLE")[2]:     # a master that still has a replica
                assert c.execute_command("WAIT", 1, 5000) == 1


def kill_a_master(cluster: LocalCluster) -> tuple[RedisServer, float]:
    """SIGKILL the live master with the most keys among those that have a replica (so
    the cluster can fail over); returns it and when it died."""
    def keys_of(node: RedisServer) -> int:
        with contextlib.closing(node.client()) as c:
            return int(c.dbsize()) if c.execute_command("ROLE")[2] else -1
    victim = max(cluster.live_masters(), key=keys_of)
    assert keys_of(victim) > 0, "no master with keys and a replica to kill"
    victim.kill()
    return victim, time.monotonic()


def wait_healed(node: DaemonProcess, errors_before: int, killed_at: float) -> float:
    """Seconds from the kill until ``node``'s tier has met the dead master (an error
    counted since ``errors_before``) and serves every slot again: no failed server, no
    unserved slot, up all along."""
    while True:
        stats = redis_stats(node)
        assert stats["up"], "the Redis tier went down as a whole while one master was lost"
        if stats["errors"] > errors_before and not stats["failed_servers"] \
                and stats["unserved_slots"] == 0:
            return time.monotonic() - killed_at
        assert time.monotonic() - killed_at < HEAL_BOUND_S, f"not healed: {stats}"
        time.sleep(0.05)


def every_slot_round_trip(node_a: DaemonProcess, node_b: DaemonProcess, seed: int) -> None:
    """Node A writes a 24-block chain (its keys fall on every master) through to Redis
    synchronously; node B, which never saw it, finds all of it (once its own tier has
    healed) and reads it back exactly."""
    ca, cb = connect(node_a.socket), connect(node_b.socket)
    try:
        ns_a, ns_b = ca.register_layout(LAYOUT, "heal-check"), cb.register_layout(
            LAYOUT, "heal-check")
        keys = block_keys(ns_a, np.arange(24 * TOKENS_PER_BLOCK) + seed * 1_000_000)
        rng = np.random.default_rng(seed)
        data = [rng.integers(0, 255, LAYOUT.block_bytes, np.uint8) for _ in keys]
        lease = ca.prepare_put(ns_a, keys)
        for view, block in zip(lease.views, data, strict=True):
            assert view is not None
            np.copyto(view, block)
        lease.commit(redis_sync_s=10.0)
        assert lease.redis_synced and lease.redis_visible == len(keys), \
            "a synchronous write-through did not reach every slot after the failover"
        # node B may not have met the dead master yet: its first lookup there fails over
        # to a miss and starts its own reload of the slot map; it heals on its own
        deadline = time.monotonic() + HEAL_BOUND_S
        while (hits := cb.lookup(ns_b, keys).hits) < len(keys):
            assert time.monotonic() < deadline, f"node B still finds {hits} of {len(keys)}"
            time.sleep(0.05)
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
        assert cb.get(ns_b, keys, outs) == len(keys)
        for out, block in zip(outs, data, strict=True):
            assert np.array_equal(out, block), "node B read wrong bytes after the failover"
    finally:
        ca.close()
        cb.close()


def run_through_a_kill(work: Path, model: Path, cluster: LocalCluster, node: DaemonProcess,
                       role: str, max_tokens: int, zygote: Zygote
                       ) -> tuple[Rows, dict[str, Any], RedisServer, float]:
    """``role``'s engine on ``node`` over PROMPTS, a master SIGKILLed after PAUSE_AFTER of
    its requests (once what was written is replicated); its rows, connector counters, the
    victim, and how long ``node``'s tier took to serve every slot again."""
    work.mkdir()
    engine = PdEngine(work, model, role_config(node, role), PROMPTS, max_tokens,
                      zygote=zygote, pause_after=PAUSE_AFTER)
    engine.wait_paused()
    replicate(cluster)
    errors = redis_stats(node)["errors"]
    victim, killed_at = kill_a_master(cluster)
    engine.go()
    rows, counters = engine.result()
    return rows, counters, victim, wait_healed(node, errors, killed_at)


def test_masters_killed_mid_run_no_request_fails_no_wrong_token(
        tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, zygote: Zygote) -> None:
    root = tmp_path_factory.mktemp("pd-failover")
    env = {"KVTIER_REDIS_WRITE_THROUGH": "false", "KVTIER_REDIS_LOOKUP_BUDGET_S": "2.0",
           "KVTIER_REDIS_OP_TIMEOUT_S": "1.0", "KVTIER_REDIS_CONNECT_TIMEOUT_S": "0.5"}
    (root / "baseline").mkdir()
    base, _ = run_pd_engine(root / "baseline", tiny_model, None, PROMPTS, MAX_TOKENS,
                            zygote=zygote)
    baseline = [row[0] for row in base]
    with running_cluster(root / "cluster", 3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS,
                         extra_args=("--cluster-require-full-coverage", "no")) as cluster:
        node_a, node_b = (DaemonProcess(root / f"node-{n}", cpu_bytes="64MiB", nvme_bytes="0",
                                        extra_args=["--redis-url", cluster.url],
                                        env=env).start() for n in ("a", "b"))
        try:
            # prefill on node A; a master dies after two of its requests
            prod, prod_counters, first, heal_a = run_through_a_kill(
                root / "producer", tiny_model, cluster, node_a, "kv_producer", 1, zygote)
            assert [row[0] for row in prod] == [want[:1] for want in baseline]
            every_slot_round_trip(node_a, node_b, seed=1)

            # decode on node B; another master dies after two of its requests
            cons, cons_counters, second, heal_b = run_through_a_kill(
                root / "consumer", tiny_model, cluster, node_b, "kv_consumer", MAX_TOKENS,
                zygote)
            assert [row[0] for row in cons] == baseline, "a wrong token after a failover"
            cached = [row[1] for row in cons]
            # the first two prompts were prefilled and replicated before the first kill
            # and decoded before the second: their whole blocks came from Redis
            assert cached[:PAUSE_AFTER] == [WHOLE] * PAUSE_AFTER, cached
            assert all(0 <= c <= WHOLE for c in cached), cached
            every_slot_round_trip(node_a, node_b, seed=2)

            for node in (node_a, node_b):
                assert redis_stats(node)["checksum_failures"] == 0
            assert node_b.stats()["requests"]["put_blocks"] == 0   # a consumer never saves
            reasons = node_a.stats()["daemon"]["redis_sync"]["gave_up_by_reason"]
            print(f"\nP/D failover: producer request seconds "
                  f"{[round(row[2], 2) for row in prod]}, sync give-ups by reason {reasons}")
            print(f"P/D failover: master :{first.port} killed mid-prefill, node A served "
                  f"every slot again within {heal_a:.2f} s (producer sync give-ups "
                  f"{prod_counters.get('redis_sync_gave_up', 0)}); master :{second.port} "
                  f"killed mid-decode, node B within {heal_b:.2f} s; consumer cached tokens "
                  f"{cached} (loaded blocks {cons_counters.get('loaded_blocks', 0)}); requests "
                  f"failed: 0; wrong tokens: 0 (cluster-node-timeout {NODE_TIMEOUT_MS} ms)")
        finally:
            node_a.kill()
            node_b.kill()
