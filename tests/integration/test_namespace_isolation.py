"""Namespaces are enforced: knowing a key is not a permission (issue 14, item 3).

A thief connects to the same real daemon with another ``cache_salt`` (same model, same
layout) and uses the victim's keys: lookup, get and delete are misses / no-ops on every tier
(cpu, nvme, and Redis through a second daemon sharing the server), counted in
``requests.namespace_mismatch``; a namespace with a larger (or smaller) block size never
reads a block of another size; the victim's blocks stay exact, byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import KVTierClient, connect
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import (
    LAYOUT_FP,
    NS,
    blocks,
    buffers,
    cfg_for,
    put_all,
    running,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)  # 32 KiB blocks
BIG = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16",
               tokens_per_block=64)     # 64 KiB blocks
SMALL = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, dtype="float16",
                 tokens_per_block=64)   # 16 KiB blocks


# gets wait for promotions from nvme/Redis (the default waits ~50 ms, too short on a loaded
# machine for "every block comes back")
ENV = {"KVTIER_POLICY_EVICTION": "lru", "KVTIER_POLICY_PREFETCH_WAIT": "wait"}


def content(key: bytes, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def wait_for(pred: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def assert_exact(client: KVTierClient, ns: Namespace, keys: list[bytes]) -> None:
    """Every block of ``keys`` comes back, byte for byte (in arena-sized pieces)."""
    nbytes = ns.layout.block_bytes
    for i in range(0, len(keys), 16):
        part = keys[i: i + 16]
        outs = [np.zeros(nbytes, np.uint8) for _ in part]
        assert client.get(ns, part, outs) == len(part)
        for k, out in zip(part, outs, strict=True):
            assert np.array_equal(out, content(bytes(k), nbytes))


def assert_stolen_keys_miss(thief: KVTierClient, ns: Namespace, keys: list[bytes]) -> None:
    nbytes = ns.layout.block_bytes
    assert thief.lookup(ns, keys).hits == 0
    outs = [np.zeros(nbytes, np.uint8) for _ in keys]
    assert thief.get(ns, keys, outs) == 0
    assert not any(out.any() for out in outs)       # nothing was written into them
    with thief.prepare_get(ns, keys) as lease:
        assert lease.views == []
    assert thief.delete(ns, keys) == 0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvd", cpu_bytes=str(32 * LAYOUT.block_bytes),
                       nvme_bytes="64MiB", env=dict(ENV)) as d:
        yield d


def test_stolen_keys_are_misses_on_cpu_and_nvme_and_delete_nothing(
        daemon: DaemonProcess) -> None:
    victim, thief = connect(daemon.socket), connect(daemon.socket)
    vns = victim.register_layout(LAYOUT, "model", cache_salt="victim")
    keys = block_keys(vns, np.arange(64 * 64))
    for i in range(0, 64, 16):   # pieces: one lease never needs the whole arena
        part = keys[i: i + 16]
        assert victim.put(vns, part, [content(bytes(k), LAYOUT.block_bytes) for k in part],
                          ) == 16
    tiers = set(victim.lookup(vns, keys, prefetch=False).tiers)
    assert tiers == {"cpu", "nvme"}                 # the arena holds 32: both local tiers
    tns = thief.register_layout(LAYOUT, "model", cache_salt="thief")
    for piece in (keys[:16], keys[-16:], keys):
        assert_stolen_keys_miss(thief, tns, piece)
    # a put of stolen keys with the thief's bytes never replaces the victim's blocks
    garbage = [np.full(LAYOUT.block_bytes, 0xEE, np.uint8) for _ in keys[:16]]
    thief.put(tns, keys[:16], garbage)
    assert thief.lookup(tns, keys[:16]).hits == 0
    assert_exact(victim, vns, keys)
    assert daemon.stats()["requests"]["namespace_mismatch"] >= 3 * 4
    victim.close()
    thief.close()


@pytest.mark.parametrize("other", [BIG, SMALL], ids=["larger", "smaller"])
def test_another_block_size_never_reads_past_a_block(daemon: DaemonProcess,
                                                     other: KVLayout) -> None:
    victim, thief = connect(daemon.socket), connect(daemon.socket)
    vns = victim.register_layout(LAYOUT, "model")
    keys = block_keys(vns, np.arange(8 * 64))
    victim.put(vns, keys, [content(bytes(k), LAYOUT.block_bytes) for k in keys])
    tns = thief.register_layout(other, "model")     # same model, no salt, another layout
    assert_stolen_keys_miss(thief, tns, keys)
    assert_exact(victim, vns, keys)
    victim.close()
    thief.close()


def test_stolen_keys_are_misses_in_redis_and_its_frames_stay(
        redis_server: RedisServer, tmp_path: Path) -> None:
    env = {"KVTIER_REDIS_WRITE_THROUGH": "true", **ENV}
    nodes = [DaemonProcess(tmp_path / name, extra_args=["--redis-url", redis_server.url],
                           env=dict(env)) for name in ("a", "b")]
    try:
        a, b = (n.start() for n in nodes)
        victim_a, thief_b, victim_b = connect(a.socket), connect(b.socket), connect(b.socket)
        vns = victim_a.register_layout(LAYOUT, "model", cache_salt="victim")
        keys = block_keys(vns, np.arange(8 * 64))
        victim_a.put(vns, keys, [content(bytes(k), LAYOUT.block_bytes) for k in keys])
        admin = redis_server.client()
        wait_for(lambda: admin.dbsize() == 8)       # write-behind reached Redis
        # on node b the keys live only in Redis
        tns = thief_b.register_layout(LAYOUT, "model", cache_salt="thief")
        assert_stolen_keys_miss(thief_b, tns, keys)
        assert admin.dbsize() == 8                  # nothing deleted, nothing dropped
        redis = b.stats()["tiers"]["redis"]
        assert redis["namespace_mismatches"] >= 3 and redis["checksum_failures"] == 0
        # the victim's own namespace on node b reads them back exactly
        vns_b = victim_b.register_layout(LAYOUT, "model", cache_salt="victim")
        assert victim_b.lookup(vns_b, keys).tiers == ["redis"] * 8
        assert_exact(victim_b, vns_b, keys)
        for c in (victim_a, thief_b, victim_b):
            c.close()
    finally:
        for n in nodes:
            n.kill()


async def test_a_frame_of_another_namespace_is_a_miss_and_is_not_deleted(
        redis_server: RedisServer) -> None:
    keys, data = blocks(3)
    thief_ns = bytes(reversed(range(16)))
    async with running(cfg_for(redis_server.url)) as tier:
        await put_all(tier, keys, data)
        assert await tier.exists_prefix(keys, namespace=NS) == 3
        assert await tier.exists_prefix(keys, namespace=thief_ns) == 0
        outs = buffers(3)
        assert await tier.get_into(keys, outs, namespace=thief_ns, layout_fp=LAYOUT_FP) == 0
        assert not any(any(o) for o in outs)
        assert await tier.delete(keys, namespace=thief_ns) == 0
        assert tier.counters.checksum_failures == 0 and tier.namespace_mismatches == 1 + 1 + 3
        assert await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP) == 3
        assert [bytes(o) for o in outs] == data
        assert await tier.delete(keys, namespace=NS) == 3
        assert await tier.exists_prefix(keys) == 0
