"""Two real daemons (separate data directories and sockets) sharing one real Redis, driven
through the client: blocks cross "nodes" through Redis, and Redis trouble never reaches a
client (it only shows as a down tier in stats and metrics)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.frame import HEADER_SIZE, Codec, FrameHeader
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import (
    RedisServer,
    free_port,
    redis_server_or_skip,
    start_server,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)  # 32 KiB blocks
WRITE_THROUGH = {"KVTIER_REDIS_WRITE_THROUGH": "true"}


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    made: list[DaemonProcess] = []

    def make(name: str, redis_url: str, *extra: str) -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, extra_args=["--redis-url", redis_url, *extra],
                          env=dict(WRITE_THROUGH))
        made.append(d)
        return d.start()

    try:
        yield make
    finally:
        for d in made:
            d.kill()


def content(key: bytes, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).standard_normal(nbytes // 2).astype(np.float16).view(
        np.uint8)


def wait_for(pred: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def redis_stats(node: DaemonProcess) -> dict:
    return node.stats()["tiers"]["redis"]


def tier_up_metric(node: DaemonProcess) -> float:
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("kvtier_tier_up{") and 'tier="redis"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("kvtier_tier_up{tier=\"redis\"} not exported")


def test_block_put_on_node_a_is_read_exactly_on_node_b(
        redis_server: RedisServer, node_factory: Callable[..., DaemonProcess]) -> None:
    node_a = node_factory("a", redis_server.url)
    node_b = node_factory("b", redis_server.url)
    ca, cb = connect(node_a.socket), connect(node_b.socket)
    ns_a = ca.register_layout(LAYOUT, "model")
    keys = block_keys(ns_a, np.arange(8 * 64))
    data = [content(bytes(k), LAYOUT.block_bytes) for k in keys]
    assert ca.put(ns_a, keys, data) == 8
    admin = redis_server.client()
    wait_for(lambda: admin.dbsize() == 8)  # write-behind reached Redis

    ns_b = cb.register_layout(LAYOUT, "model")
    found = cb.lookup(ns_b, keys)
    assert found.hits == 8 and set(found.tiers) == {"redis"}
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
    assert cb.get(ns_b, keys, outs) == 8
    for out, want in zip(outs, data, strict=True):
        assert np.array_equal(out, want)
    stats = redis_stats(node_b)
    assert stats["up"] and stats["hit_blocks"] >= 8 and stats["checksum_failures"] == 0
    # a tenant with another cache salt never sees node A's blocks
    salted = cb.register_layout(LAYOUT, "model", cache_salt="tenant-b")
    assert cb.lookup(salted, block_keys(salted, np.arange(8 * 64))).hits == 0
    ca.close()
    cb.close()


def tier_metric(node: DaemonProcess, name: str, tier: str = "redis") -> float | None:
    """A per-tier series' value from /metrics (None when not exported)."""
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and f'tier="{tier}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_redis_hits_and_misses_are_counted_by_lookups(
        redis_server: RedisServer, node_factory: Callable[..., DaemonProcess]) -> None:
    """The review's two nodes: lookups that miss in Redis count misses on the node that
    stored the blocks; a lookup without prefetch on the other counts hits and tokens."""
    node_a = node_factory("a", redis_server.url)
    node_b = node_factory("b", redis_server.url)
    ca, cb = connect(node_a.socket), connect(node_b.socket)
    ns_a = ca.register_layout(LAYOUT, "model")
    keys = block_keys(ns_a, np.arange(8 * 64))
    assert ca.put(ns_a, keys, [content(bytes(k), LAYOUT.block_bytes) for k in keys]) == 8
    admin = redis_server.client()
    wait_for(lambda: admin.dbsize() == 8)
    unknown = block_keys(ns_a, 50_000 + np.arange(4 * 64))   # stored nowhere
    for _ in range(5):
        assert ca.lookup(ns_a, unknown).hits == 0
    assert ca.lookup(ns_a, keys).hits == 8           # held by A's arena: Redis not asked
    ra = redis_stats(node_a)
    assert (ra["hit_blocks"], ra["miss_blocks"], ra["miss_tokens"]) == (0, 5, 5 * 64)

    ns_b = cb.register_layout(LAYOUT, "model")
    assert cb.lookup(ns_b, keys, prefetch=False).hits == 8
    rb = redis_stats(node_b)
    assert (rb["hit_blocks"], rb["hit_tokens"], rb["miss_blocks"]) == (8, 8 * 64, 0)
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
    assert cb.get(ns_b, keys, outs) == 8             # read from Redis: no second count
    rb = redis_stats(node_b)
    assert (rb["hit_blocks"], rb["fetched_blocks"]) == (8, 8)
    assert tier_metric(node_b, "kvtier_hit_tokens_total") == 8 * 64
    assert tier_metric(node_a, "kvtier_miss_blocks_total") == 5
    ca.close()
    cb.close()


