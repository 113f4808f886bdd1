"""Shared fixtures: a real daemon subprocess per test (cheap: ~0.5 s to start)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import DaemonProcess


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvd") as d:
        yield d


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    made: list[DaemonProcess] = []

    def make(name: str = "kvd", **kwargs: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, **kwargs)
        made.append(d)
        return d

    try:
        yield make
    finally:
        for d in made:
            d.kill()
