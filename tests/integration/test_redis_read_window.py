"""How many GET pipelines a RedisTier keeps in flight against real redis-server processes:
about ``inflight_bytes_per_server`` per live server (at least two), never over
``max_inflight``, and the blocks read are exact whatever the window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers import redis_mux
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_pool import NodePool
from tests.support.redis_servers import LocalCluster, RedisServer, running_cluster
from tests.support.redis_tier import LAYOUT_FP, NS, blocks, buffers, cfg_for, put_all, running

MiB = 1 << 20


def spy_streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the most GET pipelines in flight at once (as [peak]): connections the reader
    started a pipeline on (kvtier.tiers.redis_mux) and has not given back yet."""
    peak = [0]
    live: set[int] = set()
    start = redis_mux._start
    give = NodePool.give

    def counted_start(job: Any, pool: Any, conn: Any) -> Any:
        stream = start(job, pool, conn)
        if stream is not None:
            live.add(id(stream.conn))
            peak[0] = max(peak[0], len(live))
        return stream

    def counted_give(self: NodePool, conn: Any) -> None:
        live.discard(id(conn))
        give(self, conn)

    monkeypatch.setattr(redis_mux, "_start", counted_start)
    monkeypatch.setattr(NodePool, "give", counted_give)
    return peak


async def read_back(tier: RedisTier, keys: list[bytes], data: list[bytes], size: int) -> None:
    outs = buffers(len(keys), size)
    got = await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP)
    assert got == len(keys)
    assert all(bytes(o) == d for o, d in zip(outs, data, strict=True))


@pytest.mark.parametrize(("size", "budget", "expect"), [
    (3 * MiB, 8 * MiB, 2),        # big blocks: two in flight against one server
    (MiB // 4, 8 * MiB, 8),       # one-GET pipelines: 32 fit the budget, max_inflight binds
    (3 * MiB, 1 << 30, 8),        # a budget that never binds: max_inflight
    (3 * MiB, 1, 2),              # a tiny budget still keeps two in flight
])
async def test_get_window_per_server(redis_server: RedisServer, size: int, budget: int,
                                     expect: int, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, data = blocks(16 * MiB // size * 3, size=size)   # 48 MiB: more batches than fit
    cfg = cfg_for(redis_server.url, op_timeout_s=5.0, inflight_bytes_per_server=budget)
    async with running(cfg) as tier:
        await put_all(tier, keys, data)
        peak = spy_streams(monkeypatch)
        await read_back(tier, keys, data, size)
        assert peak[0] == expect


async def test_window_never_closes_while_the_server_is_marked_failed(
        redis_server: RedisServer) -> None:
    """A server marked failed still leaves one server's window (reads in flight finish,
    the next lookups find the tier down); the window never drops to zero."""
    async with running(cfg_for(redis_server.url)) as tier:
        assert tier._window(3 * MiB) == 2
        tier._router.mark_failed(tier._router.masters()[0])
        assert tier._window(3 * MiB) == 2
        assert tier._window(MiB) == 8


async def test_cluster_window_grows_with_live_masters(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    keys, data = blocks(24, size=3 * MiB)
    with running_cluster(tmp_path / "cluster") as cluster:
        assert isinstance(cluster, LocalCluster)
        cfg = cfg_for(cluster.url, op_timeout_s=5.0, max_inflight=16)
        async with running(cfg) as tier:
            await put_all(tier, keys, data)
            assert tier._window(3 * MiB) == 6    # 3 masters x 2
            peak = spy_streams(monkeypatch)
            await read_back(tier, keys, data, 3 * MiB)
            assert peak[0] == 6
