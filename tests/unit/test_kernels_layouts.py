"""Pure geometry of kvtier.kernels.layouts (no torch needed)."""

from __future__ import annotations

import pytest
from kvtier.kernels.layouts import (
    PagedLayout,
    block_geometry,
    canonical_view,
    vector_bytes,
)

from kvtier.errors import LayoutMismatch


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def test_nhd_view_strides_in_bytes():
    shape = (2, 10, 16, 8, 128)
    v = canonical_view(PagedLayout.NHD, shape, contiguous_strides(shape), 2)
    assert (v.num_pages, v.num_kv, v.page_size, v.num_heads, v.row_bytes) == (10, 2, 16, 8, 256)
    assert v.kv_stride == 10 * 16 * 8 * 128 * 2
    assert (v.page_stride, v.token_stride, v.head_stride) == (16 * 8 * 256, 8 * 256, 256)


def test_cpu_layout_keeps_k_rows_then_v_rows_per_head():
    # vLLM 0.32 CPU_ATTN: [pages, heads, page_size, 2*head_size], used as
    # [pages, heads, 2*page_size, head_size] chunked on dim 2.
    shape = (10, 4, 16, 2 * 64)
    v = canonical_view(PagedLayout.CPU, shape, contiguous_strides(shape), 2)
    row = 64 * 2
    assert v.token_stride == row
    assert v.kv_stride == 16 * row
    assert v.head_stride == 16 * 2 * row
    assert v.page_stride == 4 * 16 * 2 * row


def test_packed_kv_splits_the_last_dim():
    shape = (10, 4, 16, 2 * 64)
    v = canonical_view(PagedLayout.PACKED_KV, shape, contiguous_strides(shape), 1)
    assert (v.kv_stride, v.row_bytes, v.token_stride) == (64, 64, 128)


def test_mla_is_single_component():
    shape = (10, 16, 576)
    v = canonical_view(PagedLayout.MLA, shape, contiguous_strides(shape), 2)
    assert (v.num_kv, v.num_heads, v.row_bytes) == (1, 1, 1152)


def test_rank_and_contiguity_checks():
    with pytest.raises(LayoutMismatch):
        canonical_view(PagedLayout.HND, (10, 4, 16, 64), (1, 1, 1, 1), 2)
    with pytest.raises(LayoutMismatch):
        canonical_view(PagedLayout.NHD, (2, 10, 16, 8, 64), (1, 1, 1, 1, 2), 2)
    with pytest.raises(LayoutMismatch):
        shape = (3, 10, 16, 8, 64)
        canonical_view(PagedLayout.NHD, shape, contiguous_strides(shape), 2)


def test_geometry_nests_page_and_block_sizes():
    shape = (2, 10, 16, 8, 128)
    v = canonical_view(PagedLayout.NHD, shape, contiguous_strides(shape), 2)
    g = block_geometry([v, v], 256)
    assert (g.chunk_tokens, g.chunks_per_block) == (16, 16)
    assert g.block_bytes == 2 * 2 * 256 * 8 * 256
    sub = block_geometry([v], 4)
    assert (sub.chunk_tokens, sub.chunks_per_block) == (4, 1)
    with pytest.raises(LayoutMismatch):
        block_geometry([v], 24)
    with pytest.raises(LayoutMismatch):
        block_geometry([], 16)


@pytest.mark.parametrize(
    ("row", "addrs", "want"),
    [(256, (0x1000, 4096), 16), (256, (0x1008,), 8), (6, (0,), 2), (3, (0,), 1), (12, (16,), 4)],
)
def test_vector_width_falls_back_when_unaligned(row, addrs, want):
    assert vector_bytes(row, *addrs) == want

