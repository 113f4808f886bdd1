"""``get`` and ``put`` refuse buffers that are not C-contiguous, before anything is sent.

A get into a Fortran-ordered array, a transposed view or a column slice copied the blocks
into a temporary flat copy of the buffer (numpy's ``reshape(-1)`` of a strided array),
returned the count of blocks loaded and left the caller's buffer untouched: wrong bytes
with no error. Now such a buffer is a ``BufferSizeError`` in both clients, and the
connection goes on; a C-contiguous buffer of any shape or dtype works as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvtier.client import connect, connect_async
from kvtier.errors import BufferSizeError
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)  # 32 KiB blocks
B = LAYOUT.block_bytes
N = 2

STRIDED: dict[str, Callable[[], Any]] = {
    "fortran": lambda: np.zeros((128, B // 128), np.uint8, order="F"),
    "transposed": lambda: np.zeros((B // 2 // 64, 64), np.float16).T,
    "column slice": lambda: np.zeros((64, 2 * B // 64), np.uint8)[:, : B // 64],
    "strided memoryview": lambda: np.zeros(2 * B, np.uint8).data[::2],
}


def data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, B, dtype=np.uint8)


@pytest.mark.parametrize("kind", list(STRIDED))
def test_strided_buffers_are_refused_and_the_connection_goes_on(
        daemon: DaemonProcess, kind: str) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    keys = block_keys(ns, np.arange(N * 64))
    assert c.put(ns, keys, [data(i) for i in range(N)]) == N
    asked = daemon.stats()["requests"]
    outs = [STRIDED[kind]() for _ in range(N)]
    with pytest.raises(BufferSizeError, match="not C-contiguous"):
        c.get(ns, keys, outs)
    other = block_keys(ns, np.arange(N * 64) + 10**6)
    with pytest.raises(BufferSizeError, match="not C-contiguous"):
        c.put(ns, other, [STRIDED[kind]() for _ in range(N)])
    assert daemon.stats()["requests"] == asked   # nothing was sent for either
    assert c.lookup(ns, other).hits == 0
    shaped = [np.zeros((128, B // 128), np.uint8) for _ in range(N)]   # C order, 2-D
    assert c.get(ns, keys, shaped) == N
    assert all(np.array_equal(s.reshape(-1), data(i)) for i, s in enumerate(shaped))
    c.close()


def test_the_async_client_refuses_them_too(daemon: DaemonProcess) -> None:
    async def body() -> None:
        c = await connect_async(daemon.socket)
        ns = await c.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(N * 64))
        assert await c.put(ns, keys, [data(i) for i in range(N)]) == N
        with pytest.raises(BufferSizeError, match="not C-contiguous"):
            await c.get(ns, keys, [STRIDED["fortran"]() for _ in range(N)])
        with pytest.raises(BufferSizeError, match="not C-contiguous"):
            await c.put(ns, keys, [STRIDED["transposed"]() for _ in range(N)])
        outs = [np.zeros(B // 2, np.float16) for _ in range(N)]
        assert await c.get(ns, keys, outs) == N
        assert all(np.array_equal(o.view(np.uint8), data(i)) for i, o in enumerate(outs))
        await c.close()

    asyncio.run(body())
