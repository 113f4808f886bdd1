"""The trust rules as pure functions, plus the same-uid file checks (no processes here).

Other-uid cases use synthetic stat results; the integration tests (tests/integration/
test_trust.py) repeat the attack with a real second user.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from kvtier.config import default_runtime_dir, default_socket_path, trusted_daemon_uids
from kvtier.daemon.http import bearer_token_matches
from kvtier.daemon.preflight import check_shm_space, check_writable_dir, setup_error
from kvtier.errors import ConfigError, StartupError, UntrustedArena
from kvtier.socket_path import claim_socket_path, prepare_socket_dir
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.trust import (
    arena_problem,
    data_dir_problem,
    dirs_on_path,
    ensure_private_dir,
    owned_file_problem,
    private_dir_problem,
    shared_dir_problem,
)

ME = os.getuid()
OTHER = ME + 4242


def st(kind: int, mode: int, uid: int = ME, size: int = 0, nlink: int = 1) -> os.stat_result:
    """A stat result: ``kind`` (stat.S_IFDIR, ...) | ``mode``, owned by ``uid``."""
    return os.stat_result((kind | mode, 1, 1, nlink, uid, 0, size, 0, 0, 0))


# -- default socket path -------------------------------------------------------------------
def test_xdg_runtime_dir_of_ours_is_used(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    assert default_runtime_dir({"XDG_RUNTIME_DIR": str(xdg)}, ME) == xdg / "kvtier"
    assert default_socket_path({"XDG_RUNTIME_DIR": str(xdg)}) == xdg / "kvtier" / "kvtier.sock"


@pytest.mark.parametrize("why", ["other_owner", "group_readable", "missing", "relative", "file"])
def test_an_unfit_xdg_runtime_dir_falls_back(tmp_path: Path, why: str) -> None:
    xdg = tmp_path / "xdg"
    uid = ME
    if why == "file":
        xdg.write_text("")
    elif why != "missing":
        xdg.mkdir(mode=0o750 if why == "group_readable" else 0o700)
        os.chmod(xdg, 0o750 if why == "group_readable" else 0o700)
    if why == "other_owner":
        uid = OTHER                                   # the directory is ours, not theirs
    value = "relative/xdg" if why == "relative" else str(xdg)
    got = default_runtime_dir({"XDG_RUNTIME_DIR": value}, uid)
    assert got == (Path("/run/kvtier") if uid == 0 else Path(f"/tmp/kvtier-{uid}"))


@pytest.mark.parametrize(("uid", "expected"), [(0, "/run/kvtier"), (1000, "/tmp/kvtier-1000")])
def test_fallbacks_without_xdg(uid: int, expected: str) -> None:
    assert default_runtime_dir({}, uid) == Path(expected)


def test_explicit_socket_env_wins() -> None:
    assert default_socket_path({"KVTIER_SOCKET": "/x/y.sock"}) == Path("/x/y.sock")
    assert default_socket_path({"KVTIER_DAEMON_SOCKET": "/z.sock"}) == Path("/z.sock")


def test_trusted_uids_from_env() -> None:
    assert trusted_daemon_uids({}) == frozenset()
    assert trusted_daemon_uids({"KVTIER_TRUSTED_UIDS": "1000, 1001 root"}) == {1000, 1001, 0}
    with pytest.raises(ConfigError, match="KVTIER_TRUSTED_UIDS: no user named 'nobody-here'"):
        trusted_daemon_uids({"KVTIER_TRUSTED_UIDS": "nobody-here"})


# -- pure rules ------------------------------------------------------------------------------
@pytest.mark.parametrize(("result", "problem"), [
    (st(stat.S_IFDIR, 0o700), None),
    (st(stat.S_IFDIR, 0o700, OTHER), f"is owned by uid {OTHER}"),
    (st(stat.S_IFDIR, 0o777), "has mode 0777, not 0700"),
    (st(stat.S_IFDIR, 0o500), "has mode 0500, not 0700"),
    (st(stat.S_IFDIR, 0o1700), "has mode 1700, not 0700"),
    (st(stat.S_IFLNK, 0o777), "is a symbolic link"),
    (st(stat.S_IFREG, 0o700), "is not a directory"),
])
def test_private_dir_problem(result: os.stat_result, problem: str | None) -> None:
    got = private_dir_problem(result, ME)
    assert got == problem if problem is None else (got is not None and got.startswith(problem))


@pytest.mark.parametrize(("result", "ok"), [
    (st(stat.S_IFDIR, 0o755, 0), True),
    (st(stat.S_IFDIR, 0o700), True),
    (st(stat.S_IFDIR, 0o1777, 0), True),        # /tmp
    (st(stat.S_IFDIR, 0o1770, 0), True),
    (st(stat.S_IFDIR, 0o777, 0), False),
    (st(stat.S_IFDIR, 0o775), False),
    (st(stat.S_IFDIR, 0o757), False),
    (st(stat.S_IFDIR, 0o755, OTHER), False),
    (st(stat.S_IFDIR, 0o1777, OTHER), False),
    (st(stat.S_IFREG, 0o600), False),
])
def test_shared_dir_problem(result: os.stat_result, ok: bool) -> None:
    assert (shared_dir_problem(result, ME) is None) is ok


@pytest.mark.parametrize(("result", "problem"), [
    (st(stat.S_IFREG, 0o600, size=4096), None),
    (st(stat.S_IFREG, 0o400, size=8192), None),
    (st(stat.S_IFREG, 0o666, size=4096), "has mode 0666"),
    (st(stat.S_IFREG, 0o640, size=4096), "has mode 0640"),
    (st(stat.S_IFREG, 0o604, size=4096), "has mode 0604"),
    (st(stat.S_IFREG, 0o600, OTHER, 4096), f"is owned by uid {OTHER}"),
    (st(stat.S_IFREG, 0o600, size=4095), "has 4095 bytes, fewer than the 4096"),
    (st(stat.S_IFIFO, 0o600), "is not a regular file"),
    (st(stat.S_IFDIR, 0o700), "is not a regular file"),
])
def test_arena_problem(result: os.stat_result, problem: str | None) -> None:
    got = arena_problem(result, 4096, ME)
    assert got == problem if problem is None else (got is not None and got.startswith(problem))


@pytest.mark.parametrize(("result", "problem"), [
    (st(stat.S_IFREG, 0o600), None),
    (st(stat.S_IFREG, 0o644), None),
    (st(stat.S_IFREG, 0o600, nlink=2), "has 2 hard links"),
    (st(stat.S_IFREG, 0o660), "is writable by its group"),
    (st(stat.S_IFREG, 0o600, OTHER), f"is owned by uid {OTHER}"),
    (st(stat.S_IFIFO, 0o600), "is not a regular file"),
])
def test_owned_file_problem(result: os.stat_result, problem: str | None) -> None:
    got = owned_file_problem(result, ME)
    assert got == problem if problem is None else (got is not None and got.startswith(problem))


def test_dirs_on_path_follows_symlinks_and_keeps_their_directories(tmp_path: Path) -> None:
    (tmp_path / "real" / "run").mkdir(parents=True)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "run").symlink_to("../real/run")       # relative
    (tmp_path / "abs").symlink_to(tmp_path / "links")             # absolute
    dirs = dirs_on_path(tmp_path / "abs" / "run")
    assert dirs[0] == Path("/")
    assert dirs[-1] == tmp_path / "real" / "run"
    assert tmp_path / "links" in dirs and tmp_path / "real" in dirs
    assert all(not p.is_symlink() for p in dirs)


def test_dirs_on_path_refuses_a_symlink_loop(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(OSError):
        dirs_on_path(tmp_path / "a" / "x")


@pytest.mark.parametrize("mode", [0o1777, 0o1770], ids=lambda m: f"{m:04o}")
def test_a_sticky_data_dir_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    """The data directory itself gets the owned-directory rule, not the shared one the
    directories above it get: a sticky bit (fine on /tmp above it) stops others replacing
    our files but not adding one (a planted slot file or lock), so a sticky directory that
    group or others may write is refused, and a private one is not."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chmod(data, 0o700)
    assert data_dir_problem(data, ME) is None       # the directories above pass
    os.chmod(data, mode)
    found = data_dir_problem(data, ME)
    assert found is not None and found[0] == data and "writable by" in found[1]


