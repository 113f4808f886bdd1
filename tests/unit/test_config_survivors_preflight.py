"""Mutation-review pins for kvtier.daemon.preflight: the path checks that must refuse a
start on a directory the daemon cannot use, the shared-memory arithmetic, and the one-line
messages that name the path and the fix."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from kvtier.daemon import preflight
from kvtier.daemon.preflight import (
    check_dir_path,
    check_owned_dir,
    check_shm_space,
    check_writable_dir,
    dir_path_problem,
    setup_error,
    shm_dir_problem,
    shm_side_bytes,
    side_files,
)
from kvtier.errors import StartupError
from kvtier.presence import file_bytes

ME = os.getuid()


# -- dir_path_problem / check_dir_path ----------------------------------------------------------
def test_a_symlink_loop_is_named(tmp_path: Path) -> None:
    """mkdir says only "File exists" for a loop: the check must say what it is."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    found = dir_path_problem(loop / "data")
    assert found is not None and "symbolic link loop" in found[1]


def test_a_dangling_symlink_is_named_with_its_target(tmp_path: Path) -> None:
    link = tmp_path / "data"
    link.symlink_to(tmp_path / "gone")
    assert dir_path_problem(link) == (link, f"is a symbolic link to {tmp_path / 'gone'}, "
                                            "which does not exist")


def test_a_file_above_the_path_is_found(tmp_path: Path) -> None:
    """``data_dir = /x/file/sub``: the fault is ``/x/file`` (not a directory), found by
    walking up from the missing leaf (ENOTDIR), and the message names that path."""
    (tmp_path / "file").write_text("")
    wanted = tmp_path / "file" / "a" / "b"
    assert dir_path_problem(wanted) == (tmp_path / "file",
                                        "is not a directory (it is a regular file)")
    with pytest.raises(StartupError) as info:
        check_dir_path(wanted, "data directory", "daemon.data_dir", "--data-dir")
    line = str(info.value)
    assert f"unusable: {tmp_path / 'file'} is not a directory" in line
    assert line.endswith("set daemon.data_dir to a directory of yours (--data-dir PATH)")


def test_a_file_at_the_path_is_it(tmp_path: Path) -> None:
    f = tmp_path / "data"
    f.write_text("")
    with pytest.raises(StartupError, match=r"is unusable: it is not a directory"):
        check_dir_path(f, "data directory", "daemon.data_dir", "--data-dir")


def test_a_missing_path_under_a_directory_is_fine(tmp_path: Path) -> None:
    assert dir_path_problem(tmp_path / "new" / "deeper") is None
    assert dir_path_problem(tmp_path) is None


def test_check_writable_dir_runs_the_path_check_when_named(tmp_path: Path) -> None:
    """With a setting named, a loop is refused as a loop naming that setting (not mkdir's
    "File exists")."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(StartupError, match=r"symbolic link loop.*set nvme\.path"):
        check_writable_dir(loop, "nvme directory", "--nvme-path", "nvme.path")


def test_check_writable_dir_creates_a_private_directory(tmp_path: Path) -> None:
    """A data directory made by the daemon is 0700: nobody else may list or plant frames."""
    made = tmp_path / "a" / "b"
    check_writable_dir(made, "data directory", "--data-dir", "daemon.data_dir")
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
    assert os.listdir(made) == []           # the probe file is gone


def test_check_writable_dir_proves_it_can_create_a_file(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Permission bits do not tell (a read-only mount, root on NFS): the probe file must be
    tried, and its failure is one line naming the directory."""
    def full(*args: object, **kwargs: object) -> tuple[int, str]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / ".kvtier-p"))

    monkeypatch.setattr(preflight.tempfile, "mkstemp", full)
    with pytest.raises(StartupError, match=r"no space left on its file system; free some or "
                                           r"pass --data-dir PATH"):
        check_writable_dir(tmp_path, "data directory", "--data-dir")


def test_check_writable_dir_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(StartupError, match=rf"not safe: .*run `chmod go-w {d}`"):
        check_writable_dir(d, "data directory", "--data-dir")


