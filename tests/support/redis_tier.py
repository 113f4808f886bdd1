"""Helpers for tests of a RedisTier against real redis-server processes: a config for a
server's URL, fp16-like block payloads, a started tier, a flushed batch of writes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import redis

from kvtier.checksum import checksum
from kvtier.config import RedisConfig
from kvtier.frame import HEADER_SIZE, FrameHeader
from kvtier.tiers.redis import RedisTier

NS = bytes(range(16))
LAYOUT_FP = 0x5EED_C0DE_1234_5678
BLOCK = 64 * 1024
# the ACL rule docs/redis.md gives operators, verbatim (test_redis_acl checks it is there)
ACL_RULE = ("on >s3cret resetkeys ~kvtier:* -@all +get +set +getrange +exists +del +ping "
            "+info +dbsize +select +watch +multi +exec +unwatch +cluster|slots "
            "+cluster|nodes +asking")


def rkey(key: bytes) -> bytes:
    """The Redis key of block ``key`` under the default ``key_prefix``."""
    return b"kvtier:" + key.hex().encode()


def stored_bytes(reply: object) -> bytes:
    """A redis-py admin client's reply (no ``decode_responses``) as the bytes it is: typed
    ``bytes | str | None``; a missing key (None) fails here."""
    assert isinstance(reply, bytes), reply
    return reply


def head_at(admin: redis.Redis, key: bytes) -> FrameHeader:
    """The frame header stored at block ``key`` (``admin``: a redis-py client)."""
    return FrameHeader.unpack(stored_bytes(admin.getrange(rkey(key), 0, HEADER_SIZE - 1)))


def cfg_for(url: str, **over: Any) -> RedisConfig:
    base = RedisConfig(enabled=True, url=url, connect_timeout_s=0.5, op_timeout_s=1.0)
    return dataclasses.replace(base, **over)


def blocks(n: int, size: int = BLOCK, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    """``n`` (key, payload) pairs: fp16 normal data, like real KV."""
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(n)]
    data = [rng.standard_normal(size // 2).astype(np.float16).tobytes() for _ in range(n)]
    return keys, data


def buffers(n: int, size: int = BLOCK) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


@contextlib.asynccontextmanager
async def running(cfg: RedisConfig) -> AsyncIterator[RedisTier]:
    tier = RedisTier(cfg)
    await tier.start()
    try:
        yield tier
    finally:
        await tier.close()


async def put_all(tier: RedisTier, keys: list[bytes], data: list[bytes]) -> None:
    for key, payload in zip(keys, data, strict=True):
        tier.submit(NS, key, LAYOUT_FP, memoryview(payload))
    assert await tier.flush(timeout=10)


async def read_exact(tier: RedisTier, keys: list[bytes], data: list[bytes], size: int) -> None:
    """``get_into`` every key: all blocks exact, each with its verified checksum handed on
    (what the arena journal reuses)."""
    outs = buffers(len(keys), size)
    sums: list[int | None] = [None] * len(keys)
    got = await tier.get_into(keys, outs, namespace=NS, layout_fp=LAYOUT_FP, checksums=sums)
    assert got == len(keys) and [bytes(o) for o in outs] == data
    assert sums == [checksum(d) for d in data]


async def eventually(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
