"""NvmeTier against real files: round trips, hard capacity, restarts, torn frames, erase."""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.backoff import BackoffPolicy
from kvtier.errors import BufferSizeError, ChecksumError, ConfigError, FrameError, KVTierError
from kvtier.frame import HEADER_SIZE, FrameHeader, make_header
from kvtier.tiers.aligned import aligned_buffer, is_aligned
from kvtier.tiers.base import Tier, TierName, tier_stats
from kvtier.tiers.nvme import PAGE, NvmeIOError, NvmeSlot, NvmeTier, PosixFrameIO
from kvtier.tiers.nvme import probe as nvme_probe
from kvtier.tiers.nvme import split as nvme_split

NS = bytes(range(16))
LAYOUT = 0x1234_5678
MiB = 1 << 20
FAST_PROBES = BackoffPolicy(base_s=0.01, cap_s=0.05)   # a degraded tier re-probes quickly


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture(params=["auto", "off"])
def direct(request: pytest.FixtureRequest) -> str:
    """Run I/O tests through both paths: O_DIRECT (where tmp_path allows it) and buffered."""
    return str(request.param)


@pytest.fixture
def tier(tmp_path: Path, direct: str) -> Iterator[NvmeTier]:
    t = NvmeTier(tmp_path / "nvme", 64 * MiB, direct=direct, io_threads=4,
                 backoff=FAST_PROBES)
    assert t.open() == []
    yield t
    t.close()


def reopen(t: NvmeTier, capacity: int | None = None) -> tuple[NvmeTier, list]:
    """Simulate a daemon restart on the same directory."""
    t.close()
    fresh = NvmeTier(t.root, t.capacity_bytes if capacity is None else capacity,
                     direct="auto" if t.direct else "off")
    return fresh, fresh.open()


def block(rng: random.Random, payload_len: int) -> memoryview:
    """An arena-like slot: aligned, padded to the size class, random payload bytes."""
    buf = aligned_buffer(NvmeTier.slot_bytes_for(payload_len))
    buf[:payload_len] = rng.randbytes(payload_len)
    return buf


async def put(t: NvmeTier, i: int, payload: memoryview, payload_len: int,
              ) -> tuple[NvmeSlot, FrameHeader]:
    slot = t.alloc(payload_len)
    assert slot is not None
    header = make_header(NS, key_of(i), LAYOUT, payload[:payload_len], seq=t.next_seq())
    await t.write(slot, header, payload)
    return slot, header


async def get(t: NvmeTier, slot: NvmeSlot, i: int, payload_len: int) -> bytes:
    out = aligned_buffer(slot.slot_bytes)
    header = await t.read_into(slot, out, namespace=NS, key=key_of(i), layout_fp=LAYOUT)
    assert header.payload_len == payload_len
    return bytes(out[:payload_len])


async def wait_until_up(t: NvmeTier, timeout: float = 10.0) -> None:
    """Wait (bounded) for a degraded tier's space probe to restore it."""
    deadline = time.monotonic() + timeout
    while not t.up:
        assert time.monotonic() < deadline, "the nvme tier stayed degraded"
        await asyncio.sleep(0.005)


def files_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("slots-*.dat"))


# ------------------------------------------------------------------------- basics
def test_tier_protocol_and_stats(tier: NvmeTier, direct: str) -> None:
    assert isinstance(tier, Tier)
    assert tier.name is TierName.NVME and tier.up
    assert tier.backend == ("posix" if direct == "off" else "posix+odirect")
    stats = tier_stats(tier)
    assert stats["capacity_bytes"] == 64 * MiB and stats["used_bytes"] == 0
    assert stats["blocks"] == 0


def test_slot_bytes_for() -> None:
    assert [NvmeTier.slot_bytes_for(n) for n in (0, 1, 4095, 4096, 4097)] == [
        4096, 4096, 4096, 4096, 8192]
    with pytest.raises(ValueError):
        NvmeTier.slot_bytes_for(-1)


async def test_round_trip_size_classes(tier: NvmeTier) -> None:
    rng = random.Random(1)
    sizes = [1, 96, 4095, 4096, 4097, 10_000, 65_536 + 3, MiB, MiB + 17]
    stored = []
    for i, n in enumerate(sizes):
        buf = block(rng, n)
        slot, _ = await put(tier, i, buf, n)
        assert slot.slot_bytes == NvmeTier.slot_bytes_for(n)
        stored.append((slot, i, n, bytes(buf[:n])))
    for slot, i, n, data in stored:
        assert await get(tier, slot, i, n) == data
    assert tier.blocks == len(sizes)
    assert tier.used_bytes == sum(PAGE + s.slot_bytes for s, *_ in stored)
    assert tier.counters.bytes_written == tier.used_bytes
    assert tier.counters.bytes_read == tier.used_bytes
    assert tier.counters.checksum_failures == 0
    names = sorted(p.name for p in tier.root.glob("slots-*.dat"))
    assert names == sorted({f"slots-{s.slot_bytes}.dat" for s, *_ in stored})


