"""A data directory the daemon's own user owns but may not write: the one-line refusal of a
real ``kvtier serve`` names the likely cause instead of a chown that does nothing.

Found by review: on a directory made immutable (``chattr +i``) the line said
``chown -R root DIR``, though root already owned it. Needs root and a file system with the
immutable attribute (ext4, xfs, btrfs); skipped elsewhere. The attribute is always removed,
or pytest could not delete the directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.serve import one_line_error, run_serve, small_args


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("the immutable attribute needs root and chattr(1)")
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no immutable attribute here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=False)


def test_an_immutable_data_dir_of_our_own_is_not_told_to_chown(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    with immutable(data):
        line = one_line_error(run_serve([*small_args(tmp_path),
                                         "--socket", str(tmp_path / "run" / "k.sock")]))
    assert line.startswith(f"kvtier: data directory {data} is unusable: Operation not "
                           "permitted for user ")
    assert "chown" not in line
    assert f"{data} is yours (mode 0700)" in line
    assert f"chattr -i {data}" in line and "--data-dir PATH" in line