# -- socket directory (same uid) -------------------------------------------------------------
def test_private_dir_is_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o277)
    try:
        ensure_private_dir(tmp_path / "run", tmp_path / "run" / "s.sock")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700
    ensure_private_dir(tmp_path / "run", tmp_path / "run" / "s.sock")   # exists and fine


@pytest.mark.parametrize("kind", ["mode", "symlink", "file"])
def test_unfit_private_dir_is_refused(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    if kind == "mode":
        run.mkdir()
        os.chmod(run, 0o755)
    elif kind == "symlink":
        (tmp_path / "target").mkdir(mode=0o700)
        run.symlink_to(tmp_path / "target")
    else:
        run.write_text("")
    with pytest.raises(StartupError, match=f"socket directory {run} ") as err:
        ensure_private_dir(run, run / "s.sock")
    assert "\n" not in str(err.value) and "--socket" in str(err.value)


def test_prepare_socket_dir_rules(tmp_path: Path) -> None:
    prepare_socket_dir(tmp_path / "a" / "b" / "s.sock", default_dir=None)   # created
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(StartupError, match="writable by group and others"):
        prepare_socket_dir(shared / "s.sock", default_dir=None)
    os.chmod(shared, 0o1777)
    prepare_socket_dir(shared / "s.sock", default_dir=None)
    with pytest.raises(StartupError, match="longer than the 107"):
        prepare_socket_dir(tmp_path / ("x" * 120) / "s.sock", default_dir=None)
    with pytest.raises(StartupError, match="has mode 1777, not 0700"):
        prepare_socket_dir(shared / "s.sock", default_dir=shared)


def test_claim_socket_path(tmp_path: Path) -> None:
    claim_socket_path(tmp_path / "none.sock")                  # nothing there: fine
    (tmp_path / "file").write_text("keep")
    with pytest.raises(StartupError, match="is not a socket"):
        claim_socket_path(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "keep"
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))                                     # never listened: dead
    claim_socket_path(stale)
    assert not stale.exists()
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(live))
        s.listen(1)
        # not a kvtier daemon (one holds <socket>.lock, taken before this check)
        with pytest.raises(StartupError, match=f"something is listening on {live} and does "
                           "not answer as kvtier"):
            claim_socket_path(live)
    assert live.exists()