async def test_unaligned_and_exact_buffers(tier: NvmeTier) -> None:
    rng = random.Random(2)
    n = 10_000
    data = rng.randbytes(n)
    base = aligned_buffer(n + 1)
    base[1:] = data
    shifted = base[1:]                      # misaligned by one byte, exactly n long
    assert not is_aligned(shifted)
    sources = [shifted, memoryview(data), memoryview(bytearray(data))]
    slots = []
    for i, src in enumerate(sources):
        slot = tier.alloc(n)
        assert slot is not None
        await tier.write(slot, make_header(NS, key_of(i), LAYOUT, src, seq=tier.next_seq()), src)
        slots.append(slot)
    for i, slot in enumerate(slots):
        out = bytearray(n)                  # exact-length, unaligned output buffer
        await tier.read_into(slot, memoryview(out), namespace=NS, key=key_of(i),
                             layout_fp=LAYOUT)
        assert bytes(out) == data
        short = memoryview(bytearray(n - 1))
        with pytest.raises(BufferSizeError):
            await tier.read_into(slot, short, namespace=NS, key=key_of(i), layout_fp=LAYOUT)
    assert tier.counters.checksum_failures == 0


async def test_wrong_key_namespace_or_layout_is_a_frame_error(tier: NvmeTier) -> None:
    buf = block(random.Random(3), 5000)
    slot, _ = await put(tier, 7, buf, 5000)
    out = aligned_buffer(slot.slot_bytes)
    wrong: list[dict[str, Any]] = [dict(namespace=NS, key=key_of(8), layout_fp=LAYOUT),
                                   dict(namespace=bytes(16), key=key_of(7), layout_fp=LAYOUT),
                                   dict(namespace=NS, key=key_of(7), layout_fp=LAYOUT + 1)]
    for kwargs in wrong:
        with pytest.raises(FrameError):
            await tier.read_into(slot, out, **kwargs)
    assert tier.counters.checksum_failures == len(wrong)
    header = await tier.read_into(slot, out, namespace=None, key=None, layout_fp=None)
    assert header.key == key_of(7)


async def test_illegal_slot_transitions_raise(tier: NvmeTier) -> None:
    buf = block(random.Random(4), PAGE)
    header = make_header(NS, key_of(0), LAYOUT, buf)
    with pytest.raises(KVTierError):
        await tier.write(NvmeSlot(PAGE, 0), header, buf)         # never allocated
    slot = tier.alloc(PAGE)
    assert slot is not None
    with pytest.raises(KVTierError):
        await tier.read_into(slot, buf, namespace=None, key=None, layout_fp=None)  # not stored
    await tier.write(slot, header, buf)
    with pytest.raises(KVTierError):
        await tier.write(slot, header, buf)                      # already stored
    small = tier.alloc(PAGE)
    assert small is not None
    with pytest.raises(BufferSizeError):
        await tier.write(small, make_header(NS, key_of(1), LAYOUT, bytes(5000)),
                         buf)                                    # frame larger than its slot
    tier.free(slot)
    with pytest.raises(KVTierError):
        tier.free(slot)                                          # double free


async def test_concurrent_writes_and_reads(tier: NvmeTier) -> None:
    rng = random.Random(5)
    sizes = [rng.choice([4096, 20_000, 300_000, MiB]) for _ in range(32)]
    bufs = [block(rng, n) for n in sizes]
    pairs = list(zip(bufs, sizes, strict=True))
    puts = await asyncio.gather(*(put(tier, i, b, n) for i, (b, n) in enumerate(pairs)))
    stored = list(zip(puts, sizes, strict=True))
    got = await asyncio.gather(*(get(tier, slot, i, n) for i, ((slot, _), n) in enumerate(stored)))
    assert got == [bytes(b[:n]) for b, n in zip(bufs, sizes, strict=True)]
    # reads and writes interleaved on distinct slots
    more = [block(rng, 9000) for _ in range(8)]
    mixed = await asyncio.gather(*(put(tier, 100 + i, b, 9000) for i, b in enumerate(more)),
                                 *(get(tier, slot, i, n)
                                   for i, ((slot, _), n) in enumerate(stored)))
    assert mixed[8:] == got


