"""Mutation review of the nvme tier's slot file descriptors (``kvtier.tiers.nvme.files``):
real files under ``tmp_path``, a real PosixFrameIO."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.nvme import files
from kvtier.tiers.nvme.files import SlotFiles
from kvtier.tiers.nvme.frameio import PosixFrameIO
from kvtier.tiers.nvme.probe import probe_direct


def fds() -> set[str]:
    """This process's open descriptor numbers."""
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def flags_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The open flags of every slot file open (the real ``open_owned_file`` still runs)."""
    seen: list[int] = []
    real = files.open_owned_file

    def spy(path: Path, flags: int, *args: Any) -> int:
        seen.append(flags)
        return real(path, flags, *args)

    monkeypatch.setattr(files, "open_owned_file", spy)
    return seen


def test_a_limit_below_one_is_refused() -> None:
    """With no descriptor allowed open every open would shed nothing and still open.
    Mutant that survived: ``limit < 1`` weakened to ``limit < 0``."""
    with pytest.raises(ValueError):
        SlotFiles(PosixFrameIO(), limit=0)


def test_opening_one_more_file_first_makes_room_for_it(tmp_path: Path) -> None:
    """At ``limit`` open descriptors, a new class's first open closes an idle one first:
    the limit is what the daemon's descriptor budget counts on. Mutant that survived:
    ``_shed`` ignored ``room`` (limit + 1 open)."""
    sf = SlotFiles(PosixFrameIO(), limit=2)
    before = fds()
    a, b, c = (sf.open(tmp_path / f"slots-{i}") for i in range(3))
    assert sf.open_count == 2 and len(fds() - before) == 2
    assert a.fd == -1 and b.fd >= 0 and c.fd >= 0
    sf.close_all()
    assert fds() == before


def test_the_least_recently_used_file_is_closed_first(tmp_path: Path) -> None:
    """A file just used must stay open; the one idle longest is closed. Mutant that
    survived: ``pin`` did not move the file to the recent end."""
    sf = SlotFiles(PosixFrameIO(), limit=2)
    a = sf.open(tmp_path / "slots-a")
    b = sf.open(tmp_path / "slots-b")
    with sf.held(a):
        pass
    sf.open(tmp_path / "slots-c")
    assert a.fd >= 0 and b.fd == -1
    sf.close_all()


def test_a_retired_file_is_never_reopened_nor_made_again(tmp_path: Path) -> None:
    """A dropped class's file is removed; a late operation on it must fail, not create an
    empty file that nothing ever removes. Mutants that survived: the ``retired`` check of
    ``_reopen`` dropped; ``retire`` left the file in the open set."""
    sf = SlotFiles(PosixFrameIO(), limit=4)
    f = sf.open(tmp_path / "slots-a")
    sf.retire(f)
    assert sf.open_count == 0 and f.fd == -1
    with pytest.raises(OSError):
        sf.pin(f)
    assert not f.path.exists()
    assert sf.open_count == 0


def test_retire_keeps_a_file_put_in_its_place(tmp_path: Path) -> None:
    """Retire removes the class's file only if it is still the one the tier opened, never a
    file that replaced it. Mutant that survived: the identity test of ``retire`` dropped."""
    sf = SlotFiles(PosixFrameIO(), limit=4)
    f = sf.open(tmp_path / "slots-a")
    f.path.rename(tmp_path / "moved")
    f.path.write_bytes(b"someone else's")
    sf.retire(f)
    assert f.path.read_bytes() == b"someone else's"
    sf.close_all()


def test_close_all_closes_retired_files_still_in_use(tmp_path: Path) -> None:
    """A retired file whose I/O was still pinned waits in ``_retiring``; closing the tier
    must close it too (a leaked descriptor per dropped class). Mutant that survived:
    ``close_all`` closed only the open set."""
    sf = SlotFiles(PosixFrameIO(), limit=4)
    before = fds()
    f = sf.open(tmp_path / "slots-a")
    sf.pin(f)
    sf.retire(f)
    assert f.fd >= 0 and sf.open_count == 1
    sf.close_all()
    assert fds() == before and f.fd == -1


def test_a_begin_that_raises_unpins_its_files(tmp_path: Path) -> None:
    """An operation that fails to start must not leave its files pinned (they could then
    never be closed: descriptors held for the daemon's life). Mutant that survived: the
    unpin on ``begin`` raising dropped."""
    sf = SlotFiles(PosixFrameIO(), limit=4)
    f = sf.open(tmp_path / "slots-a")

    def begin(fd: int) -> Future[int]:
        raise RuntimeError("pool shut down")

    with pytest.raises(RuntimeError):
        sf.start(f, begin)
    assert f.users == 0
    sf.close_all()


def test_a_removed_file_is_made_again_exclusively_and_stays_reopenable(
        tmp_path: Path, flags_seen: list[int]) -> None:
    """A slot file removed while closed is made again with O_EXCL (never adopting a file
    planted meanwhile), and its new identity is kept so the next reopen succeeds. Mutants
    that survived: O_EXCL dropped; ``ident`` not updated (every later reopen ESTALE)."""
    sf = SlotFiles(PosixFrameIO(), limit=1)
    a = sf.open(tmp_path / "slots-a")
    b = sf.open(tmp_path / "slots-b")
    assert a.fd == -1
    a.path.rename(tmp_path / "gone")   # (kept alive: the new file gets another inode)
    with sf.held(a):
        pass
    assert flags_seen[-1] & os.O_EXCL and flags_seen[-1] & os.O_CREAT
    with sf.held(b):
        assert a.fd == -1
    with sf.held(a) as fd:
        assert os.fstat(fd).st_ino == a.path.stat().st_ino
    sf.close_all()


def test_direct_files_are_opened_with_o_direct(tmp_path: Path, flags_seen: list[int]) -> None:
    """``direct`` (the probe's verdict) must reach every open and reopen, or the tier runs
    buffered while it reports O_DIRECT. Mutant that survived: O_DIRECT dropped in
    ``_open_fd``."""
    why = probe_direct(tmp_path)
    if why is not None:
        pytest.skip(f"no O_DIRECT under {tmp_path}: {why}")
    sf = SlotFiles(PosixFrameIO(), limit=1)
    sf.direct = True
    a = sf.open(tmp_path / "slots-a")
    sf.open(tmp_path / "slots-b")
    with sf.held(a):
        pass
    assert len(flags_seen) == 3
    assert all(fl & os.O_DIRECT for fl in flags_seen)
    sf.close_all()


class FailingAttach(PosixFrameIO):
    """A backend whose per-file set-up fails (kvikio's CuFile open, say)."""

    def attach(self, path: Path, fd: int) -> None:
        raise OSError(5, "attach failed")


def test_a_failed_attach_closes_the_new_descriptor(tmp_path: Path) -> None:
    """Mutant that survived: ``open`` kept the descriptor when ``attach`` raised (one leaked
    per failed class open)."""
    sf = SlotFiles(FailingAttach(), limit=4)
    before = fds()
    with pytest.raises(OSError):
        sf.open(tmp_path / "slots-a")
    assert fds() == before
