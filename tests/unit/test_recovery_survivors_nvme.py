"""The nvme tier's start-up scan (``kvtier.tiers.nvme.recovery``), pinned where the
mutation review of warm restarts found no test: what a restart keeps, in which order, what
it drops for good (erased, so it cannot come back at a later start), and what it counts."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import pytest

from kvtier.frame import FrameHeader, make_header
from kvtier.tiers.aligned import aligned_buffer
from kvtier.tiers.nvme import PAGE, NvmeSlot, NvmeTier
from kvtier.tiers.nvme import holes as nvme_holes

NS = bytes(range(16))
LAYOUT = 0x1234_5678
SMALL = 4000                      # a 4 KiB class frame: stride 8 KiB
STRIDE = PAGE + 4096


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "little")


def tier_at(root: Path, capacity: int) -> NvmeTier:
    return NvmeTier(root, capacity, direct="off", io_threads=2)


async def put(t: NvmeTier, i: int, rng: random.Random, n: int = SMALL,
              parent: bytes | None = None) -> tuple[NvmeSlot, FrameHeader, bytes]:
    slot = t.alloc(n)
    assert slot is not None
    buf = aligned_buffer(NvmeTier.slot_bytes_for(n))
    buf[:n] = rng.randbytes(n)
    chain = None if parent is None else (parent,)
    header = make_header(NS, key_of(i), LAYOUT, buf[:n], seq=t.next_seq(), chain=chain)
    await t.write(slot, header, buf)
    return slot, header, bytes(buf[:n])


async def read(t: NvmeTier, slot: NvmeSlot, key: bytes) -> bytes:
    out = aligned_buffer(slot.slot_bytes)
    header = await t.read_into(slot, out, namespace=NS, key=key, layout_fp=LAYOUT)
    return bytes(out[: header.payload_len])


async def test_a_superseded_copy_is_erased_so_a_later_delete_is_not_undone(
        tmp_path: Path) -> None:
    """A key stored twice (old copy in slot 0, new in slot 1): the restart keeps the new
    copy and must zero the old one's header. Without the erase the old frame stays on
    disk below the tail; once the new copy is deleted, the next start serves the OLD
    bytes of a deleted block."""
    rng = random.Random(1)
    root = tmp_path / "nvme"
    t = tier_at(root, 16 * STRIDE)
    t.open()
    old = await put(t, 5, rng)
    new = await put(t, 5, rng)
    await put(t, 6, rng)              # keeps slot 0 away from the tail either way
    t.close()
    t2 = tier_at(root, 16 * STRIDE)
    found = t2.open()
    assert [(s, h.key) for s, h in found] == [(new[0], key_of(5)), (NvmeSlot(4096, 2),
                                                                     key_of(6))]
    assert t2.blocks == 2 and t2.used_bytes == 2 * STRIDE
    t2.free(new[0], erase=True)       # the block is deleted
    await t2.erased()
    t2.close()
    t3 = tier_at(root, 16 * STRIDE)
    try:
        keys = [h.key for _, h in t3.open()]
        assert keys == [key_of(6)], "a deleted block came back with its superseded bytes"
        assert old[0] == NvmeSlot(4096, 0)
    finally:
        t3.close()


async def test_frames_come_back_oldest_first_when_a_key_was_rewritten(
        tmp_path: Path) -> None:
    """The store rebuilds its LRU from this order: A, B, then A again must come back as
    B, A (by seq), not in the order of the keys' first copies."""
    rng = random.Random(2)
    root = tmp_path / "nvme"
    t = tier_at(root, 16 * STRIDE)
    t.open()
    await put(t, 1, rng)
    b = await put(t, 2, rng)
    a2 = await put(t, 1, rng)
    t.close()
    t2 = tier_at(root, 16 * STRIDE)
    try:
        found = t2.open()
        assert [(s, h) for s, h in found] == [(b[0], b[1]), (a2[0], a2[1])]
        assert [h.seq for _, h in found] == sorted(h.seq for _, h in found)
        assert await read(t2, a2[0], key_of(1)) == a2[2]
    finally:
        t2.close()


# A chain a <- b <- c and two heads d, e, each in a size class (a file) of its own, so a
# lowered capacity cuts no file unread and only the keep order decides: written d, a, b,
# c, e (seq order); kept shallowest first, among equal depths oldest first, a child only
# with its parent. Strides (header page + payload): d 20K, a 24K, b 12K, c 16K, e 8K.
SIZES = {"d": 16384, "a": 20480, "b": 8192, "c": 12288, "e": 4096}
PARENT = {"b": "a", "c": "b"}
K = 1024


