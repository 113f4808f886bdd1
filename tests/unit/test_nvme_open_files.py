"""The nvme tier's slot file descriptors are bounded: blocks of many sizes (one file per
4 KiB size class) kept one descriptor open per size for the daemon's life. Now at most
``max_open_files`` stay open, a closed file is reopened through the first open's trust
checks (and must be the same file), a descriptor handed to an I/O thread is never closed
under it, and a class cut to nothing is dropped with its file."""

from __future__ import annotations

import asyncio
import os
import random
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.daemon.metrics import KVTierCollector
from kvtier.errors import ConfigError, FrameError
from kvtier.frame import HEADER_SIZE, make_header
from kvtier.tiers.nvme import PAGE, NvmeIOError, NvmeSlot, NvmeTier, PosixFrameIO
from kvtier.tiers.nvme.kvikio_io import KvikioFileIO
from tests.support.fake_gpu_libs import FakeCuFile, fake_kvikio
from tests.unit.test_nvme_tier import LAYOUT, NS, block, get, key_of, put

MiB = 1 << 20
DEFAULT_LIMIT = 32   # kvtier.tiers.nvme.files.MAX_OPEN_FILES


def open_paths() -> set[str]:
    """What this process's open descriptors point at."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            continue
    return out


def slot_fds(root: Path) -> list[str]:
    """What this process's open descriptors on ``root``'s slot files point at."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(f"{root}/slots-"):
            out.append(target)
    return out


def sized(i: int) -> int:
    """A payload length of size class ``i + 1`` pages."""
    return (i + 1) * PAGE - 100


@pytest.fixture
def rng() -> random.Random:
    return random.Random(11)


async def test_blocks_of_many_sizes_keep_a_bounded_number_of_files_open(
        tmp_path: Path, rng: random.Random) -> None:
    root = tmp_path / "nvme"
    t = NvmeTier(root, 256 * MiB, direct="off", io_threads=4)
    assert t.open() == []
    data, slots = {}, {}
    for i in range(3 * DEFAULT_LIMIT):                  # 96 size classes
        data[i] = block(rng, sized(i))
        slots[i], _ = await put(t, i, data[i], sized(i))
        assert len(slot_fds(root)) <= DEFAULT_LIMIT
    assert len(list(root.glob("slots-*.dat"))) == 3 * DEFAULT_LIMIT
    for i in reversed(range(3 * DEFAULT_LIMIT)):        # every file reopened as it is read
        assert await get(t, slots[i], i, sized(i)) == bytes(data[i][:sized(i)])
        assert len(slot_fds(root)) <= DEFAULT_LIMIT
    assert t.open_files == len(slot_fds(root)) <= DEFAULT_LIMIT
    assert t.counters.errors == 0
    t.close()
    assert slot_fds(root) == []
    again = NvmeTier(root, 256 * MiB, direct="off", io_threads=4)
    kept = again.open()                                 # the scan holds one file at a time
    assert sorted(s.slot_bytes for s, _ in kept) == sorted(s.slot_bytes for s in slots.values())
    assert len(slot_fds(root)) <= DEFAULT_LIMIT
    i = 5
    assert await get(again, slots[i], i, sized(i)) == bytes(data[i][:sized(i)])
    again.close()


class GatedIO(PosixFrameIO):
    """Writes to ``hold``'s size class wait for ``gate``; what their descriptor named then
    is kept in ``seen``."""

    def __init__(self, hold: int) -> None:
        super().__init__("test")
        self.hold = hold
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.seen: list[str] = []

    def write_frame(self, fd: int, offset: int, packed: bytes, payload: memoryview,
                    payload_len: int, slot_bytes: int, direct: bool, sync: bool) -> int:
        if slot_bytes == self.hold:
            self.entered.set()
            assert self.gate.wait(10)
            self.seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return super().write_frame(fd, offset, packed, payload, payload_len, slot_bytes,
                                   direct, sync)


async def test_a_descriptor_in_use_by_io_is_not_closed(tmp_path: Path,
                                                       rng: random.Random) -> None:
    """With one descriptor allowed, a write waiting in its thread and an erase queued
    behind it keep their file open while other sizes come and go; both then land in the
    right file."""
    root = tmp_path / "nvme"
    io = GatedIO(hold=PAGE)
    t = NvmeTier(root, 64 * MiB, direct="off", io_threads=4, io=io, max_open_files=1)
    t.open()
    try:
        await _in_use(t, io, root, rng)
    finally:
        io.gate.set()   # (a failure must not leave a thread at the gate)
        t.close()