def test_redis_killed_mid_run_clients_see_no_error(
        redis_server: RedisServer, node_factory: Callable[..., DaemonProcess]) -> None:
    node = node_factory("a", redis_server.url)
    c = connect(node.socket)
    ns = c.register_layout(LAYOUT, "model")
    keys = block_keys(ns, np.arange(16 * 64))
    data = [content(bytes(k), LAYOUT.block_bytes) for k in keys]
    assert c.put(ns, keys[:8], data[:8]) == 8
    assert tier_up_metric(node) == 1.0

    redis_server.kill()
    assert c.put(ns, keys[8:], data[8:]) == 8          # served by the cpu tier
    assert c.lookup(ns, keys).hits == 16
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
    assert c.get(ns, keys, outs) == 16
    assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))
    wait_for(lambda: not redis_stats(node)["up"])
    assert redis_stats(node)["errors"] >= 1
    assert tier_up_metric(node) == 0.0

    redis_server.start()
    wait_for(lambda: redis_stats(node)["up"])
    assert tier_up_metric(node) == 1.0
    more = block_keys(ns, np.arange(20 * 64))[16:]
    assert c.put(ns, more, [content(bytes(k), LAYOUT.block_bytes) for k in more]) == 4
    admin = redis_server.client()
    wait_for(lambda: admin.dbsize() >= 4)
    c.close()


def test_daemon_starts_and_serves_with_redis_unreachable(
        tmp_path: Path, node_factory: Callable[..., DaemonProcess]) -> None:
    redis_server_or_skip()
    port = free_port()
    node = node_factory("a", f"redis://127.0.0.1:{port}/0")
    c = connect(node.socket)
    ns = c.register_layout(LAYOUT, "model")
    keys = block_keys(ns, np.arange(4 * 64))
    assert c.put(ns, keys, [content(bytes(k), LAYOUT.block_bytes) for k in keys]) == 4
    assert c.lookup(ns, keys).hits == 4
    assert not redis_stats(node)["up"] and tier_up_metric(node) == 0.0
    server = start_server(tmp_path / "late-redis", port=port)
    try:
        wait_for(lambda: redis_stats(node)["up"])
    finally:
        server.stop()
    c.close()


