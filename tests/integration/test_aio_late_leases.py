"""An asyncio call that gives up on a lease (its task cancelled, or past its timeout) ends
that lease once the daemon's reply comes: the caller never learns the lease, so without
this its pins (a get) or its slots (a put) stayed taken until the lease's TTL (30 s by
default), and a service cancelling requests under load could pin the arena. Real daemon,
SIGSTOPped so that the reply is surely late."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from kvtier.client import connect_async
from kvtier.client.aio import AsyncKVTierClient
from kvtier.errors import RequestTimeout
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)  # 32 KiB blocks
N = 4


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def signal_daemon(d: DaemonProcess, sig: signal.Signals) -> None:
    assert d.proc is not None
    os.kill(d.proc.pid, sig)


async def active_leases(c: AsyncKVTierClient, want: int, within_s: float = 3.0) -> int:
    """The daemon's open leases, polled until they are ``want`` (or ``within_s`` passed)."""
    deadline = time.monotonic() + within_s
    while True:
        active = int((await c.stats())["leases"]["active"])
        if active == want or time.monotonic() > deadline:
            return active
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("op", ["get", "put"])
def test_a_cancelled_prepare_ends_its_lease_when_the_reply_comes(
        daemon: DaemonProcess, op: str) -> None:
    async def body() -> None:
        c = await connect_async(daemon.socket, timeout=10.0)
        ns = await c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(N * 64))
        assert await c.put(ns, keys, [data(i) for i in range(N)]) == N
        other = block_keys(ns, np.arange(N * 64) + 7)   # not stored: a put leases slots
        signal_daemon(daemon, signal.SIGSTOP)
        try:
            task = asyncio.ensure_future(c.prepare_get(ns, keys) if op == "get"
                                         else c.prepare_put(ns, other))
            await asyncio.sleep(0.2)           # the request is out, the daemon stopped
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            signal_daemon(daemon, signal.SIGCONT)
        assert await active_leases(c, 0) == 0
        # the connection stays in step: a new lease pairs with its own reply
        async with await c.prepare_get(ns, keys) as lease:
            assert [bytes(v) for v in lease.views] == [bytes(data(i)) for i in range(N)]
        assert await active_leases(c, 0) == 0
        await c.close()

    asyncio.run(body())


def test_a_prepare_past_its_timeout_ends_its_lease_when_the_reply_comes(
        daemon: DaemonProcess) -> None:
    async def body() -> None:
        c = await connect_async(daemon.socket, timeout=0.3)
        ns = await c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(N * 64))
        assert await c.put(ns, keys, [data(i) for i in range(N)]) == N
        signal_daemon(daemon, signal.SIGSTOP)
        try:
            with pytest.raises(RequestTimeout):
                await c.prepare_get(ns, keys)
        finally:
            signal_daemon(daemon, signal.SIGCONT)
        assert await active_leases(c, 0) == 0
        assert await c.get(ns, keys, [np.zeros(LAYOUT.block_bytes, np.uint8)
                                      for _ in range(N)]) == N
        await c.close()

    asyncio.run(body())