def test_check_owned_dir_tells_chown_for_another_owner(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "data"
    d.mkdir(mode=0o700)
    monkeypatch.setattr(preflight.os, "getuid", lambda: ME + 4242)
    with pytest.raises(StartupError, match=rf"run `chown \S+ {d}` if it is yours"):
        check_owned_dir(d, "data directory", "--data-dir")


def test_a_read_only_file_system_says_remount() -> None:
    line = preflight._why(OSError(errno.EROFS, "Read-only file system", "/d/x"), Path("/d"),
                          "--data-dir")
    assert line.startswith("it is on a read-only file system; remount it read-write")


# -- shared memory ------------------------------------------------------------------------------
def test_a_group_writable_shm_dir_is_refused(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o775)
    problem = shm_dir_problem(shm, ME)
    assert problem is not None and "another user could remove or replace the arena" in problem
    shm.chmod(0o1777)       # sticky, like /dev/shm
    assert shm_dir_problem(shm, ME) is None


def fake_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(preflight, "shm_free_bytes", lambda _d: free)


def test_an_arena_that_exactly_fits_starts(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    fake_free(monkeypatch, 1 << 20)
    check_shm_space(tmp_path, 1 << 20)
    with pytest.raises(StartupError, match=r"needs 1.00 MiB \(1048577 bytes\)"):
        check_shm_space(tmp_path, (1 << 20) + 1)


def test_free_space_is_what_an_unprivileged_process_may_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """f_bavail, not f_bfree: the blocks reserved for root are not the daemon's."""
    class Vfs:
        f_bavail, f_bfree, f_frsize = 10, 1000, 4096

    monkeypatch.setattr(preflight.os, "statvfs", lambda _d: Vfs())
    assert preflight.shm_free_bytes(tmp_path) == 40960


def test_side_files_warning_only_when_the_arena_fits_but_they_do_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    fake_free(monkeypatch, 100)
    with caplog.at_level(logging.WARNING, "kvtier.daemon"):
        check_shm_space(tmp_path, 60, side_bytes=40)
    assert not caplog.records
    with caplog.at_level(logging.WARNING, "kvtier.daemon"):
        check_shm_space(tmp_path, 61, side_bytes=40)
    assert "presence filter and arena journal" in caplog.text


def test_side_bytes_count_the_journal_twice() -> None:
    """A journal compaction writes the next file beside the first: both must fit."""
    from kvtier.tiers.arena_journal import MIN_RECORDS
    from kvtier.tiers.journal_format import RECORD

    assert shm_side_bytes(warm_restart=False) == file_bytes()
    assert shm_side_bytes(warm_restart=True) == file_bytes() + 2 * MIN_RECORDS * RECORD


def test_side_file_names() -> None:
    assert side_files(Path("/dev/shm/kvtier-x.arena")) == (
        Path("/dev/shm/kvtier-x.arena.presence"), Path("/dev/shm/kvtier-x.journal"))


def test_only_our_reused_files_count_by_the_pages_they_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm restart's own arena, presence filter and journal count as room, by the pages
    they hold (a sparse file's size is not room); another user's file does not."""
    arena = tmp_path / "kvtier.arena"
    presence, journal = side_files(arena)
    with open(arena, "wb") as f:
        f.truncate(1 << 30)                 # sparse: holds no pages
    presence.write_bytes(b"\1" * 8192)
    journal.write_bytes(b"\1" * 8192)
    held = sum(os.stat(p).st_blocks * 512 for p in (arena, presence, journal))
    fake_free(monkeypatch, 0)
    check_shm_space(tmp_path, held, reusable=arena)
    with pytest.raises(StartupError):
        check_shm_space(tmp_path, held + 1, reusable=arena)
    monkeypatch.setattr(preflight.os, "getuid", lambda: ME + 4242)
    with pytest.raises(StartupError):
        check_shm_space(tmp_path, 1, reusable=arena)


# -- any other OSError ---------------------------------------------------------------------------
def test_setup_error_names_both_paths_of_a_rename() -> None:
    exc = OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/a/old", None, "/b/new")
    line = str(setup_error(exc))
    assert line.startswith("cannot start: /a/old -> /b/new: Invalid cross-device link;")
    assert "run with --debug" in line


def test_setup_error_without_a_path() -> None:
    line = str(setup_error(OSError(errno.EIO, os.strerror(errno.EIO))))
    assert line.startswith("cannot start: Input/output error; check the paths and settings")


def test_own_directory_without_the_search_bit_is_told_to_chmod(tmp_path: Path) -> None:
    """Mode 0600 (write but no search bit) refuses file creation as surely as 0500: the fix
    is chmod, not the immutable-attribute story."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    data.chmod(0o600)
    try:
        exc = OSError(errno.EACCES, os.strerror(errno.EACCES), str(data / ".kvtier-probe-1"))
        line = preflight._why(exc, data, "--data-dir")
    finally:
        data.chmod(0o700)
    assert f"mode 0600: run `chmod u+rwx {data}`" in line and "chattr" not in line
