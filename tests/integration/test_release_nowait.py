"""A get lease's release skips its round trip only when the read is known valid here.

The daemon says, in each get_prepare reply, how long the lease surely holds (``ttl_s``); a
client whose copy ended within half of that since it asked, on a connection its daemon has
not hung up, sends the release and goes on (kvtier.client.ops.op_release). These tests use
a real daemon and SIGSTOP/SIGKILL it to tell a release that waited from one that did not:
- in time: the release returns while the daemon is stopped, and the lease is released
  once it runs again (sync and asyncio clients); the skipped reply confuses no later call;
- the daemon killed during the copy: the release raises, it does not pretend;
- a copy past the safe share of the TTL: the release waits, and raises ``LeaseExpired``
  once the daemon says the lease is gone;
- a delete waits for the releases still owed (within the timeout), so it never skips the
  blocks of the caller's own finished get.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import connect, connect_async
from kvtier.errors import DaemonUnavailable, KVTierError, LeaseExpired, RequestTimeout
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)  # 32 KiB blocks
N = 8


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)


@pytest.fixture
def short_ttl(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvd", env={"KVTIER_DAEMON_LEASE_TTL_S": "0.5",
                                              "KVTIER_DAEMON_LEASE_SWEEP_S": "0.02"}) as d:
        yield d


def stopped(d: DaemonProcess) -> None:
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)


def resumed(d: DaemonProcess) -> None:
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGCONT)


def test_a_release_in_time_returns_without_the_daemon(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket, timeout=5.0)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(N * 64))
    assert c.put(ns, keys, [data(i) for i in range(N)]) == N
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(N)]
    lease = c.prepare_get(ns, keys)
    for view, out in zip(lease.views, outs, strict=True):
        np.copyto(out, view)
    stopped(daemon)
    try:
        t0 = time.monotonic()
        lease.release()            # a waited release would block for the 5 s timeout
        assert time.monotonic() - t0 < 1.0
    finally:
        resumed(daemon)
    time.sleep(0.3)                # the release's reply arrives, unread: not a hang-up,
    assert c.leading_bound(keys) == N   # the presence filter still answers without asking
    st = c.stats()                 # the skipped release reply is not taken for this one
    assert st["leases"]["active"] == 0
    for i, out in enumerate(outs):
        assert np.array_equal(out, data(i))
    # get() releases the same way; later calls on the connection still pair correctly
    again = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(N)]
    assert c.get(ns, keys, again) == N
    assert c.lookup(ns, keys).hits == N
    assert c.stats()["leases"]["active"] == 0
    assert all(np.array_equal(a, data(i)) for i, a in enumerate(again))
    c.close()


def test_an_async_release_in_time_returns_without_the_daemon(daemon: DaemonProcess) -> None:
    async def body() -> None:
        c = await connect_async(daemon.socket, timeout=5.0)
        ns = await c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(N * 64))
        assert await c.put(ns, keys, [data(i) for i in range(N)]) == N
        lease = await c.prepare_get(ns, keys)
        got = [bytes(v) for v in lease.views]
        stopped(daemon)
        try:
            await asyncio.wait_for(lease.release(), 1.0)
        finally:
            resumed(daemon)
        assert (await c.stats())["leases"]["active"] == 0
        assert got == [bytes(data(i)) for i in range(N)]
        await c.close()

    asyncio.run(body())


def test_a_release_after_the_daemon_died_raises(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(N * 64))
    assert c.put(ns, keys, [data(i) for i in range(N)]) == N
    lease = c.prepare_get(ns, keys)
    _ = [bytes(v) for v in lease.views]
    daemon.crash()                 # whoever held the lease is gone: nothing vouches for it
    with pytest.raises(DaemonUnavailable):
        lease.release()


def test_a_late_release_waits_and_reports_the_expiry(short_ttl: DaemonProcess) -> None:
    c = connect(short_ttl.socket, timeout=10.0)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(N * 64))
    assert c.put(ns, keys, [data(i) for i in range(N)]) == N
    lease = c.prepare_get(ns, keys)
    time.sleep(0.3)                # past half the 0.5 s TTL: only the daemon can tell
    stopped(short_ttl)
    outcome: list[BaseException | None] = []

    def release() -> None:
        try:
            lease.release()
            outcome.append(None)
        except KVTierError as exc:
            outcome.append(exc)

    t = threading.Thread(target=release)
    t.start()
    try:
        t.join(0.5)
        assert t.is_alive(), "a release past the safe share of the TTL did not wait"
    finally:
        resumed(short_ttl)
    t.join(10.0)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseExpired)
    c.close()


# A delete right after the caller's own get: the get's release went out without waiting,
# and the daemon runs each request as its own task (a release of more than 512 blocks
# unpins them a piece at a time), so a delete that overtook it skipped the blocks as
# still under a read lease: 0 deleted, and they stayed served (6 of 10 trials). The daemon
# is stopped between the two, so both frames reach it in one read (without the fix, each
# run of these tests failed within its 5 trials).
SMALL = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                 tokens_per_block=16)   # 512-byte blocks: 8192 of them fit 48 MiB
MANY, TAIL = 8192, 64                    # 8192 keys: the per-request maximum by default


@pytest.fixture
def roomy(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvd", cpu_bytes="48MiB", nvme_bytes="0") as d:
        yield d


def many_keys(ns: Any, trial: int) -> list[bytes]:
    return block_keys(ns, (trial + 1) * 10**7 + np.arange(MANY * 16))


def delete_into(deleted: list[int], c: Any, ns: Any, keys: list[bytes]) -> None:
    deleted.append(c.delete(ns, keys))


def test_a_delete_after_the_callers_own_get_deletes(roomy: DaemonProcess) -> None:
    c = connect(roomy.socket, timeout=10.0)
    ns = c.register_layout(SMALL, "m")
    for trial in range(5):
        keys = many_keys(ns, trial)
        assert c.put(ns, keys, [np.full(SMALL.block_bytes, trial, np.uint8)] * MANY) == MANY
        assert c.get(ns, keys, [np.zeros(SMALL.block_bytes, np.uint8)
                                for _ in keys]) == MANY
        stopped(roomy)
        deleted: list[int] = []
        t = threading.Thread(target=delete_into, args=(deleted, c, ns, keys[-TAIL:]))
        t.start()
        time.sleep(0.2)
        resumed(roomy)
        t.join(10.0)
        assert deleted == [TAIL], f"trial {trial}"
        assert c.lookup(ns, keys, prefetch=False).hits == MANY - TAIL
        c.delete(ns, keys)         # room for the next trial
    c.close()


def test_an_async_delete_after_the_callers_own_get_deletes(roomy: DaemonProcess) -> None:
    async def body() -> None:
        c = await connect_async(roomy.socket, timeout=10.0)
        ns = await c.register_layout(SMALL, "m")
        for trial in range(5):
            keys = many_keys(ns, trial)
            block = np.full(SMALL.block_bytes, trial, np.uint8)
            assert await c.put(ns, keys, [block] * MANY) == MANY
            assert await c.get(ns, keys, [np.zeros(SMALL.block_bytes, np.uint8)
                                          for _ in keys]) == MANY
            stopped(roomy)
            deleting = asyncio.ensure_future(c.delete(ns, keys[-TAIL:]))
            await asyncio.sleep(0.2)
            resumed(roomy)
            assert await asyncio.wait_for(deleting, 10.0) == TAIL, f"trial {trial}"
            assert (await c.lookup(ns, keys, prefetch=False)).hits == MANY - TAIL
            await c.delete(ns, keys)
        await c.close()

    asyncio.run(body())


def test_a_delete_waits_for_the_owed_releases_within_the_timeout(
        roomy: DaemonProcess) -> None:
    c = connect(roomy.socket, timeout=0.5)
    ns = c.register_layout(SMALL, "m")
    keys = many_keys(ns, 0)[:8]
    assert c.put(ns, keys, [np.zeros(SMALL.block_bytes, np.uint8)] * 8) == 8
    assert c.get(ns, keys, [np.zeros(SMALL.block_bytes, np.uint8) for _ in keys]) == 8
    stopped(roomy)
    try:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            c.delete(ns, keys)
        assert time.monotonic() - t0 < 2.0
    finally:
        resumed(roomy)
    c.close()