# ------------------------------------------------------------------------- capacity
async def test_capacity_is_hard(tmp_path: Path, direct: str) -> None:
    stride = PAGE + 8192
    t = NvmeTier(tmp_path, 3 * stride, direct=direct)
    t.open()
    rng = random.Random(6)
    slots = [await put(t, i, block(rng, 8000), 8000) for i in range(3)]
    assert t.used_bytes == 3 * stride
    assert t.alloc(8000) is None
    assert t.alloc(1) is None                       # any class: used_bytes is full
    assert t.counters.allocation_failures == 0      # attempts: the store counts failures
    assert files_bytes(tmp_path) <= 3 * stride
    t.free(slots[1][0])
    again = t.alloc(8000)
    assert again == slots[1][0]                     # the freed slot is reused, file not grown
    assert files_bytes(tmp_path) <= 3 * stride
    t.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 5 * PAGE)), min_size=1,
                    max_size=40))
def test_capacity_holds_under_mixed_size_churn(ops: list[tuple[bool, int]]) -> None:
    """Random alloc/free across size classes: neither used bytes nor the files' disk (their
    span less punched holes) pass the cap."""
    capacity = 10 * PAGE
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as root:
        t = NvmeTier(Path(root), capacity, direct="off")
        t.open()
        live: list[NvmeSlot] = []

        async def run() -> None:
            for do_alloc, n in ops:
                if do_alloc or not live:
                    slot = t.alloc(n)
                    if slot is None:
                        assert t.used_bytes + PAGE + t.slot_bytes_for(n) > capacity or (
                            t.disk_bytes + PAGE + t.slot_bytes_for(n) > capacity)
                        continue
                    buf = aligned_buffer(slot.slot_bytes)
                    await t.write(slot, make_header(NS, key_of(len(live)), 0, buf[:n]), buf)
                    live.append(slot)
                else:
                    t.free(live.pop(n % len(live)))
                assert t.used_bytes <= capacity and t.disk_bytes <= capacity
                # what the files span, less the free slots punched out of them
                assert files_bytes(Path(root)) - t.hole_bytes == t.disk_bytes

        asyncio.run(run())
        t.close()


# ------------------------------------------------------------------------- restarts
async def test_restart_returns_exactly_the_written_blocks(tier: NvmeTier) -> None:
    rng = random.Random(7)
    sizes = [100, 4096, 5000, 70_000, MiB, 100, 5000]
    written = []
    for i, n in enumerate(sizes):
        buf = block(rng, n)
        slot, header = await put(tier, i, buf, n)
        written.append((slot, header, bytes(buf[:n])))
    last_seq = tier.next_seq()
    t2, found = reopen(tier)
    try:
        assert found == [(slot, header) for slot, header, _ in written]   # in seq order
        for (slot, header), (_, _, data) in zip(found, written, strict=True):
            assert await get(t2, slot, int.from_bytes(header.key, "little"), len(data)) == data
        assert t2.blocks == len(sizes) and t2.used_bytes == tier.used_bytes
        assert t2.next_seq() > last_seq
        # the restarted tier keeps allocating after the old frames, without clobbering them
        slot, _ = await put(t2, 99, block(rng, 5000), 5000)
        assert slot not in {s for s, _ in found}
    finally:
        t2.close()


async def test_free_erase_survives_restart_and_plain_free_does_not(tier: NvmeTier) -> None:
    rng = random.Random(8)
    a = await put(tier, 1, block(rng, 5000), 5000)
    b = await put(tier, 2, block(rng, 5000), 5000)
    c = await put(tier, 3, block(rng, 5000), 5000)
    tier.free(a[0], erase=True)     # explicit delete: gone for good
    tier.free(b[0])                 # eviction: still a valid frame on disk
    t2, found = reopen(tier)
    t2.close()
    assert [h.key for _, h in found] == [key_of(2), key_of(3)]
    assert c in found


def physical_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.glob("slots-*.dat"))


