"""Shared fixtures: a real daemon subprocess per test (cheap: ~0.5 s to start)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.arena import shm_tempdir
from tests.support.daemon import DaemonProcess

# vLLM names its ZMQ sockets ipc://<VLLM_RPC_BASE_PATH>/<uuid4> (tempfile.gettempdir() by
# default) and leaves them behind when its processes are stopped: a suite run left dozens in
# /tmp. The engines the tests start (in process or as servers) put them in a directory of
# this run's, removed when the worker exits.
_VLLM_IPC = tempfile.mkdtemp(prefix="kvtier-test-ipc-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _VLLM_IPC)
atexit.register(shutil.rmtree, _VLLM_IPC, True)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory for arenas under /dev/shm (or the temp dir without it)."""
    with shm_tempdir() as d:
        yield d


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