async def _in_use(t: NvmeTier, io: GatedIO, root: Path, rng: random.Random) -> None:
    first = block(rng, 1000)
    write = asyncio.ensure_future(put(t, 0, first, 1000))
    assert await asyncio.get_running_loop().run_in_executor(None, io.entered.wait, 10)
    second = t.alloc(1000)                              # the same file, a second slot
    assert second is not None
    header = make_header(NS, key_of(1), LAYOUT, first[:1000], seq=t.next_seq())
    abandoned = asyncio.ensure_future(t.write(second, header, first))
    await asyncio.sleep(0.05)                           # (its thread waits at the gate too)
    t.free(second, erase=True)                          # its erase queues behind that write
    others = {}
    for i in range(2, 8):                               # other sizes, each needing its file
        others[i] = block(rng, sized(i))
        slot, _ = await put(t, i, others[i], sized(i))
        assert await get(t, slot, i, sized(i)) == bytes(others[i][:sized(i)])
        held = slot_fds(root)
        assert len(held) == 2 and f"{root}/slots-{PAGE}.dat" in held
    io.gate.set()
    slot0, _ = await write
    await abandoned
    await t.erased()
    assert io.seen == [f"{root}/slots-{PAGE}.dat"] * 2
    assert await get(t, slot0, 0, 1000) == bytes(first[:1000])
    with open(root / f"slots-{PAGE}.dat", "rb") as f:
        f.seek(second.offset)
        assert f.read(HEADER_SIZE) == bytes(HEADER_SIZE)
    assert len(slot_fds(root)) == 1 and t.counters.errors == 0


async def test_a_reopen_refuses_what_the_first_open_refuses(tmp_path: Path,
                                                            rng: random.Random) -> None:
    """A file closed to stay within the limit and then replaced (a planted symlink, a
    second hard link, a group-writable mode, another file under its name) is refused at
    its reopen: a counted I/O error, nothing read or written through it. Put back, it
    serves again."""
    root = tmp_path / "nvme"
    t = NvmeTier(root, 64 * MiB, direct="off", io_threads=2, max_open_files=1)
    t.open()
    data = block(rng, 3000)
    slot, _ = await put(t, 0, data, 3000)
    other = block(rng, sized(3))
    await put(t, 1, other, sized(3))                    # closes the first file
    path = root / f"slots-{slot.slot_bytes}.dat"
    assert slot_fds(root) == [f"{root}/slots-{4 * PAGE}.dat"]
    aside, victim = tmp_path / "aside.dat", tmp_path / "victim"
    victim.write_bytes(b"v" * (4 * PAGE))
    victim.chmod(0o600)
    os.rename(path, aside)

    async def refused() -> None:
        errors = t.counters.errors
        with pytest.raises(NvmeIOError):
            await get(t, slot, 0, 3000)
        new = t.alloc(3000)
        assert new is not None
        with pytest.raises(NvmeIOError):
            await t.write(new, make_header(NS, key_of(9), LAYOUT, data[:3000]), data)
        t.free(new)
        assert t.counters.errors == errors + 2
        assert open_paths().isdisjoint({str(path), str(victim)})
        assert victim.read_bytes() == b"v" * (4 * PAGE)

    path.symlink_to(victim)                             # planted symlink
    await refused()
    path.unlink()
    os.rename(aside, path)
    second_name = tmp_path / "second-link"
    os.link(path, second_name)                          # another name shares its bytes
    await refused()
    second_name.unlink()
    path.chmod(0o660)                                   # others may write it
    await refused()
    path.chmod(0o600)
    os.rename(path, aside)
    path.write_bytes(aside.read_bytes())                # the same bytes, another file
    path.chmod(0o600)
    await refused()
    path.unlink()
    os.rename(aside, path)                              # the file itself is back
    assert await get(t, slot, 0, 3000) == bytes(data[:3000])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    t.close()


async def test_a_class_cut_to_nothing_is_dropped_with_its_file(tmp_path: Path,
                                                               rng: random.Random) -> None:
    """Once a size class holds no slot and room is needed, its file is cut to nothing: the
    file goes and its descriptor is closed. At a start, a slot file without a frame goes."""
    root = tmp_path / "nvme"
    t = NvmeTier(root, 4 * 2 * PAGE, direct="off", io_threads=2)
    t.open()
    small = [(await put(t, i, block(rng, 100), 100))[0] for i in range(2)]
    for slot in small:
        t.free(slot)                                    # evicted: the frames stay on disk
    assert (root / f"slots-{PAGE}.dat").exists()
    big = t.alloc(5 * PAGE)                             # needs the 4 KiB file's disk
    assert big is not None and big.slot_bytes == 5 * PAGE
    assert not (root / f"slots-{PAGE}.dat").exists()
    assert f"{root}/slots-{PAGE}.dat" not in " ".join(slot_fds(root))
    payload = block(rng, 5 * PAGE)
    await t.write(big, make_header(NS, key_of(7), LAYOUT, payload[:5 * PAGE], seq=1), payload)
    again = t.alloc(100)                                # a new file for that size
    assert again == NvmeSlot(PAGE, 0) and (root / f"slots-{PAGE}.dat").exists()
    t.free(again)
    t.close()
    empty = root / f"slots-{3 * PAGE}.dat"
    empty.write_bytes(b"")
    empty.chmod(0o600)
    fresh = NvmeTier(root, 4 * 2 * PAGE, direct="off", io_threads=2)
    kept = fresh.open()
    assert [s for s, _ in kept] == [NvmeSlot(5 * PAGE, 0)]
    assert not empty.exists()
    assert sorted(p.name for p in root.glob("slots-*.dat")) == [f"slots-{5 * PAGE}.dat"]
    fresh.close()