def test_shuffle_codec_takes_each_namespace_element_width(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """An fp32 namespace's blocks are byte-shuffled with elem_bytes=4 (the codec header's
    first byte), an fp16 one's with 2: the width comes from the namespace's layout."""
    node = DaemonProcess(tmp_path / "a", extra_args=["--redis-url", redis_server.url],
                         env={**WRITE_THROUGH, "KVTIER_REDIS_CODEC": "shuffle-lz4"}).start()
    try:
        c = connect(node.socket)
        fp32 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32",
                        tokens_per_block=32)
        widths = {}
        admin = redis_server.client()
        for layout in (fp32, LAYOUT):
            ns = c.register_layout(layout, f"model-{layout.dtype}")
            keys = block_keys(ns, np.arange(layout.tokens_per_block))
            data = [content(bytes(k), layout.block_bytes) for k in keys]
            assert c.put(ns, keys, data) == 1
            rkey = b"kvtier:" + bytes(keys[0]).hex().encode()
            def stored(k: bytes = rkey) -> bool:
                return admin.exists(k) == 1

            wait_for(stored)
            value = admin.get(rkey)
            assert isinstance(value, bytes)
            header = FrameHeader.unpack(value[:HEADER_SIZE])
            assert header.codec is Codec.SHUFFLE_LZ4 and header.raw_len == layout.block_bytes
            widths[layout.dtype] = value[HEADER_SIZE]   # the shuffle codec's elem_bytes
        assert widths == {"float32": 4, "float16": 2}
        c.close()
    finally:
        node.kill()


def test_large_blocks_cross_nodes_as_stripes_and_a_delete_takes_them_all(
        redis_server: RedisServer, node_factory: Callable[..., DaemonProcess]) -> None:
    """Blocks of 8 MiB or more go to Redis as stripes (kvtier.tiers.redis_stripes): node B
    reads node A's exactly, and a delete leaves nothing of them in Redis."""
    big = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16",
                   tokens_per_block=640)   # 10 MiB blocks: a head and two more stripes
    node_a = node_factory("a", redis_server.url)
    node_b = node_factory("b", redis_server.url)
    ca, cb = connect(node_a.socket), connect(node_b.socket)
    ns_a = ca.register_layout(big, "model")
    keys = block_keys(ns_a, np.arange(2 * 640))
    data = [content(bytes(k), big.block_bytes) for k in keys]
    assert ca.put(ns_a, keys, data) == 2
    admin = redis_server.client()
    wait_for(lambda: admin.dbsize() == 2 * 3)          # two heads, four stripes
    raw = admin.getrange(b"kvtier:" + bytes(keys[0]).hex().encode(), 0, HEADER_SIZE - 1)
    assert isinstance(raw, bytes)
    head = FrameHeader.unpack(raw)
    assert head.payload_len == big.block_bytes

    ns_b = cb.register_layout(big, "model")
    assert cb.lookup(ns_b, keys).hits == 2
    outs = [np.zeros(big.block_bytes, np.uint8) for _ in keys]
    assert cb.get(ns_b, keys, outs) == 2
    assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))
    assert redis_stats(node_b)["checksum_failures"] == 0
    assert cb.delete(ns_b, keys) == 2
    assert admin.dbsize() == 0
    ca.close()
    cb.close()


def test_a_delete_right_after_a_write_through_put_deletes_everywhere(
        redis_server: RedisServer, node_factory: Callable[..., DaemonProcess]) -> None:
    """A write-through pins its blocks until their SETs are sent: a delete right after the
    put skipped the pinned blocks (they were served after the delete was answered) and
    its DELs went out before the queued SETs, which brought the blocks back in Redis for
    every node. Now the delete drops the queued writes first and waits for those in
    flight."""
    node = node_factory("a", redis_server.url, "--cpu-bytes", "64MiB")
    big = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16",
                   tokens_per_block=32)                         # 256 KiB blocks
    admin = redis_server.client()
    with connect(node.socket) as c:
        ns = c.register_layout(big, "model")
        for trial in range(5):
            keys = block_keys(ns, np.arange(32 * 32) + trial * 10**6)
            assert c.put(ns, keys, [np.full(big.block_bytes, trial, np.uint8)] * 32) == 32
            assert c.delete(ns, keys) == 32
            assert c.lookup(ns, keys, prefetch=False).hits == 0
            outs = [np.empty(big.block_bytes, np.uint8) for _ in keys]
            assert c.get(ns, keys, outs) == 0
        time.sleep(1.0)                     # anything still queued would have landed
        assert admin.dbsize() == 0
        assert c.lookup(ns, keys, prefetch=False).hits == 0
