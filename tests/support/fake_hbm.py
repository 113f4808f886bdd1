"""TEST-ONLY fake of the HBM device: a host-memory pool and mapping with the real interfaces.

The HBM tier's logic (placement, eviction, leases, handshake, client mapping selection,
stats) runs on machines without a GPU through these fakes; only the device is faked:
``ShmDevicePool`` stands in for ``kvtier.tiers.hbm.CupyDevicePool`` (the ``DevicePool``
protocol, backed by a file in /dev/shm so a second process can map it) and
``FakeHbmMapping`` for ``HbmMapping`` (what a client maps; views are numpy arrays).

Daemon side: the daemon's supported seam, ``DaemonParts(hbm=fake_hbm_tier)``
(kvtier.daemon.parts), builds the HBM tier over a ``ShmDevicePool``; nothing is patched. A
daemon subprocess runs ``python -m tests.support.fake_hbm_daemon serve ...`` (``DAEMON_PROGRAM``
with ``daemon_env()``): the real ``kvtier serve`` with those parts. Client side:
``install_client_fake(monkeypatch)`` routes ``HbmMapping.open`` here.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config import Config
from kvtier.daemon.parts import DaemonParts, open_hbm
from kvtier.errors import ConfigError, KVTierError
from kvtier.tiers import hbm as hbm_mod
from kvtier.tiers.hbm import HbmTier

MAGIC = b"KVTFAKE1"
DAEMON_PROGRAM = ("-m", "tests.support.fake_hbm_daemon")   # ``python -m ...`` like kvtier.cli
FAKE_BUS_ID = "0000:C1:00.0"
POOL_PREFIX = "kvtier-fakehbm-"   # + pid: a SIGKILLed daemon's pool is found and removed
_seq = itertools.count()


def pool_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class ShmDevicePool:
    """A ``DevicePool`` over a shared host-memory file (a fake GPU allocation)."""

    def __init__(self, size: int, device: int = 0) -> None:
        self.size = size
        self.device = device
        # A random part as well: a pool file left by a SIGKILLed process whose pid is now
        # reused must not collide with this one (O_EXCL would refuse it).
        name = f"{POOL_PREFIX}{os.getpid()}-{next(_seq)}-{secrets.token_hex(4)}"
        self.path = pool_dir() / name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.ptr = int(self.buf.ctypes.data)
        self.closed = False
        self.copies = 0

    def export_handle(self) -> bytes:
        """64 bytes like a cudaIpcMemHandle_t: a magic and the file's path."""
        raw = MAGIC + str(self.path).encode()
        if len(raw) > hbm_mod.IPC_HANDLE_BYTES:
            raise ConfigError(f"fake hbm path too long for a handle: {self.path}")
        return raw.ljust(hbm_mod.IPC_HANDLE_BYTES, b"\0")

    def view(self, offset: int, nbytes: int) -> Any:
        hbm_mod._check_range(offset, nbytes, self.size)
        return self.buf[offset: offset + nbytes]

    def copy_in(self, items: Sequence[tuple[int, Any]]) -> None:
        """The device copy of the real pool, as a memcpy."""
        for off, src in items:
            hbm_mod._check_range(off, int(src.nbytes), self.size)
            np.copyto(self.buf[off: off + src.nbytes], src.reshape(-1).view(np.uint8))
            self.copies += 1

    def describe(self) -> dict[str, Any]:
        return {"device": self.device, "device_name": "fake host-memory HBM (tests only)",
                "pci_bus_id": FAKE_BUS_ID}

    def close(self) -> None:
        self.closed = True
        self.buf = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):   # a test still holds a view: it keeps the map
            self._mm.close()
        self.path.unlink(missing_ok=True)


class FakeHbmMapping:
    """``HbmMapping``'s client-side interface over a ``ShmDevicePool`` file."""

    opened: list[FakeHbmMapping] = []

    def __init__(self, path: Path, size: int, device: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.ptr = int(self.buf.ctypes.data)
        self.size = size
        self.device = device
        self.closed = False
        self.refs = 1

    @classmethod
    def open(cls, handle: bytes, size: int, device: int = 0, *,
             pci_bus_id: str | None = None) -> FakeHbmMapping:
        raw = hbm_mod._validate_handle(handle, size)
        if not raw.startswith(MAGIC):
            raise ConfigError("not a fake hbm handle")
        if pci_bus_id is not None and pci_bus_id != FAKE_BUS_ID:
            raise ConfigError(f"the daemon's HBM pool is on GPU {pci_bus_id}, which this "
                              "process does not see")
        m = cls(Path(raw[len(MAGIC):].rstrip(b"\0").decode()), size, device)
        cls.opened.append(m)
        return m

    current_device = 0   # the calling thread's CUDA device, as the client would see it

    @classmethod
    def on_current_device(cls, device: int = 0, *, pci_bus_id: str | None = None) -> bool:
        if pci_bus_id is not None and pci_bus_id != FAKE_BUS_ID:
            raise ConfigError(f"the daemon's HBM pool is on GPU {pci_bus_id}, which this "
                              "process does not see")
        return device == cls.current_device

    def device_ptr(self, offset: int, nbytes: int = 0) -> int:
        if self.closed:
            raise KVTierError("HBM mapping is closed")
        hbm_mod._check_range(offset, nbytes, self.size)
        return self.ptr + offset

    def view(self, offset: int, nbytes: int) -> Any:
        self.device_ptr(offset, nbytes)
        v = self.buf[offset: offset + nbytes]
        v.flags.writeable = False
        return v

    def close(self) -> None:
        self.refs -= 1
        if self.refs > 0 or self.closed:
            return
        self.closed = True
        self.buf = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mm.close()


def fake_hbm_tier(cfg: Config) -> HbmTier:
    """``DaemonParts.hbm`` for tests: the real tier over a host-memory ``ShmDevicePool``."""
    return open_hbm(cfg, pool_factory=ShmDevicePool, why="fake host-memory HBM pool (tests only)")


def fake_parts() -> DaemonParts:
    """The daemon's parts with the fake HBM pool (every other tier real)."""
    return DaemonParts(hbm=fake_hbm_tier)


def install_client_fake(monkeypatch: Any) -> list[FakeHbmMapping]:
    """Route ``HbmMapping.open`` to ``FakeHbmMapping.open``; returns the list of mappings
    opened from now on (to assert who mapped the pool)."""
    FakeHbmMapping.opened = []
    monkeypatch.setattr(hbm_mod.HbmMapping, "open", FakeHbmMapping.open)
    monkeypatch.setattr(hbm_mod.HbmMapping, "on_current_device",
                        FakeHbmMapping.on_current_device)
    monkeypatch.setattr(FakeHbmMapping, "current_device", 0)
    return FakeHbmMapping.opened


def daemon_env() -> dict[str, str]:
    """Environment for a ``DAEMON_PROGRAM`` subprocess: the repository root importable (for
    ``tests.support``) wherever the test runs from."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path.rstrip(os.pathsep)}
