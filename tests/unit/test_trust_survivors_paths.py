"""Survivors of the trust-boundary mutation round, part 1 of 3: the rules on files,
directories and the socket path (``kvtier.trust``, ``kvtier.socket_path``) and the daemon's
start checks (``kvtier.daemon.preflight``). Pure rules on synthetic stat results, the
same-uid checks on real files; no process is started. Each test pins a check no test
noticed broken; its docstring names the mutant that survived."""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

import pytest

from kvtier.daemon import preflight
from kvtier.daemon.preflight import (
    check_owned_dir,
    check_shm_space,
)
from kvtier.errors import (
    StartupError,
)
from kvtier.socket_path import (
    SUN_PATH_MAX,
    claim_socket_path,
    socket_path_problem,
)
from kvtier.trust import (
    arena_problem,
    data_dir_problem,
    dirs_on_path,
    hold_flock,
    open_owned_file,
    owned_dir_problem,
    owned_file_problem,
    private_dir_problem,
)

ME = os.getuid()
USER = 1000 if ME == 0 else ME   # a daemon's uid that is not root's


def st(kind: int, mode: int, uid: int, size: int = 0, nlink: int = 1) -> os.stat_result:
    """A stat result: ``kind`` (stat.S_IFDIR, ...) | ``mode``, owned by ``uid``."""
    return os.stat_result((kind | mode, 1, 1, nlink, uid, 0, size, 0, 0, 0))


# -- pure rules --------------------------------------------------------------------------------
def test_a_root_owned_directory_is_not_a_users_private_socket_dir() -> None:
    """The default socket directory must be the daemon's own: one of root's (mode 0700) is
    not, for a daemon that is not root. Mutant that survived: root was accepted as its
    owner (the tests run as root, where the two are the same uid)."""
    got = private_dir_problem(st(stat.S_IFDIR, 0o700, 0), USER)
    assert got is not None and got.startswith(f"is owned by uid 0, not by uid {USER}")
    assert private_dir_problem(st(stat.S_IFDIR, 0o700, USER), USER) is None


def test_root_owned_data_files_and_dirs_are_not_a_users_own() -> None:
    """A daemon's data directory and files must be its user's alone: root's are not (only
    the directories above a data directory may be root's). Mutant that survived: root was
    accepted as their owner."""
    for rule, kind, mode in ((owned_file_problem, stat.S_IFREG, 0o600),
                             (owned_dir_problem, stat.S_IFDIR, 0o700)):
        got = rule(st(kind, mode, 0), USER)
        assert got is not None and got.startswith(f"is owned by uid 0, not by uid {USER}")
        assert rule(st(kind, mode, USER), USER) is None


@pytest.mark.parametrize("mode", [0o602, 0o606, 0o642], ids=lambda m: f"{m:04o}")
def test_a_data_file_others_may_write_is_refused(mode: int) -> None:
    """Write permission for others alone (not the group) makes a slot file or a lock
    another user's to forge. Mutant that survived: only the group's write bit was looked
    at (the tests had 0660 and 0666, which set both)."""
    got = owned_file_problem(st(stat.S_IFREG, mode, USER), USER)
    assert got == f"is writable by others (mode {mode:04o})"
    got = owned_dir_problem(st(stat.S_IFDIR, mode | 0o100, USER), USER)
    assert got == f"is writable by others (mode {mode | 0o100:04o})"


def test_a_data_dir_that_is_a_file_is_refused() -> None:
    """``owned_dir_problem`` names what is not a directory, whatever its owner and mode.
    Mutant that survived: a regular file of ours passed as a data directory."""
    assert owned_dir_problem(st(stat.S_IFREG, 0o600, USER), USER) == "is not a directory"


@pytest.mark.parametrize("mode", [0o610, 0o601, 0o700, 0o711], ids=lambda m: f"{m:04o}")
def test_an_arena_with_any_group_or_other_bit_is_refused(mode: int) -> None:
    """The arena must have no group or other permission bit at all, execute included, as
    the rule says (the daemon creates it 0600: any other bit means someone else made or
    changed it). Mutant that survived: execute bits for group and others passed."""
    got = arena_problem(st(stat.S_IFREG, mode, USER, size=4096), 4096, USER)
    if mode & 0o077:
        assert got == f"has mode {mode:04o}: group or others may read or write it"
    else:
        assert got is None


