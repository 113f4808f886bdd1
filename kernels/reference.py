"""Torch reference gather/scatter between engine paged caches and kvtier blocks.

This is the CPU data path (the vLLM connector calls it when the engine runs on the
CPU) and the oracle the CUDA kernel is tested against. It works on bytes: every layer
cache is reinterpreted as uint8 and seen through its canonical strided view (see
``layouts.py``), so any element type, fp8 included, copies bit-exactly. It is
vectorized per layer (one advanced-indexing gather or ``index_put_`` per layer), never
per token.

torch is imported lazily so ``import kvtier.kernels`` works without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.kernels.layouts import (
    NULL_PAGE,
    BlockGeometry,
    CanonicalView,
    PagedLayout,
    block_geometry,
    canonical_view,
)

from kvtier.errors import BufferSizeError, LayoutMismatch

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Everything both paths need for one gather or scatter call.

    ``chunk_pages`` and ``chunk_subs`` (int64, ``n_blocks * chunks_per_block``) name,
    for each chunk in block-major token order, the engine page and the index of the
    ``chunk_tokens``-sized slice inside that page.
    """

    geometry: BlockGeometry
    view: CanonicalView
    chunk_pages: torch.Tensor
    chunk_subs: torch.Tensor

    @property
    def n_blocks(self) -> int:
        """Number of kvtier blocks moved by this call."""
        return self.chunk_pages.numel() // self.geometry.chunks_per_block


def layer_views(layer_caches: Sequence[torch.Tensor], layout: PagedLayout) -> list[CanonicalView]:
    """Canonical byte views of each layer cache (shape checks included)."""
    return [canonical_view(layout, c.shape, c.stride(), c.element_size()) for c in layer_caches]


def plan_transfer(
    layer_caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    page_ids: torch.Tensor,
    *,
    tokens_per_block: int | None = None,
    token_offsets: torch.Tensor | None = None,
    for_scatter: bool = False,
) -> TransferPlan:
    """Validate a mapping and flatten it into per-chunk (page, sub-page) indices.

    ``page_ids`` is ``(n_blocks, pages_per_block)`` int; ``tokens_per_block`` defaults to
    ``pages_per_block * page_size`` and must be given for sub-page blocks, with
    ``token_offsets`` ``(n_blocks,)``. Values are checked when ``page_ids`` lives on the
    CPU (no device sync on the hot path): the null page 0 and out-of-range pages are
    refused, and a scatter may not write one chunk twice.
    """
    import torch

    views = layer_views(layer_caches, layout)
    if page_ids.dim() != 2:
        raise LayoutMismatch(f"page_ids must be (n_blocks, pages_per_block), got "
                             f"shape {tuple(page_ids.shape)}")
    psize = views[0].page_size if views else 0
    tpb = tokens_per_block if tokens_per_block is not None else page_ids.shape[1] * psize
    geom = block_geometry(views, tpb)
    if page_ids.shape[1] != geom.chunks_per_block:
        raise LayoutMismatch(f"page_ids has {page_ids.shape[1]} pages per block, the "
                             f"geometry needs {geom.chunks_per_block} "
                             f"(tokens_per_block={tpb}, page_size={psize})")
    pages = page_ids.to(torch.int64).reshape(-1)
    n_blocks = page_ids.shape[0]
    if geom.page_size > geom.tokens_per_block:
        if token_offsets is None or tuple(token_offsets.shape) != (n_blocks,):
            raise LayoutMismatch(f"page_size {psize} > tokens_per_block {tpb}: pass "
                                 f"token_offsets of shape ({n_blocks},)")
        offsets = token_offsets.to(device=pages.device, dtype=torch.int64)
        subs = torch.div(offsets, tpb, rounding_mode="floor")
        if offsets.device.type == "cpu" and n_blocks and (
            bool((offsets % tpb != 0).any()) or bool((offsets < 0).any())
            or bool((offsets >= psize).any())):
            raise LayoutMismatch(f"token_offsets must be multiples of {tpb} in [0, {psize})")
    else:
        if token_offsets is not None:
            raise LayoutMismatch("token_offsets only apply when page_size > tokens_per_block")
        subs = torch.zeros_like(pages)
    if pages.device.type == "cpu" and pages.numel():
        _check_pages(pages, subs, views[0].num_pages, geom, for_scatter)
    return TransferPlan(geom, views[0], pages, subs)


