"""Unit-test rules and shared fixtures.

Unit tests do not start processes (a daemon, redis-server, a compiler, an interpreter):
those tests live in tests/integration/. ``_no_processes`` makes starting one fail here.
The TieredStore bench fixtures (``clock``, ``arena``, ``nvme``, ``store``, ``client``) live
in tests/support/store.py; importing them here registers them for every unit module.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.store import arena, client, clock, nvme, store  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def _matplotlib_font_cache() -> None:
    """matplotlib builds its font cache on its first import, asking fontconfig's ``fc-list``
    when fontconfig is installed: the library's process, not the test's. Build it before
    ``_no_processes`` refuses processes (a fresh machine has no cache yet)."""
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a unit test that starts a process (subprocess, fork, posix_spawn)."""

    def refuse(*args: Any, **_: Any) -> Any:
        raise AssertionError("a unit test started a process; move the test to "
                             f"tests/integration/ ({args[1:2]!r})")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    yield


@pytest.fixture
def no_umask() -> Iterator[None]:
    """A umask of 0 for the test: files a module creates get the modes it asks for, so a
    test can tell a private mode asked for from one the umask happened to give."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)