# -- dirs_on_path: the kernel's own limit on symbolic links ------------------------------------
def _chain(tmp_path: Path, links: int) -> Path:
    """A path that reaches ``tmp_path/real`` through ``links`` symbolic links."""
    (tmp_path / "real").mkdir(exist_ok=True)
    target = tmp_path / "real"
    for i in range(links):
        link = tmp_path / f"l{links}-{i}"
        link.symlink_to(target)
        target = link
    return target


def test_dirs_on_path_gives_up_where_the_kernel_does(tmp_path: Path) -> None:
    """40 symbolic links on the way are resolved, as the kernel does; 41 raise ELOOP, as
    the kernel's own lookup of that path does. Mutant that survived: the bound was a
    million hops (only a loop was tested, which fails at any bound, just later)."""
    ok = _chain(tmp_path, 40)
    assert dirs_on_path(ok)[-1] == tmp_path / "real"
    os.stat(ok)                                     # the kernel agrees
    too_many = _chain(tmp_path, 41)
    with pytest.raises(OSError) as kernel:
        os.stat(too_many)
    assert kernel.value.errno == errno.ELOOP
    with pytest.raises(OSError) as ours:
        dirs_on_path(too_many)
    assert ours.value.errno == errno.ELOOP


# -- data directories: the leaf and the directories above it -----------------------------------
def test_a_data_dir_reached_through_a_symlink_gets_the_owned_rule(tmp_path: Path) -> None:
    """The data directory is judged as the directory the path resolves to, however it is
    named: a sticky 1777 directory behind a symbolic link is still one others can add files
    to, and refused. Mutant that survived: the leaf was compared unresolved, so behind a
    link it got the lenient rule of the directories above it (sticky is fine)."""
    real = tmp_path / "real"
    real.mkdir()
    os.chmod(real, 0o1777)
    (tmp_path / "link").symlink_to(real)
    found = data_dir_problem(tmp_path / "link", ME)
    assert found == (real, "is writable by group and others (mode 1777)")


def test_a_data_dir_under_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    """A private data directory is not safe under a parent that others may write without
    the sticky bit (they could rename it away and put theirs in its place): the parent is
    named. Mutant that survived: only the data directory itself was checked (the test of a
    0777 parent also had a 0777 data directory)."""
    parent = tmp_path / "shared"
    data = parent / "data"
    data.mkdir(parents=True)
    os.chmod(data, 0o700)
    os.chmod(parent, 0o777)
    assert data_dir_problem(data, ME) == (
        parent, "is writable by group and others (mode 0777) without the sticky bit")
    os.chmod(parent, 0o1777)
    assert data_dir_problem(data, ME) is None


# -- open_owned_file ---------------------------------------------------------------------------
def test_a_data_file_is_created_private_whatever_the_umask(tmp_path: Path,
                                                           no_umask: None) -> None:
    """A slot file or lock the daemon creates is 0600 (its KV bytes are no one else's to
    read, even in a directory others may traverse), not what the umask leaves. Mutant that
    survived: it was created 0644, which the owned-file check accepts (it refuses only
    others' write bits)."""
    fd = open_owned_file(tmp_path / "slots", os.O_RDWR | os.O_CREAT, "nvme slot file",
                         "--nvme-path")
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    finally:
        os.close(fd)


def test_a_busy_lock_closes_its_descriptor(tmp_path: Path) -> None:
    """``hold_flock`` closes the descriptor it was given when another holds the lock (a
    daemon refused at start does not keep the lock file open). Mutant that survived: the
    descriptor was left open."""
    path = tmp_path / "lock"
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        hold_flock(holder, lambda: "unused")
        fd = os.open(path, os.O_RDWR)
        with pytest.raises(StartupError, match="held elsewhere"):
            hold_flock(fd, lambda: "held elsewhere")
        with pytest.raises(OSError) as err:
            os.fstat(fd)
        assert err.value.errno == errno.EBADF
    finally:
        os.close(holder)