@pytest.mark.parametrize(("capacity", "kept"), [
    (40 * K, "de"),    # a does not fit: b, which would, goes with its parent
    (44 * K, "da"),    # the older head first (newest first would keep e, a, b)
    (52 * K, "dae"),   # an exact fit is kept
    (60 * K, "dae"),   # heads before children (by seq alone: d, a, b)
    (80 * K, "dabce"),  # all fit: nothing dropped
])
async def test_a_lowered_capacity_keeps_shallow_old_frames_and_whole_chains(
        tmp_path: Path, capacity: int, kept: str) -> None:
    """What a restart with a lower ``nvme.bytes`` keeps: never a block whose parent it
    dropped (unreachable, yet holding room), heads before their descendants, and the
    older of equal depth; every drop counted a capacity eviction and its file removed."""
    rng = random.Random(3)
    root = tmp_path / "nvme"
    t = tier_at(root, 1 << 20)
    t.open()
    names = list(SIZES)
    frames = {}
    for n in names:
        parent = key_of(ord(PARENT[n])) if n in PARENT else None
        frames[n] = await put(t, ord(n), rng, SIZES[n], parent=parent)
    t.close()
    t2 = tier_at(root, capacity)
    try:
        found = t2.open()
        assert sorted(chr(int.from_bytes(h.key, "little")) for _, h in found) == sorted(kept)
        assert [h.seq for _, h in found] == sorted(h.seq for _, h in found)
        assert t2.counters.evictions.get("capacity", 0) == len(names) - len(kept)
        assert t2.used_bytes == t2.disk_bytes <= capacity
        assert sum(p.stat().st_size for p in root.glob("slots-*.dat")) <= capacity
        for n in kept:
            slot, _, data = frames[n]
            assert await read(t2, slot, key_of(ord(n))) == data
    finally:
        t2.close()


async def test_without_holes_a_restart_fits_the_files_spans_to_the_capacity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where holes cannot be punched, the free slot between two frames is disk too: the
    frames' footprints (28 KiB) fit the lowered capacity but the files (36 KiB) do not,
    so the newest frame goes, and the files never exceed ``nvme.bytes`` (a span counted
    one slot short kept them all, 8 KiB over)."""
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise nvme_holes.HolesUnsupported(errno.EOPNOTSUPP, "no holes here")

    rng = random.Random(4)
    root = tmp_path / "nvme"
    t = tier_at(root, 1 << 20)
    t.open()
    first = await put(t, 1, rng)
    gone = await put(t, 2, rng)
    third = await put(t, 3, rng)
    await put(t, 4, rng, 8192)        # another file: 12 KiB
    t.free(gone[0], erase=True)
    await t.erased()
    t.close()
    monkeypatch.setattr(nvme_holes, "punch_hole", unsupported)
    cap = 28 * K
    t2 = tier_at(root, cap)
    try:
        found = t2.open()
        assert [h.key for _, h in found] == [key_of(1), key_of(3)]
        assert t2.disk_bytes <= cap
        assert sum(p.stat().st_size for p in root.glob("slots-*.dat")) <= cap
        assert t2.counters.evictions.get("capacity", 0) == 1
        assert await read(t2, first[0], key_of(1)) == first[2]
        assert await read(t2, third[0], key_of(3)) == third[2]
    finally:
        t2.close()


async def test_a_header_claiming_more_than_its_slot_is_dropped_at_the_scan(
        tmp_path: Path) -> None:
    """A whole, self-consistent header page that claims a 6000-byte payload in a 4 KiB
    slot (the file is long enough, another frame follows): the scan must drop it as
    corrupt (counted, its slot free again), not index a block no read can return."""
    rng = random.Random(5)
    root = tmp_path / "nvme"
    t = tier_at(root, 16 * STRIDE)
    t.open()
    victim = await put(t, 1, rng)
    other = await put(t, 2, rng)
    t.close()
    liar = make_header(NS, key_of(1), LAYOUT, bytes(6000), seq=victim[1].seq).pack()
    with open(root / "slots-4096.dat", "r+b") as f:
        f.seek(victim[0].offset)
        f.write(liar)
    t2 = tier_at(root, 16 * STRIDE)
    try:
        assert [(s, h) for s, h in t2.open()] == [(other[0], other[1])]
        assert t2.counters.checksum_failures == 1
        assert t2.blocks == 1 and t2.alloc(SMALL) == victim[0]
    finally:
        t2.close()


async def test_a_rewrite_after_a_restart_outranks_frames_with_seqs_ahead_of_the_clock(
        tmp_path: Path) -> None:
    """Frames whose seq is ahead of this start's clock (the clock stepped back, or frames
    from a host ahead of it): the restarted tier's seqs must go on above the highest seq
    on disk, or a key rewritten now loses to its old copy at the next start."""
    rng = random.Random(6)
    root = tmp_path / "nvme"
    t = tier_at(root, 16 * STRIDE)
    t.open()
    ahead = t.next_seq() + 10**12
    for i, seq in ((1, 10), (2, ahead)):
        slot = t.alloc(SMALL)
        assert slot is not None
        buf = aligned_buffer(4096)
        buf[:SMALL] = rng.randbytes(SMALL)
        await t.write(slot, make_header(NS, key_of(i), LAYOUT, buf[:SMALL], seq=seq), buf)
    t.close()
    t2 = tier_at(root, 16 * STRIDE)
    t2.open()
    try:
        assert t2.next_seq() > ahead
        new = await put(t2, 2, rng)
    finally:
        t2.close()
    t3 = tier_at(root, 16 * STRIDE)
    try:
        found = {h.key: s for s, h in t3.open()}
        assert found[key_of(2)] == new[0]
        assert await read(t3, new[0], key_of(2)) == new[2]
    finally:
        t3.close()
