"""Mutation review of the nvme tier's write health (``kvtier.tiers.nvme.health``) and its
directory lock (``kvtier.tiers.nvme.lock``): real files under ``tmp_path``."""

from __future__ import annotations

import asyncio
import errno
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvtier.backoff import BackoffPolicy
from kvtier.errors import StartupError
from kvtier.tiers.aligned import PAGE
from kvtier.tiers.nvme import health
from kvtier.tiers.nvme.health import PROBE_MAX_BYTES, NvmeHealth, WriteHealth, probe_space_sync
from kvtier.tiers.nvme.lock import LOCK_NAME, lock_nvme_dir

FAST = BackoffPolicy(base_s=0.001, cap_s=0.002)


def fds() -> set[str]:
    """This process's open descriptor numbers."""
    return set(os.listdir("/proc/self/fd"))


def test_a_read_only_file_system_degrades_the_tier() -> None:
    """EROFS (a disk remounted read-only after errors) must degrade the tier like a full
    disk, not fail each write against the disk forever. Mutant that survived: EROFS
    dropped from ``DEGRADING_ERRNOS``."""
    assert errno.EROFS in health.DEGRADING_ERRNOS
    assert errno.EPERM not in health.DEGRADING_ERRNOS


def test_the_space_probe_allocates_syncs_and_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe must ask for as much space as the failed write (a one-page probe succeeds
    on a disk that still cannot take the block, and the tier flaps), sync it, and leave no
    file or descriptor behind. Mutants that survived: fallocate of PAGE only; fdatasync
    dropped; the unlink dropped; the close dropped."""
    lengths: list[int] = []
    synced: list[int] = []
    real_fallocate, real_sync = os.posix_fallocate, os.fdatasync

    def spy_fallocate(fd: int, offset: int, length: int) -> None:
        lengths.append(length)
        real_fallocate(fd, offset, length)

    def spy_sync(fd: int) -> None:
        synced.append(fd)
        real_sync(fd)

    monkeypatch.setattr(health.os, "posix_fallocate", spy_fallocate)
    monkeypatch.setattr(health.os, "fdatasync", spy_sync)
    before = fds()
    probe_space_sync(tmp_path, 5 * PAGE)
    probe_space_sync(tmp_path, 10)
    assert lengths == [5 * PAGE, PAGE]
    assert len(synced) == 2
    assert fds() == before
    assert os.listdir(tmp_path) == []


async def _degrade(h: WriteHealth, nbytes: int, err: int = errno.ENOSPC) -> bool:
    return h.write_failed(OSError(err, os.strerror(err)), nbytes)


@pytest.mark.parametrize(("nbytes", "probe"), [(3 * PAGE, 3 * PAGE), (10, PAGE),
                                               (2 * PROBE_MAX_BYTES, PROBE_MAX_BYTES)])
async def test_the_probe_is_as_large_as_the_failed_write_up_to_its_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int, probe: int) -> None:
    """A restore must mean the failed write would fit (probe of its size), but a huge block
    must not make each probe allocate gigabytes. Mutants that survived: the probe size not
    capped at PROBE_MAX_BYTES; the probe size fixed at one page."""
    asked: list[int] = []
    monkeypatch.setattr(health, "probe_space_sync", lambda root, n: asked.append(n))
    h = WriteHealth(tmp_path, FAST)
    with ThreadPoolExecutor(1) as pool:
        h.pool = pool
        assert await _degrade(h, nbytes)
        for _ in range(500):
            if h.accepting:
                break
            await asyncio.sleep(0.002)
    assert h.accepting and asked == [probe]
    h.close()


async def test_a_second_failure_while_degraded_is_not_a_second_degradation(
        tmp_path: Path) -> None:
    """Writes already in flight fail one after another on a full disk: only the first
    degrades (one log line, one probe loop). Mutant that survived: the DEGRADED early
    return of ``write_failed`` dropped (each failure counted and a probe task started)."""
    h = WriteHealth(tmp_path, BackoffPolicy(base_s=30.0, cap_s=30.0))
    assert await _degrade(h, PAGE)
    task = h._task
    assert await _degrade(h, 2 * PAGE, errno.EIO)
    assert h.counters.degradations == 1 and h._task is task
    assert h.reason.startswith("ENOSPC")
    assert not await _degrade(h, PAGE, errno.EBADF)
    h.close()
    assert task is not None
    await asyncio.sleep(0)
    assert task.cancelled()


async def test_close_stops_the_probe_loop(tmp_path: Path) -> None:
    """A closing tier must stop its probe task (else it probes the directory of a closed
    tier until the loop ends). Mutant that survived: ``close`` dropped the cancel."""
    h = WriteHealth(tmp_path, BackoffPolicy(base_s=30.0, cap_s=30.0))
    await _degrade(h, PAGE)
    task = h._task
    assert task is not None
    h.close()
    await asyncio.sleep(0)
    assert task.cancelled() and h._task is None


async def test_a_success_while_degraded_does_not_restart_the_backoff(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that was in flight when the disk filled may still succeed; that must not
    reset the probe backoff (the full disk would be probed at the base rate). After the
    restore a success does reset it. Mutant that survived: ``write_ok`` reset always."""
    fail = [True]

    def probe(root: Path, n: int) -> None:
        if fail[0]:
            raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(health, "probe_space_sync", probe)
    h = WriteHealth(tmp_path, FAST)
    with ThreadPoolExecutor(1) as pool:
        h.pool = pool
        await _degrade(h, PAGE)
        while h.counters.space_probes < 3:
            await asyncio.sleep(0.002)
        h.write_ok()
        assert h._backoff.attempts >= 3
        fail[0] = False
        while not h.accepting:
            await asyncio.sleep(0.002)
    h.write_ok()
    assert h._backoff.attempts == 0


