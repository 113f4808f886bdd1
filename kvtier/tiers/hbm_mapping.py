"""The engine side of the HBM tier: a process's mapping of the daemon's pool (CUDA IPC).

``HbmMapping.open`` maps the pool exported by ``HbmTier.export_handle`` once per process and
device; the process that allocated the pool cannot open its own handle (CUDA refuses), which
is why this is a separate class. See kvtier.tiers.hbm for the design. Nothing here imports
cupy or torch at module import time.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from kvtier.errors import BufferSizeError, ConfigError, KVTierError
from kvtier.tiers.hbm_pool import _check_range

IPC_HANDLE_BYTES = 64          # sizeof(cudaIpcMemHandle_t)


def _normalize_bus_id(bus_id: str) -> str:
    """``0000:C1:00.0`` and ``00000000:c1:00.0`` name the same device: compare them equal."""
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        try:
            return f"{int(parts[0], 16):08x}:{parts[1]}:{parts[2]}"
        except ValueError:
            return text
    return text


_MAPPINGS: dict[tuple[bytes, int], HbmMapping] = {}
_MAPPINGS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """In a forked child: a fresh ``_MAPPINGS_LOCK`` (the parent's may be held by a thread
    that does not exist here, inside ``cudaIpcOpenMemHandle``), and none of the parent's
    mappings. A CUDA IPC mapping is a pointer of the parent's CUDA context, which the
    child does not have: each is marked closed, so a later ``open`` maps the pool anew and
    the inherited clients' ``close`` makes no CUDA call."""
    global _MAPPINGS_LOCK
    _MAPPINGS_LOCK = threading.Lock()
    for mapping in _MAPPINGS.values():
        mapping._closed = True
    _MAPPINGS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _validate_handle(handle: bytes, size: int) -> bytes:
    if not isinstance(handle, (bytes, bytearray, memoryview)):
        raise ConfigError(f"HBM IPC handle must be bytes, got {type(handle).__name__}")
    raw = bytes(handle)
    if len(raw) != IPC_HANDLE_BYTES:
        raise ConfigError(f"HBM IPC handle must be {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
    if size <= 0:
        raise ConfigError(f"HBM pool size must be > 0, got {size}")
    return raw


def _resolve_device(device: int, pci_bus_id: str | None) -> int:
    """The local ordinal of the daemon's GPU: by PCI bus id when given, else ``device``."""
    if not pci_bus_id:
        return device
    import cupy

    want = _normalize_bus_id(pci_bus_id)
    for i in range(int(cupy.cuda.runtime.getDeviceCount())):
        if _normalize_bus_id(str(cupy.cuda.runtime.deviceGetPCIBusId(i))) == want:
            return i
    raise ConfigError(f"the daemon's HBM pool is on GPU {pci_bus_id}, which this process does "
                      "not see (check CUDA_VISIBLE_DEVICES)")


class HbmMapping:
    """An engine process's view of the daemon's HBM pool (mapped once per process and device).

    ``open`` returns the existing mapping when the same handle was already opened here and
    counts the reference; each ``open`` is paired with one ``close``, and the last ``close``
    unmaps (so several clients in one process share one mapping, and an engine that outlives
    a daemon restart does not keep the old pool's memory mapped). Slots are addressed by the
    offsets the daemon hands out. UNTESTED ON HARDWARE.
    """

    def __init__(self, ptr: int, size: int, device: int, *, handle: bytes = b"",
                 closer: Any = None) -> None:
        self.ptr = ptr
        self.size = size
        self.device = device
        self._handle = handle
        self._closer = closer
        self._closed = False
        self._refs = 1

    @classmethod
    def open(cls, handle: bytes, size: int, device: int = 0, *,
             pci_bus_id: str | None = None) -> HbmMapping:
        """Map the pool exported by ``HbmTier.export_handle`` (``cudaIpcOpenMemHandle`` with
        lazy peer access). Raises ConfigError for a malformed handle or a GPU not visible
        here, and cupy's CUDARuntimeError when CUDA refuses the handle."""
        raw = _validate_handle(handle, size)
        with _MAPPINGS_LOCK:
            found = _MAPPINGS.get((raw, size))
            if found is not None and not found._closed:
                found._refs += 1
                return found
            import cupy

            local = _resolve_device(device, pci_bus_id)
            with cupy.cuda.Device(local):
                ptr = int(cupy.cuda.runtime.ipcOpenMemHandle(raw))

            def closer(p: int = ptr, d: int = local) -> None:
                with cupy.cuda.Device(d):
                    cupy.cuda.runtime.ipcCloseMemHandle(p)

            mapping = cls(ptr, size, local, handle=raw, closer=closer)
            _MAPPINGS[(raw, size)] = mapping
            return mapping

    @staticmethod
    def on_current_device(device: int = 0, *, pci_bus_id: str | None = None) -> bool:
        """Whether the pool (``device``, or the GPU of ``pci_bus_id``) is the calling
        thread's current CUDA device. A caller on another GPU should not map it: that
        makes a CUDA context on the pool's GPU (hundreds of MiB) and turns each load
        into a peer copy. ConfigError for a GPU not visible here, as ``open``."""
        import cupy

        return _resolve_device(device, pci_bus_id) == int(cupy.cuda.runtime.getDevice())

    def device_ptr(self, offset: int, nbytes: int = 0) -> int:
        """The device address of ``[offset, offset + nbytes)`` in this process."""
        if self._closed:
            raise KVTierError("HBM mapping is closed")
        if type(offset) is not int or type(nbytes) is not int:   # a bool or a float
            raise BufferSizeError(f"HBM pool range of {type(offset).__name__} offset "   # passed
                                  f"and {type(nbytes).__name__} size")   # (found by review)
        _check_range(offset, nbytes, self.size)
        return self.ptr + offset

    def cupy_view(self, offset: int, nbytes: int) -> Any:
        """A uint8 cupy array over a slot (no copy); keeps this mapping alive."""
        import cupy

        ptr = self.device_ptr(offset, nbytes)
        mem = cupy.cuda.memory.UnownedMemory(ptr, nbytes, self, self.device)
        memptr = cupy.cuda.memory.MemoryPointer(mem, 0)
        return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=memptr)

    def view(self, offset: int, nbytes: int) -> Any:
        """The view a client lease hands out for an hbm slot: a uint8 cupy array (device
        memory of the daemon's pool; read it, never write it)."""
        return self.cupy_view(offset, nbytes)

    def torch_view(self, offset: int, nbytes: int) -> Any:
        """A uint8 torch tensor over a slot (no copy, through DLPack)."""
        import torch

        return torch.from_dlpack(self.cupy_view(offset, nbytes))

    def close(self) -> None:
        """Drop one reference; the last one unmaps (``cudaIpcCloseMemHandle``). Views made
        from it must be dropped first."""
        if self._closed:
            return
        with _MAPPINGS_LOCK:
            self._refs -= 1
            if self._refs > 0:
                return
            self._closed = True
            if _MAPPINGS.get((self._handle, self.size)) is self:
                del _MAPPINGS[(self._handle, self.size)]
        if self._closer is not None:
            self._closer()
