"""The kvikio FrameIO backend: the nvme tier's frames through ``kvikio.CuFile`` (GPU hosts).

kvikio uses GPUDirect Storage where cuFile is set up and its own POSIX compat mode
otherwise. The on-disk format is exactly the POSIX backend's (``kvtier.tiers.nvme.frameio``),
so files written by one backend are read by the other. ``kvtier.tiers.nvme.backends`` decides
whether this backend runs.

UNTESTED ON HARDWARE: the kvikio calls here were written against kvikio's documented Python
API (``CuFile(path, "r+")``, ``pread``/``pwrite`` returning an ``IOFuture``,
``kvikio.defaults``) on a machine without a GPU or kvikio; only the error paths are exercised
by the CPU tests (with a fake kvikio module). ``tests/gpu/test_kvikio.py`` checks the real
thing wherever a GPU and kvikio exist (``scripts/device_check.sh``).

Nothing here imports kvikio (or cupy) at module import time.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

from kvtier.errors import BufferSizeError, FrameError
from kvtier.frame import HEADER_SIZE, FrameHeader
from kvtier.tiers.aligned import PAGE
from kvtier.tiers.nvme.buffers import scratch
from kvtier.tiers.nvme.frameio import PooledFrameIO

__all__ = ["KvikioFileIO", "kvikio_mode"]

log = logging.getLogger(__name__)


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


class KvikioFileIO(PooledFrameIO):
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
        """Open a CuFile on a slot file the tier just opened (``fd``), through the
        descriptor's own /proc link: the file the tier checked, even if ``path`` was
        swapped since (opened by path, a reopen could reach a file put there meanwhile;
        found by review)."""
        try:
            handle = self._kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")
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
        page = scratch.wpage
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
        page = scratch.wpage
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
        page = scratch.rpage
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
