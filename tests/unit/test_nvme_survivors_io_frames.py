"""Mutation review of the nvme tier's frame I/O, bounce buffers and O_DIRECT probe
(``kvtier.tiers.nvme.frameio``, ``buffers``, ``probe``): real files under ``tmp_path``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError, FrameError
from kvtier.frame import FrameHeader, payload_checksum
from kvtier.tiers.aligned import PAGE, aligned_buffer, is_aligned
from kvtier.tiers.nvme import buffers, frameio, probe
from kvtier.tiers.nvme.backends import select_nvme_backend
from kvtier.tiers.nvme.buffers import BouncePool
from kvtier.tiers.nvme.frameio import PosixFrameIO, write_frame_sync

NS = b"n" * 16
KEY = b"k" * 16
SLOT = 2 * PAGE


def _slots(tmp_path: Path) -> int:
    return os.open(tmp_path / "slots", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def test_a_frame_read_under_another_key_fails_its_check(tmp_path: Path) -> None:
    """``read_frame`` must check the key it was asked for: a slot reused by (or holding)
    another block would otherwise be served as this one's bytes. Mutant that survived:
    ``PosixFrameIO.read_frame`` passed ``key=None`` to its ReadJob (no key check)."""
    payload = os.urandom(SLOT)
    header = FrameHeader(NS, b"o" * 16, 1, SLOT, SLOT, payload_checksum(payload))
    fd = _slots(tmp_path)
    try:
        write_frame_sync(fd, 0, header.pack(), memoryview(payload), SLOT, SLOT, False, False)
        out = memoryview(bytearray(SLOT))
        with pytest.raises(FrameError):
            PosixFrameIO().read_frame(fd, 0, out, SLOT, False, NS, KEY, 1)
    finally:
        os.close(fd)


def test_an_odirect_write_of_an_unaligned_full_payload_goes_through_an_aligned_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT needs page-aligned memory: a payload that covers its slot but does not start
    on a page boundary must be copied to a bounce buffer (the kernel answers EINVAL
    otherwise, every such write failing). Mutant that survived: the alignment test of
    ``write_frame_sync`` dropped (the unaligned payload handed to ``pwritev`` as is)."""
    seen: list[bool] = []
    real = os.pwritev

    def spy(fd: int, bufs: list[Any], offset: int) -> int:
        seen.extend(is_aligned(memoryview(b)) for b in bufs)
        return real(fd, bufs, offset)

    monkeypatch.setattr(frameio.os, "pwritev", spy)
    raw = aligned_buffer(SLOT + 8)
    payload = raw[8:]
    payload[:] = os.urandom(SLOT)
    header = FrameHeader(NS, KEY, 1, SLOT, SLOT, payload_checksum(payload))
    fd = _slots(tmp_path)
    try:
        write_frame_sync(fd, 0, header.pack(), payload, SLOT, SLOT, True, False)
        assert seen == [True, True]
        assert os.pread(fd, SLOT, PAGE) == bytes(payload)
    finally:
        os.close(fd)


def test_a_buffered_write_of_a_short_payload_writes_only_its_bytes(tmp_path: Path) -> None:
    """Without O_DIRECT a payload view longer than ``payload_len`` (but shorter than its
    slot) writes ``payload_len`` bytes, never the caller's trailing bytes. Mutant that
    survived: the buffered branch sliced ``payload[:slot_bytes]``."""
    payload = memoryview(os.urandom(SLOT - 10))
    header = FrameHeader(NS, KEY, 1, 100, 100, payload_checksum(payload[:100]))
    fd = _slots(tmp_path)
    try:
        written = write_frame_sync(fd, 0, header.pack(), payload, 100, SLOT, False, False)
        assert written == PAGE + 100
        assert os.fstat(fd).st_size == PAGE + 100
    finally:
        os.close(fd)