def _check_pages(pages: torch.Tensor, subs: torch.Tensor, num_pages: int,
                 geom: BlockGeometry, for_scatter: bool) -> None:
    lo, hi = int(pages.min()), int(pages.max())
    if lo <= NULL_PAGE or hi >= num_pages:
        raise LayoutMismatch(f"page ids must be in [1, {num_pages}) (page 0 is the null "
                             f"block), got range [{lo}, {hi}]")
    if for_scatter:
        per_page = geom.page_size // geom.chunk_tokens
        flat = pages * per_page + subs
        if flat.unique().numel() != flat.numel():
            raise LayoutMismatch("scatter mapping writes the same page slice twice")


def _chunked_view(cache: torch.Tensor, view: CanonicalView, geom: BlockGeometry) -> torch.Tensor:
    """uint8 view ``[page][sub][kv][chunk_token][head][row]`` aliasing the layer cache."""
    import torch

    c = geom.chunk_tokens
    flat = cache.view(torch.uint8)
    size = (view.num_pages, view.page_size // c, view.num_kv, c, view.num_heads, view.row_bytes)
    stride = (view.page_stride, c * view.token_stride, view.kv_stride, view.token_stride,
              view.head_stride, 1)
    return torch.as_strided(flat, size, stride, _storage_offset_bytes(cache))


def _storage_offset_bytes(cache: torch.Tensor) -> int:
    return int(cache.storage_offset()) * cache.element_size()


def _as_blocks(out: torch.Tensor, geom: BlockGeometry, n_blocks: int) -> torch.Tensor:
    """uint8 view ``[block][layer][kv][chunk][chunk_token][head][row]`` of a block buffer."""
    import torch

    if out.dim() != 2 or out.shape[0] != n_blocks:
        raise BufferSizeError(f"block buffer must be (n_blocks={n_blocks}, ...), got "
                              f"{tuple(out.shape)}")
    if out.stride(-1) != 1 and out.shape[1] > 1:
        raise BufferSizeError("each block row of the buffer must be contiguous")
    raw = out.view(torch.uint8)
    if raw.shape[1] != geom.block_bytes:
        raise BufferSizeError(f"block rows hold {raw.shape[1]} bytes, the layout needs "
                              f"{geom.block_bytes}")
    return raw.view(n_blocks, geom.num_layers, geom.num_kv, geom.chunks_per_block,
                    geom.chunk_tokens, geom.num_heads, geom.row_bytes)


def gather_reference(layer_caches: Sequence[torch.Tensor], plan: TransferPlan,
                     out: torch.Tensor) -> None:
    """Copy the planned pages of every layer into ``out`` (n_blocks, block_bytes)."""
    geom, n = plan.geometry, plan.n_blocks
    dst = _as_blocks(out, geom, n)
    device = layer_caches[0].device
    pages, subs = plan.chunk_pages.to(device), plan.chunk_subs.to(device)
    for layer, cache in enumerate(layer_caches):
        src = _chunked_view(cache, plan.view, geom)[pages, subs]  # [n*cpb, kv, c, h, row]
        src = src.view(n, geom.chunks_per_block, *src.shape[1:]).transpose(1, 2)
        dst[:, layer].copy_(src)


def scatter_reference(layer_caches: Sequence[torch.Tensor], plan: TransferPlan,
                      src: torch.Tensor) -> None:
    """Copy blocks from ``src`` (n_blocks, block_bytes) into the planned pages."""
    geom, n = plan.geometry, plan.n_blocks
    blocks = _as_blocks(src, geom, n)
    device = layer_caches[0].device
    pages, subs = plan.chunk_pages.to(device), plan.chunk_subs.to(device)
    for layer, cache in enumerate(layer_caches):
        rows = blocks[:, layer].transpose(1, 2).to(device)  # [n, cpb, kv, c, h, row]
        rows = rows.reshape(n * geom.chunks_per_block, *rows.shape[2:])
        _chunked_view(cache, plan.view, geom).index_put_((pages, subs), rows)