@pytest.fixture
def cufiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeCuFile]]:
    opened: list[FakeCuFile] = []
    monkeypatch.setattr(FakeCuFile, "opened", opened)
    monkeypatch.setattr(FakeCuFile, "fail", None)
    yield opened


async def test_kvikio_handles_follow_the_descriptors(tmp_path: Path, rng: random.Random,
                                                     cufiles: list[FakeCuFile]) -> None:
    io = KvikioFileIO("test", kvikio_module=fake_kvikio(compat=True))
    t = NvmeTier(tmp_path / "nvme", 64 * MiB, direct="off", io=io, max_open_files=2)
    t.open()
    blocks = {i: block(rng, sized(i)) for i in range(5)}
    slots = {i: (await put(t, i, blocks[i], sized(i)))[0] for i in blocks}
    for _ in range(2):
        for i in blocks:
            assert await get(t, slots[i], i, sized(i)) == bytes(blocks[i][:sized(i)])
            assert sum(not h.closed for h in cufiles) <= 2
    assert len(cufiles) > 5                             # closed, and opened again
    t.close()
    assert all(h.closed for h in cufiles)


def test_max_open_files_must_leave_one_open(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_open_files"):
        NvmeTier(tmp_path, MiB, max_open_files=0)


async def test_a_slot_file_removed_while_closed_is_made_again(tmp_path: Path,
                                                              rng: random.Random) -> None:
    """The user's clean-up (or a tmp reaper) removed a slot file while the cap had closed
    its descriptor: every later write of that size failed for the daemon's life, its slots
    and disk budget held (found by review). The file is made again, empty: its old blocks
    read as misses (never other bytes), new ones are written and read back."""
    root = tmp_path / "nvme"
    t = NvmeTier(root, 16 * MiB, direct="off", max_open_files=1)
    assert t.open() == []
    old = block(rng, sized(0))
    old_slot, _ = await put(t, 0, old, sized(0))
    await put(t, 1, block(rng, sized(1)), sized(1))   # closes the first size's file
    assert str(root / "slots-4096.dat") not in slot_fds(root)
    (root / "slots-4096.dat").unlink()
    fresh = {i: block(rng, sized(0)) for i in range(2, 10)}
    slots = {i: (await put(t, i, fresh[i], sized(0)))[0] for i in fresh}
    for i, slot in slots.items():
        assert await get(t, slot, i, sized(0)) == bytes(fresh[i][:sized(0)])
    with pytest.raises(FrameError):   # the lost block: no frame there, never bytes
        await get(t, old_slot, 0, sized(0))
    assert (root / "slots-4096.dat").exists()
    t.close()


async def test_the_descriptor_bound_shows_in_stats_and_metrics(tmp_path: Path,
                                                               rng: random.Random) -> None:
    """What the bound costs is visible to operators: open descriptors, closes and reopens
    are in the tier's stats and exported as ``kvtier_nvme_*`` series."""
    t = NvmeTier(tmp_path / "nvme", 64 * MiB, direct="off", max_open_files=2)
    t.open()
    blocks = {i: block(rng, sized(i)) for i in range(4)}
    slots = {i: (await put(t, i, blocks[i], sized(i)))[0] for i in blocks}
    for i in blocks:                                    # 0 and 1 were closed: reopened
        assert await get(t, slots[i], i, sized(i)) == bytes(blocks[i][:sized(i)])
    extra = t.stats_extra()
    assert extra["open_files"] == len(slot_fds(tmp_path / "nvme")) == 2
    assert extra["file_reopens"] >= 2 and extra["file_closes"] >= 4
    series = {s.name: s.value for fam in KVTierCollector(lambda: {"tiers": {"nvme": extra}})
              .collect() for s in fam.samples if s.name.startswith("kvtier_nvme_")}
    assert series == {"kvtier_nvme_open_files": 2.0,
                      "kvtier_nvme_file_reopens_total": float(extra["file_reopens"]),
                      "kvtier_nvme_file_closes_total": float(extra["file_closes"])}
    t.close()
