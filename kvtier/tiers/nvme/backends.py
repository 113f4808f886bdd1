"""How the nvme tier does its file I/O: POSIX (always there) or kvikio's CuFile (GPU hosts).

Selection (``select_nvme_backend``), run once when the daemon builds the nvme tier:

- ``posix``: the tier's own ``pwritev``/``preadv`` path (O_DIRECT where it works).
- ``kvikio``: kvikio's ``CuFile`` (GPUDirect Storage where cuFile is set up, kvikio's POSIX
  compat mode otherwise). Needs ``import kvikio`` to work, ``libcuda.so.1`` to load and a
  CUDA device to be visible: kvikio's file I/O needs the driver even in compat mode, so a
  driverless host must not pick it. Forcing it where that does not hold is a ConfigError.
- ``auto``: kvikio when all three hold, else posix; the reason is recorded either way and is
  shown by ``kvtier stats --json`` (``tiers.nvme.io_backend`` / ``io_backend_reason``).

The on-disk format is the same whichever backend writes it (``kvtier.tiers.nvme.slots``
documents it). The backends themselves are ``kvtier.tiers.nvme.frameio.PosixFrameIO`` and
``kvtier.tiers.nvme.kvikio_io.KvikioFileIO``; ``cuda_driver_status`` is also the HBM tier's
driver probe. Nothing here imports kvikio (or cupy) at module import time.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tiers.nvme.frameio import PosixFrameIO
from kvtier.tiers.nvme.kvikio_io import KvikioFileIO

__all__ = [
    "LIBCUDA",
    "BackendChoice",
    "DriverStatus",
    "cuda_driver_status",
    "make_frame_io",
    "select_nvme_backend",
]

log = logging.getLogger(__name__)

LIBCUDA = "libcuda.so.1"
BACKENDS = ("auto", "posix", "kvikio")
_GPU_EXTRA = "pip install 'kvtier[gpu]'"


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """The nvme I/O backend the daemon will use and why (shown in ``kvtier stats``)."""

    name: str      # "posix" | "kvikio"
    reason: str    # one line for operators
    forced: bool = False   # nvme.backend named it (not auto): failing to set it up is fatal


@dataclass(frozen=True, slots=True)
class DriverStatus:
    """What the CUDA driver probe found: usable with ``devices`` > 0, else ``reason``."""

    ok: bool
    devices: int
    reason: str


def _load_libcuda() -> Any:
    """Load the CUDA driver library (a seam for tests: monkeypatch this or ``ctypes.CDLL``)."""
    return ctypes.CDLL(LIBCUDA)


def _cu_error(lib: Any, code: int) -> str:
    """``CUDA_ERROR_NO_DEVICE (100)``-style text for a CUresult (best effort)."""
    name = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(int(code), ctypes.byref(name)) == 0 and name.value:
            return f"{name.value.decode()} ({code})"
    except Exception:  # a fake or partial driver: the number alone will do
        pass
    return f"CUDA error {code}"


def cuda_driver_status() -> DriverStatus:
    """Probe the CUDA driver through ``libcuda.so.1`` alone (no cupy, no kvikio, no context).

    Calls ``cuInit(0)`` and ``cuDeviceGetCount``. Never raises: every failure becomes a reason
    (no driver library, driver too old for the runtime, no device visible, ...).
    """
    try:
        lib = _load_libcuda()
    except OSError as exc:
        return DriverStatus(False, 0, f"{LIBCUDA} cannot be loaded ({exc}): no NVIDIA driver "
                                      "on this host")
    try:
        rc = int(lib.cuInit(0))
        if rc != 0:
            return DriverStatus(False, 0, f"cuInit failed: {_cu_error(lib, rc)}")
        count = ctypes.c_int(0)
        rc = int(lib.cuDeviceGetCount(ctypes.byref(count)))
        if rc != 0:
            return DriverStatus(False, 0, f"cuDeviceGetCount failed: {_cu_error(lib, rc)}")
    except (AttributeError, OSError, ValueError, TypeError) as exc:
        return DriverStatus(False, 0, f"{LIBCUDA} is not a usable CUDA driver ({exc})")
    if count.value <= 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return DriverStatus(False, 0, f"the CUDA driver sees no device{hint}")
    return DriverStatus(True, count.value, f"{count.value} CUDA device(s) visible")


def _import_kvikio() -> tuple[Any | None, str]:
    """(module, "") or (None, why not). Any import failure counts, not only ImportError."""
    try:
        return importlib.import_module("kvikio"), ""
    except ImportError:
        return None, f"kvikio not installed ({_GPU_EXTRA})"
    except Exception as exc:  # a broken install (missing libkvikio, ABI mismatch, ...)
        return None, f"kvikio failed to import ({type(exc).__name__}: {exc})"


def select_nvme_backend(requested: str) -> BackendChoice:
    """Choose the nvme tier's I/O backend for ``nvme.backend = requested``.

    ``auto`` picks kvikio only when ``import kvikio`` works, ``libcuda.so.1`` loads and a
    CUDA device is visible, else posix with the first condition that failed as the reason.
    ``kvikio`` raises ConfigError (with that reason) when any of them fails; ``posix`` always
    succeeds. Unknown values raise ConfigError.
    """
    if requested not in BACKENDS:
        raise ConfigError(f"nvme.backend must be auto, posix or kvikio, got {requested!r}")
    if requested == "posix":
        return BackendChoice("posix", "nvme.backend = posix", forced=True)
    module, why = _import_kvikio()
    if module is not None:
        driver = cuda_driver_status()
        why = "" if driver.ok else driver.reason
    if why:
        if requested == "kvikio":
            raise ConfigError(
                f"nvme.backend = kvikio but {why}; kvikio's file I/O needs the CUDA driver "
                "(libcuda.so.1) and a visible GPU even in compat mode. Set nvme.backend = auto "
                "(falls back to POSIX I/O) or posix.")
        return BackendChoice("posix", why)
    version = getattr(module, "__version__", "?")
    source = "nvme.backend = kvikio" if requested == "kvikio" else "auto"
    return BackendChoice("kvikio", f"{source}: kvikio {version} and {driver.reason}",
                         forced=requested == "kvikio")


def make_frame_io(choice: BackendChoice, *, threads: int = 0) -> PosixFrameIO | KvikioFileIO:
    """The FrameIO object for a choice. A kvikio that imported but cannot be set up falls back
    to POSIX (with the reason) unless kvikio was forced, which raises ConfigError."""
    if choice.name == "posix":
        return PosixFrameIO(choice.reason)
    try:
        return KvikioFileIO(choice.reason, threads=threads)
    except Exception as exc:
        why = f"kvikio set-up failed ({type(exc).__name__}: {exc})"
        if choice.forced:
            raise ConfigError(f"nvme.backend = kvikio but {why}; set nvme.backend = auto or "
                              "posix") from exc
        log.warning("nvme tier: %s; using POSIX I/O", why)
        return PosixFrameIO(why)
