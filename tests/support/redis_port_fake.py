"""``FakeRedis``: what the store's promotions, moves and write-through ask of a Redis tier
(``kvtier.store.ports.RedisPort``), in memory, for unit tests that start no server."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from kvtier.store import TieredStore
from kvtier.tiers.redis_queue import Borrowed


class FakeRedis:
    """What the store's promotion and write-through ask of a Redis tier, in memory.

    ``frames``: the blocks Redis holds (key -> bytes); ``get_into`` copies the leading ones
    found, or raises ``fail`` when set. Borrowed writes are kept in ``held`` (their arena
    slots pinned) until ``finish`` stores and releases them."""

    def __init__(self) -> None:
        self.up = True
        self.healing_since: float | None = None
        self.frames: dict[bytes, bytes] = {}
        self.held: list[Borrowed] = []
        self.copies: list[bytes] = []
        self.fail: Exception | None = None
        self.batches: list[list[bytes]] = []   # the keys of each ``submit_many``
        self.room_for: Callable[[int, float], Awaitable[int]] | None = None
        self.stall: asyncio.Event | None = None   # reads wait for it when set

    async def exists_prefix(self, keys: Sequence[bytes], *,
                            namespace: bytes | None = None) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.frames), len(keys))

    async def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview], *,
                       namespace: bytes, layout_fp: int,
                       checksums: list[int | None] | None = None) -> int:
        if self.stall is not None:
            await self.stall.wait()
        if self.fail is not None:
            raise self.fail
        n = 0
        for key, out in zip(keys, outs, strict=True):
            data = self.frames.get(key)
            if data is None:
                break
            out[:] = data
            n += 1
        return n

    def submit_many(self, blocks: Sequence[Borrowed]) -> None:
        self.batches.append([b.key for b in blocks])
        self.held.extend(blocks)

    def submit(self, namespace: bytes, key: bytes, layout_fp: int, payload: memoryview, *,
               seq: int = 0, release: Callable[[], None] | None = None,
               on_checksum: Callable[[int | None], None] | None = None,
               owned: bool = False) -> None:
        self.copies.append(key)
        self.frames[key] = bytes(payload)

    def finish(self) -> None:
        """Every borrowed write is over: stored, its slot released."""
        held, self.held = self.held, []
        for b in held:
            self.frames[b.key] = bytes(b.payload)
            if b.on_checksum is not None:
                b.on_checksum(None)
            b.release()

    async def forget_writes(self, keys: Sequence[bytes], *, namespace: bytes) -> int:
        """Queued writes of ``keys`` dropped, their slots released."""
        gone = set(keys)
        dropped = [b for b in self.held if b.key in gone]
        self.held = [b for b in self.held if b.key not in gone]
        for b in dropped:
            b.release()
        return len(dropped)

    async def delete(self, keys: Sequence[bytes], *, namespace: bytes | None = None) -> int:
        return sum(self.frames.pop(k, None) is not None for k in keys)

    async def flush(self, timeout: float | None = None) -> bool:
        """Every write over, unless ``stall``: then waits up to ``timeout`` (None: for
        ever) and says False."""
        if self.stall is not None and not self.stall.is_set():
            try:
                await asyncio.wait_for(self.stall.wait(), timeout)
            except TimeoutError:
                return False
        self.finish()
        return True

    async def room(self, n: int, timeout: float) -> int:
        return n if self.room_for is None else await self.room_for(n, timeout)


def with_redis(store: TieredStore, redis: FakeRedis) -> None:
    """Promotions of ``store`` read ``redis`` (the Redis side of its transfers only)."""
    store.transfers.redis = redis  # type: ignore[assignment]
