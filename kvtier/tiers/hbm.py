"""HBM tier: a daemon-owned GPU memory pool, carved into slots, shared with engines by CUDA IPC.

Owner side (the daemon): ``HbmTier`` allocates one device buffer of ``hbm.bytes`` with a plain
``cudaMalloc`` (``cupy.cuda.Memory``, never cupy's memory pool: an IPC handle always names a
whole allocation, so the pool must be one) and exports it once with
``cupy.cuda.runtime.ipcGetMemHandle``. Slots are handed out by ``SlabAllocator``, the same
slab/size-class scheme as the cpu arena (``kvtier.tiers.arena``): slots are whole 4 KiB pages,
a size class takes a unit of contiguous slabs, an emptied unit goes back to the pool.
``HbmTier.copy_in`` fills slots from host memory (the arena) and returns once the bytes are on
the device, so a slot handed to an engine right after is complete.

Client side (an engine process): ``HbmMapping.open(handle, size, device)`` maps the pool once
per process (``ipcOpenMemHandle``) and gives device pointers, cupy arrays or torch tensors of
slots by offset, so engines copy device-to-device. The process that allocated the pool cannot
open its own handle (CUDA refuses), which is why this is a separate class.

Availability: off unless ``hbm.enabled`` and ``hbm_available()`` holds (driver, device, cupy).
Nothing here imports cupy or torch at module import time.

Wiring: the daemon builds the pool and passes it to the store, which places blocks in it for
clients that ask for device placement (``kvtier.store.hbm``); the control handshake carries
``HbmTier.handshake_info`` to every client, and ``kvtier.client`` maps the pool lazily, only
for callers that asked for device placement.

UNTESTED ON HARDWARE: written without a GPU. The CUDA calls follow cupy's documented API
(``cupy.cuda.Memory``, ``runtime.ipcGetMemHandle``/``ipcOpenMemHandle``/``ipcCloseMemHandle``,
``runtime.memcpyAsync`` on a non-blocking ``cupy.cuda.Stream``,
``cupy.cuda.UnownedMemory``/``MemoryPointer``); the CPU tests cover the allocator, the tier's
bookkeeping and the store's placement over host-memory fake pools, the availability checks
and argument validation. ``tests/gpu/test_hbm.py`` and ``tests/gpu/test_hbm_daemon.py`` check
the real pool, an IPC round trip in a second process and a daemon serving device views.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.errors import BufferSizeError, ConfigError, KVTierError
from kvtier.tiers.base import TierCounters, TierName
from kvtier.tiers.nvme_backend import cuda_driver_status
from kvtier.tiers.slab import PAGE, SlabAllocator

__all__ = [
    "IPC_HANDLE_BYTES",
    "PAGE",
    "CupyDevicePool",
    "DevicePool",
    "HbmMapping",
    "HbmTier",
    "SlabAllocator",
    "hbm_available",
]

IPC_HANDLE_BYTES = 64          # sizeof(cudaIpcMemHandle_t)
_GPU_EXTRA = "pip install 'kvtier[gpu]'"


# ---------------------------------------------------------------------- availability
def hbm_available(device: int = 0) -> tuple[bool, str]:
    """(True, what was found) when the HBM tier can run on CUDA device ``device``, else
    (False, why not). Checks, in order: Linux (CUDA IPC), the driver (``libcuda.so.1``,
    ``cuInit``, device count), cupy importable, cupy agreeing that the device exists.
    Never raises; creates no CUDA context.
    """
    if not sys.platform.startswith("linux"):
        return False, f"CUDA IPC memory handles need Linux (this is {sys.platform})"
    if device < 0:
        return False, f"hbm.device must be >= 0, got {device}"
    driver = cuda_driver_status()
    if not driver.ok:
        return False, driver.reason
    if device >= driver.devices:
        return False, (f"hbm.device = {device} but only {driver.devices} CUDA device(s) are "
                       "visible")
    try:
        import cupy
    except ImportError:
        return False, f"cupy not installed ({_GPU_EXTRA})"
    except Exception as exc:  # a broken install
        return False, f"cupy failed to import ({type(exc).__name__}: {exc})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return False, f"cupy cannot use the CUDA runtime ({exc})"
    if device >= count:
        return False, f"hbm.device = {device} but cupy sees {count} CUDA device(s)"
    return True, f"cupy {getattr(cupy, '__version__', '?')}, device {device} of {count}"


# ---------------------------------------------------------------------- allocator
# ---------------------------------------------------------------------- device pool
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


# ---------------------------------------------------------------------- the tier
class HbmTier:
    """The daemon's HBM pool as a tier: capacity, occupancy, counters, slot allocation.

    Lifecycle: construct (checks sizes only), ``open()`` (allocates the device pool; a pool
    factory can be injected for tests), ``alloc``/``free``/``view`` from the event loop,
    ``close()``. ``capacity_bytes`` is the configured ``hbm.bytes`` rounded down to whole slabs
    and is a hard limit.
    """

    name = TierName.HBM

    def __init__(self, capacity_bytes: int, *, device: int = 0,
                 slab_bytes: int = 64 * 2**20, pool_factory: Any = None) -> None:
        if capacity_bytes <= 0:
            raise ConfigError("hbm.enabled needs hbm.bytes > 0 (the device pool size, e.g. 8GiB)")
        if device < 0:
            raise ConfigError(f"hbm.device must be >= 0, got {device}")
        self.counters = TierCounters()
        self.device = device
        self.allocator = SlabAllocator(capacity_bytes, slab_bytes)
        self._factory = pool_factory if pool_factory is not None else CupyDevicePool
        self._pool: DevicePool | None = None
        self._closed = False
        self.placement = "pool only: no store places blocks in hbm"
        """What uses the pool, shown in stats (the store replaces it when it takes the tier)."""

    # ------------------------------------------------------------------ Tier protocol
    @property
    def backend(self) -> str:
        return "cuda-ipc"

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.size

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def blocks(self) -> int:
        return self.allocator.allocated_slots

    @property
    def up(self) -> bool:
        return self._pool is not None and not self._closed

    def stats_extra(self) -> dict[str, Any]:
        """Device details merged into ``tiers.hbm`` of /v1/stats."""
        out: dict[str, Any] = {"slab_bytes": self.allocator.slab_bytes,
                               "placement": self.placement}
        if self._pool is not None:
            out.update(self._pool.describe())
        else:
            out["device"] = self.device
        return out

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Allocate the device pool (once)."""
        if self._pool is not None or self._closed:
            raise KVTierError("hbm tier: open() is called once")
        self._pool = self._factory(self.allocator.size, self.device)

    def close(self) -> None:
        """Free the device pool. Engines that still map it must not touch it afterwards."""
        if self._pool is not None:
            self._pool.close()
        self._pool = None
        self._closed = True

    # ------------------------------------------------------------------ slots
    def alloc(self, nbytes: int) -> int | None:
        """Offset of a slot for ``nbytes`` bytes, or None (counted) when the pool is full."""
        self._require_open()
        off = self.allocator.alloc(nbytes)
        if off is None:
            self.counters.allocation_failures += 1
        return off

    def free(self, offset: int) -> None:
        """Return a slot."""
        self._require_open()
        self.allocator.free(offset)

    def device_ptr(self, offset: int) -> int:
        """The daemon-side device address of a slot offset."""
        pool = self._require_open()
        _check_range(offset, 0, pool.size)
        return pool.ptr + offset

    def view(self, offset: int, nbytes: int) -> Any:
        """A device array (cupy) over a slot, for daemon-side copies."""
        return self._require_open().view(offset, nbytes)

    def copy_in(self, items: Sequence[tuple[int, Any]]) -> None:
        """Fill slots from host memory: ``items`` are (slot offset, uint8 numpy array) pairs.
        Blocking (run it in a worker thread); returns once the bytes are on the device."""
        self._require_open().copy_in(items)

    def export_handle(self) -> bytes:
        """The CUDA IPC handle of the whole pool (64 bytes) for engine processes."""
        return self._require_open().export_handle()

    def handshake_info(self) -> dict[str, Any]:
        """What a client needs to map the pool: to go in the control handshake (msgpack-safe).

        ``pci_bus_id`` lets a client whose ``CUDA_VISIBLE_DEVICES`` numbers devices
        differently find the same GPU.
        """
        pool = self._require_open()
        desc = pool.describe()
        return {"handle": pool.export_handle(), "size": pool.size, "device": pool.device,
                "pci_bus_id": desc.get("pci_bus_id", "")}

    def _require_open(self) -> DevicePool:
        if self._pool is None or self._closed:
            raise KVTierError("hbm tier is not open")
        return self._pool


# ---------------------------------------------------------------------- client side
_MAPPINGS: dict[tuple[bytes, int], HbmMapping] = {}
_MAPPINGS_LOCK = threading.Lock()


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

    def device_ptr(self, offset: int, nbytes: int = 0) -> int:
        """The device address of ``[offset, offset + nbytes)`` in this process."""
        if self._closed:
            raise KVTierError("HBM mapping is closed")
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
