"""Client-side CUDA-stream prefetch: layer-wise loads and saves off the compute stream.

``LayerStreams`` gives an engine connector one dedicated *load* stream with one event
per layer and one *save* stream:

- ``start_step()`` makes the load stream wait for work already queued on the compute
  stream (pages being reused may still be read by it), without blocking the host;
- ``load_layer(i, fn)`` runs ``fn(stream)`` (e.g. a scatter from the registered arena)
  on the load stream and records layer i's event;
- ``wait_for_layer(i)`` makes the *compute* stream wait on layer i's event only, so
  layer 0's attention starts while layers 1.. are still loading (vLLM's
  ``wait_for_layer_load``). It never blocks the host;
- ``save_layer(i, fn)`` runs ``fn(stream)`` on the save stream after the compute
  stream's current work (the layer's KV is written), so saves never stall the forward
  pass; ``wait_for_saves()`` blocks the host until they are done (vLLM's
  ``wait_for_save``, before the arena slots are committed).

Without a CUDA device (``device=None`` or a CPU device) every call runs ``fn(None)``
synchronously and the waits return at once: the same connector code runs on the CPU.
torch is imported lazily; no cupy is needed here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

StreamFn = Callable[[Any], object]
"""A transfer to run; receives the stream to enqueue on (None on the CPU fallback)."""


class LayerStreams:
    """One load stream with per-layer events and one save stream, for one device.

    Invariant: ``wait_for_layer(i)`` only orders the compute stream after the last
    ``load_layer(i, ...)`` of the current step; a layer with no load submitted this
    step is a no-op, exactly like a layer whose KV is not being loaded.
    """

    def __init__(self, num_layers: int, device: Any = None) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        self.num_layers = num_layers
        self._device = _cuda_device(device)
        self._submitted = [False] * num_layers
        self._load_stream: Any = None
        self._save_stream: Any = None
        self._events: list[Any] = []
        if self._device is not None:
            import torch

            with torch.cuda.device(self._device):
                self._load_stream = torch.cuda.Stream()
                self._save_stream = torch.cuda.Stream()
                self._events = [torch.cuda.Event() for _ in range(num_layers)]

    @property
    def is_async(self) -> bool:
        """True when transfers run on CUDA streams; False on the synchronous fallback."""
        return self._device is not None

    @property
    def load_stream(self) -> Any:
        """The dedicated load stream (None on the CPU fallback)."""
        return self._load_stream

    @property
    def save_stream(self) -> Any:
        """The save stream (None on the CPU fallback)."""
        return self._save_stream

    def start_step(self) -> None:
        """Begin a forward step: forget last step's loads; order loads after compute."""
        self._submitted = [False] * self.num_layers
        if self._device is not None:
            self._load_stream.wait_stream(self._compute_stream())

    def load_layer(self, layer: int, fn: StreamFn) -> None:
        """Enqueue layer ``layer``'s load on the load stream and record its event."""
        self._check(layer)
        if self._device is None:
            fn(None)
        else:
            import torch

            with torch.cuda.stream(self._load_stream):
                fn(self._load_stream)
                self._events[layer].record(self._load_stream)
        self._submitted[layer] = True

    def wait_for_layer(self, layer: int) -> None:
        """Make the compute stream wait for this layer's load only (host never blocks)."""
        self._check(layer)
        if self._device is not None and self._submitted[layer]:
            self._compute_stream().wait_event(self._events[layer])

    def save_layer(self, layer: int, fn: StreamFn) -> None:
        """Enqueue a save of ``layer`` on the save stream, after the compute queued so far."""
        self._check(layer)
        if self._device is None:
            fn(None)
            return
        import torch

        self._save_stream.wait_stream(self._compute_stream())
        with torch.cuda.stream(self._save_stream):
            fn(self._save_stream)

    def compute_fence(self) -> Any:
        """An event recorded on the calling thread's compute stream (None on the CPU):
        hand it to :meth:`run_save` on another thread to order a save after this point."""
        if self._device is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(self._compute_stream())
        return event

    def run_save(self, fence: Any, fn: StreamFn) -> None:
        """Run ``fn(stream)`` on the save stream after ``fence`` and block the calling
        thread (a saver thread, never the forward) until it has finished."""
        if self._device is None:
            fn(None)
            return
        import torch

        if fence is not None:
            self._save_stream.wait_event(fence)
        with torch.cuda.stream(self._save_stream):
            fn(self._save_stream)
        self._save_stream.synchronize()

    def sync_loads(self) -> None:
        """Block the calling thread until every enqueued load has finished."""
        if self._device is not None:
            self._load_stream.synchronize()

    def wait_for_saves(self) -> None:
        """Block the host until every enqueued save has finished."""
        if self._device is not None:
            self._save_stream.synchronize()

    def layer_loaded(self, layer: int) -> bool:
        """Whether layer ``layer``'s load (if any this step) has completed, without waiting."""
        self._check(layer)
        if not self._submitted[layer]:
            return False
        return True if self._device is None else bool(self._events[layer].query())

    def _compute_stream(self) -> Any:
        import torch

        return torch.cuda.current_stream(self._device)

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")


def _cuda_device(device: Any) -> Any:
    """The torch CUDA device to use, or None for the synchronous CPU fallback."""
    if device is None:
        return None
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise RuntimeError(f"{dev} requested but torch sees no CUDA device")
    return dev


HOST_MEMORY_ALREADY_REGISTERED = 712   # cudaErrorHostMemoryAlreadyRegistered
_REGISTERED_LOCK = threading.Lock()   # (registries on several threads add to it)
_REGISTERED: tuple[tuple[int, int], ...] = ()
"""[start, end) of the host memory this process registered (one entry per arena): a row of
an arena is then known to be reachable from the device without asking CUDA."""


def in_registered_memory(ptr: int, nbytes: int = 1) -> bool:
    """Whether ``[ptr, ptr + nbytes)`` lies in memory ``register_host_memory`` registered.
    ``select_path`` asked ``cudaPointerGetAttributes`` for every block row of every layer
    (4,096 calls a step for 128 blocks of a 32-layer model, on the loader's critical path;
    found by a review of the unrun GPU path)."""
    return any(start <= ptr and ptr + nbytes <= end for start, end in _REGISTERED)


def register_host_memory(address: int, nbytes: int) -> bool:
    """Register host memory (the shared arena) with CUDA so copies and kernels reach it.

    Uses ``cudaHostRegister`` (portable + mapped) through cupy. Returns False, without
    raising, when cupy or a device is missing: callers then stay on the CPU path.
    """
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() <= 0:
            return False
        portable_mapped = 0x01 | 0x02
        try:
            cupy.cuda.runtime.hostRegister(address, nbytes, portable_mapped)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            # a second registry in this process (nothing here ever unregisters): the
            # memory is registered, so copies are asynchronous (not "stay pageable"). Not
            # recorded: CUDA says this for any overlap, so the range may be partly ours
            if getattr(exc, "status", None) != HOST_MEMORY_ALREADY_REGISTERED:
                raise
            return True
    except Exception:
        return False
    global _REGISTERED
    with _REGISTERED_LOCK:
        _REGISTERED = (*_REGISTERED, (address, address + nbytes))
    return True


def unregister_host_memory(address: int) -> None:
    """Undo :func:`register_host_memory` (before the arena is unmapped)."""
    import cupy

    global _REGISTERED
    with _REGISTERED_LOCK:
        _REGISTERED = tuple(r for r in _REGISTERED if r[0] != address)
    cupy.cuda.runtime.hostUnregister(address)
