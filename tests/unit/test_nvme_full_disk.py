"""A full disk degrades the nvme tier (issue 14): writes refused fast, reads go on, a space
probe after a backoff restores it. On a real 2 MiB tmpfs (skipped where it cannot be
mounted); probes are paced by a shortened backoff, never by a hard-coded sleep."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvtier.backoff import BackoffPolicy
from kvtier.daemon.metrics import Metrics
from kvtier.frame import make_header
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.aligned import PAGE, aligned_buffer
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.base import tier_stats
from kvtier.tiers.nvme import NvmeDegradedError, NvmeIOError, NvmeSlot, NvmeTier
from tests.support.arena import temp_arena
from tests.support.small_fs import fill, small_tmpfs

NS = bytes(range(16))
LAYOUT_FP = 0x5151
FS_BYTES = 2 * 2**20
PAYLOAD = 15 * PAGE                   # a 16-page stride: the free space is a whole number
FAST_PROBES = BackoffPolicy(base_s=0.01, cap_s=0.05)
HEALTH_LOG = "kvtier.tiers.nvme.health"


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


async def wait_until_up(t: NvmeTier, timeout: float = 10.0) -> None:
    """Wait (bounded) for the tier's own space probe to restore it."""
    deadline = time.monotonic() + timeout
    while not t.up:
        assert time.monotonic() < deadline, "the nvme tier stayed degraded"
        await asyncio.sleep(0.005)


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "fs", FS_BYTES) as root:
        yield root


async def write_one(t: NvmeTier, i: int, payload: memoryview) -> NvmeSlot:
    slot = t.alloc(PAYLOAD)
    assert slot is not None
    try:
        await t.write(slot, make_header(NS, key_of(i), LAYOUT_FP, payload, seq=t.next_seq()),
                      payload)
    except NvmeIOError:
        t.free(slot)
        raise
    return slot


async def read_one(t: NvmeTier, slot: NvmeSlot, i: int) -> bytes:
    out = aligned_buffer(slot.slot_bytes)
    await t.read_into(slot, out, namespace=NS, key=key_of(i), layout_fp=LAYOUT_FP)
    return bytes(out[:PAYLOAD])