async def test_the_probe_loop_ends_when_the_pool_is_shut_down(tmp_path: Path) -> None:
    """A tier closing with its pool shut down ends the probe loop; it must not spin on
    RuntimeError forever. Mutant that survived: ``except RuntimeError`` continued."""
    h = WriteHealth(tmp_path, FAST)
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    h.pool = pool
    await _degrade(h, PAGE)
    task = h._task
    assert task is not None
    await asyncio.wait_for(asyncio.shield(task), 2.0)
    assert h.state is NvmeHealth.DEGRADED and h.counters.restorations == 0


def test_two_holders_of_one_nvme_directory_are_refused(tmp_path: Path) -> None:
    """Two daemons on one directory overwrite each other's frames: the second lock must
    fail, name the holder's pid, and leak no descriptor; closing releases it. Mutant that
    survived (in unit tests): the ``hold_flock`` call of ``lock_nvme_dir`` dropped."""
    fd = lock_nvme_dir(tmp_path)
    try:
        before = fds()
        with pytest.raises(StartupError, match=f"pid {os.getpid()} holds the lock"):
            lock_nvme_dir(tmp_path)
        assert fds() == before
    finally:
        os.close(fd)
    os.close(lock_nvme_dir(tmp_path))


def test_the_lock_file_holds_only_the_new_holders_pid(tmp_path: Path) -> None:
    """A longer pid left by an earlier holder must not stay after the new one (the message
    would then name no pid, or the wrong one). Mutant that survived: ``ftruncate`` dropped."""
    (tmp_path / LOCK_NAME).write_text("9" * 20 + "\n")
    (tmp_path / LOCK_NAME).chmod(0o600)
    fd = lock_nvme_dir(tmp_path)
    try:
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    finally:
        os.close(fd)


def test_a_lock_file_without_a_pid_is_described_not_quoted(tmp_path: Path) -> None:
    """The busy message quotes the recorded pid only when it is one. Mutant that survived:
    the ``isdigit`` test weakened to "any text"."""
    fd = lock_nvme_dir(tmp_path)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"junk\n", 0)
        with pytest.raises(StartupError, match="a process that recorded no pid"):
            lock_nvme_dir(tmp_path)
    finally:
        os.close(fd)
