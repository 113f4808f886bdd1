"""What a config.json leaves out but its Transformers config class defines.

vLLM reads a model's config through its Transformers config class, so a field the file
omits takes the class's default, not kvtier's generic fallback: Gemma-3-12B's published
``text_config`` has no ``head_dim`` and is served with 256 (not hidden / heads = 240), and
Gemma-3-4B's gives no head counts at all (8 heads, 4 KV heads). The defaults below are
copied from Transformers' ``configuration_*.py`` (checked against the installed version);
only fields the plan reads, and only families vLLM serves with a model of its own.
"""

from __future__ import annotations

from typing import Any

_GEMMA3_TEXT = {"head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
                "vocab_size": 262_208, "sliding_window": 4096,
                "max_position_embeddings": 131_072}
_GEMMA4_TEXT = {"head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
                "vocab_size": 262_144}

CLASS_DEFAULTS: dict[str, dict[str, int]] = {
    "gemma": {"head_dim": 256, "num_attention_heads": 16, "num_key_value_heads": 16,
              "vocab_size": 256_000, "max_position_embeddings": 8192},
    "gemma2": {"head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
               "vocab_size": 256_000, "sliding_window": 4096,
               "max_position_embeddings": 8192},
    "gemma3_text": _GEMMA3_TEXT,
    "gemma3n_text": {"head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
                     "vocab_size": 262_400, "sliding_window": 512,
                     "max_position_embeddings": 32_768},
    "gemma4_text": {**_GEMMA4_TEXT, "sliding_window": 512, "max_position_embeddings": 131_072},
    "gemma4_unified_text": {**_GEMMA4_TEXT, "sliding_window": 1024,
                            "max_position_embeddings": 262_144},
    "vaultgemma": {"head_dim": 256},
    "qwen3": {"head_dim": 128},
    "qwen3_vl_text": {"head_dim": 128},
    "qwen3_next": {"head_dim": 256},
    "qwen3_5_text": {"head_dim": 256},
    "qwen3_5_moe_text": {"head_dim": 256},
    "gpt_oss": {"head_dim": 64},
    "glm": {"head_dim": 128},
    "glm4": {"head_dim": 128},
    "llama4_text": {"head_dim": 128},
    "ministral3": {"head_dim": 128},
    "step3p5": {"head_dim": 128},
    "seed_oss": {"head_dim": 128},
    "ernie4_5": {"head_dim": 128},
    "minimax_m2": {"head_dim": 128},
    "nemotron_h": {"head_dim": 128},
    "mimo_v2_flash": {"head_dim": 192},
    # MiniCPM3 is served as plain attention over per-head K and V of qk_nope + qk_rope
    "minicpm3": {"qk_nope_head_dim": 64, "qk_rope_head_dim": 32},
}
"""Per model type, the class defaults of the fields the plan reads (absent or null)."""

TEXT_TYPE = {"gemma3": "gemma3_text", "gemma3n": "gemma3n_text", "gemma4": "gemma4_text",
             "gemma4_unified": "gemma4_unified_text", "qwen3_vl": "qwen3_vl_text",
             "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
             "llama4": "llama4_text"}
"""A multimodal model type's language-model type, for a ``text_config`` without one."""


def with_class_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the fields its model type's config class defaults filled in where the
    file leaves them out; ``cfg`` itself when its type has none listed. An explicit null
    stays null, as Transformers keeps it (Gemma 2/3's ``sliding_window: null`` is full
    attention in vLLM; a class default there planned windows, found by review)."""
    defaults = CLASS_DEFAULTS.get(str(cfg.get("model_type", "")))
    if not defaults:
        return cfg
    return {**cfg, **{k: v for k, v in defaults.items() if k not in cfg}}
