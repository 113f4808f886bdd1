"""A stalled daemon (SIGSTOP) bounds every client call by the client's own ``timeout``.

- asyncio client: the send was unbounded. Once the socket's buffer filled (the daemon reads
  nothing), ``writer.drain()`` waited for ever, and so did ``close()`` (``wait_closed``
  flushes first). The send and the reply now share one deadline; a send that cannot finish
  leaves the connection unusable (the frame may be half sent) and ``close`` aborts it.
- sync client on a socket the caller connected itself (``KVTierClient(sock, timeout)``):
  ``timeout`` bounded nothing unless the caller had also called ``sock.settimeout``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from kvtier.client import KVTierClient, connect_async
from kvtier.errors import DaemonUnavailable, KVTierError, RequestTimeout
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=16)
TIMEOUT = 0.3
SLACK = 1.0   # scheduling noise on a loaded machine; a hang is the 5 s guard


@contextmanager
def stopped(d: DaemonProcess) -> Iterator[None]:
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)


def test_an_async_client_bounds_its_sends_and_close(daemon: DaemonProcess) -> None:
    async def body() -> None:
        c = await connect_async(daemon.socket, timeout=TIMEOUT)
        ns = await c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(8192 * 16))   # a 128 KiB lookup request
        assert (await c.lookup(ns, keys)).hits == 0
        outcomes: list[tuple[str, float]] = []
        with stopped(daemon):
            for _ in range(40):   # each frame stays in the socket's buffer, until full
                t0 = time.monotonic()
                try:
                    await asyncio.wait_for(c.lookup(ns, keys, prefetch=False), 5.0)
                except RequestTimeout:
                    outcomes.append(("timeout", time.monotonic() - t0))
                except DaemonUnavailable:
                    outcomes.append(("unusable", time.monotonic() - t0))
                    break
            t0 = time.monotonic()
            await asyncio.wait_for(c.close(), 5.0)
            closing = time.monotonic() - t0
        assert outcomes[-1][0] == "unusable", outcomes   # a send ran out of time
        assert all(took < TIMEOUT + SLACK for _, took in outcomes), outcomes
        assert closing < TIMEOUT + SLACK

    asyncio.run(body())


def test_an_async_client_stays_usable_after_a_late_reply(daemon: DaemonProcess) -> None:
    """Only a send that did not finish breaks the connection: a late reply does not."""
    async def body() -> None:
        c = await connect_async(daemon.socket, timeout=TIMEOUT)
        ns = await c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(4 * 16))
        with stopped(daemon):
            try:
                await asyncio.wait_for(c.lookup(ns, keys), 5.0)
                raise AssertionError("a stopped daemon answered")
            except RequestTimeout:
                pass
        assert (await c.lookup(ns, keys)).hits == 0
        await asyncio.wait_for(c.close(), 5.0)

    asyncio.run(body())


def in_thread(call: Callable[[], object]) -> list[str]:
    """Run ``call`` in a thread for at most 5 s; what it ended with, and after how long
    (empty: still blocked)."""
    result: list[str] = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            call()
            result.append("answered")
        except KVTierError as exc:
            result.append(f"{type(exc).__name__} {time.monotonic() - t0:.2f}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5.0)
    return result


def own_socket(d: DaemonProcess) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(d.socket))   # no settimeout: the client's timeout must apply
    return sock


def test_a_client_on_the_callers_socket_bounds_its_calls(daemon: DaemonProcess) -> None:
    c = KVTierClient(own_socket(daemon), TIMEOUT)
    c.ping()
    with stopped(daemon):
        result = in_thread(c.ping)
    assert result and result[0].startswith("RequestTimeout"), result
    assert float(result[0].split()[1]) < TIMEOUT + SLACK
    c.close()


def test_a_hello_on_the_callers_socket_is_bounded(daemon: DaemonProcess) -> None:
    sock = own_socket(daemon)
    with stopped(daemon):
        result = in_thread(lambda: KVTierClient(sock, TIMEOUT))
    sock.close()
    assert result and result[0].startswith("RequestTimeout"), result
