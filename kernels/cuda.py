"""CUDA path: load ``gather_scatter.cu`` with cupy (NVRTC) at first use and launch it.

The module is compiled once per process and device and cached. Launches take raw
pointers, so the kvtier side may be device memory or host memory registered with
CUDA (``cudaHostRegister`` / pinned): the kernel writes straight into the daemon's
shared arena with no staging copy. cupy is imported inside functions only, so this
module imports on machines without it.

Not exercised on hardware in the session that wrote it (no GPU was lent); the GPU
tests in ``tests/gpu`` check it against the torch reference wherever a GPU exists.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from kvtier.kernels.cuda_stream import in_registered_memory
from kvtier.kernels.layouts import vector_bytes

from kvtier.errors import LayoutMismatch

log = logging.getLogger("kvtier.kernels")

if TYPE_CHECKING:
    import torch
    from kvtier.kernels.reference import TransferPlan

SOURCE_NAME = "gather_scatter.cu"
THREADS_PER_CTA = 256
MAX_CTAS = 65535 * 8
_MEMORY_TYPE_UNREGISTERED = 0


def cupy_available() -> bool:
    """True when cupy imports and sees at least one CUDA device (never raises)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def kernel_source() -> str:
    """The CUDA C source shipped as package data next to this module."""
    return resources.files("kvtier.kernels").joinpath(SOURCE_NAME).read_text()


_MODULES: dict[int, Any] = {}
_COMPILE_LOCK = threading.Lock()


def _module(device_index: int) -> Any:
    """Compile (NVRTC) and cache the kernel module for one device, once (the loader and
    saver threads both reach it; a compile is slow)."""
    found = _MODULES.get(device_index)
    if found is not None:
        return found
    with _COMPILE_LOCK:
        found = _MODULES.get(device_index)
        if found is None:
            import cupy

            with cupy.cuda.Device(device_index):
                found = cupy.RawModule(code=kernel_source(), options=("-std=c++17",))
                found.compile()
            _MODULES[device_index] = found
    return found


def warm_kernels(device_index: int) -> bool:
    """Compile the module for a device now (a GPU engine's start), so that the first
    step's loads do not pay for NVRTC. False without cupy or a device, or when the compile
    fails (logged: the launch would fail the same way and the load be recomputed)."""
    if not cupy_available():
        return False
    try:
        _module(device_index)
    except Exception as exc:
        log.warning("kvtier: compiling the transfer kernels for GPU %d failed (%s: %s)",
                    device_index, type(exc).__name__, exc)
        return False
    return True


def kernel(direction: str, vec: int, device_index: int) -> Any:
    """The compiled ``kvtier_{gather,scatter}_v{vec}`` function for a device."""
    return _module(device_index).get_function(f"kvtier_{direction}_v{vec}")


def is_device_accessible(ptr: int) -> bool:
    """True when a pointer is device memory or CUDA-registered/pinned host memory (an
    arena this process registered is known without a CUDA call)."""
    if in_registered_memory(ptr):
        return True
    import cupy

    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(ptr)
    except cupy.cuda.runtime.CUDARuntimeError:
        return False
    return int(attrs.type) != _MEMORY_TYPE_UNREGISTERED


def _stream_handle(stream: Any) -> int:
    """Raw cudaStream_t of a torch or cupy stream, an int handle, or torch's current one."""
    if stream is None:
        import torch

        return int(torch.cuda.current_stream().cuda_stream)
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"not a CUDA stream: {stream!r}")


def launch(
    direction: str,
    layer_caches: Sequence[torch.Tensor],
    plan: TransferPlan,
    block_ptrs: Sequence[int],
    stream: Any = None,
) -> None:
    """Run one gather or scatter over all layers and blocks on ``stream``.

    ``block_ptrs`` are the kvtier block addresses (device memory or registered host
    memory), one per block. The call is asynchronous on the stream; index arrays are
    staged to the device on that same stream, so ordering is preserved.
    """
    import cupy
    import numpy as np
    import torch

    device = layer_caches[0].device
    if device.type != "cuda":
        raise LayoutMismatch("the CUDA path needs layer caches on a CUDA device")
    geom, view = plan.geometry, plan.view
    if len(block_ptrs) != plan.n_blocks:
        raise LayoutMismatch(f"{len(block_ptrs)} block pointers for {plan.n_blocks} blocks")
    if plan.n_blocks == 0:
        return
    layer_ptrs = [c.data_ptr() for c in layer_caches]
    vec = vector_bytes(view.row_bytes, *layer_ptrs, *block_ptrs, view.page_stride,
                       view.kv_stride, view.token_stride, view.head_stride)
    total = plan.n_blocks * geom.num_layers * geom.num_kv * geom.chunks_per_block
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index), cupy.cuda.Device(index):
        handle = _stream_handle(stream)
        torch_stream = torch.cuda.ExternalStream(handle)
        with torch.cuda.stream(torch_stream):
            ptrs = torch.tensor(layer_ptrs + list(block_ptrs), dtype=torch.int64)
            ptrs = ptrs.pin_memory().to(device, non_blocking=True)
            pages = plan.chunk_pages.to(device, non_blocking=True)
            subs = plan.chunk_subs.to(device, non_blocking=True)
        fn = kernel(direction, vec, index)
        args = (
            np.uint64(ptrs.data_ptr()),
            np.uint64(ptrs.data_ptr() + 8 * len(layer_ptrs)),
            np.uint64(pages.data_ptr()),
            np.uint64(subs.data_ptr()),
            np.int32(geom.num_layers), np.int32(geom.num_kv),
            np.int32(geom.chunks_per_block), np.int32(geom.chunk_tokens),
            np.int32(geom.num_heads), np.int32(geom.row_bytes),
            np.int64(view.page_stride), np.int64(view.kv_stride),
            np.int64(view.token_stride), np.int64(view.head_stride),
            np.int64(total),
        )
        fn((min(total, MAX_CTAS),), (THREADS_PER_CTA,), args,
           stream=cupy.cuda.ExternalStream(handle))
        # The index tensors must outlive the kernel: tie them to the stream.
        for t in (ptrs, pages, subs):
            t.record_stream(torch_stream)
