"""Survivors of the tiers' mutation round: the nvme tier's frame reads and writes
(kvtier.tiers.nvme.split and frameio through ``PosixFrameIO``) on a real file, and the
tier's frame sequence numbers (``NvmeTier.next_seq``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvtier.errors import FrameError
from kvtier.frame import FrameHeader, payload_checksum
from kvtier.tiers.aligned import PAGE
from kvtier.tiers.nvme.frameio import PosixFrameIO, write_frame_sync
from kvtier.tiers.nvme.tier import NvmeTier

NS = b"n" * 16
KEY = b"k" * 16
SLOT = 8192


def test_a_slot_file_cut_short_is_never_read_from_the_callers_old_bytes(tmp_path: Path) -> None:
    """A frame read into a buffer that already holds the block (a second read of the same
    slot, in the same thread) after the file was cut, inside the payload or inside the
    header page, must fail: the bytes are not on disk any more. The checksum alone cannot
    tell, since the caller's buffer (and the thread's header page) still hold the right
    bytes. Mutant that survived: the ``payload truncated`` check of ``ReadJob._consume``
    dropped (the read then succeeded from what the previous read left in ``out``)."""
    payload = os.urandom(SLOT)
    header = FrameHeader(NS, KEY, 1, SLOT, SLOT, payload_checksum(payload))
    fd = os.open(tmp_path / "slots", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        write_frame_sync(fd, 0, header.pack(), memoryview(payload), SLOT, SLOT, False, False)
        io = PosixFrameIO()
        out = bytearray(SLOT)
        got, _ = io.read_frame(fd, 0, memoryview(out), SLOT, False, NS, KEY, 1)
        assert got.checksum == header.checksum and bytes(out) == payload
        os.ftruncate(fd, PAGE + SLOT // 2)            # half the payload gone
        with pytest.raises(FrameError):
            io.read_frame(fd, 0, memoryview(out), SLOT, False, NS, KEY, 1)
        out[:] = payload
        os.ftruncate(fd, 64)                          # inside the header page
        with pytest.raises(FrameError):
            io.read_frame(fd, 0, memoryview(out), SLOT, False, NS, KEY, 1)
    finally:
        os.close(fd)


def test_an_odirect_write_of_a_short_payload_pads_its_slot_with_zeros(tmp_path: Path) -> None:
    """An O_DIRECT write whose payload is shorter than its slot goes through a shared
    bounce buffer; the slot's padding after ``payload_len`` must be written as zeros, not
    as what the buffer held from an earlier write (another block's bytes on disk, read
    back into a reader's buffer past the payload, ``read_into`` reads whole slots).
    Mutant that survived: the padding's zeroing in ``write_frame_sync`` dropped."""
    slot = 4 * PAGE
    fd = os.open(tmp_path / "slots", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        other = b"\xaa" * slot
        old = FrameHeader(NS, b"o" * 16, 1, slot, slot, payload_checksum(other))
        for _ in range(9):   # every pooled bounce buffer of this size now holds 0xaa
            write_frame_sync(fd, 0, old.pack(), memoryview(other), slot, slot, True, False)
        short = os.urandom(100)
        header = FrameHeader(NS, KEY, 1, 100, 100, payload_checksum(short))
        offset = PAGE + slot
        write_frame_sync(fd, offset, header.pack(), memoryview(short), 100, slot, True, False)
        on_disk = os.pread(fd, slot, offset + PAGE)
        assert on_disk[:100] == short
        assert on_disk[100:] == bytes(slot - 100)
    finally:
        os.close(fd)


async def test_new_frames_are_numbered_after_every_frame_written_or_found(
        tmp_path: Path) -> None:
    """``next_seq`` stays above every ``seq`` the tier has seen, whatever the wall clock
    says: a frame written with a seq ahead of the clock (another node's clock, a clock
    stepped back) and the frames found at ``open`` after a restart. Recovery keeps the
    copy with the highest seq when a key is stored twice, so a newer write numbered lower
    would lose to the stale copy. Mutants that survived: the write not raising the tier's
    seq (``self._seq = max(self._seq, header.seq)`` dropped), and ``next_seq`` taking the
    clock alone (``max(self._seq + 1, ...)`` dropped)."""
    ahead = time.time_ns() // 1000 + 10**12          # ~11 days ahead of the clock
    payload = os.urandom(PAGE)
    tier = NvmeTier(tmp_path / "nvme", 1 << 20, direct="off", io_threads=2)
    tier.open()
    try:
        slot = tier.alloc(PAGE)
        assert slot is not None
        header = FrameHeader(NS, KEY, 1, PAGE, PAGE, payload_checksum(payload), seq=ahead)
        await tier.write(slot, header, memoryview(payload))
        assert tier.next_seq() > ahead
    finally:
        tier.close()
    again = NvmeTier(tmp_path / "nvme", 1 << 20, direct="off", io_threads=2)
    found = again.open()
    try:
        assert [h.seq for _, h in found] == [ahead]
        first = again.next_seq()
        assert ahead < first < again.next_seq()
    finally:
        again.close()


def test_a_slot_file_of_a_size_that_is_not_a_page_multiple_is_left_alone(
        tmp_path: Path) -> None:
    """``open`` adopts only slot files whose size class is a multiple of PAGE (the only
    classes kvtier makes); a file named like one but of another size (``slots-5000.dat``)
    is not the tier's: it is neither read nor cut nor removed. Mutant that survived: the
    PAGE test dropped from ``recover``'s file filter (the file was opened as a size class,
    found empty of frames and deleted)."""
    root = tmp_path / "nvme"
    root.mkdir()
    stranger = root / "slots-5000.dat"
    stranger.write_bytes(b"not a slot file" * 1000)
    tier = NvmeTier(root, 1 << 20, direct="off", io_threads=2)
    try:
        assert tier.open() == []
        assert tier.counters.checksum_failures == 0
    finally:
        tier.close()
    assert stranger.read_bytes() == b"not a slot file" * 1000
