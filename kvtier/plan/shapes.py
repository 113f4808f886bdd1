"""The shape of each layer's KV as vLLM 0.32's model code builds it.

Whether a model's KV is an MLA latent is vLLM's decision by model type
(``ModelArchConfigConvertorBase.is_deepseek_mla``), not the presence of ``kv_lora_rank``:
MiniCPM3 has the field but vLLM serves it as plain attention, caching full K and V for
every head (head size qk_nope + qk_rope, V padded to it), 26.7x the latent. Some families
give some layers other KV heads or head sizes (Gemma-4's full-attention layers,
``global_head_dim`` and ``num_global_key_value_heads``; Step-3.5's
``attention_other_setting``): their per-token KV is a sum over layers, and vLLM cannot put
layers of different page sizes in the one KV cache group kvtier's connector takes.
"""

from __future__ import annotations

from typing import Any

from kvtier.plan.errors import PlanError
from kvtier.plan.fields import MAX_DIM, brief, flag, int_field

MLA_MODEL_TYPES = frozenset({
    "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41",
    "dots3_note", "deepseek_mtp", "k3_dspark", "glm5_next", "glm5_next_text", "glm_moe_dsa",
    "glm4_moe_lite", "glm4_moe_lite_mtp", "kimi_k2", "kimi_linear", "longcat_flash",
    "pangu_ultra_moe", "pangu_ultra_moe_mtp", "bailing_hybrid", "bailing_hybrid_mtp",
    "bailing_hybrid_v3_mtp", "hy_v4", "hy_v4_mtp"})
"""vLLM 0.32's model types served with an MLA latent cache when ``kv_lora_rank`` is set
(vllm/transformers_utils/model_arch_config_convertor.py, ``is_deepseek_mla``)."""
MLA_ROPE_DEFAULT = 64
"""``qk_rope_head_dim`` of every MLA config class (DeepSeek-V2/V3, Kimi) when omitted."""

Shape = tuple[int, int]
"""A layer's (KV heads, head size)."""


def is_mla(cfg: dict[str, Any]) -> bool:
    """Whether vLLM caches an MLA latent for this config: an MLA model type with
    ``kv_lora_rank`` set."""
    return str(cfg.get("model_type", "")) in MLA_MODEL_TYPES \
        and cfg.get("kv_lora_rank") is not None


def expanded_head_dim(cfg: dict[str, Any], source: str) -> int | None:
    """For a config with MLA-style projections that vLLM serves as plain attention
    (MiniCPM3): the per-head K size qk_nope + qk_rope (V is padded to it); None when the
    config has no ``kv_lora_rank`` or is served as MLA."""
    if cfg.get("kv_lora_rank") is None or is_mla(cfg):
        return None
    nope = int_field(cfg, "qk_nope_head_dim", source, 0, MAX_DIM) or 0
    rope = int_field(cfg, "qk_rope_head_dim", source, 0, MAX_DIM) or 0
    return nope + rope or None


def _override(entry: object, key: str, label: str, source: str) -> int | None:
    if not isinstance(entry, dict):
        raise PlanError(f"{source}: config field {label!r} must be an object, got "
                        f"{brief(entry)}")
    return int_field(entry, key, source, 1, MAX_DIM, f"{label}.{key}")


def _gemma4(cfg: dict[str, Any], types: list[object], base: Shape,
            source: str) -> list[Shape]:
    """Gemma-4 (Transformers' Gemma4TextConfig): full-attention layers take
    ``global_head_dim`` (default 512) and, with ``attention_k_eq_v``, the
    ``num_global_key_value_heads``; an explicit ``per_layer_config`` wins."""
    kv, head = base
    per_layer = cfg.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:
        shapes = [base] * len(types)
        for key, entry in per_layer.items():
            if not (str(key).isdigit() and int(key) < len(types)):
                raise PlanError(f"{source}: config field 'per_layer_config' key {brief(key)} "
                                f"is not a layer index below {len(types)}")
            label = f"per_layer_config.{key}"
            shapes[int(key)] = (_override(entry, "num_key_value_heads", label, source) or kv,
                                _override(entry, "head_dim", label, source) or head)
        return shapes
    global_head = int_field(cfg, "global_head_dim", source, 1, MAX_DIM) or 512
    global_kv = int_field(cfg, "num_global_key_value_heads", source, 1, MAX_DIM)
    if not flag(cfg, "attention_k_eq_v", source, False):
        global_kv = None
    full = (global_kv or kv, global_head)
    return [full if t == "full_attention" else base for t in types]


def _step3p5(cfg: dict[str, Any], types: list[object], base: Shape,
             source: str) -> list[Shape]:
    """Step-3.5: layers of ``attention_other_setting.attention_type`` take its
    ``num_attention_groups`` KV heads and ``head_dim``."""
    other = cfg.get("attention_other_setting")
    label = "attention_other_setting"
    kind = other.get("attention_type") if isinstance(other, dict) else None
    if kind is None:
        return [base] * len(types)
    shape = (_override(other, "num_attention_groups", label, source) or base[0],
             _override(other, "head_dim", label, source) or base[1])
    return [shape if t == kind else base for t in types]


def layer_shapes(cfg: dict[str, Any], layers: int, base: Shape,
                 source: str) -> tuple[Shape, ...]:
    """Per layer, the (KV heads, head size) vLLM gives its attention; empty when every
    layer has ``base``."""
    model_type = str(cfg.get("model_type", ""))
    types = cfg.get("layer_types")
    if types is None and model_type.startswith("gemma4"):  # Gemma4TextConfig's default
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                 for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        return ()
    if model_type.startswith("gemma4"):
        shapes = _gemma4(cfg, types, base, source)
    elif model_type == "step3p5":
        shapes = _step3p5(cfg, types, base, source)
    else:
        return ()
    return tuple(shapes) if any(s != base for s in shapes) else ()
