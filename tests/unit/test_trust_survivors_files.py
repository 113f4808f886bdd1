"""Survivors of the trust-boundary mutation round, part 3 of 3: the shared files a daemon
hands out or keeps (``kvtier.presence``, ``kvtier.tiers.arena_mapping``, the arena
journal's files, the nvme O_DIRECT probe), on real files; no process is started. Each test
pins a check no test noticed broken; its docstring names the mutant."""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import (
    ProtocolError,
    StartupError,
    UntrustedArena,
)
from kvtier.presence import HEADER_BYTES, PresenceFilter, PresenceView, _unlink_if_same
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.journal_files import write_file
from kvtier.tiers.journal_format import RECORD, open_private
from kvtier.tiers.journal_run import RUN_BYTES, RUN_FILE, begin_run, last_run
from kvtier.tiers.nvme import probe
from kvtier.tiers.nvme.probe import choose_direct

ME = os.getuid()


# -- the presence filter (kvtier.presence) -----------------------------------------------------
LOG2 = 12


@pytest.mark.parametrize("swap", ["file", "symlink"])
def test_a_client_never_gets_a_filter_swapped_under_the_daemon(tmp_path: Path,
                                                               swap: str) -> None:
    """The descriptor passed to a client is the daemon's own filter: a file put at its
    name since (another file, or a link to the daemon's own file) is refused. Mutants that
    survived: the inode comparison dropped; the open followed a link."""
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    try:
        os.rename(f.path, tmp_path / "kept")
        if swap == "file":
            (tmp_path / "p").write_bytes(bytes(HEADER_BYTES + (1 << LOG2)))
        else:
            (tmp_path / "p").symlink_to(tmp_path / "kept")
        with pytest.raises(OSError):
            f.open_for_client()
    finally:
        f.close()


def test_a_client_gets_a_read_only_descriptor(tmp_path: Path) -> None:
    """The filter's descriptor for a client is opened read-only: the counters are the
    daemon's to change. Mutant that survived: it was opened read-write (the client maps it
    read-only, but the descriptor let it write)."""
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    fd = f.open_for_client()
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(OSError):
            os.write(fd, b"x")
    finally:
        os.close(fd)
        f.close()


def test_a_view_checks_the_filters_owner_and_whole_header(tmp_path: Path) -> None:
    """A client maps the filter only when it is owned by the daemon's verified uid (not
    its own), and its header matches the whole announcement (hashes included, not only
    the magic). Mutants that survived: the owner compared with the client's uid; only the
    magic compared."""
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    try:
        with pytest.raises(UntrustedArena, match=f"not by the daemon's uid {ME + 4242}"):
            PresenceView(f.open_for_client(), f.announce(True), ME + 4242)
        with pytest.raises(UntrustedArena, match="header does not match"):
            PresenceView(f.open_for_client(), {**f.announce(True), "hashes": 2}, ME)
        view = PresenceView(f.open_for_client(), f.announce(True), ME)
        view.close()
    finally:
        f.close()


def test_a_filter_without_hashes_is_malformed(tmp_path: Path) -> None:
    """A filter needs at least one counter per key: zero hashes (under which every key
    would read as present) is a ValueError, for the daemon and for a client's view.
    Mutant that survived: zero hashes were accepted."""
    with pytest.raises(ValueError, match="0 hashes"):
        PresenceFilter.create(tmp_path / "p", counters_log2=LOG2, hashes=0)
    f = PresenceFilter.create(tmp_path / "q", counters_log2=LOG2)
    try:
        with pytest.raises(ValueError, match="0 hashes"):
            PresenceView(f.open_for_client(), {**f.announce(True), "hashes": 0}, ME)
    finally:
        f.close()


def test_keys_that_are_not_block_keys_get_no_bound(tmp_path: Path) -> None:
    """Only 16-byte block keys are looked up in the filter: keys of another length give no
    bound (every one may be there), never one read from misaligned bytes. Mutant that
    survived: the length guard dropped (a 17-byte key was read as the first 16 bytes of
    it, and ruled out)."""
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    view = view_of_filter(f)
    try:
        assert view.leading_bound([b"\1" * 17]) == 1
        assert view.leading_bound([b"\1" * 16, b"\2" * 17]) == 2
    finally:
        view.close()
        f.close()


def view_of_filter(f: PresenceFilter) -> PresenceView:
    return PresenceView(f.open_for_client(), f.announce(True), ME)


