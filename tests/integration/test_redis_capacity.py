"""What the Redis tier reports as its capacity, against real redis-servers: ``redis.bytes``
when set, else the server's ``maxmemory``, else no limit (no capacity or free series, "no
limit" in ``kvtier stats``), never a capacity of 0 that reads as a full tier."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from kvtier.store.stats import BytesMoved, PrefetchCounters, RequestCounters, store_stats
from kvtier.tiers.redis import RedisTier
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer, running_server
from tests.support.redis_tier import cfg_for, eventually, running

MiB = 1 << 20


@pytest.fixture
def capped_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "capped", extra_args=("--maxmemory", "64mb")) as s:
        yield s


def _section(tier: RedisTier) -> dict:
    """The tier's section of /v1/stats, as the store builds it."""
    doc = store_stats([tier], RequestCounters(), PrefetchCounters(), BytesMoved(), {}, {},
                      eviction="lru", namespaces=0, index_blocks=0, recovery=None)
    return doc["tiers"]["redis"]


async def test_the_tier_reports_no_limit_maxmemory_or_its_budget(
        redis_server: RedisServer, capped_server: RedisServer) -> None:
    async with running(cfg_for(redis_server.url)) as tier:
        await eventually(lambda: tier.used_bytes > 0)    # the first INFO round
        t = _section(tier)
        assert t["used_bytes"] > 0 and t["capacity_from"] == "none"
        assert t["capacity_bytes"] is None and t["free_bytes"] is None
    async with running(cfg_for(capped_server.url)) as tier:
        await eventually(lambda: tier.used_bytes > 0)
        t = _section(tier)
        assert t["capacity_from"] == "maxmemory" and t["capacity_bytes"] == 64 * MiB
        assert t["free_bytes"] == 64 * MiB - t["used_bytes"] > 0
    async with running(cfg_for(capped_server.url, bytes=1024 * MiB)) as tier:
        await eventually(lambda: tier.used_bytes > 0)
        t = _section(tier)
        assert t["capacity_from"] == "redis.bytes" and t["capacity_bytes"] == 1024 * MiB


def _metrics(node: DaemonProcess) -> dict[str, float]:
    """The redis tier's gauges from /metrics, by name."""
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvtier_tier_") and 'tier="redis"' in line}


def _stats_row(node: DaemonProcess) -> str:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "stats", "--url", node.http_url],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return next(line for line in out.splitlines() if line.startswith("redis "))


def _used(node: DaemonProcess) -> bool:
    return bool(node.stats()["tiers"]["redis"]["used_bytes"] > 0)


def _until(pred: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_daemon_exports_no_free_bytes_for_an_unbounded_redis(
        daemon_factory: Callable[..., DaemonProcess], redis_server: RedisServer,
        capped_server: RedisServer) -> None:
    free = daemon_factory("free", extra_args=["--redis-url", redis_server.url]).start()
    capped = daemon_factory("capped", extra_args=["--redis-url", capped_server.url]).start()
    for node in (free, capped):   # the first INFO round
        _until(partial(_used, node))
    got = _metrics(free)
    assert got["kvtier_tier_used_bytes"] > 0 and got["kvtier_tier_up"] == 1
    assert "kvtier_tier_free_bytes" not in got and "kvtier_tier_capacity_bytes" not in got
    assert _stats_row(free).split()[3:5] == ["no", "limit"]
    got = _metrics(capped)
    assert got["kvtier_tier_capacity_bytes"] == 64 * MiB
    assert 0 < got["kvtier_tier_free_bytes"] < 64 * MiB
    assert _stats_row(capped).split()[3:6] == ["64.0", "MiB", "maxmemory"]
