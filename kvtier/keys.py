"""Block keys: chained 128-bit hashes over token chunks, scoped by a namespace.

``key_i = xxh3_128(key_{i-1} || namespace digest || token ids of chunk i as <u4)``.
The hash depends only on bytes (never on Python's ``hash()`` or PYTHONHASHSEED), so
every process on every machine computes the same keys, and a prefix match is a walk
along the chain until the first miss. The namespace binds model, layout, tensor-parallel
rank and an optional tenant ``cache_salt``: different salts can never share a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import xxhash

from kvtier.errors import LayoutMismatch
from kvtier.layout import KVLayout

BlockKey = bytes
"""A 16-byte block key."""

KEY_BYTES = 16
KEY_SCHEME = "xxh3_128-chain/1"
"""The key function's version: clients report it at hello; a mismatch never shares blocks."""
ROOT_KEY: BlockKey = b"\x00" * KEY_BYTES


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for two blocks to be interchangeable."""

    model_id: str
    layout: KVLayout
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str | None = None
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutMismatch(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        try:   # (model_id and cache_salt hash as UTF-8: a lone surrogate has no bytes)
            packed = msgpack.packb(
                [1, self.model_id, self.layout.fingerprint, self.tp_rank, self.tp_size,
                 self.cache_salt],
                use_bin_type=True,
            )
        except UnicodeEncodeError:
            raise LayoutMismatch("model_id and cache_salt must be valid Unicode (no lone "
                                 "surrogates)") from None
        object.__setattr__(self, "digest", xxhash.xxh3_128_digest(packed))

    def with_salt(self, cache_salt: str | None) -> Namespace:
        """The same namespace for another tenant."""
        return Namespace(self.model_id, self.layout, self.tp_rank, self.tp_size, cache_salt)


def block_keys(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    tokens_per_block: int | None = None,
    parent: BlockKey = ROOT_KEY,
) -> list[BlockKey]:
    """Keys of every *full* chunk of ``token_ids`` (a trailing partial chunk is not cached).

    ``parent`` continues a chain (the key of the block before ``token_ids[0]``).
    """
    tpb = tokens_per_block or namespace.layout.tokens_per_block
    tokens = _as_u4(token_ids)
    n_full = len(tokens) // tpb
    if n_full == 0:
        return []
    chunks = tokens[: n_full * tpb].reshape(n_full, tpb)
    ns = namespace.digest
    keys: list[BlockKey] = []
    prev = parent
    hasher = xxhash.xxh3_128
    for row in chunks:
        h = hasher(prev)
        h.update(ns)
        h.update(row.data)
        prev = h.digest()
        keys.append(prev)
    return keys


_U4_MAX = 0xFFFF_FFFF


def _as_u4(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as contiguous little-endian u4, refusing any id that would wrap.

    A silent cast (-1 or 2**32 becoming another id, 7.5 becoming 7) would make two
    different prompts share keys, i.e. hand one prompt another prompt's KV.
    """
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" or arr.dtype.itemsize > 4:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _U4_MAX:
            raise ValueError(f"token ids must lie in [0, 2**32), got [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype="<u4")
