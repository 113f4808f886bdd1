"""The TieredStore test bench shared by the store unit tests: a small layout, a fake clock,
a real shared-memory arena and a real NvmeTier on tmp_path, and put/get helpers that move
bytes through a client mapping of the arena as real clients do.

Fixtures (``clock``, ``arena``, ``nvme``, ``store``, ``client``) are imported by the test
modules that use them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.slab import PAGE
from tests.support.arena import temp_arena

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=128)
BLOCK = LAYOUT.block_bytes
ARENA_BLOCKS = 4
NVME_BLOCKS = 16
TTL = 30.0
CLIENT = 1
OTHER_CLIENT = 2


class FakeClock:
    """A monotonic clock that moves only when the test advances it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def payload(key: bytes) -> bytes:
    """Deterministic, key-specific block bytes (so a mixed-up slot is noticed)."""
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


async def seed_redis(tier: RedisTier, keys: list[bytes]) -> None:
    """Blocks another node wrote: in Redis only (``payload`` of each key)."""
    for key in keys:
        tier.submit(DIGEST, key, FP, memoryview(payload(key)))
    assert await tier.flush(timeout=10)


def chain(n: int, start: int = 0) -> list[bytes]:
    """Keys of ``n`` chained blocks of one prompt (distinct per ``start``)."""
    tokens = list(range(start * 10_000, start * 10_000 + n * LAYOUT.tokens_per_block))
    return block_keys(NAMESPACE, tokens)


NAMESPACE = Namespace("test/model", LAYOUT)
FP = LAYOUT.fingerprint
DIGEST = NAMESPACE.digest


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(ARENA_BLOCKS * BLOCK, BLOCK) as a:
        yield a


@pytest.fixture
def nvme(tmp_path: Path) -> Iterator[NvmeTier]:
    tier = NvmeTier(tmp_path / "nvme", NVME_BLOCKS * (PAGE + BLOCK), direct="off",
                    io_threads=2)
    tier.open()
    yield tier
    tier.close()


@pytest.fixture
async def store(arena: Arena, nvme: NvmeTier, clock: FakeClock) -> AsyncIterator[TieredStore]:
    s = TieredStore(arena, nvme=nvme, eviction="lru", lease_ttl_s=TTL, prefetch_wait="wait",
                    clock=clock)
    assert s.register_namespace(LAYOUT, "test/model", 0, 1, None) == NAMESPACE
    yield s
    await s.drain(clock() + 5)


@pytest.fixture
def client(arena: Arena) -> Iterator[ArenaMapping]:
    """The client's own mapping of the arena (how real clients move KV bytes)."""
    m = ArenaMapping(str(arena.path), arena.size)
    yield m
    m.close()


async def put(store: TieredStore, client: ArenaMapping, keys: list[bytes], *,
              owner: int = CLIENT, durable: bool = False) -> list[int | None]:
    """prepare_put, write each key's payload through the client mapping, commit."""
    lease, offsets = await store.prepare_put(owner, DIGEST, FP, keys)
    for key, off in zip(keys, offsets, strict=True):
        if off is not None:
            client.view(off, BLOCK, writable=True)[:] = memoryview(payload(key))
    await store.commit_put(owner, lease, durable=durable)
    return offsets


async def get(store: TieredStore, client: ArenaMapping, keys: list[bytes], *,
              owner: int = CLIENT) -> list[bytes]:
    """prepare_get + read every leased block + release; returns the blocks' bytes."""
    lease, offsets = await store.prepare_get(owner, DIGEST, FP, keys)
    data = [bytes(client.view(off, BLOCK, writable=False)) for off in offsets]
    await store.release_get(owner, lease)
    return data


def nvme_corrupt_payload(nvme: NvmeTier, store: TieredStore, key: bytes) -> None:
    """Flip one payload byte of ``key``'s frame on disk."""
    slot = store.index[key].nvme
    assert slot is not None
    path = nvme.root / f"slots-{slot.slot_bytes}.dat"
    fd = os.open(path, os.O_RDWR)
    try:
        pos = slot.offset + PAGE + 100
        (byte,) = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([byte ^ 0x01]), pos)
    finally:
        os.close(fd)
