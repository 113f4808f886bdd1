"""DeepSeek-V3.2's sparse-attention indexer: a second KV cache beside the MLA latent.

A config with ``index_topk`` is V3.2-style sparse attention (vLLM's test:
``hasattr(config, "index_topk")``). vLLM then gives each indexed layer a key cache for the
lightning indexer (``DeepseekV32IndexerCache``): per token one key of ``index_head_dim``
fp8 values plus an fp32 scale per block of 128 values, whatever ``--kv-dtype`` is, held
whole by every TP rank like the latent. For V3.2 that is 128 + 4 = 132 B per token per
layer beside the latent's 1,152 B (bf16): leaving it out under-plans the KV by ~10%.
"""

from __future__ import annotations

from typing import Any

from kvtier.plan.errors import PlanError
from kvtier.plan.fields import MAX_LAYERS, brief, opt_int

#: Values per fp32 scale in the indexer key cache (vLLM's ``Indexer.quant_block_size``,
#: fixed in its code: no config field gives it).
QUANT_BLOCK = 128
SCALE_BYTES = 4  # one float32 scale per quant block
KEY_BYTES = 1  # fp8 per value


def indexer_bytes(index_head_dim: int) -> int:
    """Bytes one token adds to one layer's indexer key cache (vLLM's head_size, uint8)."""
    return index_head_dim * KEY_BYTES + index_head_dim // QUANT_BLOCK * SCALE_BYTES


def indexer_layers(cfg: dict[str, Any], layers: int, source: str) -> tuple[bool, ...]:
    """Per layer, whether vLLM builds an indexer (and its cache) there; empty without
    ``index_topk``. ``index_topk_pattern`` ("S" skips a layer) or ``index_topk_freq`` with
    ``index_skip_topk_offset`` thin them out, as vLLM's DeepseekV2 attention reads them."""
    if "index_topk" not in cfg:
        return ()
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str | list):
            raise PlanError(f"{source}: config field 'index_topk_pattern' must be a string or "
                            f"a list, got {brief(pattern)}")
        return tuple(not (i < len(pattern) and pattern[i] == "S") for i in range(layers))
    freq = opt_int(cfg, "index_topk_freq", source, 1, high=MAX_LAYERS)
    offset = cfg.get("index_skip_topk_offset", 2)
    if isinstance(offset, bool) or not isinstance(offset, int) or abs(offset) > MAX_LAYERS:
        raise PlanError(f"{source}: config field 'index_skip_topk_offset' must be an integer, "
                        f"got {brief(offset)}")
    return tuple(max(i - offset + 1, 0) % freq == 0 for i in range(layers))


def index_head_dim(cfg: dict[str, Any], source: str) -> int:
    """``index_head_dim`` of a config with ``index_topk`` (0 without); PlanError when absent."""
    if "index_topk" not in cfg:
        return 0
    dim = opt_int(cfg, "index_head_dim", source)
    if not dim:
        raise PlanError(f"{source}: config gives 'index_topk' (sparse attention with an "
                        "indexer) but not 'index_head_dim', which sizes the indexer's cache")
    return dim
