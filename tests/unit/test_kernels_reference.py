"""Gather/scatter (numpy host copies, torch reference) against a per-page oracle.

The oracle reads each layout the way the engine does (vLLM's own views and splits),
not through kvtier's canonical strides, so a stride mistake in ``layouts.py`` fails here.
"""

from __future__ import annotations

import threading
import zlib
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from kvtier.kernels import (
    KernelPath,
    PagedLayout,
    block_bytes,
    gather_blocks,
    scatter_blocks,
    select_path,
)
from kvtier.kernels.reference import (
    gather_reference,
    plan_transfer,
    scatter_reference,
)

from kvtier.errors import BufferSizeError, LayoutMismatch

NUM_LAYERS, NUM_PAGES, HEADS, DIM = 3, 13, 2, 8
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
LAYOUTS = list(PagedLayout)


def make_cache(layout: PagedLayout, page_size: int, dtype: torch.dtype,
               gen: torch.Generator, heads: int = HEADS, dim: int = DIM) -> torch.Tensor:
    """One random layer cache, sometimes non-contiguous or at a storage offset."""
    shapes = {
        PagedLayout.NHD: (2, NUM_PAGES, page_size, heads, dim),
        PagedLayout.HND: (2, NUM_PAGES, heads, page_size, dim),
        PagedLayout.CPU: (NUM_PAGES, heads, page_size, 2 * dim),
        PagedLayout.MLA: (NUM_PAGES, page_size, dim),
    }
    if layout is PagedLayout.PACKED_KV:
        # vLLM 0.32 LBNHC: physical [B, N, H, 2D], logical view [B, H, N, 2D].
        phys = (NUM_PAGES, page_size, heads, 2 * dim)
        return _random(phys, dtype, gen).permute(0, 2, 1, 3)
    shape = shapes[layout]
    # A slice of a bigger allocation: exercises a non-zero storage offset.
    n = 1
    for s in shape:
        n *= s
    return _random((n + 7,), dtype, gen)[7:].view(shape)


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def page_components(cache: torch.Tensor, layout: PagedLayout, page: int) -> torch.Tensor:
    """[kv, page_size, heads, dim] of one page, read the way the engine reads it."""
    if layout is PagedLayout.NHD:
        return cache[:, page]
    if layout is PagedLayout.HND:
        return cache[:, page].transpose(1, 2)
    if layout is PagedLayout.CPU:
        heads, psize, two_dim = cache.shape[1:]
        kv = cache[page].reshape(heads, psize * 2, two_dim // 2)
        k, v = kv.chunk(2, dim=1)  # vLLM: view [.., 2*block_size, head_size], chunk dim 2
        return torch.stack([k.transpose(0, 1), v.transpose(0, 1)])
    if layout is PagedLayout.PACKED_KV:
        dim = cache.shape[-1] // 2
        k, v = cache[page].transpose(0, 1).split(dim, dim=-1)
        return torch.stack([k, v])
    return cache[page].unsqueeze(1).unsqueeze(0)


def expected_blocks(caches, layout, page_ids, offsets, tpb) -> torch.Tensor:
    """Oracle: (n_blocks, block_bytes) uint8 built page by page."""
    blocks = []
    for b, pages in enumerate(page_ids.tolist()):
        layers = []
        for cache in caches:
            parts = [page_components(cache, layout, p) for p in pages]
            comp = torch.cat(parts, dim=1)
            if offsets is not None:
                start = int(offsets[b])
                comp = comp[:, start:start + tpb]
            layers.append(comp)
        blocks.append(torch.stack(layers).contiguous().view(torch.uint8).reshape(-1))
    return torch.stack(blocks)


def mapping(gen: torch.Generator, n_blocks: int, per_block: int) -> torch.Tensor:
    """Distinct non-null pages in a random (odd) order."""
    perm = torch.randperm(NUM_PAGES - 1, generator=gen)[: n_blocks * per_block] + 1
    return perm.view(n_blocks, per_block)


def poisoned_gather(caches, layout, page_ids, **kw) -> list[torch.Tensor]:
    """Gather twice, into buffers poisoned with 0x00 and 0xFF: every byte must be written."""
    tpb = kw.get("tokens_per_block") or page_ids.shape[1] * _page_size(caches[0], layout)
    nbytes = block_bytes(caches, layout, tpb)
    outs = []
    for poison in (0x00, 0xFF):
        out = torch.full((page_ids.shape[0], nbytes), poison, dtype=torch.uint8)
        assert gather_blocks(caches, layout, page_ids, out, **kw) is KernelPath.TORCH
        outs.append(out)
    return outs


def _page_size(cache: torch.Tensor, layout: PagedLayout) -> int:
    index = {PagedLayout.NHD: 2, PagedLayout.HND: 3, PagedLayout.CPU: 2,
             PagedLayout.PACKED_KV: 2, PagedLayout.MLA: 1}[layout]
    return cache.shape[index]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_matches_oracle_and_writes_every_byte(layout, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{layout.value}-{dtype}".encode()))
    page_size, per_block = 4, 3
    caches = [make_cache(layout, page_size, dtype, gen) for _ in range(NUM_LAYERS)]
    page_ids = mapping(gen, 4, per_block)
    want = expected_blocks(caches, layout, page_ids, None, page_size * per_block)
    for out in poisoned_gather(caches, layout, page_ids):
        assert torch.equal(out, want)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
def test_round_trip_touches_only_mapped_pages(layout, dtype):
    gen = torch.Generator().manual_seed(7)
    page_size = 2
    caches = [make_cache(layout, page_size, dtype, gen) for _ in range(NUM_LAYERS)]
    page_ids = mapping(gen, 3, 2)
    out = poisoned_gather(caches, layout, page_ids)[0]
    fresh = [make_cache(layout, page_size, dtype, gen) for _ in range(NUM_LAYERS)]
    before = [f.clone() for f in fresh]
    assert scatter_blocks(fresh, layout, page_ids, out) is KernelPath.TORCH
    touched = set(page_ids.flatten().tolist())
    for orig, new, old in zip(caches, fresh, before, strict=True):
        for page in range(NUM_PAGES):
            src = orig if page in touched else old
            got = page_components(new, layout, page).contiguous().view(torch.uint8)
            assert torch.equal(got, page_components(src, layout, page).contiguous()
                               .view(torch.uint8)), (layout, page)


@pytest.mark.parametrize("layout", [PagedLayout.NHD, PagedLayout.CPU, PagedLayout.MLA],
                         ids=lambda x: x.name)
def test_sub_page_blocks_use_token_offsets(layout):
    gen = torch.Generator().manual_seed(11)
    page_size, tpb = 8, 2
    caches = [make_cache(layout, page_size, torch.float16, gen) for _ in range(NUM_LAYERS)]
    page_ids = torch.tensor([[5], [2], [5], [9]])
    offsets = torch.tensor([6, 0, 2, 4])
    want = expected_blocks(caches, layout, page_ids, offsets, tpb)
    for out in poisoned_gather(caches, layout, page_ids, tokens_per_block=tpb,
                               token_offsets=offsets):
        assert torch.equal(out, want)
    fresh = [torch.zeros_like(c) for c in caches]
    scatter_blocks(fresh, layout, page_ids, want, tokens_per_block=tpb, token_offsets=offsets)
    again = expected_blocks(fresh, layout, page_ids, offsets, tpb)
    assert torch.equal(again, want)
    # Page 5 tokens 4..5 were never written: still zero.
    assert not page_components(fresh[0], layout, 5)[:, 4:6].view(torch.uint8).any()


def test_block_rows_may_be_separate_tensors_and_typed():
    gen = torch.Generator().manual_seed(3)
    caches = [make_cache(PagedLayout.HND, 4, torch.float16, gen) for _ in range(2)]
    page_ids = mapping(gen, 3, 2)
    nbytes = block_bytes(caches, PagedLayout.HND, 8)
    want = torch.empty((3, nbytes), dtype=torch.uint8)
    gather_blocks(caches, PagedLayout.HND, page_ids, want)
    slots = [torch.full((nbytes // 2,), 1.5, dtype=torch.float16) for _ in range(3)]
    gather_blocks(caches, PagedLayout.HND, page_ids, slots)
    for slot, row in zip(slots, want, strict=True):
        assert torch.equal(slot.view(torch.uint8), row)
    fresh = [torch.zeros_like(c) for c in caches]
    scatter_blocks(fresh, PagedLayout.HND, page_ids, slots)
    again = torch.empty_like(want)
    gather_blocks(fresh, PagedLayout.HND, page_ids, again)
    assert torch.equal(again, want)


def test_gather_into_strided_rows_of_a_larger_arena():
    gen = torch.Generator().manual_seed(5)
    caches = [make_cache(PagedLayout.NHD, 4, torch.float32, gen) for _ in range(2)]
    page_ids = mapping(gen, 2, 1)
    nbytes = block_bytes(caches, PagedLayout.NHD, 4)
    arena = torch.zeros((4, nbytes + 64), dtype=torch.uint8)
    gather_blocks(caches, PagedLayout.NHD, page_ids, arena[1:3, 32:32 + nbytes])
    want = expected_blocks(caches, PagedLayout.NHD, page_ids, None, 4)
    assert torch.equal(arena[1:3, 32:32 + nbytes], want)
    assert not arena[0].any() and not arena[3].any() and not arena[1:3, :32].any()


def test_rejects_null_and_out_of_range_pages():
    caches = [torch.zeros(2, NUM_PAGES, 4, HEADS, DIM)]
    out = torch.empty((1, block_bytes(caches, PagedLayout.NHD, 4)), dtype=torch.uint8)
    for bad in (0, NUM_PAGES, -1):
        with pytest.raises(LayoutMismatch):
            gather_blocks(caches, PagedLayout.NHD, torch.tensor([[bad]]), out)


def test_scatter_rejects_duplicate_pages():
    caches = [torch.zeros(2, NUM_PAGES, 4, HEADS, DIM)]
    src = torch.empty((2, block_bytes(caches, PagedLayout.NHD, 4)), dtype=torch.uint8)
    with pytest.raises(LayoutMismatch):
        scatter_blocks(caches, PagedLayout.NHD, torch.tensor([[3], [3]]), src)


def test_rejects_wrong_buffer_size_and_non_nesting_sizes():
    caches = [torch.zeros(2, NUM_PAGES, 4, HEADS, DIM)]
    with pytest.raises(BufferSizeError):
        gather_blocks(caches, PagedLayout.NHD, torch.tensor([[1]]),
                      torch.empty((1, 7), dtype=torch.uint8))
    with pytest.raises(LayoutMismatch):
        block_bytes(caches, PagedLayout.NHD, 6)
    with pytest.raises(LayoutMismatch):  # sub-page blocks need token offsets
        gather_blocks(caches, PagedLayout.NHD, torch.tensor([[1]]),
                      torch.empty((1, 1), dtype=torch.uint8), tokens_per_block=2)


def test_rejects_layers_that_disagree_and_wrong_rank():
    a = torch.zeros(2, NUM_PAGES, 4, HEADS, DIM)
    b = torch.zeros(2, NUM_PAGES, 4, HEADS, DIM * 2)
    with pytest.raises(LayoutMismatch):
        block_bytes([a, b], PagedLayout.NHD, 4)
    with pytest.raises(LayoutMismatch):
        block_bytes([a], PagedLayout.CPU, 4)


def test_cpu_tensors_select_the_torch_path():
    caches = [torch.zeros(2, 3, 4, 1, 8)]
    assert select_path(caches, [torch.zeros(8)]) is KernelPath.TORCH
    assert select_path([], []) is KernelPath.TORCH


# -- the numpy host copies (CPU engines) against the torch reference ---------------


@pytest.mark.parametrize("layout", list(PagedLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_host_and_torch_reference_agree(layout: PagedLayout, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    caches = [make_cache(layout, 4, dtype, gen) for _ in range(NUM_LAYERS)]
    page_ids = mapping(gen, 3, 2)
    nbytes = block_bytes(caches, layout, 8)
    plan = plan_transfer(caches, layout, page_ids)
    want = torch.empty((3, nbytes), dtype=torch.uint8)
    gather_reference(caches, plan, want)
    slots = [torch.full((nbytes,), 0xA5, dtype=torch.uint8) for _ in range(3)]
    gather_blocks(caches, layout, page_ids, slots)
    assert torch.equal(torch.stack(slots), want)
    by_host = [torch.zeros_like(c) for c in caches]
    by_torch = [torch.zeros_like(c) for c in caches]
    scatter_blocks(by_host, layout, page_ids, slots)
    scatter_reference(by_torch, plan_transfer(by_torch, layout, page_ids, for_scatter=True),
                      want)
    for a, b in zip(by_host, by_torch, strict=True):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_host_copies_run_no_torch_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch copy started from a new thread starts a second OpenMP team that competes
    with a CPU engine's own; the host path must move the bytes without any torch kernel
    (only views), so the copies the old path made here are made to fail."""
    gen = torch.Generator().manual_seed(3)
    caches = [make_cache(PagedLayout.NHD, 16, torch.float32, gen, heads=8, dim=64)
              for _ in range(2)]
    page_ids = mapping(gen, 4, 3)
    nbytes = block_bytes(caches, PagedLayout.NHD, 48)
    want = torch.empty((4, nbytes), dtype=torch.uint8)
    gather_blocks(caches, PagedLayout.NHD, page_ids, want)
    rows = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(4)]

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("a torch kernel ran on the host path")

    for name in ("copy_", "index_put_", "__getitem__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "stack", refuse)
    errors: list[BaseException] = []

    def copy() -> None:
        try:
            gather_blocks(caches, PagedLayout.NHD, page_ids, rows)
            scatter_blocks(caches, PagedLayout.NHD, page_ids, rows)
        except BaseException as exc:   # reported on the test's thread
            errors.append(exc)

    t = threading.Thread(target=copy)
    t.start()
    t.join()
    monkeypatch.undo()
    assert not errors, errors
    assert torch.equal(torch.stack(rows), want)