def test_a_half_made_filter_removes_only_its_own_file(tmp_path: Path) -> None:
    """The cleanup of a filter that could not be made removes the path only while it is
    still the file the daemon opened, never what another put there since. Mutant that
    survived: whatever was at the path was removed."""
    path = tmp_path / "p"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.rename(path, tmp_path / "ours")
        path.write_bytes(b"someone else's")
        _unlink_if_same(path, fd)
        assert path.read_bytes() == b"someone else's"
        os.rename(tmp_path / "ours", tmp_path / "back")
        _unlink_if_same(tmp_path / "back", fd)
        assert not (tmp_path / "back").exists()
    finally:
        os.close(fd)


# -- the arena mapping (kvtier.tiers.arena_mapping) --------------------------------------------
def test_mappings_of_one_file_at_two_sizes_are_not_shared(tmp_path: Path) -> None:
    """A process shares one mapping per arena file and size: a client told a larger size
    for the same file gets a mapping of that size, not the smaller one another client
    made (whose buffer would end short of the slots it is lent). Mutant that survived: the
    size was not part of the key."""
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(8192))
    os.chmod(arena, 0o600)
    small = ArenaMapping(str(arena), 4096)
    large = ArenaMapping(str(arena), 8192)
    try:
        assert len(small.buf) == 4096 and len(large.buf) == 8192
        assert large.view(4096, 4096, writable=True).size == 4096
    finally:
        small.close()
        large.close()


def _arena_4k(tmp_path: Path) -> ArenaMapping:
    """A private 4 KiB arena file, mapped."""
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    os.chmod(arena, 0o600)
    return ArenaMapping(str(arena), 4096)


@pytest.mark.parametrize(("offset", "nbytes"), [(-1, 1), (4096 - 10, 11), (4096, 1)])
def test_a_view_outside_the_arena_is_refused(tmp_path: Path, offset: int, nbytes: int) -> None:
    """A slot that starts before the arena or ends past it is a ProtocolError, not a
    shorter slice (or one counted from the end). Mutants that survived: a negative offset
    passed; the end compared one byte late."""
    m = _arena_4k(tmp_path)
    try:
        with pytest.raises(ProtocolError, match="outside the arena"):
            m.view(offset, nbytes, writable=False)
        assert m.view(4096 - 10, 10, writable=False).size == 10
    finally:
        m.close()


@pytest.mark.parametrize("offset", [1.0, "0", None], ids=["float", "str", "none"])
def test_a_view_at_an_offset_that_is_not_an_int_is_refused(tmp_path: Path,
                                                           offset: object) -> None:
    """A slot offset from a reply must be an int: anything else is a ProtocolError, not a
    TypeError from the slice (or a slice of another meaning). Mutant that survived: the
    offset's type was not checked."""
    m = _arena_4k(tmp_path)
    try:
        with pytest.raises(ProtocolError, match="outside the arena"):
            m.view(offset, 16, writable=False)  # type: ignore[arg-type]
    finally:
        m.close()


# -- the arena journal's files -----------------------------------------------------------------
def test_a_journal_file_is_new_and_private(tmp_path: Path, no_umask: None) -> None:
    """A compaction's journal file is created fresh (O_EXCL: never a file someone put at
    its name) and 0600 whatever the umask (its records name every cached key). Mutants
    that survived: O_EXCL dropped; the file created 0644."""
    tmp = tmp_path / "arena.journal.tmp"
    fd = write_file(tmp, [b"r" * RECORD], 4)
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        assert os.fstat(fd).st_size == 4 * RECORD
    finally:
        os.close(fd)
    tmp.unlink()
    tmp.write_bytes(b"planted")
    with pytest.raises(FileExistsError):
        write_file(tmp, [b"r" * RECORD], 4)
    assert tmp.read_bytes() == b"planted"


def test_a_journal_file_that_cannot_be_written_is_removed(tmp_path: Path) -> None:
    """A journal file that fails while being written (a file system too small) is not left
    behind. Mutant that survived: the half-made file stayed."""
    tmp = tmp_path / "arena.journal.tmp"
    with pytest.raises(OSError):
        write_file(tmp, [], 1 << 50)
    assert not tmp.exists()


def test_a_run_file_is_private_whatever_the_umask(tmp_path: Path, no_umask: None) -> None:
    """``begin_run`` writes the run file 0600 whatever the umask, so the next start can
    read it back (``last_run`` refuses a file others may write). Mutant that survived: it
    was created 0666 less the umask, which with umask 0 made every start a cold one."""
    run = begin_run(tmp_path)
    assert stat.S_IMODE((tmp_path / RUN_FILE).stat().st_mode) == 0o600
    assert last_run(tmp_path) == run


