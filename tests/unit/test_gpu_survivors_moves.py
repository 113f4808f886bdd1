"""The byte moves between arena and nvme (``kvtier.store.transfers``; mutation review
survivors): a real nvme tier in a temporary directory and ``Transfers`` driven by hand, so
a frame served as a block it does not hold, a frame written without its sequence number,
or a durable write made lazily shows."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.frame import Codec, FrameHeader
from kvtier.index import BlockMeta, SlotState
from kvtier.policy.prefetch import PrefetchWait, wait_for_prefix
from kvtier.store.transfers import Transfer, Transfers
from kvtier.tiers.arena import Arena
from kvtier.tiers.base import TierName
from kvtier.tiers.nvme import PAGE, NvmeTier
from tests.support.arena import temp_arena
from tests.support.redis_port_fake import FakeRedis

BLOCK = 8192


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(4 * BLOCK, BLOCK) as a:
        yield a


@pytest.fixture
def nvme(tmp_path: Path) -> Iterator[NvmeTier]:
    tier = NvmeTier(tmp_path / "nvme", 4 * (PAGE + BLOCK), direct="off", io_threads=1)
    tier.open()
    yield tier
    tier.close()


def _block(arena: Arena, key: bytes, fill: int) -> BlockMeta:
    off = arena.alloc(BLOCK)
    assert off is not None
    arena.view(off, BLOCK)[:] = fill
    m = BlockMeta(key, b"n" * 16, 1, BLOCK, None, 0, cpu=off)
    m.set_cpu_state(SlotState.LOADING)
    m.set_cpu_state(SlotState.READY)
    return m


async def _on_nvme(arena: Arena, nvme: NvmeTier, key: bytes, fill: int,
                   sync: bool = False) -> tuple[Transfers, BlockMeta]:
    moves = Transfers(arena, nvme)
    m = _block(arena, key, fill)
    slot = nvme.alloc(BLOCK)
    assert slot is not None
    done = await moves.move(TierName.CPU, TierName.NVME, Transfer([m], slot=slot, sync=sync))
    assert done.moved == 1
    m.nvme, m.nvme_ready = slot, True
    return moves, m


@pytest.mark.parametrize("change", [{"codec": Codec.LZ4}, {"raw_len": 2 * BLOCK}])
async def test_a_frame_that_is_not_the_block_s_raw_bytes_is_never_served(
        arena: Arena, nvme: NvmeTier, monkeypatch: pytest.MonkeyPatch,
        change: dict[str, Any]) -> None:
    """A verified nvme frame whose header says encoded, or of another raw length than the
    block, read back into the arena is a corrupt frame (dropped, counted), never a block
    that moved: its payload is not the block's KV (mutants: the ``_not_plain`` check
    dropped from the read to cpu; only ``payload_len`` compared)."""
    moves, m = await _on_nvme(arena, nvme, b"k" * 16, 7)
    real = type(nvme).read_into

    async def odd(self: NvmeTier, *args: Any, **kw: Any) -> FrameHeader:
        header = await real(self, *args, **kw)
        return dataclasses.replace(header, **change)

    monkeypatch.setattr(type(nvme), "read_into", odd)
    failures = nvme.counters.checksum_failures
    done = await moves.move(TierName.NVME, TierName.CPU, Transfer([m]))
    assert done.moved == 0 and done.corrupt
    assert nvme.counters.checksum_failures == failures + 1
    assert ("nvme", "cpu") not in moves.moved.by_pair


async def test_each_frame_written_carries_a_new_sequence_number(
        arena: Arena, nvme: NvmeTier) -> None:
    """A block written to nvme takes a fresh sequence number, recorded both on the block
    and in its frame, newer than the previous frame's: a restart keeps the newest frame of
    a key by it, so a stale seq brings an older copy of the block back (mutant: the seq
    not taken)."""
    _, first = await _on_nvme(arena, nvme, b"a" * 16, 1)
    _, second = await _on_nvme(arena, nvme, b"b" * 16, 2)
    assert 0 < first.seq < second.seq
    assert second.nvme is not None
    out = memoryview(bytearray(BLOCK))
    header = await nvme.read_into(second.nvme, out, namespace=second.namespace,
                                  key=second.key, layout_fp=second.layout_fp)
    assert header.seq == second.seq
    assert bytes(out) == bytes([2]) * BLOCK


@pytest.mark.parametrize("sync", [True, False])
async def test_a_durable_write_reaches_the_disk_synced(
        arena: Arena, nvme: NvmeTier, monkeypatch: pytest.MonkeyPatch, sync: bool) -> None:
    """A transfer asked to be durable writes its frame with ``sync`` (a put acknowledged
    durable survives a power cut only then), and only that one pays for it (mutant: the
    flag not passed on)."""
    seen: list[bool] = []
    real = type(nvme).write

    async def write(self: NvmeTier, *args: Any, sync: bool = False) -> None:
        seen.append(sync)
        await real(self, *args, sync=sync)

    monkeypatch.setattr(type(nvme), "write", write)
    await _on_nvme(arena, nvme, b"d" * 16, 3, sync=sync)
    assert seen == [sync]



async def test_moves_to_redis_and_reads_from_nvme_are_measured(
        arena: Arena, nvme: NvmeTier) -> None:
    """Every move is counted in ``BytesMoved`` (the stats operators size tiers by): a
    block lent to Redis from its slot, and one read back from nvme for Redis; a read from
    nvme to cpu is a bandwidth sample for the reload rate lookups report (mutants: the
    counts dropped; the sample taken as 0 bytes, so never learnt)."""
    moves, m = await _on_nvme(arena, nvme, b"r" * 16, 5)
    redis = FakeRedis()
    moves.redis = redis  # type: ignore[assignment]
    done = await moves.move(TierName.NVME, TierName.CPU, Transfer([m]))
    assert done.moved == 1
    assert moves.bandwidth.leg("nvme", "cpu") is not None
    done = await moves.move(TierName.CPU, TierName.REDIS, Transfer([m]))
    assert done.moved == 1 and moves.moved.by_pair[("cpu", "redis")] == BLOCK
    redis.finish()
    m.set_cpu_state(SlotState.NONE)     # gone from the arena: read back from nvme
    done = await moves.move(TierName.NVME, TierName.REDIS, Transfer([m]))
    assert done.moved == 1 and moves.moved.by_pair[("nvme", "redis")] == BLOCK
    assert redis.frames[m.key] == bytes([5]) * BLOCK


@pytest.mark.parametrize("policy", [PrefetchWait.WAIT, PrefetchWait.TIMEOUT])
def test_a_get_returns_when_its_slowest_ready_block_has_landed(
        policy: PrefetchWait) -> None:
    """Blocks do not land in chain order: a get returns once the latest of its ready
    prefix has landed, not when the last one in the list did (mutant: ``return_at`` taken
    from the last block, so the engine reads a block still being promoted)."""
    out = wait_for_prefix(policy, [0.0, 3.0, 1.0], 0.0, per_block_s=10.0)
    assert out.ready_blocks == 3 and out.late_blocks == 0
    assert out.return_at == 3.0