async def test_a_new_size_class_takes_the_room_of_free_slots_in_other_files(
        tmp_path: Path) -> None:
    """Room freed in the middle of another class's file used to be of no use to a new
    class (files grow at their tails), so the store evicted until a tail came free: up
    to 4096 blocks for one 4 MiB block. Those free slots are now punched out."""
    small_stride, big = PAGE + 4096, 64 * 1024
    t = NvmeTier(tmp_path / "nvme", 64 * small_stride, direct="off", io_threads=1)
    t.open()
    rng = random.Random(12)
    try:
        stored = [await put(t, i, block(rng, 4000), 4000) for i in range(64)]
        assert t.alloc(big) is None                        # full
        for slot, _ in stored[1:40:2]:                     # 20 free slots in the middle
            t.free(slot)
        assert t.alloc(big) is None and t.disk_short(big) > 0   # alloc never punches: the
        assert await t.make_room(big)                      # loop must not wait on it
        assert t.alloc(big) is not None                    # room enough, no eviction
        assert t.disk_bytes <= t.capacity_bytes
        assert physical_bytes(t.root) <= t.capacity_bytes
        kept = [(s, h) for n, (s, h) in enumerate(stored) if not (n % 2 and n < 40)]
        for slot, header in kept:                          # the other frames are intact
            got = await t.read_into(slot, aligned_buffer(slot.slot_bytes), namespace=NS,
                                    key=header.key, layout_fp=LAYOUT)
            assert got.checksum == header.checksum
        punched = t.stats_extra()["punched_slots"]
        assert punched == -(-(PAGE + big) // small_stride)   # only what it needed
    finally:
        t.close()
    again = NvmeTier(tmp_path / "nvme", 64 * small_stride, direct="off", io_threads=1)
    try:   # kept frames, and the freed ones not punched (an evicted frame stays on disk)
        found = {h.key for _, h in again.open()}
        assert {h.key for _, h in kept} <= found
        assert len(found) == len(kept) + 20 - punched
    finally:
        again.close()


@pytest.mark.parametrize("bigs", [1, 3, 6])
async def test_frames_written_into_punched_room_survive_a_restart(tmp_path: Path,
                                                                  bigs: int) -> None:
    """The files then span more than the capacity (the holes are not disk): the start-up
    scan fitted the spans to the capacity and dropped exactly the frames written into
    punched room, newest first, at every start."""
    small_stride, big = PAGE + 4096, 64 * 1024
    cap = 64 * small_stride
    t = NvmeTier(tmp_path / "nvme", cap, direct="off", io_threads=1)
    t.open()
    rng = random.Random(13)
    try:
        stored = [await put(t, i, block(rng, 4000), 4000) for i in range(64)]
        for slot, _ in stored[:62]:              # evicted: their frames stay on disk
            t.free(slot)
        large = []
        for j in range(bigs):
            if t.disk_short(big):
                assert await t.make_room(big)
            large.append(await put(t, 1000 + j, block(rng, big), big))
        live = {h.key for _, h in stored[62:]} | {h.key for _, h in large}
        assert t.stats_extra()["punched_slots"] > 0
    finally:
        t.close()
    again = NvmeTier(tmp_path / "nvme", cap, direct="off", io_threads=1)
    try:
        found = {h.key for _, h in again.open()}
        assert live <= found                       # every live frame, none dropped
        assert again.counters.evictions.get("capacity", 0) == 0
        assert again.used_bytes <= cap and again.disk_bytes <= cap
        assert physical_bytes(again.root) <= cap
        for slot, header in large:
            got = await again.read_into(slot, aligned_buffer(slot.slot_bytes),
                                        namespace=NS, key=header.key, layout_fp=LAYOUT)
            assert got.checksum == header.checksum
    finally:
        again.close()


async def test_queueing_many_erases_costs_linear_bookkeeping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropping a long chain's orphans erases each one: the list of erases in flight was
    rebuilt per erase (every future asked ``done()``), O(n^2) on the event loop, a 0.4-4 s
    stall for 2047 orphans. Now it is pruned when it doubles."""
    import concurrent.futures

    t = NvmeTier(tmp_path / "nvme", 16 * MiB, direct="off", io_threads=1)
    t.open()
    try:
        slots = [t.alloc(1) for _ in range(1500)]
        calls = 0
        done = concurrent.futures.Future.done

        def counted(self: concurrent.futures.Future[object]) -> bool:
            nonlocal calls
            calls += 1
            return done(self)

        monkeypatch.setattr(concurrent.futures.Future, "done", counted)
        for slot in slots:
            assert slot is not None
            t.free(slot, erase=True)
        assert calls < 8 * len(slots)        # grew with n^2 (each erase asked them all)
        await t.erased()
    finally:
        t.close()


async def test_reuse_of_freed_slots(tier: NvmeTier) -> None:
    rng = random.Random(9)
    old, _ = await put(tier, 1, block(rng, 6000), 6000)
    tier.free(old, erase=True)      # erase is queued; the next write must land after it
    new_buf = block(rng, 7000)
    new, _ = await put(tier, 2, new_buf, 7000)
    assert new == old
    assert await get(tier, new, 2, 7000) == bytes(new_buf[:7000])
    t2, found = reopen(tier)
    try:
        assert [(s, h.key) for s, h in found] == [(new, key_of(2))]
        assert await get(t2, new, 2, 7000) == bytes(new_buf[:7000])
    finally:
        t2.close()


async def test_restart_keeps_newest_copy_of_a_key(tier: NvmeTier) -> None:
    rng = random.Random(10)
    first = await put(tier, 5, block(rng, 5000), 5000)
    second_buf = block(rng, 5000)
    second = await put(tier, 5, second_buf, 5000)
    t2, found = reopen(tier)
    try:
        assert found == [second]
        assert t2.blocks == 1 and t2.alloc(5000) == first[0]
    finally:
        t2.close()


async def test_restart_with_lower_capacity_keeps_what_fits(tier: NvmeTier) -> None:
    """Frames keep their slots: what lies past the lower capacity is cut off the file."""
    rng = random.Random(11)
    puts = [await put(tier, i, block(rng, 8192), 8192) for i in range(5)]
    t2, found = reopen(tier, capacity=2 * (PAGE + 8192))
    try:
        assert found == puts[:2]
        assert t2.used_bytes <= t2.disk_bytes <= t2.capacity_bytes
        assert (tier.root / "slots-8192.dat").stat().st_size == 2 * (PAGE + 8192)
    finally:
        t2.close()


# ------------------------------------------------------------------------- torn frames
def _corrupt(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("damage", ["truncate_payload", "flip_header", "half_header",
                                    "garbage_header", "flip_payload"])
async def test_torn_or_corrupt_frames_are_dropped_and_counted(tier: NvmeTier,
                                                              damage: str) -> None:
    rng = random.Random(12)
    n = 3 * PAGE + 100
    puts = [await put(tier, i, block(rng, n), n) for i in range(4)]
    datas = {}
    for slot, header in puts:
        datas[header.key] = await get(tier, slot, int.from_bytes(header.key, "little"), n)
    victim = puts[-1][0] if damage == "truncate_payload" else puts[1][0]
    path = tier.root / f"slots-{victim.slot_bytes}.dat"
    tier.close()
    if damage == "truncate_payload":
        os.truncate(path, victim.offset + PAGE + n // 2)
    elif damage == "flip_header":
        _flip(path, victim.offset + 40)
    elif damage == "half_header":
        other = make_header(NS, key_of(77), LAYOUT, b"x" * n, seq=1).pack()
        _corrupt(path, victim.offset, other[: HEADER_SIZE // 2] + bytes(PAGE - HEADER_SIZE // 2))
    elif damage == "garbage_header":
        _corrupt(path, victim.offset, os.urandom(PAGE))
    else:
        _flip(path, victim.offset + PAGE + n - 1)

    t2 = NvmeTier(tier.root, tier.capacity_bytes, direct="auto" if tier.direct else "off")
    found = t2.open()
    try:
        survivors = [(s, h) for s, h in puts if s != victim]
        if damage == "flip_payload":
            # the header is intact, so the slot is listed; its payload fails at read time
            assert found == puts
            with pytest.raises(ChecksumError):
                await get(t2, victim, 1, n)
        else:
            assert found == survivors
            assert t2.alloc(n) == victim        # the dropped slot is free again
        assert t2.counters.checksum_failures == 1
        for slot, header in survivors:
            i = int.from_bytes(header.key, "little")
            assert await get(t2, slot, i, n) == datas[header.key]
    finally:
        t2.close()


async def test_reused_slot_with_torn_new_payload_never_returns_old_or_mixed_bytes(
        tier: NvmeTier) -> None:
    """Old header intact + half-overwritten payload (a write torn before its header landed)."""
    rng = random.Random(13)
    n = 4 * PAGE
    slot, _ = await put(tier, 1, block(rng, n), n)
    path = tier.root / f"slots-{slot.slot_bytes}.dat"
    tier.close()
    _corrupt(path, slot.offset + PAGE, rng.randbytes(n // 2))
    t2 = NvmeTier(tier.root, tier.capacity_bytes, direct="auto" if tier.direct else "off")
    try:
        assert [s for s, _ in t2.open()] == [slot]
        with pytest.raises(ChecksumError):
            await get(t2, slot, 1, n)
        assert t2.counters.checksum_failures == 1
    finally:
        t2.close()


# ------------------------------------------------------------------------- errors, config
async def test_os_errors_are_counted_and_typed(tier: NvmeTier,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pwritev(*_args: object) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "pwritev", failing_pwritev)
    slot = tier.alloc(PAGE)
    assert slot is not None
    buf = aligned_buffer(PAGE)
    with pytest.raises(NvmeIOError):
        await tier.write(slot, make_header(NS, key_of(0), LAYOUT, buf), buf)
    assert tier.counters.errors == 1 and tier.blocks == 0
    monkeypatch.undo()
    await wait_until_up(tier)   # EIO degraded the tier until its space probe succeeded
    await tier.write(slot, make_header(NS, key_of(0), LAYOUT, buf), buf)   # a retry is legal
    assert tier.blocks == 1


def test_direct_on_without_o_direct_is_a_config_error(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvme_probe, "probe_direct", lambda root: "EINVAL (tmpfs)")
    with pytest.raises(ConfigError, match=r"nvme\.direct=on"):
        NvmeTier(tmp_path, MiB, direct="on").open()
    auto = NvmeTier(tmp_path, MiB, direct="auto")
    auto.open()
    assert auto.backend == "posix"
    auto.close()
    with pytest.raises(ConfigError):
        NvmeTier(tmp_path, MiB, direct="sometimes")


def test_use_after_close_raises(tmp_path: Path) -> None:
    t = NvmeTier(tmp_path, MiB)
    with pytest.raises(KVTierError):
        t.alloc(10)                      # not opened yet
    t.open()
    t.close()
    assert not t.up
    with pytest.raises(KVTierError):
        t.alloc(10)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(0, 3 * PAGE + 7), min_size=1, max_size=12),
       seed=st.integers(0, 2**32 - 1))
def test_random_sizes_round_trip_through_restart(sizes: list[int], seed: int) -> None:
    rng = random.Random(seed)

    async def run(root: Path) -> None:
        t = NvmeTier(root, 16 * MiB)
        t.open()
        written = [(await put(t, i, block(rng, n), n), n) for i, n in enumerate(sizes)]
        datas = [await get(t, slot, i, n) for i, ((slot, _), n) in enumerate(written)]
        t2, found = reopen(t)
        try:
            assert found == [sh for sh, _ in written]
            for i, ((slot, _), n) in enumerate(written):
                assert await get(t2, slot, i, n) == datas[i]
        finally:
            t2.close()

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as root:
        asyncio.run(run(Path(root)))


async def test_cancelled_io_propagates_and_leaves_the_tier_usable(tier: NvmeTier) -> None:
    rng = random.Random(14)
    buf = block(rng, MiB)
    slot = tier.alloc(MiB)
    assert slot is not None
    header = make_header(NS, key_of(1), LAYOUT, buf, seq=tier.next_seq())
    task = asyncio.create_task(tier.write(slot, header, buf))
    await asyncio.sleep(0)              # submitted to the pool, then cancelled in flight
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await tier.write(slot, header, buf)     # the slot is still reserved: writing again is legal
    out = aligned_buffer(MiB)
    reader = asyncio.create_task(
        tier.read_into(slot, out, namespace=NS, key=key_of(1), layout_fp=LAYOUT))
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert await get(tier, slot, 1, MiB) == bytes(buf)
    assert tier.counters.checksum_failures == 0 and tier.counters.errors == 0


# ------------------------------------------------------------------------- split reads
PIECE = 2 * PAGE    # small pieces, so modest frames are read as several concurrent pieces


@pytest.fixture
def split_tier(tmp_path: Path, direct: str) -> Iterator[NvmeTier]:
    t = NvmeTier(tmp_path / "split", 64 * MiB, direct=direct, io_threads=4, split_bytes=PIECE)
    t.open()
    yield t
    t.close()


def test_split_geometry() -> None:
    assert nvme_split.plan_pieces(MiB, 0, 8) == (1, MiB)                  # splitting off
    assert nvme_split.plan_pieces(MiB, 512 * 1024, 1) == (1, MiB)         # one piece allowed
    assert nvme_split.plan_pieces(MiB - 1, 512 * 1024, 8) == (1, MiB - 1)  # too small to split
    assert nvme_split.plan_pieces(MiB, 512 * 1024, 8) == (2, 512 * 1024)
    assert nvme_split.plan_pieces(4 * MiB, 512 * 1024, 8) == (8, 512 * 1024)
    assert nvme_split.plan_pieces(4 * MiB, 256 * 1024, 8) == (8, 512 * 1024)   # capped at 8
    for length in (MiB + PAGE, 5 * PAGE, 17 * PAGE + 5):
        pieces, size = nvme_split.plan_pieces(length, PIECE, 4)
        assert size % PAGE == 0 and (pieces - 1) * size < length <= pieces * size


def test_streaming_checksum_matches_the_frame_checksum() -> None:
    """The split read hashes pieces with a streaming xxh3-64: it must equal the frame's."""
    rng = random.Random(20)
    data = rng.randbytes(3 * MiB + 11)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(data)), rng.randint(1, 9)))
        hasher = xxhash.xxh3_64()
        for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
            hasher.update(memoryview(data)[a:b])
        assert hasher.intdigest() == make_header(NS, key_of(0), LAYOUT, data).checksum


