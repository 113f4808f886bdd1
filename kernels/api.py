"""Public gather/scatter API: engine paged caches <-> kvtier contiguous blocks.

One entry point per direction. The path is chosen from where the tensors live:
CUDA caches with cupy present run the CUDA kernel (one launch for all layers, on the
given stream); CPU caches and buffers run the numpy host copies (``host.py``: no second
OpenMP team beside the engine's); everything else runs the torch reference. The chosen
path is returned so callers (and ``kvtier stats``) can report it (``TORCH`` covers both
reference paths).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from kvtier.kernels.layouts import PagedLayout, block_geometry

from kvtier.errors import BufferSizeError

if TYPE_CHECKING:
    import torch

    # Blocks as one (n_blocks, block_bytes) tensor, or one tensor per block in a list or
    # tuple (arena slots need not be adjacent).
    BlockBuffers: TypeAlias = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]

class KernelPath(enum.Enum):
    """Which implementation moved the bytes."""

    TORCH = "torch"
    CUDA = "cuda"


@functools.lru_cache(maxsize=1)
def _cuda_kernels_usable() -> bool:
    from kvtier.kernels.cuda import cupy_available

    return cupy_available()


def select_path(
    layer_caches: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]
) -> KernelPath:
    """CUDA when the caches are on a GPU, cupy works, and every kvtier buffer is
    reachable from the device (device memory or pinned/registered host memory);
    TORCH otherwise (CPU engines, no cupy, or pageable host buffers)."""
    if not layer_caches or layer_caches[0].device.type != "cuda":
        return KernelPath.TORCH
    if not _cuda_kernels_usable():
        return KernelPath.TORCH
    from kvtier.kernels.cuda import is_device_accessible

    device = layer_caches[0].device
    for buf in buffers:
        if buf.device.type == "cuda" and buf.device != device:
            return KernelPath.TORCH
        if buf.device.type == "cpu" and not is_device_accessible(buf.data_ptr()):
            return KernelPath.TORCH
    return KernelPath.CUDA


def block_bytes(layer_caches: Sequence[torch.Tensor], layout: PagedLayout,
                tokens_per_block: int) -> int:
    """Bytes of one kvtier block for these engine caches (the buffer row size)."""
    from kvtier.kernels.reference import layer_views

    return block_geometry(layer_views(layer_caches, layout), tokens_per_block).block_bytes


def gather_blocks(
    layer_caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    page_ids: torch.Tensor,
    out: BlockBuffers,
    *,
    tokens_per_block: int | None = None,
    token_offsets: torch.Tensor | None = None,
    stream: Any = None,
    path: KernelPath | None = None,
) -> KernelPath:
    """Copy the engine pages of each block into kvtier's contiguous block format.

    ``layer_caches``: one tensor per layer in ``layout``. ``page_ids``: int64
    ``(n_blocks, pages_per_block)`` in token order (for sub-page blocks ``(n_blocks, 1)``
    plus ``token_offsets`` and ``tokens_per_block``). ``out``: ``(n_blocks, block_bytes)``
    uint8 (or any dtype with that many bytes per row; rows may be strided) or one
    1-D tensor per block (arena slots need not be adjacent). On the CUDA path the copy is
    enqueued on ``stream`` (default: torch's current stream) and is asynchronous.
    """
    from kvtier.kernels.reference import plan_transfer

    plan = plan_transfer(layer_caches, layout, page_ids, tokens_per_block=tokens_per_block,
                         token_offsets=token_offsets)
    rows = _rows(out, plan.n_blocks)
    chosen = path or select_path(layer_caches, rows)
    if chosen is KernelPath.CUDA:
        from kvtier.kernels.cuda import launch

        launch("gather", layer_caches, plan, _row_pointers(rows, plan.geometry.block_bytes),
               stream)
        return chosen
    if _on_host(layer_caches, rows, plan.geometry.block_bytes):
        from kvtier.kernels.host import gather_host

        gather_host(layer_caches, plan, rows)
        return chosen
    from kvtier.kernels.reference import gather_reference

    if isinstance(out, (list, tuple)):
        import torch

        staging = torch.empty((plan.n_blocks, plan.geometry.block_bytes), dtype=torch.uint8,
                              device=layer_caches[0].device)
        _row_pointers(rows, plan.geometry.block_bytes)  # validates sizes
        gather_reference(layer_caches, plan, staging)
        for row, dst in zip(staging, rows, strict=True):
            dst.view(torch.uint8).copy_(row)
    else:
        gather_reference(layer_caches, plan, out)
    return chosen


def scatter_blocks(
    layer_caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    page_ids: torch.Tensor,
    src: BlockBuffers,
    *,
    tokens_per_block: int | None = None,
    token_offsets: torch.Tensor | None = None,
    stream: Any = None,
    path: KernelPath | None = None,
) -> KernelPath:
    """Copy kvtier blocks back into the engine pages named by ``page_ids``.

    The reverse of :func:`gather_blocks`, with the same arguments; pages not named
    are left untouched, and a mapping that writes one page slice twice is refused.
    """
    from kvtier.kernels.reference import plan_transfer

    plan = plan_transfer(layer_caches, layout, page_ids, tokens_per_block=tokens_per_block,
                         token_offsets=token_offsets, for_scatter=True)
    rows = _rows(src, plan.n_blocks)
    chosen = path or select_path(layer_caches, rows)
    if chosen is KernelPath.CUDA:
        from kvtier.kernels.cuda import launch

        launch("scatter", layer_caches, plan, _row_pointers(rows, plan.geometry.block_bytes),
               stream)
        return chosen
    if _on_host(layer_caches, rows, plan.geometry.block_bytes):
        from kvtier.kernels.host import scatter_host

        scatter_host(layer_caches, plan, rows)
        return chosen
    from kvtier.kernels.reference import scatter_reference

    if isinstance(src, (list, tuple)):
        import torch

        _row_pointers(rows, plan.geometry.block_bytes)  # validates sizes
        src = torch.stack([r.view(torch.uint8).reshape(-1) for r in rows])
    scatter_reference(layer_caches, plan, src)
    return chosen


def _on_host(layer_caches: Sequence[torch.Tensor], rows: Sequence[torch.Tensor],
             nbytes: int) -> bool:
    """Whether the numpy host copies apply (every tensor in CPU memory); the rows'
    sizes and contiguity are checked first."""
    if layer_caches[0].device.type != "cpu" or any(r.device.type != "cpu" for r in rows):
        return False
    _row_pointers(rows, nbytes)
    return True


def _rows(buffer: BlockBuffers, n_blocks: int) -> list[torch.Tensor]:
    """The per-block rows of a block buffer, whichever form it came in."""
    rows = list(buffer) if isinstance(buffer, (list, tuple)) else list(buffer.unbind(0))
    if len(rows) != n_blocks:
        raise BufferSizeError(f"{len(rows)} block buffers for {n_blocks} blocks")
    return rows


def _row_pointers(rows: Sequence[torch.Tensor], nbytes: int) -> list[int]:
    """Base address of each block row, after checking it is contiguous and big enough."""
    ptrs = []
    for i, row in enumerate(rows):
        size = row.numel() * row.element_size()
        if size != nbytes or not row.is_contiguous():
            raise BufferSizeError(f"block buffer {i} must be {nbytes} contiguous bytes, "
                                  f"got {size} (contiguous={row.is_contiguous()})")
        ptrs.append(row.data_ptr())
    return ptrs