def test_a_synced_write_calls_fdatasync_and_an_unsynced_one_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sync=True`` (nvme.sync_writes) must reach the disk before the write reports done.
    Mutant that survived: the ``fdatasync`` after the write dropped."""
    synced: list[int] = []
    monkeypatch.setattr(frameio.os, "fdatasync", synced.append)
    payload = memoryview(os.urandom(SLOT))
    header = FrameHeader(NS, KEY, 1, SLOT, SLOT, payload_checksum(payload))
    fd = _slots(tmp_path)
    try:
        write_frame_sync(fd, 0, header.pack(), payload, SLOT, SLOT, False, False)
        assert synced == []
        write_frame_sync(fd, 0, header.pack(), payload, SLOT, SLOT, False, True)
        assert synced == [fd]
    finally:
        os.close(fd)


def test_a_bounce_buffer_goes_back_to_the_pool_after_the_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every O_DIRECT write of a short payload takes a bounce buffer; dropping it instead of
    giving it back allocates a fresh slot-sized buffer for every such write. Mutant that
    survived: ``bounces.give`` in ``write_frame_sync`` dropped."""
    pool = BouncePool()
    monkeypatch.setattr(frameio, "bounces", pool)
    short = memoryview(os.urandom(100))
    header = FrameHeader(NS, KEY, 1, 100, 100, payload_checksum(short))
    fd = _slots(tmp_path)
    try:
        write_frame_sync(fd, 0, header.pack(), short, 100, SLOT, True, False)
    finally:
        os.close(fd)
    assert len(pool._free) == 1 and len(pool._free[0]) >= SLOT


def test_the_bounce_pool_hands_each_buffer_out_once_and_keeps_at_most_keep() -> None:
    """Two threads must never share a bounce buffer (one's payload would be written under
    the other's header), and the pool must neither grow without bound nor keep nothing.
    Mutants that survived: ``take`` returned ``_free[i]`` without popping it; ``give`` kept
    every buffer; ``give`` kept none."""
    pool = BouncePool(keep=2)
    bufs = [pool.take(PAGE) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert len(pool._free) == 2
    a, b = pool.take(PAGE), pool.take(PAGE)
    assert a is not b and a.obj is not b.obj
    assert len(pool._free) == 0
    assert is_aligned(a) and len(buffers.ZERO_PAGE) == PAGE


def test_the_probe_refuses_an_o_direct_read_back_of_other_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that accepts O_DIRECT but returns other bytes must not be used with it.
    Mutant that survived: the read-back comparison of ``probe_direct`` dropped."""
    real = os.preadv

    def garbling(fd: int, bufs: list[Any], offset: int) -> int:
        n = real(fd, bufs, offset)
        bufs[0][0] ^= 0xFF
        return n

    monkeypatch.setattr(probe.os, "preadv", garbling)
    why = probe.probe_direct(tmp_path)
    if why is not None and "O_DIRECT failed" in why:
        pytest.skip(f"no O_DIRECT under {tmp_path}: {why}")
    assert why == "O_DIRECT read back different bytes"
    assert os.listdir(tmp_path) == []


def test_the_probe_opens_with_o_direct_excl_nofollow_and_closes_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe must test O_DIRECT itself (else tmpfs passes and every slot open then
    fails), never follow a planted symlink, and close its descriptor (a leak per start).
    Mutants that survived: O_DIRECT, O_NOFOLLOW dropped from the open; ``os.close`` dropped."""
    flags: list[int] = []
    opened: list[int] = []
    closed: list[int] = []
    real_open, real_close = os.open, os.close

    def spy_open(path: Any, fl: int, mode: int = 0o777) -> int:
        flags.append(fl)
        fd = real_open(path, fl, mode)
        opened.append(fd)
        return fd

    def spy_close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    monkeypatch.setattr(probe.os, "open", spy_open)
    monkeypatch.setattr(probe.os, "close", spy_close)
    try:
        probe.probe_direct(tmp_path)
    finally:
        monkeypatch.undo()
    assert len(flags) == 1
    for flag in (os.O_DIRECT, os.O_NOFOLLOW, os.O_EXCL, os.O_CREAT):
        assert flags[0] & flag
    assert closed == opened
    assert os.listdir(tmp_path) == []


def test_the_probe_pattern_is_not_all_zeros(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that moves no data leaves the zeroed read buffer as it was: the probe writes a
    pattern so that such a read is caught. Mutant that survived: the pattern dropped (an
    all-zero page, equal to a read that did nothing)."""
    monkeypatch.setattr(probe.os, "preadv", lambda fd, bufs, offset: PAGE)
    why = probe.probe_direct(tmp_path)
    if why is not None and "O_DIRECT failed" in why:
        pytest.skip(f"no O_DIRECT under {tmp_path}: {why}")
    assert why == "O_DIRECT read back different bytes"


def test_an_empty_backend_name_is_refused() -> None:
    """Mutant that survived: ``select_nvme_backend`` accepted a value outside BACKENDS."""
    with pytest.raises(ConfigError):
        select_nvme_backend("")