# -- arena mapping (same uid) ----------------------------------------------------------------
def _file(path: Path, mode: int, size: int = 8192) -> Path:
    path.write_bytes(b"\0" * size)
    os.chmod(path, mode)
    return path


def test_arena_mapping_checks_the_opened_file(tmp_path: Path) -> None:
    good = _file(tmp_path / "good", 0o600)
    ArenaMapping(str(good), 8192).close()
    with pytest.raises(UntrustedArena, match="has mode 0666"):
        ArenaMapping(str(_file(tmp_path / "open", 0o666)), 8192)
    with pytest.raises(UntrustedArena, match="fewer than the 16384"):
        ArenaMapping(str(good), 16384)
    with pytest.raises(UntrustedArena, match=f"not by the daemon's uid {OTHER}"):
        ArenaMapping(str(good), 8192, owner_uid=OTHER)
    (tmp_path / "link").symlink_to(good)
    with pytest.raises(UntrustedArena, match="symbolic link"):
        ArenaMapping(str(tmp_path / "link"), 8192)
    with pytest.raises(UntrustedArena, match="size of 0"):
        ArenaMapping(str(good), 0)


def test_arena_mapping_by_fd_takes_the_descriptor_over(tmp_path: Path) -> None:
    good = _file(tmp_path / "good", 0o600)
    fd = os.open(good, os.O_RDWR)
    m = ArenaMapping("/nonexistent", 8192, fd=fd)
    assert m.source == "fd"
    with pytest.raises(OSError):
        os.fstat(fd)                                           # closed by the mapping
    m.close()
    fd = os.open(_file(tmp_path / "open", 0o644), os.O_RDWR)
    with pytest.raises(UntrustedArena, match=r"\(fd\): it has mode 0644"):
        ArenaMapping(str(good), 8192, fd=fd)
    with pytest.raises(OSError):
        os.fstat(fd)                                           # closed on refusal too


# -- preflight and HTTP ----------------------------------------------------------------------
def test_check_shm_space(tmp_path: Path) -> None:
    check_shm_space(tmp_path, 4096)
    with pytest.raises(StartupError, match=f"but {tmp_path} has only .* free: lower "
                                           r"--cpu-bytes"):
        check_shm_space(tmp_path, 2**62)
    with pytest.raises(StartupError, match="shared-memory directory"):
        check_shm_space(tmp_path / "missing", 4096)


def test_check_writable_dir(tmp_path: Path) -> None:
    check_writable_dir(tmp_path / "new" / "data", "data directory", "--data-dir")
    assert not list((tmp_path / "new" / "data").iterdir())          # the probe is gone
    (tmp_path / "file").write_text("")
    with pytest.raises(StartupError, match=r"data directory .* is unusable: .*--data-dir"):
        check_writable_dir(tmp_path / "file", "data directory", "--data-dir")


def test_setup_error_is_one_line_with_the_path() -> None:
    err = setup_error(PermissionError(13, "Permission denied", "/var/lib/x"))
    assert str(err).startswith("cannot start: /var/lib/x: Permission denied; check that path")
    assert "\n" not in str(err)
    assert "check the paths" in str(setup_error(OSError(5, "Input/output error")))


@pytest.mark.parametrize(("header", "ok"), [
    ("Bearer s3cret", True), ("bearer s3cret", True), ("Bearer  s3cret ", True),
    ("Bearer wrong", False), ("", False), ("s3cret", False), ("Basic s3cret", False),
    ("Bearer tökén", False), ("Bearer 秘密", False), ("Bearer \udcff\udcfe", False),
])
def test_bearer_token_matches(header: str, ok: bool) -> None:
    assert bearer_token_matches(header, "s3cret") is ok


def test_a_non_ascii_admin_token_works_too() -> None:
    assert bearer_token_matches("Bearer 秘密", "秘密")
    assert not bearer_token_matches("Bearer anything", "")
