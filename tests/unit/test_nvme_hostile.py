"""NvmeTier against hostile or odd files at start (issue: nvme audit): real files, real tmpfs.

Alias names of a size class, stale duplicates and capacity drops that must not come back,
a lowered capacity that keeps chain heads, a slot file far larger than the capacity, the
O_DIRECT probe on a full disk and next to a planted symlink.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import StartupError
from kvtier.frame import make_header
from kvtier.tiers.aligned import aligned_buffer
from kvtier.tiers.nvme import PAGE, NvmeSlot, NvmeTier
from kvtier.tiers.nvme.probe import choose_direct
from tests.support.small_fs import small_tmpfs

NS = bytes(range(16))
LAYOUT_FP = 0x1234_5678
MiB = 1 << 20


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int, n: int) -> memoryview:
    buf = aligned_buffer(NvmeTier.slot_bytes_for(n))
    buf[:n] = bytes([i % 251 + 1]) * n
    return buf


async def put(t: NvmeTier, i: int, n: int, parent: int | None = None) -> NvmeSlot:
    """Write block ``i`` (``n`` bytes; ``parent``: its parent's number in the chain)."""
    slot = t.alloc(n)
    assert slot is not None
    buf = payload(i, n)
    chain = (None if parent is None else key_of(parent),)
    await t.write(slot, make_header(NS, key_of(i), LAYOUT_FP, buf[:n], seq=t.next_seq(),
                                    chain=chain), buf)
    return slot


def reopen(t: NvmeTier, capacity: int) -> tuple[NvmeTier, list[bytes]]:
    """Close ``t`` and start a tier on its directory (a daemon restart); the keys it found."""
    t.close()
    fresh = NvmeTier(t.root, capacity, direct="off")
    return fresh, [h.key for _, h in fresh.open()]


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[NvmeTier]:
    t = NvmeTier(tmp_path / "nvme", 64 * MiB, direct="off")
    t.open()
    yield t
    t.close()


async def test_a_size_class_file_name_with_leading_zeros_is_ignored(tier: NvmeTier) -> None:
    """``slots-04096.dat`` is no second file of the 4 KiB class: reading it as one freed the
    real file's stored slots for reuse (and leaked its descriptor)."""
    slots = [await put(tier, i, PAGE) for i in range(3)]
    tier.close()
    shutil.copy(tier.root / "slots-4096.dat", tier.root / "slots-04096.dat")
    t2 = NvmeTier(tier.root, 64 * MiB, direct="off")
    try:
        assert sorted(h.key for _, h in t2.open()) == [key_of(i) for i in range(3)]
        assert t2.blocks == 3 and t2.used_bytes == 3 * 2 * PAGE
        fresh = t2.alloc(PAGE)
        assert fresh is not None and fresh not in slots   # no stored slot is handed out
    finally:
        t2.close()


async def test_a_stale_duplicate_does_not_come_back_after_a_delete(tier: NvmeTier) -> None:
    """The older of two copies of a key, released at start, is erased: deleting the newer
    copy later must not bring the old one back at the next start."""
    await put(tier, 5, 3000)
    newer = await put(tier, 5, 3000)
    t2, found = reopen(tier, 64 * MiB)
    assert found == [key_of(5)]
    t2.free(newer, erase=True)         # an explicit delete
    t3, found = reopen(t2, 64 * MiB)
    t3.close()
    assert found == []


async def test_lower_capacity_keeps_chain_heads_and_drops_for_good(tier: NvmeTier) -> None:
    """Lowered capacity: the deepest blocks go first and a kept block's parent is always
    kept (dropping the oldest dropped the heads and orphaned every chain); the files are
    trimmed to the capacity, and what was dropped stays dropped with the old capacity."""
    small, big = 3 * (PAGE + 4096), 64 * MiB
    # 4 KiB class: E (child of D1, written first), P (head), C1 (child of P);
    # 8 KiB class: Q (head), D1 (child of Q). E lies below P: dropping it needs an erase.
    e, p, c1, q, d1 = 10, 11, 12, 13, 14
    await put(tier, e, 4096, parent=d1)
    await put(tier, p, 4096)
    await put(tier, c1, 4096, parent=p)
    await put(tier, q, 8192)
    await put(tier, d1, 8192, parent=q)
    small_cap = small + (PAGE + 8192)
    t2, found = reopen(tier, small_cap)
    try:
        assert sorted(found) == [key_of(p), key_of(c1), key_of(q)]
        assert t2.used_bytes <= t2.disk_bytes <= small_cap
        on_disk = sum(f.stat().st_size for f in tier.root.glob("slots-*.dat"))
        assert on_disk <= small_cap
        assert t2.counters.evictions.get("capacity") == 2
    finally:
        t3, found = reopen(t2, big)
        t3.close()
    assert sorted(found) == [key_of(p), key_of(c1), key_of(q)]


async def test_start_reads_no_more_than_the_capacity(tier: NvmeTier,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot file far larger than ``nvme.bytes`` (here a sparse GiB): the scan reads what
    can be kept, not the file, and the file is cut to what it holds."""
    await put(tier, 1, PAGE)
    tier.close()
    path = tier.root / "slots-4096.dat"
    with open(path, "r+b") as f:
        f.truncate(1 << 30)
    read = 0
    real_preadv = os.preadv

    def counting_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        nonlocal read
        got = real_preadv(fd, buffers, offset)
        read += got
        return got

    monkeypatch.setattr(os, "preadv", counting_preadv)
    t0 = time.monotonic()
    t2 = NvmeTier(tier.root, MiB, direct="off")
    try:
        assert [h.key for _, h in t2.open()] == [key_of(1)]
        took = time.monotonic() - t0
        assert read <= MiB, f"the scan read {read} bytes for a 1 MiB tier"
        assert path.stat().st_size == 2 * PAGE and t2.disk_bytes == 2 * PAGE
        assert took < 2.0
    finally:
        t2.close()


def test_full_disk_keeps_o_direct_for_auto_and_says_full_for_on(tmp_path: Path) -> None:
    """ENOSPC in the O_DIRECT probe says nothing about O_DIRECT: ``auto`` keeps it (it used
    to fall back to buffered I/O for the whole run), ``on`` names the full disk."""
    with small_tmpfs(tmp_path / "fs", MiB) as fs:
        root = fs / "nvme"
        root.mkdir()
        probe = aligned_buffer(PAGE)
        try:   # this kernel's tmpfs must take O_DIRECT for the test to mean anything
            fd = os.open(fs / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            os.pwritev(fd, [probe], 0)
            os.close(fd)
            os.unlink(fs / "probe")
        except OSError as exc:
            pytest.skip(f"tmpfs here does not take O_DIRECT: {exc.strerror}")
        with open(fs / "ballast", "wb", buffering=0) as ballast, \
                contextlib.suppress(OSError):   # to the last page
            while ballast.write(b"x" * PAGE):
                pass
        assert choose_direct(root, "auto") is True
        with pytest.raises(StartupError, match=r"nvme\.direct=on .* file system is full"):
            choose_direct(root, "on")
        t = NvmeTier(root, MiB, direct="auto")
        try:
            t.open()
            assert t.direct
        finally:
            t.close()


def test_probe_never_opens_a_planted_name(tmp_path: Path) -> None:
    """The O_DIRECT probe file used a predictable name with O_CREAT | O_TRUNC: a symlink
    planted there had its target truncated. Now a random name, O_EXCL | O_NOFOLLOW."""
    root = tmp_path / "nvme"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 512)
    planted = root / f".odirect-probe-{os.getpid()}-{threading.get_ident()}"
    planted.symlink_to(victim)
    choose_direct(root, "auto")
    assert victim.read_bytes() == b"precious" * 512
    assert [p.name for p in root.iterdir()] == [planted.name]   # its own file is gone
