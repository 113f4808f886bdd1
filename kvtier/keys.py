"""Block keys: chained 128-bit BLAKE2b hashes over token chunks, scoped by a namespace.

``key_i = BLAKE2b-128(namespace digest || key_{i-1} || token ids of chunk i as <u4)``.
The hash depends only on bytes (never on Python's ``hash()`` or PYTHONHASHSEED), so
every process on every machine computes the same keys, and a prefix match is a walk
along the chain until the first miss. The namespace binds model, layout, tensor-parallel
rank and an optional tenant ``cache_salt``: different salts can never share a block.

The hash is a cryptographic one because the tokens are the tenants': two prompts whose
keys collide would be handed each other's KV. An unkeyed non-cryptographic hash (xxh3,
this module's first scheme) leaves crafting such a pair to whoever can study it; vLLM's
own prefix cache defaults to SHA-256 for the same reason. See docs/architecture.md ("Block
keys").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np

from kvtier.errors import LayoutMismatch
from kvtier.layout import KVLayout

BlockKey = bytes
"""A 16-byte block key."""

KEY_BYTES = 16
KEY_SCHEME = "blake2b_128-chain/2"
"""The key function's version: clients report it at hello; a mismatch never shares blocks."""
ROOT_KEY: BlockKey = b"\x00" * KEY_BYTES
MAX_NAME_CHARS = 1024
"""The longest ``model_id`` and ``cache_salt`` a daemon registers (its namespaces keep
them): a longer one is refused, so a client does not ask with it."""


def name_refusal(text: str) -> str | None:
    """Why a daemon would refuse ``text`` as a ``model_id`` or ``cache_salt`` (over
    ``MAX_NAME_CHARS`` characters, or not valid Unicode: a lone surrogate has no UTF-8
    bytes to hash), None when it takes it: clients check before they ask."""
    if len(text) > MAX_NAME_CHARS:
        return f"{len(text)} characters (the daemon takes at most {MAX_NAME_CHARS})"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid Unicode (a lone surrogate)"
    return None
# BLAKE2b personalisation (domain separation): a namespace digest is never a block key.
_KEY_PERSON = b"kvtier-key/2"
_NS_PERSON = b"kvtier-ns/2"


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
                [2, self.model_id, self.layout.fingerprint, self.tp_rank, self.tp_size,
                 self.cache_salt],
                use_bin_type=True,
            )
        except UnicodeEncodeError:
            raise LayoutMismatch("model_id and cache_salt must be valid Unicode (no lone "
                                 "surrogates)") from None
        object.__setattr__(self, "digest", hashlib.blake2b(
            packed, digest_size=KEY_BYTES, person=_NS_PERSON).digest())

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

    ``parent`` continues a chain (the key of the block before ``token_ids[0]``); it must be
    a whole key, so that every hashed input splits one way only (ValueError otherwise).
    """
    if len(parent) != KEY_BYTES:
        raise ValueError(f"a parent key is {KEY_BYTES} bytes, got {len(parent)}")
    tpb = tokens_per_block or namespace.layout.tokens_per_block
    tokens = _as_u4(token_ids)
    n_full = len(tokens) // tpb
    if n_full == 0:
        return []
    # One hash object per block, copied from a state that has already absorbed the
    # namespace, fed the parent key and then a view of the block's ids: no copy of the ids
    # (a bytes copy of the prompt, and a slice and a concatenation per block, cost ~0.05 ms
    # of the ~0.27 ms that 128 blocks of 256 tokens took here; BLAKE2b itself is ~0.18 ms).
    data = tokens[: n_full * tpb].data.cast("B")
    step = tpb * 4
    start = hashlib.blake2b(namespace.digest, digest_size=KEY_BYTES, person=_KEY_PERSON).copy
    keys: list[BlockKey] = []
    append = keys.append
    prev = parent
    for off in range(0, len(data), step):
        h = start()
        h.update(prev)
        h.update(data[off:off + step])
        prev = h.digest()
        append(prev)
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
