"""The HBM tier's device pool: one ``cudaMalloc`` the tier carves into slots.

``DevicePool`` is the interface ``HbmTier`` allocates through (tests inject a host-memory
fake behind it); ``CupyDevicePool`` is the real one. See kvtier.tiers.hbm for the design
and for what is untested on hardware. Nothing here imports cupy at module import time.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.errors import BufferSizeError, ConfigError


class DevicePool(Protocol):
    """One device allocation the tier carves up (``CupyDevicePool``; tests use a host fake)."""

    ptr: int
    size: int
    device: int

    def export_handle(self) -> bytes: ...

    def view(self, offset: int, nbytes: int) -> Any: ...

    def copy_in(self, items: Sequence[tuple[int, Any]]) -> None:
        """Copy each host buffer (a C-contiguous uint8 numpy array) to its pool offset and
        return once every byte is on the device. Called from a worker thread."""
        ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...



class CupyDevicePool:
    """``size`` bytes of device memory on ``device`` from one ``cudaMalloc`` (cupy).

    UNTESTED ON HARDWARE (see the module docstring).
    """

    def __init__(self, size: int, device: int = 0) -> None:
        import cupy

        self.size = size
        self.device = device
        try:
            with cupy.cuda.Device(device):
                self._mem = cupy.cuda.memory.Memory(size)   # a whole allocation: IPC exports it all
                cupy.cuda.runtime.memset(self._mem.ptr, 0, size)
                cupy.cuda.runtime.deviceSynchronize()
                self.pci_bus_id = str(cupy.cuda.runtime.deviceGetPCIBusId(device))
                props = cupy.cuda.runtime.getDeviceProperties(device)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise ConfigError(f"cannot allocate hbm.bytes = {size} on CUDA device {device}: "
                              f"{exc}; lower hbm.bytes") from exc
        name = props.get("name", b"?")
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.ptr = int(self._mem.ptr)
        self._handle: bytes | None = None
        self._stream: Any = None
        self._stream_lock = threading.Lock()

    def export_handle(self) -> bytes:
        """The pool's ``cudaIpcMemHandle_t`` (64 bytes), made once."""
        if self._handle is None:
            import cupy

            with cupy.cuda.Device(self.device):
                self._handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.ptr))
        return self._handle

    def view(self, offset: int, nbytes: int) -> Any:
        """A uint8 cupy array over ``[offset, offset + nbytes)`` of the pool (no copy)."""
        import cupy

        _check_range(offset, nbytes, self.size)
        ptr = cupy.cuda.memory.MemoryPointer(self._mem, offset)
        return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=ptr)

    def copy_in(self, items: Sequence[tuple[int, Any]]) -> None:
        """H2D copies of host arrays into pool slots on the pool's own non-blocking stream,
        then one stream synchronize: ``cudaMemcpyAsync`` from pageable memory may return
        before the DMA lands, and the daemon hands the slots to engines right after.

        Thread-safe (CUDA API calls are; the stream is made once under a lock).
        """
        import cupy

        for off, src in items:
            _check_range(off, int(src.nbytes), self.size)
        with cupy.cuda.Device(self.device):
            with self._stream_lock:
                if self._stream is None:
                    self._stream = cupy.cuda.Stream(non_blocking=True)
                stream = self._stream
            for off, src in items:
                cupy.cuda.runtime.memcpyAsync(self.ptr + off, int(src.ctypes.data),
                                              int(src.nbytes),
                                              cupy.cuda.runtime.memcpyHostToDevice,
                                              stream.ptr)
            stream.synchronize()

    def describe(self) -> dict[str, Any]:
        return {"device": self.device, "device_name": self.name, "pci_bus_id": self.pci_bus_id}

    def close(self) -> None:
        """Free the allocation (engines must have closed their mappings first)."""
        self._mem = None
        self.ptr = 0


def _check_range(offset: int, nbytes: int, size: int) -> None:
    """BufferSizeError unless ``[offset, offset + nbytes)`` lies inside a ``size``-byte pool."""
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise BufferSizeError(f"range [{offset}, {offset + nbytes}) is outside the "
                              f"{size}-byte HBM pool")

