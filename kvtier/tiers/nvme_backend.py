"""How the nvme tier does its file I/O: POSIX (always there) or kvikio's CuFile (GPU hosts).

Selection (``select_nvme_backend``), run once when the daemon builds the nvme tier:

- ``posix``: the tier's own ``pwritev``/``preadv`` path (O_DIRECT where it works).
- ``kvikio``: kvikio's ``CuFile`` (GPUDirect Storage where cuFile is set up, kvikio's POSIX
  compat mode otherwise). Needs ``import kvikio`` to work, ``libcuda.so.1`` to load and a
  CUDA device to be visible: kvikio's file I/O needs the driver even in compat mode, so a
  driverless host must not pick it. Forcing it where that does not hold is a ConfigError.
- ``auto``: kvikio when all three hold, else posix; the reason is recorded either way and is
  shown by ``kvtier stats --json`` (``tiers.nvme.io_backend`` / ``io_backend_reason``).

The on-disk format is the same whichever backend writes it (``kvtier.tiers.nvme`` documents
it): a 4 KiB header page then the payload, in fixed slots. Files written by one backend are
read by the other. Only the frame reads and writes go through the backend; the tier's slot
scan at start, erases and trims stay on its own POSIX descriptors.

UNTESTED ON HARDWARE: the kvikio calls here (``KvikioFileIO``) were written against kvikio's
documented Python API (``CuFile(path, "r+")``, ``pread``/``pwrite`` returning an ``IOFuture``,
``kvikio.defaults``) on a machine without a GPU or kvikio; only the selection logic, the
error paths and the POSIX fallback are exercised by the CPU tests. ``tests/gpu/test_kvikio.py``
checks the real thing wherever a GPU and kvikio exist (``scripts/device_check.sh``).

Nothing here imports kvikio (or cupy) at module import time.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import BufferSizeError, ConfigError, FrameError
from kvtier.frame import HEADER_SIZE, FrameHeader
from kvtier.tiers._aligned import PAGE
from kvtier.tiers.nvme import PosixFrameIO, _scratch

__all__ = [
    "LIBCUDA",
    "BackendChoice",
    "DriverStatus",
    "KvikioFileIO",
    "cuda_driver_status",
    "kvikio_mode",
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


def kvikio_mode(kvikio: Any) -> str:
    """``"gds"`` when kvikio will use cuFile, ``"compat"`` when it runs its POSIX compat mode,
    ``"unknown"`` when it cannot say. Works with kvikio >= 25.04
    (``defaults.is_compat_mode_preferred()``) and older releases (``defaults.compat_mode()``).
    """
    defaults = getattr(kvikio, "defaults", None)
    try:
        preferred = getattr(defaults, "is_compat_mode_preferred", None)
        if callable(preferred):
            return "compat" if preferred() else "gds"
        legacy = getattr(defaults, "compat_mode", None)
        if callable(legacy):
            value = legacy()
            name = getattr(value, "name", None)   # kvikio.CompatMode (ON, OFF, AUTO)
            if name is not None:
                return {"ON": "compat", "OFF": "gds"}.get(str(name), "unknown")
            return "compat" if value else "gds"   # very old releases return a bool
    except Exception as exc:
        log.debug("kvikio compat mode query failed: %s", exc)
    return "unknown"


def _set_kvikio_threads(kvikio: Any, threads: int) -> None:
    """Size kvikio's own thread pool (default 1) unless KVIKIO_NTHREADS already does."""
    if threads < 1 or os.environ.get("KVIKIO_NTHREADS"):
        return
    defaults = getattr(kvikio, "defaults", None)
    try:
        setter = getattr(defaults, "set", None)
        if callable(setter):   # kvikio >= 25.04
            setter({"num_threads": threads})
            return
        reset = getattr(defaults, "num_threads_reset", None)
        if callable(reset):    # older releases
            reset(threads)
    except Exception as exc:
        log.warning("could not set kvikio's thread pool to %d threads: %s", threads, exc)


