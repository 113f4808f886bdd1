"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_servers import RedisServer, running_server


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty redis-server of its own for the test (a file may override it)."""
    with running_server(tmp_path / "redis") as server:
        yield server
