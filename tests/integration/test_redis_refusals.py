"""Error replies that are about one write or one node, not about the tier (review of
2026-12-06): a server at its maxmemory refusing SETs with -OOM took the whole tier down
(three refused blocks of one batch counted as three failures), so every lookup and get
missed, blocks on healthy cluster masters included, and the tier kept flapping."""

from __future__ import annotations

from pathlib import Path

from kvtier.tiers.redis_route import key_slot
from tests.support.redis_servers import RedisServer, running_cluster
from tests.support.redis_tier import (
    LAYOUT_FP,
    NS,
    blocks,
    cfg_for,
    put_all,
    read_exact,
    rkey,
    running,
)

BLOCK = 1 << 20


async def test_a_server_at_its_maxmemory_drops_writes_and_keeps_serving_reads(
        redis_server: RedisServer) -> None:
    admin = redis_server.client()
    keys, data = blocks(8, size=BLOCK, seed=51)
    async with running(cfg_for(redis_server.url, op_timeout_s=10.0)) as tier:
        await put_all(tier, keys, data)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + BLOCK)
        more, payloads = blocks(24, size=BLOCK, seed=52)
        for _ in range(2):                       # batches of refused SETs, twice
            for key, payload in zip(more, payloads, strict=True):
                tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
            await tier.flush(timeout=10)
        stats = tier.stats_extra()
        assert stats["dropped_writes"] >= 24 and "OOM" in stats["last_error"]
        assert tier.up and stats["reconnects"] == 0
        await read_exact(tier, keys, data, BLOCK)   # what was stored is still served


async def test_one_full_cluster_master_costs_only_its_own_writes(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "cluster", 3) as cluster:
        async with running(cfg_for(cluster.url, op_timeout_s=10.0)) as tier:
            keys, data = blocks(12, size=BLOCK, seed=53)
            await put_all(tier, keys, data)
            full = cluster.master_of_slot(key_slot(rkey(keys[0])))
            admin = full.client()
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + BLOCK)
            more, payloads = blocks(48, size=BLOCK, seed=54)
            for key, payload in zip(more, payloads, strict=True):
                tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
            await tier.flush(timeout=10)
            refused = [k for k in more if cluster.master_of_slot(key_slot(rkey(k))) is full]
            assert refused and tier.stats_extra()["dropped_writes"] >= len(refused) - 1
            assert tier.up and tier.stats_extra()["reconnects"] == 0
            await read_exact(tier, keys, data, BLOCK)   # every master's blocks, the full one's too
            elsewhere = [(k, p) for k, p in zip(more, payloads, strict=True) if k not in refused]
            await read_exact(tier, [k for k, _ in elsewhere], [p for _, p in elsewhere], BLOCK)
