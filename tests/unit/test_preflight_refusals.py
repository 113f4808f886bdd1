"""The one-line fix of a data directory the daemon may not write (EACCES, EPERM).

Found by review: the line always said ``chown -R <user> DIR``, which does nothing when the
directory is already the daemon user's (made immutable with ``chattr +i``, a read-only
mount that answers EACCES, a security module). chown is the fix only when another user owns
it; chmod when the owner's own mode bits refuse; else the causes ownership cannot explain.
A real ``kvtier serve`` on an immutable directory is
tests/integration/test_startup_errors_immutable.py.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvtier.daemon import preflight
from kvtier.daemon.preflight import check_writable_dir


def refusal(code: int, where: Path) -> OSError:
    return OSError(code, os.strerror(code), str(where / ".kvtier-probe-x1"))


@pytest.mark.parametrize("code", [errno.EPERM, errno.EACCES])
def test_own_directory_is_not_told_to_chown(tmp_path: Path, code: int) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    line = preflight._why(refusal(code, data), data, "--data-dir")
    assert line.startswith(f"{os.strerror(code)} for user ")
    assert "chown" not in line
    assert f"{data} is yours (mode 0700)" in line
    assert f"chattr -i {data}" in line and f"findmnt -T {data}" in line
    assert line.endswith("or pass --data-dir PATH")


def test_own_directory_without_write_bits_is_told_to_chmod(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    data.chmod(0o500)
    try:
        line = preflight._why(refusal(errno.EACCES, data), data, "--data-dir")
    finally:
        data.chmod(0o700)
    assert f"mode 0500: run `chmod u+rwx {data}`" in line and "chown" not in line


def test_another_users_directory_is_told_to_chown(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    owner = os.stat(data).st_uid
    monkeypatch.setattr(preflight.os, "getuid", lambda: owner + 4242)   # the daemon's uid
    line = preflight._why(refusal(errno.EACCES, data), data, "--data-dir")
    assert f"(uid {owner + 4242})" in line and f"{data} belongs to " in line
    assert f"`chown -R {owner + 4242} {data}`" in line and "chattr" not in line


def test_a_directory_that_could_not_be_made_is_judged_by_its_parent(tmp_path: Path) -> None:
    parent = tmp_path / "p"
    parent.mkdir(mode=0o700)
    wanted = parent / "a" / "b"
    exc = OSError(errno.EPERM, os.strerror(errno.EPERM), str(parent / "a"))
    line = preflight._why(exc, wanted, "--nvme-path")
    assert f"{parent} is yours" in line and "chown" not in line


def test_an_immutable_directory_through_the_real_check(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """check_writable_dir as a start runs it; mkstemp refuses like an immutable dir does."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)

    def immutable(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM),
                              str(data / ".kvtier-probe-abc"))

    monkeypatch.setattr(preflight.tempfile, "mkstemp", immutable)
    with pytest.raises(preflight.StartupError) as got:
        check_writable_dir(data, "data directory", "--data-dir")
    line = str(got.value)
    assert line.startswith(f"data directory {data} is unusable: Operation not permitted")
    assert "chown" not in line and f"chattr -i {data}" in line
