"""Hybrid stacks whose layer pattern lives in a family's own fields, as vLLM reads them.

Falcon-H1 runs attention and Mamba side by side in every layer (Transformers' config
computes ``layers_block_type``; config.json never holds it): every layer keeps KV and a
recurrent state. Kimi-Linear's ``linear_attn_config.kda_layers`` (1-based) are KDA
(linear attention, a fixed state); the others MLA. Bailing-V2.5's ``layer_group_size``
makes every group's last layer MLA and the rest linear attention; Bailing-V3 keeps the
layers past the last whole group as MLA too. Planned as every layer attention, these
hybrids got up to 4x their KV and no word that kvtier's connector refuses them.
"""

from __future__ import annotations

from typing import Any

#: Layer type names, as kvtier.plan.layers reads them.
FULL, STATE, BOTH = "full_attention", "linear_attention", "hybrid"


def _kimi(cfg: dict[str, Any], layers: int) -> list[str] | None:
    """Kimi-Linear (vLLM's KimiLinearConfig.is_kda_layer): ``(i + 1) in kda_layers``."""
    linear = cfg.get("linear_attn_config")
    if not isinstance(linear, dict):
        return None
    kda = linear.get("kda_layers")
    if isinstance(kda, list) and all(isinstance(i, int) for i in kda):
        return [STATE if i + 1 in kda else FULL for i in range(layers)]
    full = linear.get("full_attn_layers")
    if isinstance(full, list) and all(isinstance(i, int) for i in full):
        return [FULL if i + 1 in full else STATE for i in range(layers)]
    return None


def _bailing(cfg: dict[str, Any], layers: int) -> list[str]:
    """Bailing hybrid (vLLM's bailing_moe_linear.py and bailing_moe_v3.py)."""
    size = cfg.get("layer_group_size")
    size = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1
    v3 = any("V3" in str(a) for a in cfg.get("architectures") or ())
    grouped = layers // size * size
    return [FULL if (i + 1) % size == 0 or (v3 and i >= grouped) else STATE
            for i in range(layers)]


def hybrid_types(cfg: dict[str, Any], layers: int) -> list[str] | None:
    """The layer types of Falcon-H1, Kimi-Linear and Bailing hybrids; None for others."""
    model_type = str(cfg.get("model_type", ""))
    if model_type == "falcon_h1":
        return [BOTH] * layers
    if model_type == "kimi_linear" or "linear_attn_config" in cfg:
        return _kimi(cfg, layers)
    if model_type == "bailing_hybrid":
        return _bailing(cfg, layers)
    return None
