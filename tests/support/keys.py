"""Small namespaces and token runs for block-key tests (4 tokens per block)."""

from __future__ import annotations

from kvtier.keys import Namespace
from kvtier.layout import KVLayout

TPB = 4


def layout(**overrides: object) -> KVLayout:
    """A small layout (4 tokens per block) with selected fields changed."""
    base: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                               "dtype": "float16", "tokens_per_block": TPB}
    base.update(overrides)
    return KVLayout(**base)  # type: ignore[arg-type]


def ns(**overrides: object) -> Namespace:
    base: dict[str, object] = {"model_id": "org/model-7b", "layout": layout(), "tp_rank": 0,
                               "tp_size": 1, "cache_salt": None}
    base.update(overrides)
    return Namespace(**base)  # type: ignore[arg-type]


TOKENS = list(range(1000, 1000 + 4 * TPB))  # four full blocks