@pytest.mark.parametrize("plant", ["symlink", "world-writable", "hard-link", "short", "long"])
def test_a_run_file_not_ours_alone_or_not_an_id_means_no_run(tmp_path: Path,
                                                              plant: str) -> None:
    """``last_run`` names a run only from a private regular file of ours holding exactly a
    16-byte id: a symbolic link (to a valid id of ours), a file others may write, one with
    a second name, an id too short or too long all mean no run (a cold start). Mutants
    that survived: the open followed links; the file was not checked; a short id passed;
    a long one was cut to 16 bytes."""
    run = begin_run(tmp_path)
    assert last_run(tmp_path) == run
    path = tmp_path / RUN_FILE
    if plant == "symlink":
        os.rename(path, tmp_path / "elsewhere")
        path.symlink_to(tmp_path / "elsewhere")
    elif plant == "world-writable":
        os.chmod(path, 0o666)
    elif plant == "hard-link":
        os.link(path, tmp_path / "second-name")
    else:
        path.write_text(("ab" * (RUN_BYTES - 1) if plant == "short" else "ab" * (RUN_BYTES + 1))
                        + "\n")
    assert last_run(tmp_path) is None


@pytest.mark.parametrize("plant", ["fifo", "symlink", "other-uid", "group-readable"])
def test_open_private_refuses_what_is_not_a_private_file_of_ours(tmp_path: Path,
                                                                 plant: str) -> None:
    """The arena journal is opened only as a regular file of this uid with no group or
    other permission bit, never through a symbolic link; a FIFO at its name does not pass
    (opened read-write here, which never blocks on a FIFO). Mutants that survived: each
    of those checks dropped in turn."""
    path = tmp_path / "arena.journal"
    good = tmp_path / "good"
    good.write_bytes(bytes(RECORD))
    os.chmod(good, 0o600)
    os.close(open_private(good, os.O_RDWR))
    if plant == "fifo":
        os.mkfifo(path, 0o600)
    elif plant == "symlink":
        path.symlink_to(good)
    elif plant == "other-uid":
        if ME != 0:
            pytest.skip("a file of another uid needs root")
        path.write_bytes(bytes(RECORD))
        os.chmod(path, 0o600)
        os.chown(path, 4242, 4242)
    else:
        path.write_bytes(bytes(RECORD))
        os.chmod(path, 0o640)
    with pytest.raises(OSError):
        os.close(open_private(path, os.O_RDWR))


def test_open_private_hands_back_a_blocking_descriptor(tmp_path: Path) -> None:
    """The journal's descriptor is opened O_NONBLOCK (a planted FIFO) but handed back
    blocking, as its readers and writers expect. Mutant that survived: it stayed
    non-blocking."""
    path = tmp_path / "arena.journal"
    path.write_bytes(bytes(RECORD))
    os.chmod(path, 0o600)
    fd = open_private(path, os.O_RDWR)
    try:
        assert os.get_blocking(fd)
    finally:
        os.close(fd)


class _FullDiskOs:
    """``os`` for the probe's module, whose ``open`` finds the file system full."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def open(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_disk_too_full_to_create_the_probe_gives_no_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC (or EDQUOT) creating the O_DIRECT probe file says nothing about O_DIRECT, as
    when writing it: ``auto`` keeps O_DIRECT, ``on`` names the full disk. Mutant that
    survived: a full disk at the open was taken for a file system without O_DIRECT (the
    test filled the disk after the open, at the write)."""
    monkeypatch.setattr(probe, "os", _FullDiskOs())
    assert choose_direct(tmp_path, "auto") is True
    with pytest.raises(StartupError, match=r"nvme\.direct=on .* file system is full"):
        choose_direct(tmp_path, "on")


class _FixedNames:
    """``secrets`` for the probe's module, whose random names are all one (as if guessed)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(secrets, name)

    @staticmethod
    def token_hex(nbytes: int | None = None) -> str:
        return "0" * 16


def test_the_probe_never_writes_a_file_already_at_its_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The O_DIRECT probe creates its file (O_EXCL): a file already at the name, even a
    regular one of ours that O_NOFOLLOW lets through, is neither written nor removed.
    Mutant that survived: O_EXCL dropped (the name is random, so no test could plant it)."""
    monkeypatch.setattr(probe, "secrets", _FixedNames())
    planted = tmp_path / f".odirect-probe-{os.getpid()}-{'0' * 16}"
    planted.write_bytes(b"precious" * 512)
    assert probe.probe_direct(tmp_path) is not None
    assert planted.read_bytes() == b"precious" * 512