async def test_full_disk_degrades_refuses_writes_keeps_reads_and_recovers(
        fs: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.DEBUG, logger="kvtier.tiers.nvme")
    fill(fs / "ballast", FS_BYTES // 2)
    rng = random.Random(1)
    tier = NvmeTier(fs / "nvme", 64 * 2**20, direct="auto", io_threads=2, backoff=FAST_PROBES)
    tier.open()
    try:
        stored: dict[int, tuple[NvmeSlot, bytes]] = {}
        first_error: NvmeIOError | None = None
        for i in range(64):   # far more than 1 MiB of frames: the file system fills first
            payload = aligned_buffer(PAYLOAD)
            payload[:] = rng.randbytes(PAYLOAD)
            try:
                stored[i] = (await write_one(tier, i, payload), bytes(payload))
            except NvmeIOError as exc:
                first_error = exc
                break
        assert first_error is not None and not isinstance(first_error, NvmeDegradedError)
        assert isinstance(first_error.__cause__, OSError)
        assert first_error.__cause__.errno in (errno.ENOSPC, errno.EIO)   # EIO: a short write
        assert 4 <= len(stored) < 64

        # degraded: visible in up, stats and the health fields; counted once
        assert not tier.up and tier.degraded
        assert tier_stats(tier)["up"] is False
        health = tier.stats_extra()
        assert health["health"] == "degraded" and health["degradations"] == 1
        assert health["degraded_reason"].startswith(("ENOSPC", "EIO"))
        errors, written = tier.counters.errors, tier.counters.bytes_written
        sizes = {p: p.stat().st_size for p in (fs / "nvme").glob("slots-*.dat")}

        # writes are refused at once, without a single pwritev
        calls: list[int] = []
        real_pwritev = os.pwritev

        def counting_pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
            calls.append(fd)
            return real_pwritev(fd, bufs, offset)

        monkeypatch.setattr(os, "pwritev", counting_pwritev)
        payload = aligned_buffer(PAYLOAD)
        for i in range(100, 120):
            with pytest.raises(NvmeDegradedError, match="degraded"):
                await write_one(tier, i, payload)
        monkeypatch.undo()
        assert calls == []
        assert (tier.counters.errors, tier.counters.bytes_written) == (errors, written)
        assert tier.counters.dropped_writes == 20
        assert tier.stats_extra()["refused_writes"] == 20
        assert {p: p.stat().st_size for p in sizes} == sizes

        # reads of the frames already stored keep working, exactly
        for i, (slot, data) in stored.items():
            assert await read_one(tier, slot, i) == data
        assert tier.counters.checksum_failures == 0

        # space back: the backoff-paced probe restores the tier by itself
        (fs / "ballast").unlink()
        await wait_until_up(tier)
        health = tier.stats_extra()
        assert health["health"] == "up" and health["restorations"] == 1
        assert health["space_probes"] >= 1 and health["degraded_reason"] == ""
        assert tier_stats(tier)["up"] is True
        new = aligned_buffer(PAYLOAD)
        new[:] = rng.randbytes(PAYLOAD)
        slot = await write_one(tier, 500, new)
        assert await read_one(tier, slot, 500) == bytes(new)
        for i, (slot, data) in stored.items():
            assert await read_one(tier, slot, i) == data
    finally:
        tier.close()

    warnings = [r for r in caplog.records if r.name == HEALTH_LOG and r.levelno >= logging.WARNING]
    restored = [r for r in caplog.records if r.name == HEALTH_LOG and "restored" in r.message]
    assert len(warnings) == 1 and "degraded" in warnings[0].message   # once per transition
    assert len(restored) == 1


async def test_only_full_or_failing_disk_errors_degrade(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """EINVAL (a bug, not the disk) is an error but no reason to stop writing; EDQUOT is."""
    tier = NvmeTier(tmp_path / "nvme", 8 * 2**20, direct="off", io_threads=1,
                    backoff=BackoffPolicy(base_s=30.0, cap_s=30.0))   # no probe in this test
    tier.open()
    try:
        payload = aligned_buffer(PAYLOAD)
        for code, degrades in ((errno.EINVAL, False), (errno.EDQUOT, True)):
            def failing(*_args: object, code: int = code) -> int:
                raise OSError(code, os.strerror(code))

            monkeypatch.setattr(os, "pwritev", failing)
            with pytest.raises(NvmeIOError) as info:
                await write_one(tier, code, payload)
            monkeypatch.undo()
            assert not isinstance(info.value, NvmeDegradedError)
            assert tier.degraded is degrades
        assert tier.stats_extra()["degraded_reason"].startswith("EDQUOT")
        assert tier.counters.errors == 2
        slot = tier.alloc(PAYLOAD)
        assert slot is not None
        with pytest.raises(NvmeDegradedError):
            await tier.write(slot, make_header(NS, key_of(1), LAYOUT_FP, payload), payload)
    finally:
        tier.close()
    assert not tier.up   # closed


# ---------------------------------------------------------------------- through the store
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=128)
BLOCK = LAYOUT.block_bytes
NAMESPACE = Namespace("test/full-disk", LAYOUT)


def block_payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(4 * BLOCK, BLOCK) as a:
        yield a


async def test_store_keeps_nvme_blocks_and_serves_them_while_the_disk_is_full(
        fs: Path, arena: Arena) -> None:
    """The store needs no change: refused writes cost it a cpu eviction without demotion,
    never an nvme eviction, and nvme blocks stay readable; metrics show tier up = 0."""
    fill(fs / "ballast", FS_BYTES - 24 * (PAGE + BLOCK))   # room for about 24 frames
    nvme = NvmeTier(fs / "nvme", 64 * 2**20, direct="off", io_threads=2, backoff=FAST_PROBES)
    nvme.open()
    store = TieredStore(arena, nvme=nvme, eviction="lru", prefetch_wait="wait")
    assert store.register_namespace(LAYOUT, "test/full-disk", 0, 1, None) == NAMESPACE
    digest, fp = NAMESPACE.digest, LAYOUT.fingerprint
    client = ArenaMapping(str(arena.path), arena.size)
    metrics = Metrics(store.stats)

    async def put(keys: list[bytes]) -> None:
        lease, offsets = await store.prepare_put(1, digest, fp, keys)
        for key, off in zip(keys, offsets, strict=True):
            if off is not None:
                client.view(off, BLOCK, writable=True)[:] = memoryview(block_payload(key))
        await store.commit_put(1, lease)

    def tier_up() -> str:
        text = generate_latest(metrics.registry).decode()
        return next(line for line in text.splitlines()
                    if line.startswith('kvtier_tier_up{tier="nvme"}'))

    try:
        assert tier_up().endswith(" 1.0")
        keys = block_keys(NAMESPACE, list(range(200 * LAYOUT.tokens_per_block)))
        for n in range(0, len(keys), 2):   # cpu holds 4: each put evicts older blocks to nvme
            await put(keys[n:n + 2])
            if nvme.degraded:
                break
        assert nvme.degraded and tier_up().endswith(" 0.0")
        on_nvme = [k for k in keys if k in store.index and store.index[k].in_nvme]
        assert on_nvme and nvme.blocks == len(on_nvme)
        more = block_keys(NAMESPACE, list(range(10**6, 10**6 + 20 * LAYOUT.tokens_per_block)))
        for n in range(0, len(more), 2):   # puts go on; nvme keeps every block it had
            await put(more[n:n + 2])
        assert nvme.degraded and nvme.blocks == len(on_nvme)
        assert nvme.stats_extra()["refused_writes"] > 0
        for key in on_nvme:   # still served from nvme, exact bytes
            result = await store.lookup(digest, fp, [key])
            assert result.hits == 1
            lease, offsets = await store.prepare_get(1, digest, fp, [key])
            assert bytes(client.view(offsets[0], BLOCK, writable=False)) == block_payload(key)
            await store.release_get(1, lease)
        (fs / "ballast").unlink()
        await wait_until_up(nvme)
        assert tier_up().endswith(" 1.0")
    finally:
        client.close()
        await store.drain(time.monotonic() + 5)
        nvme.close()


def test_the_daemon_paces_probes_with_the_configured_backoff(tmp_path: Path) -> None:
    from kvtier.config import load_config
    from kvtier.daemon.service import Daemon
    from kvtier.errors import ConfigError

    env = {"KVTIER_NVME_BACKOFF_MIN_S": "0.01", "KVTIER_NVME_BACKOFF_MAX_S": "0.2"}
    cfg = load_config(env=env, overrides={"daemon.data_dir": tmp_path, "nvme.bytes": "8MiB",
                                          "nvme.backend": "posix"})
    tier = Daemon(cfg)._make_nvme()
    assert tier.health.policy == BackoffPolicy(base_s=0.01, cap_s=0.2)
    assert load_config(env={}).nvme.backoff_min_s == 0.5
    with pytest.raises(ConfigError, match=r"nvme\.backoff_min_s"):
        load_config(env={"KVTIER_NVME_BACKOFF_MIN_S": "5", "KVTIER_NVME_BACKOFF_MAX_S": "1"})
