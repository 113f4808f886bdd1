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

Modules: the device pool (``DevicePool``, ``CupyDevicePool``) is in kvtier.tiers.hbm_pool, the
engine-side ``HbmMapping`` in kvtier.tiers.hbm_mapping; this module keeps the tier and the
availability check and re-exports the others' names.

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
from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError, KVTierError
from kvtier.tiers.base import TierCounters, TierName
from kvtier.tiers.hbm_mapping import IPC_HANDLE_BYTES, HbmMapping
from kvtier.tiers.hbm_mapping import _normalize_bus_id as _normalize_bus_id
from kvtier.tiers.hbm_mapping import _validate_handle as _validate_handle
from kvtier.tiers.hbm_pool import CupyDevicePool, DevicePool, _check_range
from kvtier.tiers.nvme.backends import cuda_driver_status
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
        """Offset of a slot for ``nbytes`` bytes, or None when the pool is full (an attempt:
        the store evicts and retries, and counts the failure if that cannot make room)."""
        self._require_open()
        return self.allocator.alloc(nbytes)

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
