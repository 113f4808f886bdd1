"""A client used across fork(): the child's calls raise ClientForked, the parent's go on
with the right bytes, and a client the child connects itself works. Before, parent and
child shared one connection and one request-id sequence and could each take the other's
reply: in 16 of 40 trials each got the other's blocks, with no error."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.client import connect, connect_async
from kvtier.client.aio import AsyncKVTierClient
from kvtier.errors import ClientForked, ProtocolError
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.tiers import arena_mapping
from tests.support.daemon import DaemonProcess
from tests.support.forking import run_in_child

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=16)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kvd-fork"), cpu_bytes="16MiB",
                      nvme_bytes="0").start()
    yield d
    d.terminate()


def test_a_forked_child_cannot_use_its_parents_client(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "fork-model")
    a = block_keys(ns, np.arange(4 * 16))
    b = block_keys(ns, np.arange(10**6, 10**6 + 2 * 16))
    assert c.put(ns, a, [np.full(LAYOUT.block_bytes, 0xAA, np.uint8)] * 4) == 4
    assert c.put(ns, b, [np.full(LAYOUT.block_bytes, 0xBB, np.uint8)] * 2) == 2

    def in_child() -> bool:
        out = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(2)]
        try:
            c.get(ns, b, out)
            return False
        except ClientForked as exc:
            if str(os.getpid()) not in str(exc):
                return False
        c.close()                                       # the child's descriptor only
        with connect(daemon.socket) as own:
            own_ns = own.register_layout(LAYOUT, "fork-model")
            return own.get(own_ns, b, out) == 2 and all((o == 0xBB).all() for o in out)

    assert run_in_child(in_child) == 0
    out = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(4)]
    assert c.get(ns, a, out) == 4 and all((o == 0xAA).all() for o in out)
    c.close()


def test_a_forked_child_cannot_use_its_parents_async_client(daemon: DaemonProcess) -> None:
    async def connected() -> AsyncKVTierClient:
        client = await connect_async(daemon.socket)
        await client.stats()
        return client

    loop = asyncio.new_event_loop()
    try:
        client = loop.run_until_complete(connected())

        def in_child() -> bool:
            try:
                asyncio.new_event_loop().run_until_complete(client.stats())
            except ClientForked:
                return True
            return False

        assert run_in_child(in_child) == 0
        loop.run_until_complete(client.stats())
        loop.run_until_complete(client.close())
    finally:
        loop.close()


def test_a_sync_client_called_from_two_threads_says_so(daemon: DaemonProcess) -> None:
    """A sync client is one thread's: a second thread calling it at once used to get a
    confusing ProtocolError ("reply of 2242210917 bytes", "ExtraData") or interleave
    frames; it now gets a clear one, and the client stays usable for the first."""
    import threading

    with connect(daemon.socket) as c:
        ns = c.register_layout(LAYOUT, "thread-model")
        keys = block_keys(ns, np.arange(4 * 16) + 5 * 10**6)
        assert c.put(ns, keys, [np.full(LAYOUT.block_bytes, 7, np.uint8)] * 4) == 4
        errors: list[BaseException] = []
        wrong = 0

        def hammer() -> None:
            nonlocal wrong
            out = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
            for _ in range(200):
                try:
                    if c.get(ns, keys, out) == 4 and not all((o == 7).all() for o in out):
                        wrong += 1
                except Exception as exc:   # every error is checked below
                    errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert wrong == 0
        assert all(isinstance(e, ProtocolError) and "two threads" in str(e) for e in errors), \
            {type(e).__name__: str(e) for e in errors}
        out = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
        assert c.get(ns, keys, out) == 4 and all((o == 7).all() for o in out)


def test_a_fork_while_another_thread_maps_an_arena(daemon: DaemonProcess) -> None:
    """A thread inside connect() holds the arena-mapping lock across mmap(MAP_POPULATE)
    (~0.1 s per 2 GiB); a fork then (a fork pool, gunicorn) gave the child a lock held by
    a thread it does not have, and its own connect() hung for ever. Here a thread holds
    the lock across the fork, as that connect() does."""
    with connect(daemon.socket) as c:
        ns = c.register_layout(LAYOUT, "fork-model")
        keys = block_keys(ns, np.arange(2 * 16) + 7 * 10**6)
        assert c.put(ns, keys, [np.full(LAYOUT.block_bytes, 0x5A, np.uint8)] * 2) == 2
    holding, done = threading.Event(), threading.Event()

    def mapping() -> None:
        with arena_mapping._LOCK:
            holding.set()
            done.wait(30)

    t = threading.Thread(target=mapping, daemon=True)
    t.start()
    assert holding.wait(10)

    def in_child() -> bool:
        with connect(daemon.socket, timeout=2) as own:
            own_ns = own.register_layout(LAYOUT, "fork-model")
            out = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
            return own.get(own_ns, keys, out) == 2 and all((o == 0x5A).all() for o in out)

    try:
        assert run_in_child(in_child, 15.0) == 0
    finally:
        done.set()
        t.join(10)
    with connect(daemon.socket) as again:   # the parent's lock works as before
        again.ping()
