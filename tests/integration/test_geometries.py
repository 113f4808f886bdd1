"""Model geometries the other tests do not use, side by side in one daemon: block sizes that
are not powers of two nor page multiples (fp8 MLA latents, odd head counts and dims, a
single 64-byte token, a 4.5 MB DeepSeek-like block), in one small arena that spills to nvme
and writes through to Redis. Every block read back (from the arena, from nvme, and on a
second daemon from Redis) has exactly the bytes that were put; what is not read back is a
shorter prefix, never other bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.client import KVTierClient, connect
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer

GEOMETRIES = {
    # name: (layout, blocks stored)
    "mla-fp8": (KVLayout(num_layers=3, num_kv_heads=1, head_dim=576, dtype="float8_e4m3fn",
                         tokens_per_block=16, kv_components=1), 24),          # 27,648 B
    "odd-fp16": (KVLayout(num_layers=5, num_kv_heads=3, head_dim=72, dtype="float16",
                          tokens_per_block=17), 24),                          # 73,440 B
    "one-token": (KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32",
                           tokens_per_block=1), 64),                          # 64 B
    "deepseek-bf16": (KVLayout(num_layers=61, num_kv_heads=1, head_dim=576, dtype="bfloat16",
                               tokens_per_block=64, kv_components=1), 6),     # 4,497,408 B
}


def payload(name: str, layout: KVLayout, i: int) -> np.ndarray:
    seed = sum(name.encode()) * 1000 + i
    return np.random.default_rng(seed).integers(0, 256, layout.block_bytes, dtype=np.uint8)


def keys_of(ns: Namespace, name: str, layout: KVLayout, n: int) -> list[bytes]:
    base = sum(name.encode()) * 10_000
    return block_keys(ns, np.arange(base, base + n * layout.tokens_per_block))


def read_back(c: KVTierClient, ns: Namespace, name: str, layout: KVLayout,
              keys: list[bytes], first: int = 0) -> int:
    """Get ``keys`` (block ``first`` on) in one get; assert the leading blocks read are
    exact; how many were read."""
    outs = [np.zeros(layout.block_bytes, np.uint8) for _ in keys]
    got = c.get(ns, keys, outs)
    for i in range(got):
        assert np.array_equal(outs[i], payload(name, layout, first + i)), (name, first + i)
    return got


@pytest.mark.parametrize("order", ["small-first", "large-first"])
def test_mixed_geometries_round_trip_exactly_through_every_tier(
        tmp_path: Path, redis_server: RedisServer, order: str) -> None:
    names = sorted(GEOMETRIES, key=lambda n: GEOMETRIES[n][0].block_bytes,
                   reverse=order == "large-first")
    env = {"KVTIER_REDIS_WRITE_THROUGH": "true", "KVTIER_POLICY_PREFETCH_WAIT": "wait"}
    args = ["--redis-url", redis_server.url]
    # the deepseek blocks alone are 27 MB: a 24 MiB arena must spill to nvme
    a = DaemonProcess(tmp_path / "a", cpu_bytes="24MiB", nvme_bytes="256MiB",
                      extra_args=args, env=env).start()
    b = DaemonProcess(tmp_path / "b", cpu_bytes="64MiB", nvme_bytes="0",
                      extra_args=args, env=env).start()
    try:
        ca, cb = connect(a.socket, timeout=60), connect(b.socket, timeout=60)
        spaces: dict[str, tuple[Namespace, KVLayout, list[bytes]]] = {}
        for name in names:
            layout, n = GEOMETRIES[name]
            ns = ca.register_layout(layout, f"geo-{name}")
            keys = keys_of(ns, name, layout, n)
            for i in range(n):   # one block per put: the arena turns over under the big ones
                lease = ca.prepare_put(ns, keys[i:i + 1])
                for view in lease.views:
                    assert view is not None
                    np.copyto(view, payload(name, layout, i))
                assert lease.commit(redis_sync_s=30.0) == 1, (name, i)
            spaces[name] = (ns, layout, keys)
        stats = ca.stats()
        assert stats["tiers"]["nvme"]["blocks"] > 0        # some of it spilled
        for name, (ns, layout, keys) in spaces.items():
            # on A: from the arena or nvme, whichever holds each block now; a get holds
            # all its blocks in the arena at once, and one process pins at most half of
            # it (daemon.client_get_share), so 6 deepseek blocks (27 MB) cannot come in
            # one get from 24 MiB: the leading ones that fit in the share do, exact
            whole = read_back(ca, ns, name, layout, keys)
            assert whole == len(keys) or (whole + 1) * layout.block_bytes > (24 << 20) // 2, \
                name
            for i in range(len(keys)):
                assert read_back(ca, ns, name, layout, keys[i:i + 1], first=i) == 1, (name, i)
            # on B, which never saw them: from Redis (64 MiB holds each namespace's blocks)
            ns_b = cb.register_layout(layout, f"geo-{name}")
            assert cb.lookup(ns_b, keys).hits == len(keys), name
            assert read_back(cb, ns_b, name, layout, keys) == len(keys), name
        for c in (ca, cb):
            tiers = c.stats()["tiers"]
            assert "redis" in tiers and all(t["checksum_failures"] == 0 for t in tiers.values())
        ca.close()
        cb.close()
    finally:
        a.kill()
        b.kill()
