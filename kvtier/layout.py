"""KVLayout: the shape of one kvtier block and its fingerprint.

A block holds the KV of all layers for ``tokens_per_block`` tokens, contiguous as
``[layer][component][token][head][dim]`` where component is K and V (``kv_components=2``)
or a single compressed latent (``kv_components=1``, MLA). Engines with another page
format may store their pages verbatim; ``kv_format`` names that format and is part of
the fingerprint, so two formats never share blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import xxhash

from kvtier.errors import LayoutMismatch, brief

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

CANONICAL_FORMAT = "layer_kv_token_head_dim"
MAX_DIM = 1 << 31   # each dimension is below this (a block's bytes are bounded elsewhere)


def _is_int(value: object) -> bool:
    """A real int (bool is an int subclass, but True is not a layer count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _utf8(text: str) -> bool:
    """Whether ``text`` has UTF-8 bytes (a lone surrogate, e.g. from JSON, has none)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


DEFAULT_TOKENS_PER_BLOCK = 256
"""kvtier's block (one key) when none is configured: large enough that per-block work and
the daemon's per-block memory stay small beside the bytes."""


def default_tokens_per_block(page_tokens: int) -> int:
    """The default block for an engine whose KV pages hold ``page_tokens``: a multiple of
    the page, about ``DEFAULT_TOKENS_PER_BLOCK`` tokens, at least one page."""
    return max(page_tokens, DEFAULT_TOKENS_PER_BLOCK // page_tokens * page_tokens)


MAX_KV_FORMAT = 256
"""Characters of a layout's ``kv_format``: registered namespaces retain their layout, so
what a client may make the daemon keep per namespace is bounded (as model ids are)."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of a block; ``block_bytes`` is what every tier stores per key."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    kv_components: int = 2
    kv_format: str = CANONICAL_FORMAT
    # derived once (the store checks a block's fingerprint on every prefix walk)
    _fingerprint: int = field(init=False, repr=False, compare=False)
    _block_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            value = getattr(self, name)
            if not _is_int(value) or not 0 < value < MAX_DIM:   # (msgpack packs < 2**64)
                raise LayoutMismatch(f"KVLayout.{name} must be a positive int below 2**31, "
                                     f"got {brief(value)}")
        # 2.0 == 2 but packs differently: equal layouts with different fingerprints.
        if not _is_int(self.kv_components) or self.kv_components not in (1, 2):
            raise LayoutMismatch(f"kv_components must be 1 (MLA latent) or 2 (K and V), "
                                 f"got {brief(self.kv_components)}")
        if not isinstance(self.kv_format, str) or not 0 < len(self.kv_format) <= MAX_KV_FORMAT:
            raise LayoutMismatch(f"kv_format must be a non-empty string of at most "
                                 f"{MAX_KV_FORMAT} characters, got {brief(self.kv_format)}")
        if not _utf8(self.kv_format):   # (the fingerprint hashes its UTF-8 bytes)
            raise LayoutMismatch("kv_format must be valid Unicode (no lone surrogates)")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise LayoutMismatch(
                f"unsupported KV dtype {brief(self.dtype)}; use one of {sorted(DTYPE_BYTES)}")
        packed = msgpack.packb(sorted(self.to_dict().items()), use_bin_type=True)
        object.__setattr__(self, "_fingerprint", xxhash.xxh3_64_intdigest(packed))
        object.__setattr__(self, "_block_bytes", self.bytes_per_token * self.tokens_per_block)

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers (the planner's unit)."""
        return (self.num_layers * self.kv_components * self.num_kv_heads * self.head_dim
                * self.element_bytes)

    @property
    def block_bytes(self) -> int:
        """Payload size of one block, the unit of allocation in every tier."""
        return self._block_bytes

    def to_dict(self) -> dict[str, int | str]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "tokens_per_block": self.tokens_per_block,
            "kv_components": self.kv_components,
            "kv_format": self.kv_format,
        }

    @classmethod
    def from_dict(cls, data: object) -> KVLayout:
        """Build a layout from untrusted data (a socket frame); bad input raises LayoutMismatch."""
        if not isinstance(data, dict):
            raise LayoutMismatch("layout must be a map")
        allowed = {"num_layers", "num_kv_heads", "head_dim", "dtype", "tokens_per_block",
                   "kv_components", "kv_format"}
        unknown = set(data) - allowed
        if unknown:
            raise LayoutMismatch(f"unknown layout fields {sorted(map(str, unknown))}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise LayoutMismatch(f"incomplete layout: {exc}") from None

    @property
    def fingerprint(self) -> int:
        """64-bit digest of the geometry; stored in every frame header."""
        return self._fingerprint