@pytest.mark.parametrize("n", [
    PIECE * 2,                  # exactly two pieces
    PIECE * 2 - 1,              # payload ends one byte before a piece boundary
    PIECE * 2 + 1,              # one byte into the third piece
    PIECE * 3 - PAGE + 7,       # the last piece holds padding only past the payload
    5 * PIECE + 123,
    MiB + 17,
])
async def test_split_reads_round_trip_at_piece_boundaries(split_tier: NvmeTier, n: int) -> None:
    rng = random.Random(n)
    buf = block(rng, n)
    slot, _ = await put(split_tier, 1, buf, n)
    assert nvme_split.plan_pieces(slot.slot_bytes, PIECE, nvme_split.MAX_PIECES)[0] > 1
    assert await get(split_tier, slot, 1, n) == bytes(buf[:n])
    unaligned = memoryview(bytearray(slot.slot_bytes + 1))[1:]   # bounce buffer path
    await split_tier.read_into(slot, unaligned, namespace=NS, key=key_of(1), layout_fp=LAYOUT)
    assert bytes(unaligned[:n]) == bytes(buf[:n])
    exact = memoryview(bytearray(n))                               # shorter than the slot
    await split_tier.read_into(slot, exact, namespace=NS, key=key_of(1), layout_fp=LAYOUT)
    assert bytes(exact) == bytes(buf[:n])
    assert split_tier.counters.bytes_read == 3 * (PAGE + slot.slot_bytes) or not split_tier.direct
    assert split_tier.counters.checksum_failures == 0


