"""Built-in model presets, written as the fields of each model's Hugging Face config.json.

Presets go through the same parser as a user's config.json, so a preset and the
published config.json of the same model plan identically. Values are copied from the
public configs on the Hugging Face Hub (only the fields the planner reads).
"""

from __future__ import annotations

from typing import Any

_LLAMA2_BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
    "max_position_embeddings": 4096, "torch_dtype": "float16", "tie_word_embeddings": False,
    "hidden_act": "silu", "rms_norm_eps": 1e-05,
}
_LLAMA3_BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "hidden_act": "silu", "rope_theta": 500000.0,
}
_QWEN25_BASE: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": 131072, "hidden_act": "silu",
}

_QWEN3_BASE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "head_dim": 128, "attention_bias": False, "use_sliding_window": False,
    "sliding_window": None, "hidden_act": "silu",
}
_QWEN3_MOE_BASE: dict[str, Any] = {
    **_QWEN3_BASE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_experts": 128,
    "num_experts_per_tok": 8,
}


def _gpt_oss(name: str, layers: int, experts: int) -> dict[str, Any]:
    """gpt-oss: MXFP4 experts, sliding-window (128) and full attention alternating."""
    return {
        "_name_or_path": name, "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss", "num_hidden_layers": layers, "num_local_experts": experts,
        "num_experts_per_tok": 4, "hidden_size": 2880, "intermediate_size": 2880,
        "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
        "sliding_window": 128, "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "vocab_size": 201088, "max_position_embeddings": 131072, "attention_bias": True,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]},
    }


def _with(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    merged = dict(base)
    merged.update(fields)
    return merged


PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": _with(_LLAMA2_BASE, _name_or_path="meta-llama/Llama-2-7b-hf",
                        num_hidden_layers=32, hidden_size=4096, intermediate_size=11008,
                        num_attention_heads=32, num_key_value_heads=32),
    "llama-2-13b": _with(_LLAMA2_BASE, _name_or_path="meta-llama/Llama-2-13b-hf",
                         num_hidden_layers=40, hidden_size=5120, intermediate_size=13824,
                         num_attention_heads=40, num_key_value_heads=40),
    "llama-2-70b": _with(_LLAMA2_BASE, _name_or_path="meta-llama/Llama-2-70b-hf",
                         num_hidden_layers=80, hidden_size=8192, intermediate_size=28672,
                         num_attention_heads=64, num_key_value_heads=8),
    "llama-3-8b": _with(_LLAMA3_BASE, _name_or_path="meta-llama/Meta-Llama-3-8B",
                        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                        num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": _with(_LLAMA3_BASE, _name_or_path="meta-llama/Meta-Llama-3-70B",
                         num_hidden_layers=80, hidden_size=8192, intermediate_size=28672,
                         num_attention_heads=64, num_key_value_heads=8),
    "qwen2.5-7b": _with(_QWEN25_BASE, _name_or_path="Qwen/Qwen2.5-7B-Instruct",
                        num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                        num_attention_heads=28, num_key_value_heads=4, max_window_layers=28),
    "qwen2.5-14b": _with(_QWEN25_BASE, _name_or_path="Qwen/Qwen2.5-14B-Instruct",
                         num_hidden_layers=48, hidden_size=5120, intermediate_size=13824,
                         num_attention_heads=40, num_key_value_heads=8, max_window_layers=48),
    "qwen2.5-32b": _with(_QWEN25_BASE, _name_or_path="Qwen/Qwen2.5-32B-Instruct",
                         num_hidden_layers=64, hidden_size=5120, intermediate_size=27648,
                         num_attention_heads=40, num_key_value_heads=8, max_window_layers=64),
    "qwen2.5-72b": _with(_QWEN25_BASE, _name_or_path="Qwen/Qwen2.5-72B-Instruct",
                         num_hidden_layers=80, hidden_size=8192, intermediate_size=29568,
                         num_attention_heads=64, num_key_value_heads=8, max_window_layers=80),
    "mistral-7b": {
        "_name_or_path": "mistralai/Mistral-7B-v0.1", "architectures": ["MistralForCausalLM"],
        "model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    },
    "mixtral-8x7b": {
        "_name_or_path": "mistralai/Mixtral-8x7B-v0.1", "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "max_position_embeddings": 32768, "sliding_window": None, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "gemma-2-9b": {
        "_name_or_path": "google/gemma-2-9b", "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2", "num_hidden_layers": 42, "hidden_size": 3584,
        "intermediate_size": 14336, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
        "sliding_window": 4096, "torch_dtype": "float32", "tie_word_embeddings": True,
    },
    "qwen3-8b": _with(_QWEN3_BASE, _name_or_path="Qwen/Qwen3-8B", num_hidden_layers=36,
                      hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                      num_key_value_heads=8, max_window_layers=36),
    "qwen3-32b": _with(_QWEN3_BASE, _name_or_path="Qwen/Qwen3-32B", num_hidden_layers=64,
                       hidden_size=5120, intermediate_size=25600, num_attention_heads=64,
                       num_key_value_heads=8, max_window_layers=64),
    "qwen3-30b-a3b": _with(_QWEN3_MOE_BASE, _name_or_path="Qwen/Qwen3-30B-A3B",
                           num_hidden_layers=48, hidden_size=2048, intermediate_size=6144,
                           moe_intermediate_size=768, num_attention_heads=32,
                           num_key_value_heads=4, max_window_layers=48),
    "qwen3-235b-a22b": _with(_QWEN3_MOE_BASE, _name_or_path="Qwen/Qwen3-235B-A22B",
                             num_hidden_layers=94, hidden_size=4096, intermediate_size=12288,
                             moe_intermediate_size=1536, num_attention_heads=64,
                             num_key_value_heads=4, max_window_layers=94),
    "gpt-oss-20b": _gpt_oss("openai/gpt-oss-20b", 24, 32),
    "gpt-oss-120b": _gpt_oss("openai/gpt-oss-120b", 36, 128),
    "deepseek-v3": {
        "_name_or_path": "deepseek-ai/DeepSeek-V3", "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
        "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    },
}

ALIASES: dict[str, str] = {
    "llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b", "llama2-70b": "llama-2-70b",
    "llama3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b",
    "mistral-7b-v0.1": "mistral-7b", "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "deepseek-r1": "deepseek-v3",
}


def preset_names() -> list[str]:
    """Names accepted by ``--model`` (aliases excluded), in table order."""
    return list(PRESETS)


def find_preset(name: str) -> dict[str, Any] | None:
    """Return a copy of the preset's config fields, matching names case-insensitively."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    fields = PRESETS.get(key)
    return None if fields is None else dict(fields)
