"""Engine paged-KV layouts and their mapping onto kvtier's contiguous block format.

A kvtier block holds ``tokens_per_block`` tokens of every layer, laid out
``[layer][kv][token][head][dim]`` (``kv`` has 2 entries, K then V, or 1 for an MLA
latent cache, where ``head`` is 1). An engine keeps one paged cache per layer; this
module describes each supported page format as a *canonical strided view*
``[page][kv][token][head][row]`` in bytes (``row`` = one head's ``head_size`` elements,
always contiguous), so the torch reference and the CUDA kernel share one description
and never disagree about where a byte lives.

Granularity. The unit both paths copy is a *chunk* of ``min(page_size,
tokens_per_block)`` tokens of one page:

- ``tokens_per_block % page_size == 0`` (the usual case: vLLM pages 16-128 tokens,
  kvtier blocks 256): a block spans ``tokens_per_block // page_size`` whole pages,
  ``page_ids`` has shape ``(n_blocks, pages_per_block)``, in token order.
- ``page_size % tokens_per_block == 0`` and ``page_size > tokens_per_block`` (hybrid
  models with big pages): a block is a sub-page; ``page_ids`` has shape
  ``(n_blocks, 1)`` and ``token_offsets`` (a multiple of ``tokens_per_block``, below
  ``page_size``) says where in the page the block starts.
- Any other ratio is refused: the engine and kvtier block sizes must nest.

Page 0 is vLLM's null block: it never appears in a valid mapping and is rejected.
This module imports neither torch nor cupy.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import LayoutMismatch

NULL_PAGE = 0


class PagedLayout(enum.Enum):
    """Per-layer paged KV cache formats of the engines kvtier serves.

    - ``NHD``: FlashAttention, ``[2, num_pages, page_size, num_kv_heads, head_size]``.
    - ``HND``: FlashInfer / head-major, ``[2, num_pages, num_kv_heads, page_size, head_size]``.
    - ``CPU``: vLLM 0.32 CPU backend (``CPU_ATTN``), declared shape
      ``[num_pages, num_kv_heads, page_size, 2 * head_size]`` but *used* as
      ``[num_pages, num_kv_heads, 2 * page_size, head_size]`` chunked on dim 2: per page
      and head, the K rows of all tokens come first, then the V rows (K and V are not
      interleaved per token). Memory order: ``[page][head][kv][token][dim]``.
    - ``PACKED_KV``: vLLM 0.32 GPU backends' logical view
      ``[num_pages, num_kv_heads, page_size, 2 * head_size]`` where K and V are the two
      halves of the last dim (split on ``head_size``); any strides, so the physical
      orders LBHNC and LBNHC are both covered. Same shape as ``CPU``, different meaning:
      the layout must be named, it cannot be guessed from the shape.
    - ``MLA``: single-component latent cache ``[num_pages, page_size, head_size]``.
    """

    NHD = "nhd"
    HND = "hnd"
    CPU = "cpu"
    PACKED_KV = "packed_kv"
    MLA = "mla"


@dataclass(frozen=True, slots=True)
class CanonicalView:
    """Byte strides of one layer cache seen as ``[page][kv][token][head][row]``.

    ``row_bytes`` bytes starting at ``page*page_stride + kv*kv_stride + token*token_stride
    + head*head_stride`` (from the layer's base pointer) are one head's vector.
    """

    num_pages: int
    num_kv: int
    page_size: int
    num_heads: int
    row_bytes: int
    page_stride: int
    kv_stride: int
    token_stride: int
    head_stride: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Byte-level view shape, for ``torch.as_strided`` over a uint8 view."""
        return (self.num_pages, self.num_kv, self.page_size, self.num_heads, self.row_bytes)

    @property
    def strides(self) -> tuple[int, int, int, int, int]:
        """Byte strides matching :attr:`shape` (the row itself is contiguous)."""
        return (self.page_stride, self.kv_stride, self.token_stride, self.head_stride, 1)


def canonical_view(
    layout: PagedLayout, shape: Sequence[int], stride: Sequence[int], element_size: int
) -> CanonicalView:
    """Describe one engine layer cache (its shape and element strides) canonically.

    Raises ``LayoutMismatch`` when the tensor's rank does not fit the layout or its
    innermost (head_size) dimension is not contiguous, since both paths copy whole rows.
    """
    shape = tuple(int(s) for s in shape)
    st = tuple(int(s) * element_size for s in stride)
    expected_rank = {PagedLayout.MLA: 3, PagedLayout.CPU: 4, PagedLayout.PACKED_KV: 4}
    rank = expected_rank.get(layout, 5)
    if len(shape) != rank:
        raise LayoutMismatch(f"{layout.name} layer cache must have {rank} dims, got shape "
                             f"{shape}; pass the layout the engine actually uses")
    if shape[-1] > 1 and stride[-1] != 1:
        raise LayoutMismatch(f"{layout.name} layer cache's last dim must be contiguous "
                             f"(stride {stride[-1]}); copy rows cannot be strided")
    if layout is PagedLayout.NHD:
        two, pages, psize, heads, dim = shape
        _require_kv_pair(layout, two)
        return CanonicalView(pages, 2, psize, heads, dim * element_size,
                             st[1], st[0], st[2], st[3])
    if layout is PagedLayout.HND:
        two, pages, heads, psize, dim = shape
        _require_kv_pair(layout, two)
        return CanonicalView(pages, 2, psize, heads, dim * element_size,
                             st[1], st[0], st[3], st[2])
    if layout is PagedLayout.CPU:
        pages, heads, psize, two_dim = shape
        if two_dim % 2:
            raise LayoutMismatch(f"CPU layout's last dim must be 2*head_size, got {two_dim}")
        dim = two_dim // 2
        if psize > 1 and st[2] != two_dim * element_size:
            raise LayoutMismatch("CPU layout needs each head's [page_size, 2*head_size] "
                                 "plane contiguous (vLLM views it as [2*page_size, head_size])")
        row = dim * element_size
        return CanonicalView(pages, 2, psize, heads, row, st[0], psize * row, row, st[1])
    if layout is PagedLayout.PACKED_KV:
        pages, heads, psize, two_dim = shape
        if two_dim % 2:
            raise LayoutMismatch(f"PACKED_KV last dim must be 2*head_size, got {two_dim}")
        row = two_dim // 2 * element_size
        return CanonicalView(pages, 2, psize, heads, row, st[0], row, st[2], st[1])
    pages, psize, dim = shape
    return CanonicalView(pages, 1, psize, 1, dim * element_size, st[0], 0, st[1], 0)


def _require_kv_pair(layout: PagedLayout, two: int) -> None:
    if two != 2:
        raise LayoutMismatch(f"{layout.name} layer cache's first dim must be 2 (K, V), "
                             f"got {two}")


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """What one kvtier block looks like for a given set of engine layer caches.

    All layers must share one canonical geometry (same heads, head size, page size,
    dtype); strides may differ per layer only in the base pointer.
    """

    num_layers: int
    num_kv: int
    num_heads: int
    row_bytes: int
    page_size: int
    tokens_per_block: int

    @property
    def chunk_tokens(self) -> int:
        """Tokens copied per (page, block) chunk: ``min(page_size, tokens_per_block)``."""
        return min(self.page_size, self.tokens_per_block)

    @property
    def chunks_per_block(self) -> int:
        """Pages one block spans (1 when a block is a sub-page)."""
        return self.tokens_per_block // self.chunk_tokens

    @property
    def block_bytes(self) -> int:
        """Bytes of one kvtier block: layers x kv x tokens x heads x row."""
        return (self.num_layers * self.num_kv * self.tokens_per_block
                * self.num_heads * self.row_bytes)


def block_geometry(views: Sequence[CanonicalView], tokens_per_block: int) -> BlockGeometry:
    """Check that all layer views agree and that page and block sizes nest.

    Every layer must have the same view (strides included): engines allocate all
    layers alike, and the kernel takes one set of strides for all layers.
    """
    if not views:
        raise LayoutMismatch("need at least one layer cache")
    first = views[0]
    for i, v in enumerate(views[1:], start=1):
        if v != first:
            raise LayoutMismatch(f"layer {i} cache differs from layer 0 ({v} vs {first}); "
                                 "all layers must share shape, dtype and strides")
    psize, tpb = first.page_size, tokens_per_block
    if tpb <= 0 or psize <= 0 or (tpb % psize and psize % tpb):
        raise LayoutMismatch(f"tokens_per_block={tpb} and page_size={psize} must nest "
                             "(one a multiple of the other)")
    return BlockGeometry(len(views), first.num_kv, first.num_heads, first.row_bytes,
                         psize, tpb)


def vector_bytes(row_bytes: int, *addresses_and_strides: int) -> int:
    """Widest copy vector (16, 8, 4, 2 or 1 bytes) that divides a row and every address.

    The CUDA kernel copies with 16-byte vectors when rows and all base pointers and
    strides are 16-byte aligned, and falls back to narrower ones otherwise.
    """
    for width in (16, 8, 4, 2):
        if row_bytes % width == 0 and all(a % width == 0 for a in addresses_and_strides):
            return width
    return 1
