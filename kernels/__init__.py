"""kvtier.kernels: moving KV between engine paged caches and kvtier blocks.

``gather_blocks`` / ``scatter_blocks`` convert between an engine's per-layer paged KV
cache (``PagedLayout``) and kvtier's contiguous block format
``[layer][kv][token][head][dim]``, on the GPU through a CUDA kernel (cupy, compiled at
first use) and elsewhere through a torch reference. Importing this package needs
neither torch nor cupy; they are imported when a function needs them.
"""

from __future__ import annotations

from kvtier.kernels.api import KernelPath, block_bytes, gather_blocks, scatter_blocks, select_path
from kvtier.kernels.layouts import BlockGeometry, CanonicalView, PagedLayout, canonical_view

__all__ = [
    "BlockGeometry",
    "CanonicalView",
    "KernelPath",
    "PagedLayout",
    "block_bytes",
    "canonical_view",
    "gather_blocks",
    "scatter_blocks",
    "select_path",
]