@pytest.mark.parametrize("damage", ["flip", "truncate"])
async def test_split_read_never_returns_a_frame_torn_in_any_piece(split_tier: NvmeTier,
                                                                 damage: str) -> None:
    """Damage inside each piece in turn (first byte, last byte, a middle byte): every read
    fails, is counted, and the other frames still read back exactly."""
    rng = random.Random(21)
    n = 4 * PIECE + 100            # the last piece ends in padding
    pieces, size = nvme_split.plan_pieces(NvmeTier.slot_bytes_for(n), PIECE, nvme_split.MAX_PIECES)
    assert pieces >= 3 and (pieces - 1) * size < n
    cases = [(j, off) for j in range(pieces)
             for off in sorted({j * size, j * size + size // 2, min((j + 1) * size, n) - 1})]
    slots = []
    for i in range(len(cases) + 1):
        buf = block(rng, n)
        slot, _ = await put(split_tier, i, buf, n)
        slots.append((slot, bytes(buf[:n])))
    path = split_tier.root / f"slots-{slots[0][0].slot_bytes}.dat"
    if damage == "truncate":
        cases = cases[-1:]         # truncating cuts every later frame: check the last one
        victims = [slots[-2][0]]
        os.truncate(path, victims[0].offset + PAGE + cases[0][1])
    else:
        victims = [slots[i][0] for i in range(len(cases))]
        for (_, off), victim in zip(cases, victims, strict=True):
            _flip(path, victim.offset + PAGE + off)
    for victim in victims:
        i = slots.index(next(s for s in slots if s[0] == victim))
        out = aligned_buffer(victim.slot_bytes)
        out[:] = b"\xee" * victim.slot_bytes
        err = ChecksumError if damage == "flip" else FrameError
        with pytest.raises(err):
            await split_tier.read_into(victim, out, namespace=NS, key=key_of(i),
                                       layout_fp=LAYOUT)
    assert split_tier.counters.checksum_failures == len(victims)
    for i, (slot, data) in enumerate(slots):
        if slot not in victims and (damage == "flip" or slot.offset < victims[0].offset):
            assert await get(split_tier, slot, i, n) == data


async def test_split_read_os_error_in_one_piece_is_typed_and_waits_for_the_others(
        split_tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(22)
    n = 6 * PIECE
    buf = block(rng, n)
    slot, _ = await put(split_tier, 1, buf, n)
    real = os.preadv
    calls: list[int] = []
    active = [0]

    def flaky(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls.append(offset)
        active[0] += 1
        try:
            if offset == slot.offset + PAGE + 3 * PIECE:
                raise OSError(5, "Input/output error")
            return real(fd, bufs, offset)
        finally:
            active[0] -= 1

    monkeypatch.setattr(os, "preadv", flaky)
    with pytest.raises(NvmeIOError):
        await split_tier.read_into(slot, aligned_buffer(slot.slot_bytes), namespace=NS,
                                   key=key_of(1), layout_fp=LAYOUT)
    assert active[0] == 0 and len(calls) == 6          # every piece ended before the raise
    assert split_tier.counters.errors == 1
    monkeypatch.undo()
    assert await get(split_tier, slot, 1, n) == bytes(buf[:n])


async def test_cancelled_split_read_waits_for_every_piece(split_tier: NvmeTier,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancelled read re-raises CancelledError only once no thread touches ``out``."""
    rng = random.Random(23)
    n = 8 * PIECE
    buf = block(rng, n)
    slot, _ = await put(split_tier, 1, buf, n)
    real = os.preadv
    active = [0]
    started = [0]

    def slow(fd: int, bufs: list[memoryview], offset: int) -> int:
        started[0] += 1
        active[0] += 1
        try:
            time.sleep(0.02)
            return real(fd, bufs, offset)
        finally:
            active[0] -= 1

    monkeypatch.setattr(os, "preadv", slow)
    out = aligned_buffer(slot.slot_bytes)
    reader = asyncio.create_task(
        split_tier.read_into(slot, out, namespace=NS, key=key_of(1), layout_fp=LAYOUT))
    await asyncio.sleep(0.005)          # pieces are in flight
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert started[0] > 0 and active[0] == 0
    monkeypatch.undo()
    assert await get(split_tier, slot, 1, n) == bytes(buf[:n])
    assert split_tier.counters.checksum_failures == 0 and split_tier.counters.errors == 0


async def test_split_reads_on_a_saturated_pool_do_not_deadlock(tmp_path: Path,
                                                               direct: str) -> None:
    """Pieces never wait for each other: one I/O thread still finishes every split read,
    with writes and erases queued among them."""
    t = NvmeTier(tmp_path / "one", 64 * MiB, direct=direct, io_threads=1, split_bytes=PIECE)
    t.open()
    try:
        rng = random.Random(24)
        n = 6 * PIECE + 5
        stored = []
        for i in range(6):
            buf = block(rng, n)
            slot, _ = await put(t, i, buf, n)
            stored.append((slot, bytes(buf[:n])))
        datas = await asyncio.wait_for(asyncio.gather(
            *(get(t, slot, i, n) for i, (slot, _) in enumerate(stored))), timeout=30)
        assert datas == [data for _, data in stored]
        t.free(stored[0][0], erase=True)
        assert await asyncio.wait_for(get(t, stored[1][0], 1, n), timeout=30) == stored[1][1]
    finally:
        t.close()


def test_posix_frame_io_reads_and_writes_inline(tmp_path: Path) -> None:
    """PosixFrameIO (the sync FrameIO API) still moves a frame in the calling thread."""
    rng = random.Random(25)
    n = 3 * PAGE + 9
    buf = block(rng, n)
    io = PosixFrameIO()
    fd = os.open(tmp_path / "f.dat", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        header = make_header(NS, key_of(1), LAYOUT, buf[:n], seq=1)
        slot_bytes = NvmeTier.slot_bytes_for(n)
        assert io.write_frame(fd, 0, header.pack(), buf, n, slot_bytes, False, False) == (
            PAGE + slot_bytes)
        out = aligned_buffer(slot_bytes)
        back, got = io.read_frame(fd, 0, out, slot_bytes, False, NS, key_of(1), LAYOUT)
        assert back == header and got == PAGE + slot_bytes and bytes(out[:n]) == bytes(buf[:n])
    finally:
        os.close(fd)


def test_zero_io_threads_names_only_io_threads(tmp_path: Path) -> None:
    """The message blamed nvme.bytes too ("nvme.bytes must be >= 0 and nvme.io_threads
    >= 1") for a tier of 64 MiB."""
    with pytest.raises(ConfigError) as info:
        NvmeTier(tmp_path / "nvme", 64 * MiB, direct="off", io_threads=0)
    assert str(info.value) == "nvme.io_threads must be >= 1, got 0"
