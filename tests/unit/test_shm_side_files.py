"""The cpu tier's companions in cpu.shm_dir (presence filter, arena journal): the start
check and ``doctor --env`` count them, a presence file that cannot be made is not left
behind, and its warning says what to do about a full tmpfs. They used to be ignored: with
the tmpfs sized for cpu.bytes the daemon served without either, doctor said OK, and the
failed ``.presence`` file stayed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.daemon import preflight
from kvtier.daemon.preflight import check_shm_space, shm_side_bytes
from kvtier.daemon.service import Daemon
from kvtier.doctor import env_fs
from kvtier.doctor.env import Verdict
from kvtier.presence import PresenceFilter, file_bytes
from kvtier.units import ByteSize
from tests.support.small_fs import small_tmpfs
from tests.unit.test_doctor_env import host

MiB = 2**20


def test_side_bytes_cover_the_presence_filter_and_journal() -> None:
    assert file_bytes() >= 4 * MiB
    assert shm_side_bytes(warm_restart=False) == file_bytes()
    assert shm_side_bytes(warm_restart=True) >= file_bytes() + 2 * MiB


def test_start_check_warns_when_only_the_arena_fits(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(preflight, "shm_free_bytes", lambda d: 64 * MiB)
    side = shm_side_bytes(warm_restart=True)
    with caplog.at_level(logging.WARNING, "kvtier.daemon"):
        check_shm_space(tmp_path, 50 * MiB, side_bytes=side)
        assert not caplog.records
        check_shm_space(tmp_path, 63 * MiB, side_bytes=side)
    [rec] = caplog.records
    assert "presence filter and arena journal" in rec.getMessage()
    assert "cpu.bytes" in rec.getMessage() and str(tmp_path) in rec.getMessage()


def test_our_stale_side_files_count_as_room(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    arena = tmp_path / "kvtier-0-dabc.arena"
    arena.write_bytes(b"\1" * MiB)
    Path(f"{arena}.presence").write_bytes(b"\1" * 4 * MiB)
    arena.with_suffix(".journal").write_bytes(b"\1" * 4 * MiB)
    monkeypatch.setattr(preflight, "shm_free_bytes", lambda d: 55 * MiB)
    with caplog.at_level(logging.WARNING, "kvtier.daemon"):
        check_shm_space(tmp_path, 56 * MiB, reusable=arena, side_bytes=8 * MiB)
    assert not caplog.records


def test_doctor_warns_when_the_side_files_do_not_fit(tmp_path: Path) -> None:
    cfg = Config()
    cfg.cpu.bytes = ByteSize(63 * MiB)
    cfg.cpu.shm_dir = tmp_path
    tmpfs = f"1 0 0:9 / {tmp_path} rw - tmpfs tmpfs rw\n"
    tight = host(statvfs=lambda p: (64 * MiB, 64 * MiB), mountinfo=lambda: tmpfs)
    c = env_fs.check_shm(cfg, tight)
    assert c.verdict is Verdict.WARN and "presence filter and journal" in c.detail
    roomy = host(statvfs=lambda p: (80 * MiB, 80 * MiB), mountinfo=lambda: tmpfs)
    assert env_fs.check_shm(cfg, roomy).verdict is Verdict.OK


def test_a_presence_file_that_does_not_fit_is_removed(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "shm", 2 * MiB) as shm:
        path = shm / "kvtier-0-x.arena.presence"
        with pytest.raises(OSError) as err:
            PresenceFilter.create(path)
        assert err.value.errno == 28
        assert not path.exists()
        assert list(shm.iterdir()) == []


def test_another_users_presence_file_is_left_alone(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("a file of another uid needs root")
    path = tmp_path / "kvtier-0-x.arena.presence"
    path.write_bytes(b"")
    os.chown(path, 65534, 65534)
    with pytest.raises(PermissionError):
        PresenceFilter.create(path)
    assert path.exists()


def test_the_presence_warning_for_a_full_tmpfs(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with small_tmpfs(tmp_path / "shm", 2 * MiB) as shm, \
            caplog.at_level(logging.WARNING, "kvtier.daemon"):
        assert Daemon._make_presence(shm / "kvtier-0-x.arena.presence") is None
    msg = caplog.records[-1].getMessage()
    assert "No space left" in msg and "free space in the shared-memory directory" in msg
    assert "remove that file" not in msg
