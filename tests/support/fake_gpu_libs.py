"""Fakes of the GPU libraries the nvme backend selection probes: libcuda (the driver API
the probe calls through ctypes) and kvikio (``CuFile`` over plain POSIX calls), installed
with ``monkeypatch`` so tests run the selection logic on hosts without a GPU.
"""

from __future__ import annotations

import ctypes
import os
import sys
import types
from typing import Any

import pytest

from kvtier.tiers.nvme import backends as nb


class FakeDriver:
    """A stand-in for libcuda.so.1 answering cuInit / cuDeviceGetCount / cuGetErrorName."""

    def __init__(self, init_rc: int = 0, count: int = 1, count_rc: int = 0) -> None:
        self.init_rc, self.count, self.count_rc = init_rc, count, count_rc

    def cuInit(self, flags: int) -> int:
        return self.init_rc

    def cuDeviceGetCount(self, ref: Any) -> int:
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int)).contents.value = self.count
        return self.count_rc

    def cuGetErrorName(self, code: int, ref: Any) -> int:
        names = {100: b"CUDA_ERROR_NO_DEVICE", 35: b"CUDA_ERROR_INSUFFICIENT_DRIVER"}
        if code not in names:
            return 1
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_char_p)).contents.value = names[code]
        return 0


class _Future:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


class FakeCuFile:
    """kvikio.CuFile's pread/pwrite contract over plain POSIX calls on its own descriptor."""

    fail: str | None = None   # "pread" / "pwrite": raise RuntimeError like a CUfileException
    opened: list[FakeCuFile] = []

    def __init__(self, path: str, flags: str = "r") -> None:
        assert flags == "r+"
        self.fd = os.open(path, os.O_RDWR)
        self.closed = False
        FakeCuFile.opened.append(self)

    def close(self) -> None:
        os.close(self.fd)
        self.closed = True

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0) -> _Future:
        if FakeCuFile.fail == "pread":
            raise RuntimeError("cuFile error: fake read failure")
        view = memoryview(buf).cast("B")
        size = len(view) if size is None else size
        assert size <= len(view)
        return _Future(os.preadv(self.fd, [view[:size]], file_offset))

    def pwrite(self, buf: Any, size: int | None = None, file_offset: int = 0) -> _Future:
        if FakeCuFile.fail == "pwrite":
            raise RuntimeError("cuFile error: fake write failure")
        view = memoryview(buf).cast("B")
        size = len(view) if size is None else size
        return _Future(os.pwrite(self.fd, view[:size], file_offset))


def fake_kvikio(compat: bool | None = True, version: str = "26.10.0") -> types.ModuleType:
    mod = types.ModuleType("kvikio")
    mod.__version__ = version  # type: ignore[attr-defined]
    mod.CuFile = FakeCuFile  # type: ignore[attr-defined]
    defaults = types.SimpleNamespace(calls=[])
    if compat is not None:
        defaults.is_compat_mode_preferred = lambda: compat
    defaults.set = lambda d: defaults.calls.append(d)
    mod.defaults = defaults  # type: ignore[attr-defined]
    return mod


def no_kvikio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", None)   # import kvikio -> ImportError


def with_kvikio(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> types.ModuleType:
    mod = fake_kvikio(**kw)
    monkeypatch.setitem(sys.modules, "kvikio", mod)
    return mod


def no_libcuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str, *a: Any, **k: Any) -> Any:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", refuse)


def with_driver(monkeypatch: pytest.MonkeyPatch, driver: object) -> None:
    """``driver`` (a ``FakeDriver``, or anything a test wants refused) as the loaded libcuda."""
    monkeypatch.setattr(nb, "_load_libcuda", lambda: driver)
