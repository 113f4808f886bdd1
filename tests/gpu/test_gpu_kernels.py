"""CUDA gather/scatter against the torch reference, on every layout and dtype.

Runs only where a GPU, torch with CUDA and cupy exist (see conftest.py); elsewhere
each test is skipped with the reason. Buffers are device memory, pinned host memory
and cudaHostRegister'd host memory (the zero-copy arena path).
"""

from __future__ import annotations

import zlib

import pytest
from kvtier.kernels import KernelPath, PagedLayout, block_bytes, gather_blocks, scatter_blocks

pytestmark = pytest.mark.gpu

NUM_LAYERS, NUM_PAGES = 4, 37


def _torch():
    import torch

    return torch


def make_caches(layout: PagedLayout, page_size: int, heads: int, dim: int, dtype, seed: int,
                device: str = "cuda"):
    """Random bytes in each layer cache (NaN patterns included: compared as bytes)."""
    torch = _torch()
    shapes = {
        PagedLayout.NHD: (2, NUM_PAGES, page_size, heads, dim),
        PagedLayout.HND: (2, NUM_PAGES, heads, page_size, dim),
        PagedLayout.CPU: (NUM_PAGES, heads, page_size, 2 * dim),
        PagedLayout.PACKED_KV: (NUM_PAGES, page_size, heads, 2 * dim),
        PagedLayout.MLA: (NUM_PAGES, page_size, dim),
    }
    gen = torch.Generator(device="cpu").manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    caches = []
    for _ in range(NUM_LAYERS):
        shape = shapes[layout]
        n = 1
        for s in shape:
            n *= s
        raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
        cache = raw.view(dtype).view(shape).to(device)
        if layout is PagedLayout.PACKED_KV:
            cache = cache.permute(0, 2, 1, 3)  # LBNHC physical, [B, H, N, 2D] logical
        caches.append(cache)
    return caches


def mapping(n_blocks: int, per_block: int, seed: int):
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_PAGES - 1, generator=gen)[: n_blocks * per_block] + 1
    return perm.view(n_blocks, per_block)


def dtypes():
    torch = _torch()
    out = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
    if hasattr(torch, "float8_e4m3fn"):
        out.append(torch.float8_e4m3fn)
    return out


@pytest.mark.parametrize("layout", list(PagedLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("dtype_index", range(5))
@pytest.mark.parametrize("buffer", ["device", "pinned"])
def test_gather_and_scatter_match_reference(layout, dtype_index, buffer):
    torch = _torch()
    all_dtypes = dtypes()
    if dtype_index >= len(all_dtypes):
        pytest.skip("float8 not in this torch")
    dtype = all_dtypes[dtype_index]
    seed = zlib.crc32(f"{layout.value}{dtype}{buffer}".encode())
    page_size, per_block, heads, dim = 16, 4, 4, 64
    caches = make_caches(layout, page_size, heads, dim, dtype, seed)
    cpu_caches = [c.cpu() for c in caches]
    page_ids = mapping(7, per_block, seed)
    nbytes = block_bytes(caches, layout, page_size * per_block)

    want = torch.empty((7, nbytes), dtype=torch.uint8)
    assert gather_blocks(cpu_caches, layout, page_ids, want) is KernelPath.TORCH

    stream = torch.cuda.Stream()
    for poison in (0x00, 0xFF):
        if buffer == "device":
            out = torch.full((7, nbytes), poison, dtype=torch.uint8, device="cuda")
        else:
            out = torch.full((7, nbytes), poison, dtype=torch.uint8).pin_memory()
        torch.cuda.synchronize()
        path = gather_blocks(caches, layout, page_ids, out, stream=stream)
        stream.synchronize()
        assert path is KernelPath.CUDA
        assert torch.equal(out.cpu(), want)

    fresh = [torch.zeros_like(c) for c in caches]
    src = want.to("cuda") if buffer == "device" else want.pin_memory()
    stream.wait_stream(torch.cuda.current_stream())   # the zero fill before the scatter
    assert scatter_blocks(fresh, layout, page_ids, src, stream=stream) is KernelPath.CUDA
    stream.synchronize()
    ref = [torch.zeros_like(c) for c in cpu_caches]
    scatter_blocks(ref, layout, page_ids, want)
    for got, exp in zip(fresh, ref, strict=True):
        assert torch.equal(got.cpu().contiguous().view(torch.uint8),
                           exp.contiguous().view(torch.uint8))


@pytest.mark.parametrize(("dim", "dtype_name"), [(3, "float16"), (5, "uint8"), (4, "float32")])
def test_unaligned_rows_fall_back_to_narrow_vectors(dim, dtype_name):
    torch = _torch()
    dtype = getattr(torch, dtype_name)
    caches = make_caches(PagedLayout.HND, 8, 3, dim, dtype, seed=dim)
    page_ids = mapping(5, 2, seed=dim)
    nbytes = block_bytes(caches, PagedLayout.HND, 16)
    want = torch.empty((5, nbytes), dtype=torch.uint8)
    gather_blocks([c.cpu() for c in caches], PagedLayout.HND, page_ids, want)
    arena = torch.full((5 * nbytes + 1,), 0xAB, dtype=torch.uint8, device="cuda")
    out = arena[1:].view(5, nbytes)  # odd base address: forces 1-byte copies
    assert gather_blocks(caches, PagedLayout.HND, page_ids, out) is KernelPath.CUDA
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)


def test_sub_page_blocks_on_cuda():
    torch = _torch()
    caches = make_caches(PagedLayout.NHD, 64, 2, 128, torch.bfloat16, seed=3)
    page_ids = torch.tensor([[9], [4], [9]])
    offsets = torch.tensor([48, 0, 16])
    nbytes = block_bytes(caches, PagedLayout.NHD, 16)
    want = torch.empty((3, nbytes), dtype=torch.uint8)
    gather_blocks([c.cpu() for c in caches], PagedLayout.NHD, page_ids, want,
                  tokens_per_block=16, token_offsets=offsets)
    out = torch.empty((3, nbytes), dtype=torch.uint8, device="cuda")
    gather_blocks(caches, PagedLayout.NHD, page_ids, out, tokens_per_block=16,
                  token_offsets=offsets)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)


def test_zero_copy_into_cuda_registered_host_memory():
    """The arena path: plain host memory registered with cudaHostRegister."""
    import cupy
    import numpy as np

    torch = _torch()
    caches = make_caches(PagedLayout.NHD, 16, 8, 128, torch.float16, seed=5)
    page_ids = mapping(6, 2, seed=5)
    nbytes = block_bytes(caches, PagedLayout.NHD, 32)
    host = np.zeros(6 * nbytes, dtype=np.uint8)  # stands in for the shared-memory arena
    cupy.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 0)
    try:
        slots = [torch.from_numpy(host[i * nbytes:(i + 1) * nbytes]) for i in (3, 0, 5, 1, 4, 2)]
        assert gather_blocks(caches, PagedLayout.NHD, page_ids, slots) is KernelPath.CUDA
        torch.cuda.synchronize()
        want = torch.empty((6, nbytes), dtype=torch.uint8)
        gather_blocks([c.cpu() for c in caches], PagedLayout.NHD, page_ids, want)
        for slot, row in zip(slots, want, strict=True):
            assert torch.equal(slot, row)
    finally:
        cupy.cuda.runtime.hostUnregister(host.ctypes.data)