# -- the socket path ---------------------------------------------------------------------------
def test_the_socket_path_limit_is_exactly_what_bind_takes(tmp_path: Path) -> None:
    """A path of SUN_PATH_MAX (107) bytes is accepted and binds; one byte more is refused
    with the one line, before bind fails with a bare error. Mutants that survived: the
    comparison off by one either way (the test had a 120-byte path only)."""
    base = str(tmp_path) + "/"
    exact = Path(base + "x" * (SUN_PATH_MAX - len(base)))
    assert len(os.fsencode(exact)) == SUN_PATH_MAX
    assert socket_path_problem(exact) is None
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(exact))                          # the kernel takes it
    longer = Path(str(exact) + "y")
    got = socket_path_problem(longer)
    assert got is not None and f"is {SUN_PATH_MAX + 1} bytes, longer than the" in got
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
        s.bind(str(longer))                         # the kernel does not


def test_another_users_stale_socket_is_not_removed(tmp_path: Path) -> None:
    """A dead socket of another uid on the path is theirs to remove, not the daemon's.
    Mutant that survived: it was unlinked like a stale socket of ours."""
    if ME != 0:
        pytest.skip("a socket of another uid needs root")
    stale = tmp_path / "theirs.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))                          # never listened: dead
    os.chown(stale, 4242, 4242)
    with pytest.raises(StartupError, match=f"stale socket {stale} belongs to uid 4242"):
        claim_socket_path(stale)
    assert stale.is_socket()


def test_a_symlink_to_a_stale_socket_is_not_claimed(tmp_path: Path) -> None:
    """Only a socket itself is ever removed from the path: a symbolic link there (to a
    dead socket of ours) is "not a socket", and stays. Mutant that survived: the path was
    stat'ed through the link, so the link was taken for a stale socket and unlinked."""
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
    link = tmp_path / "kvtier.sock"
    link.symlink_to(stale)
    with pytest.raises(StartupError, match="is not a socket"):
        claim_socket_path(link)
    assert link.is_symlink()


# -- the daemon's start checks (kvtier.daemon.preflight) ---------------------------------------
def test_another_users_files_at_the_arenas_names_are_not_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only this daemon's own stale arena and side files count as shared memory it may
    reuse: files of another uid at those names (which it will not take over) do not.
    Mutant that survived: any regular file there counted."""
    if ME != 0:
        pytest.skip("files of another uid need root")
    arena = tmp_path / "kvtier-0-dabc.arena"
    arena.write_bytes(b"\1" * 8 * 2**20)
    os.chown(arena, 4242, 4242)
    monkeypatch.setattr(preflight, "shm_free_bytes", lambda d: 4 * 2**20)
    with pytest.raises(StartupError, match=r"needs .* of shared memory but"):
        check_shm_space(tmp_path, 6 * 2**20, reusable=arena)
    os.chown(arena, ME, os.getgid())
    check_shm_space(tmp_path, 6 * 2**20, reusable=arena)


def test_an_arena_one_page_larger_than_the_free_space_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena must fit in the free shared memory to the byte: one page more than there
    is free is refused, exactly as much is not. Mutant that survived: a page of slack."""
    monkeypatch.setattr(preflight, "shm_free_bytes", lambda d: 64 * 2**20)
    check_shm_space(tmp_path, 64 * 2**20)
    with pytest.raises(StartupError, match=r"needs .* of shared memory but"):
        check_shm_space(tmp_path, 64 * 2**20 + 4096)


def test_a_data_dir_under_another_users_directory_is_not_told_to_chown(
        tmp_path: Path) -> None:
    """When the unsafe directory is one above the data directory (another user's), the fix
    is another directory, not a chown of theirs. Mutant that survived: every ownership
    problem was told to chown."""
    if ME != 0:
        pytest.skip("a directory of another uid needs root")
    parent = tmp_path / "theirs"
    data = parent / "data"
    data.mkdir(parents=True)
    os.chmod(data, 0o700)
    os.chown(parent, 4242, 4242)
    with pytest.raises(StartupError) as err:
        check_owned_dir(data, "data directory", "--data-dir")
    msg = str(err.value)
    assert f"{parent} is owned by uid 4242" in msg
    assert "use a directory owned by you or root" in msg and "chown" not in msg