class KvikioFileIO:
    """Frame reads and writes of the nvme tier through ``kvikio.CuFile``.

    Host buffers (the shared arena) are what the tier passes today: kvikio moves them with its
    own POSIX thread pool, so this path mainly matters for the device-buffer methods
    (``write_frame_device`` / ``read_frame_device``), which let an HBM block go to and from
    NVMe without a host bounce when GPUDirect Storage is set up. The frame layout on disk is
    exactly the POSIX path's.

    A write puts the payload first and the header page last (the header is the commit mark;
    both are checksummed, so a torn write is a miss either way). Reads check the file size
    first so a truncated slot reports the same FrameError as the POSIX path instead of
    relying on kvikio's end-of-file behaviour. kvikio errors are re-raised as
    ``OSError(EIO)`` so the tier counts them and maps them to NvmeIOError.

    UNTESTED ON HARDWARE (no GPU or kvikio where it was written): checked against a fake
    kvikio module on the CPU only; tests/gpu/test_kvikio.py runs the real one.
    """

    name = "kvikio"

    def __init__(self, reason: str, *, threads: int = 0, kvikio_module: Any = None) -> None:
        self.reason = reason
        self._kvikio = kvikio_module if kvikio_module is not None else importlib.import_module(
            "kvikio")
        self.mode = kvikio_mode(self._kvikio)
        _set_kvikio_threads(self._kvikio, threads)
        self._files: dict[int, Any] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ FrameIO protocol
    def label(self, direct: bool) -> str:
        """The tier's ``backend`` string: ``kvikio`` (cuFile/GDS) or ``kvikio-compat``."""
        return "kvikio" if self.mode == "gds" else f"kvikio-{self.mode}"

    def stats_extra(self) -> dict[str, Any]:
        return {"kvikio_mode": self.mode,
                "kvikio_version": str(getattr(self._kvikio, "__version__", "?"))}

    def attach(self, path: Path, fd: int) -> None:
        """Open a CuFile on a slot file the tier just opened (``fd``)."""
        try:
            handle = self._kvikio.CuFile(str(path), "r+")
        except Exception as exc:
            raise OSError(errno.EIO, f"kvikio could not open {path}: {exc}") from exc
        with self._lock:
            self._files[fd] = handle

    def detach(self, fd: int) -> None:
        """Close the CuFile of a slot file the tier is about to close."""
        with self._lock:
            handle = self._files.pop(fd, None)
        if handle is not None:
            try:
                handle.close()
            except Exception as exc:
                log.warning("kvikio: closing a slot file failed: %s", exc)

    def close(self) -> None:
        """Close every CuFile still open."""
        for fd in list(self._files):
            self.detach(fd)

    def write_frame(self, fd: int, offset: int, packed: bytes, payload: memoryview,
                    payload_len: int, slot_bytes: int, direct: bool, sync: bool) -> int:
        """Write one frame (payload, then header page); return the bytes written."""
        handle = self._file(fd)
        body = payload[:slot_bytes] if len(payload) >= slot_bytes else payload[:payload_len]
        written = self._pwrite(handle, body, len(body), offset + PAGE)
        page = _scratch.wpage
        page[:HEADER_SIZE] = packed
        written += self._pwrite(handle, page, PAGE, offset)
        if sync:
            os.fdatasync(fd)   # per inode: covers what kvikio wrote through its descriptors
        return written

    def read_frame(self, fd: int, offset: int, out: memoryview, slot_bytes: int, direct: bool,
                   namespace: bytes | None, key: bytes | None, layout_fp: int | None,
                   ) -> tuple[FrameHeader, int]:
        """Read and check one frame's header, read its payload into ``out`` and verify it."""
        handle = self._file(fd)
        header, plen = self._read_header(handle, fd, offset, slot_bytes, namespace, key,
                                         layout_fp)
        if plen > len(out):
            raise BufferSizeError(f"output buffer of {len(out)} bytes is smaller than the "
                                  f"{plen}-byte frame")
        if plen:
            self._pread(handle, out[:plen], plen, offset + PAGE)
        header.verify(out[:plen])
        return header, PAGE + plen

    # ------------------------------------------------------------------ device buffers (HBM)
    def write_frame_device(self, fd: int, offset: int, packed: bytes, dev_payload: Any,
                           payload_len: int, *, sync: bool = False) -> int:
        """Write a frame whose payload is in device memory (any object with
        ``__cuda_array_interface__``, e.g. a cupy view of an HBM slot). ``packed`` must carry
        the payload's checksum already (computed where the bytes were on the host)."""
        handle = self._file(fd)
        written = self._pwrite(handle, dev_payload, payload_len, offset + PAGE)
        page = _scratch.wpage
        page[:HEADER_SIZE] = packed
        written += self._pwrite(handle, page, PAGE, offset)
        if sync:
            os.fdatasync(fd)
        return written

    def read_frame_device(self, fd: int, offset: int, dev_out: Any, slot_bytes: int, *,
                          namespace: bytes | None, key: bytes | None, layout_fp: int | None,
                          verify: bool = True) -> tuple[FrameHeader, int]:
        """Read a frame's payload straight into device memory (GDS when available).

        ``verify=True`` copies the payload back to the host (cupy) to check its checksum: a
        cost the caller may skip when it checks the block another way.
        """
        handle = self._file(fd)
        header, plen = self._read_header(handle, fd, offset, slot_bytes, namespace, key,
                                         layout_fp)
        capacity = int(getattr(dev_out, "nbytes", 0))
        if plen > capacity:
            raise BufferSizeError(f"device buffer of {capacity} bytes is smaller than the "
                                  f"{plen}-byte frame")
        if plen:
            self._pread(handle, dev_out, plen, offset + PAGE)
        if verify:
            import cupy

            flat = cupy.asarray(dev_out).reshape(-1).view(cupy.uint8)
            header.verify(memoryview(cupy.asnumpy(flat[:plen])))
        return header, PAGE + plen

    # ------------------------------------------------------------------ internals
    def _file(self, fd: int) -> Any:
        handle = self._files.get(fd)
        if handle is None:
            raise OSError(errno.EBADF, "slot file has no kvikio handle (tier closed?)")
        return handle

    def _read_header(self, handle: Any, fd: int, offset: int, slot_bytes: int,
                     namespace: bytes | None, key: bytes | None, layout_fp: int | None,
                     ) -> tuple[FrameHeader, int]:
        avail = max(os.fstat(fd).st_size - offset, 0)
        if avail < HEADER_SIZE:
            raise FrameError(f"slot truncated ({avail} bytes on disk)")
        page = _scratch.rpage
        got = min(PAGE, avail)
        self._pread(handle, page[:got], got, offset)
        header = FrameHeader.unpack(page)
        header.check(namespace, key, layout_fp)
        plen = header.payload_len
        if plen > slot_bytes:
            raise FrameError(f"frame of {plen} bytes does not fit its {slot_bytes}-byte slot")
        if avail < PAGE + plen:
            raise FrameError(f"frame payload truncated ({max(avail - PAGE, 0)} of {plen} "
                             "bytes on disk)")
        return header, plen

    @staticmethod
    def _pread(handle: Any, buf: Any, nbytes: int, offset: int) -> int:
        try:
            got = int(handle.pread(buf, nbytes, offset).get())
        except OSError:
            raise
        except Exception as exc:   # kvikio raises RuntimeError (CUfileException) and kin
            raise OSError(errno.EIO, f"kvikio pread failed: {exc}") from exc
        if got != nbytes:
            raise OSError(errno.EIO, f"short kvikio read ({got} of {nbytes} bytes)")
        return got

    @staticmethod
    def _pwrite(handle: Any, buf: Any, nbytes: int, offset: int) -> int:
        try:
            done = int(handle.pwrite(buf, nbytes, offset).get())
        except OSError:
            raise
        except Exception as exc:
            raise OSError(errno.EIO, f"kvikio pwrite failed: {exc}") from exc
        if done != nbytes:
            raise OSError(errno.EIO, f"short kvikio write ({done} of {nbytes} bytes)")
        return done


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
