"""A client process for stall tests: puts and gets in a loop, verifying every byte it gets.

Run as ``python -m tests.support.stall_client SOCKET COUNTERS STOPFILE MODE`` (MODE: ``sync``
or ``async``). The test stops it with SIGSTOP at random points (as a GC pause, swap or a
debugger would) for longer than the daemon's lease TTL, and lets another client churn the
arena meanwhile. Counters go to a small shared file (``COUNTERS``, int64 slots named in
``FIELDS``) so the test can watch progress without slowing the loop; the loop ends when
``STOPFILE`` exists.

Each iteration puts one chain of ``BLOCKS`` blocks (``put`` may raise ``LeaseExpired``: a
stalled put stores nothing) and gets it back into host buffers (``get`` may raise
``LeaseExpired``); every block a get returns is compared with the bytes that key must hold.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import numpy as np

from kvtier.client import connect, connect_async
from kvtier.errors import LeaseExpired
from kvtier.keys import block_keys
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, dtype="float16",
                  tokens_per_block=64)  # 64 KiB blocks
BLOCKS = 32
CHAINS = 8
FIELDS = ("iterations", "puts_ok", "puts_expired", "gets_ok", "gets_expired", "wrong",
          "blocks_verified", "done")


def key_bytes(key: bytes, nbytes: int) -> np.ndarray:
    """What a block must hold: its key repeated (cheap, and distinct per key)."""
    return np.tile(np.frombuffer(key, np.uint8), nbytes // len(key))


def chains(ns: Any) -> list[tuple[list[bytes], np.ndarray]]:
    out = []
    for c in range(CHAINS):
        tokens = np.arange(BLOCKS * 64) + c * 1_000_000
        keys = block_keys(ns, tokens)
        out.append((keys, np.stack([key_bytes(bytes(k), LAYOUT.block_bytes) for k in keys])))
    return out


class Loop:
    """The shared iteration logic, driven by a sync or async put/get pair."""

    def __init__(self, counters: np.ndarray, stopfile: str) -> None:
        self.c = counters
        self.stopfile = stopfile
        self.out = np.zeros((BLOCKS, LAYOUT.block_bytes), np.uint8)

    def count(self, name: str, n: int = 1) -> None:
        self.c[FIELDS.index(name)] += n

    def check(self, n: int, want: np.ndarray) -> None:
        for i in range(n):
            if not np.array_equal(self.out[i], want[i]):
                self.count("wrong")
        self.count("blocks_verified", n)

    def stop(self) -> bool:
        return os.path.exists(self.stopfile)


def run_sync(sock: str, loop: Loop) -> None:
    client = connect(sock, timeout=30)
    ns = client.register_layout(LAYOUT, "stall-model", cache_salt="stalled")
    work = chains(ns)
    i = 0
    while not loop.stop():
        keys, want = work[i % CHAINS]
        i += 1
        try:
            client.put(ns, keys, list(want))
            loop.count("puts_ok")
        except LeaseExpired:
            loop.count("puts_expired")
        try:
            n = client.get(ns, keys, list(loop.out))
            loop.count("gets_ok")
            loop.check(n, want)
        except LeaseExpired:
            loop.count("gets_expired")
        loop.count("iterations")
    client.close()


async def run_async(sock: str, loop: Loop) -> None:
    client = await connect_async(sock, timeout=30)
    ns = await client.register_layout(LAYOUT, "stall-model", cache_salt="stalled")
    work = chains(ns)
    i = 0
    while not loop.stop():
        keys, want = work[i % CHAINS]
        i += 1
        try:
            await client.put(ns, keys, list(want))
            loop.count("puts_ok")
        except LeaseExpired:
            loop.count("puts_expired")
        try:
            n = await client.get(ns, keys, list(loop.out))
            loop.count("gets_ok")
            loop.check(n, want)
        except LeaseExpired:
            loop.count("gets_expired")
        loop.count("iterations")
    await client.close()


def main() -> None:
    sock, counters_path, stopfile, mode = sys.argv[1:5]
    counters = np.memmap(counters_path, dtype=np.int64, mode="r+", shape=(len(FIELDS),))
    loop = Loop(counters, stopfile)
    try:
        if mode == "async":
            asyncio.run(run_async(sock, loop))
        else:
            run_sync(sock, loop)
    finally:
        loop.count("done")
        counters.flush()


if __name__ == "__main__":
    main()
