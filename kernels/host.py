"""CPU gather/scatter in numpy: single-threaded, GIL-free copies straight into the rows.

A CPU engine's forward runs on an OpenMP team bound to the cores. torch's copies spread
over the intra-op pool, and a torch op started from another thread (the connector's
loader or saver) starts a *second* OpenMP team: on a small node that team steals the
cores the engine's team is spinning on, and the engine's step slows far more than the
copy costs. numpy copies run on the calling thread alone and release the GIL, so a
background save costs the engine at most one core for the copy's length, and nothing
when the thread runs at a lower priority.

The copies follow the same canonical views as ``reference.py`` (one strided copy per
block, layer and chunk, straight from the engine page into the block row: no staging
buffer, one memcpy per byte).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from kvtier.kernels.layouts import BlockGeometry, CanonicalView

from kvtier.errors import BufferSizeError

if TYPE_CHECKING:
    import torch
    from kvtier.kernels.reference import TransferPlan


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A numpy uint8 array aliasing a CPU tensor's memory from its first element."""
    import torch

    return t.view(torch.uint8).numpy()


def chunked_array(cache: torch.Tensor, view: CanonicalView, geom: BlockGeometry) -> np.ndarray:
    """uint8 array ``[page][sub][kv][chunk_token][head][row]`` aliasing a CPU layer cache."""
    c = geom.chunk_tokens
    size = (view.num_pages, view.page_size // c, view.num_kv, c, view.num_heads, view.row_bytes)
    stride = (view.page_stride, c * view.token_stride, view.kv_stride, view.token_stride,
              view.head_stride, 1)
    return np.lib.stride_tricks.as_strided(_as_bytes(cache), size, stride)


def block_array(row: torch.Tensor, geom: BlockGeometry) -> np.ndarray:
    """uint8 array ``[layer][kv][chunk][chunk_token][head][row]`` of one block row."""
    raw = _as_bytes(row.reshape(-1))
    if raw.size != geom.block_bytes:
        raise BufferSizeError(f"block rows hold {raw.size} bytes, the layout needs "
                              f"{geom.block_bytes}")
    return raw.reshape(geom.num_layers, geom.num_kv, geom.chunks_per_block,
                       geom.chunk_tokens, geom.num_heads, geom.row_bytes)


def _chunk_pairs(layer_caches: Sequence[torch.Tensor], plan: TransferPlan,
                 rows: Sequence[torch.Tensor]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(engine page chunk, block row chunk) views of every (layer, block, chunk) planned:
    both ``[kv][chunk_token][head][row]``, one strided copy apart."""
    geom = plan.geometry
    cpb = geom.chunks_per_block
    pages = plan.chunk_pages.reshape(-1, cpb).tolist()
    subs = plan.chunk_subs.reshape(-1, cpb).tolist()
    blocks = [block_array(r, geom) for r in rows]
    for layer, cache in enumerate(layer_caches):
        cached = chunked_array(cache, plan.view, geom)
        for blk, bp, bs in zip(blocks, pages, subs, strict=True):
            row = blk[layer]
            for j, (p, s) in enumerate(zip(bp, bs, strict=True)):
                yield cached[p, s], row[:, j]


def gather_host(layer_caches: Sequence[torch.Tensor], plan: TransferPlan,
                rows: Sequence[torch.Tensor]) -> None:
    """Copy the planned pages of every CPU layer cache into one row per block."""
    for page, chunk in _chunk_pairs(layer_caches, plan, rows):
        np.copyto(chunk, page)


def scatter_host(layer_caches: Sequence[torch.Tensor], plan: TransferPlan,
                 rows: Sequence[torch.Tensor]) -> None:
    """Copy one row per block into the planned pages of every CPU layer cache."""
    for page, chunk in _chunk_pairs(layer_caches, plan, rows):
        np.copyto(page, chunk)
