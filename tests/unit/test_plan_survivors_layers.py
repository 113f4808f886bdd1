"""Mutation-review pins for which layers ``kvtier plan`` gives KV, experts or a window
(layers, hybrid, moe, shapes, blocks, families, connector_fit) and the trace it sizes from.

A layer pattern read one layer off, or a family default read wrong, plans KV for layers
that hold none (or none for layers that hold it): each test says which.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.plan import PlanError
from kvtier.plan.connector_fit import as_the_connector_runs
from kvtier.plan.kvmath import estimate_params, kv_bytes_per_sequence, kv_bytes_per_token
from kvtier.plan.layers import NO_KV
from kvtier.plan.model import AttentionKind, spec_from_config
from kvtier.plan.workload import parse_context, read_trace


def _kv_layers(cfg: dict[str, Any]) -> list[int]:
    """0-based indices of the layers that hold attention KV."""
    return [i for i, w in enumerate(spec_from_config(cfg).layer_windows) if w != NO_KV]


_KIMI: dict[str, Any] = {
    "model_type": "kimi_linear", "hidden_size": 2304, "num_hidden_layers": 8,
    "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "intermediate_size": 9216, "vocab_size": 163840,
}


def test_kimi_linear_layer_lists_are_one_based() -> None:
    """vLLM's is_kda_layer tests ``layer_idx + 1 in kda_layers``: with the last layer KDA,
    reading the list 0-based gives KV to layer 0 (a KDA layer) and plans a layer too many."""
    kda = {"linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7, 8]}}
    assert _kv_layers({**_KIMI, **kda}) == [3]
    full = {"linear_attn_config": {"full_attn_layers": [4, 8]}}
    m = spec_from_config({**_KIMI, **full})
    assert [i for i, w in enumerate(m.layer_windows) if w != NO_KV] == [3, 7]
    assert m.attention is AttentionKind.MLA
    assert kv_bytes_per_token(m, "bf16") == 2 * 576 * 2


def test_deepseek_moe_layer_freq_leaves_dense_layers_between() -> None:
    """DeepSeek's ``moe_layer_freq`` (vLLM: ``layer_idx % moe_layer_freq == 0`` past
    first_k_dense_replace): at 2, half of the remaining layers have a dense MLP."""
    cfg = {"model_type": "deepseek_v2", "num_hidden_layers": 6, "hidden_size": 1024,
           "intermediate_size": 4096, "moe_intermediate_size": 512,
           "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 2,
           "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
           "v_head_dim": 64, "vocab_size": 1000}
    m = spec_from_config(cfg)
    assert m.moe is not None
    assert m.moe.moe_layers == (False, False, True, False, True, False)
    assert estimate_params(m).experts == 2 * 8 * 3 * 1024 * 512


def test_linear_attn_config_is_read_whatever_the_model_type() -> None:
    """A config carrying Kimi-Linear's ``linear_attn_config`` under another model type
    (a fine-tune's renamed class) still has KDA layers without KV: read as every layer
    attention it planned 4x the KV."""
    cfg = {**_KIMI, "model_type": "kimi_linear_custom",
           "linear_attn_config": {"full_attn_layers": [4, 8]}}
    assert _kv_layers(cfg) == [3, 7]


_SMALL: dict[str, Any] = {
    "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 1024, "vocab_size": 1000,
}


def test_hybrid_sliding_layers_keep_a_window_beside_their_state() -> None:
    """``hybrid_sliding`` is sliding attention beside a recurrent state: its KV stops at
    the window and it counts as a state layer, like ``hybrid`` does with full attention."""
    cfg = {**_SMALL, "sliding_window": 128,
           "layer_types": ["hybrid_sliding", "hybrid", "mamba2", "full_attention"]}
    m = spec_from_config(cfg)
    assert m.layer_windows == (128, None, NO_KV, None)
    assert m.state_layers == 3


def test_nemotron_h_moe_layers_hold_no_kv() -> None:
    """Nemotron-H's pattern: M Mamba, * attention, E MoE and - MLP; only * holds KV (an E
    read as an unknown type counted as full attention)."""
    assert _kv_layers({**_SMALL, "model_type": "nemotron_h", "num_hidden_layers": 5,
                       "hybrid_override_pattern": "M*ME-"}) == [1]


def test_family_layer_patterns_without_their_optional_fields() -> None:
    """Each family's own default, as its config class has it: Qwen3-Next full attention
    every 4th layer, Jamba every 8th from the 5th, LFM2 at full_attn_idxs, and Bamba's
    layers_block_type; read wrong, the plan gives KV to the linear or SSM layers."""
    assert _kv_layers({**_SMALL, "model_type": "qwen3_next",
                       "num_hidden_layers": 8}) == [3, 7]
    assert _kv_layers({**_SMALL, "model_type": "jamba", "num_hidden_layers": 16}) == [4, 12]
    assert _kv_layers({**_SMALL, "model_type": "lfm2", "num_hidden_layers": 6,
                       "full_attn_idxs": [2, 5]}) == [2, 5]
    bamba = {**_SMALL, "model_type": "bamba",
             "layers_block_type": ["mamba", "attention", "mamba", "mamba"]}
    assert _kv_layers(bamba) == [1]
    assert spec_from_config(bamba).state_layers == 3


def test_qwen2_window_switched_on_without_max_window_layers_plans_full_layers() -> None:
    """use_sliding_window without max_window_layers gives no first windowed layer: every
    layer is planned full (never less KV than it can hold), not every layer windowed."""
    cfg = {**_SMALL, "model_type": "qwen2", "use_sliding_window": True,
           "sliding_window": 64}
    assert spec_from_config(cfg).layer_windows == (None,) * 4


def test_gemma3_text_config_without_its_type_takes_gemma3_text_defaults() -> None:
    """A multimodal Gemma-3 config whose text_config names no model_type is gemma3_text
    (vLLM's class): head_dim 256, not hidden / heads = 240 (Gemma-3-12B), 6.7% more KV."""
    cfg = {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {
        "num_hidden_layers": 48, "hidden_size": 3840, "num_attention_heads": 16,
        "num_key_value_heads": 8, "intermediate_size": 15360}}
    m = spec_from_config(cfg)
    assert (m.model_type, m.head_dim) == ("gemma3_text", 256)
    assert kv_bytes_per_token(m, "bf16") == 48 * 2 * 8 * 256 * 2


def test_a_config_with_its_own_layers_is_not_unwrapped() -> None:
    """A config giving num_hidden_layers itself is the language model even with a
    text_config beside it (the text_config is then another part's)."""
    cfg = {**_SMALL, "text_config": {**_SMALL, "num_hidden_layers": 40}}
    assert spec_from_config(cfg).num_layers == 4


def test_kimi_k2_caches_the_mla_latent() -> None:
    """Kimi-K2 (model_type kimi_k2, DeepSeek-V3's architecture) is served with an MLA
    latent: 61 x 576 values per token, 70,272 B in bf16; not 64 heads of K and V of
    qk_nope + qk_rope each (27x more), as a type vLLM serves as plain attention would be."""
    cfg = {"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 7168,
           "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512,
           "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "intermediate_size": 18432, "vocab_size": 163840}
    m = spec_from_config(cfg)
    assert m.attention is AttentionKind.MLA
    assert kv_bytes_per_token(m, "bf16") == 61 * 576 * 2 == 70_272


def test_gemma4_defaults_put_the_512_wide_heads_on_every_sixth_layer() -> None:
    """Gemma-4 without layer_types or global_head_dim: every 6th layer (5, 11) is full
    attention with Gemma4TextConfig's global_head_dim 512; the others slide over 512
    tokens with head_dim 256. Their KV per sequence follows which layers are which."""
    cfg = {"model_type": "gemma4_text", "num_hidden_layers": 12, "hidden_size": 2048,
           "intermediate_size": 8192, "sliding_window": 512}
    m = spec_from_config(cfg)
    small, big = 2 * 4 * 256 * 2, 2 * 4 * 512 * 2
    assert [i for i, w in enumerate(m.layer_windows) if w is None] == [5, 11]
    assert kv_bytes_per_token(m, "bf16") == 10 * small + 2 * big
    assert kv_bytes_per_sequence(m, "bf16", 4096) == 10 * 512 * small + 2 * 4096 * big


def test_step3p5_other_attention_type_alone_takes_its_heads() -> None:
    """Step-3.5's attention_other_setting applies to the layers of its attention_type only:
    two sliding layers of 16 KV heads beside two full ones of num_attention_groups=8."""
    base = {k: v for k, v in _SMALL.items() if k != "num_key_value_heads"}
    cfg = {**base, "model_type": "step3p5", "num_attention_heads": 64,
           "num_attention_groups": 8, "head_dim": 128,
           "layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 512,
           "attention_other_setting": {"attention_type": "sliding_attention",
                                       "num_attention_groups": 16, "head_dim": 128}}
    m = spec_from_config(cfg)
    assert kv_bytes_per_token(m, "bf16") == 2 * (2 * 8 * 128 * 2) + 2 * (2 * 16 * 128 * 2)


def test_decilm_ffn_mult_width_rounds_up_to_256() -> None:
    """DeciLM's MLP width from ffn_mult: 2/3 x 1.3 x 8192 = 7,099.7, rounded up to the next
    multiple of 256, 7,168 (as its modeling code's _find_multiple does)."""
    block = {"attention": {"n_heads_in_group": 8}, "ffn": {"ffn_mult": 1.3}}
    cfg = {"model_type": "nemotron-nas", "num_hidden_layers": 1, "hidden_size": 8192,
           "num_attention_heads": 64, "vocab_size": 1000, "block_configs": [block]}
    assert spec_from_config(cfg).blocks[0].ffn_width == 7168


def test_trace_prefix_reuse_is_capped_at_the_prompt(tmp_path: Path) -> None:
    """A request reuses the leading blocks already seen, and never more tokens than its
    prompt has: a 100-token prompt in a seen 512-token block reuses 100 tokens."""
    rows = [(1024, [1, 2]), (1024, [1, 2]), (1024, [9, 10]), (100, [1])]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": n,
                                        "output_length": 1, "hash_ids": h}) + "\n"
                            for i, (n, h) in enumerate(rows)))
    summary = read_trace(path)
    assert summary.block_tokens == 512
    assert summary.prefix_share == (1024 + 0 + 100) / (3 * 1024 + 100)
    assert summary.block_hit_share == 3 / 7


def test_a_zero_token_context_is_refused() -> None:
    """--context 0 plans sequences holding no KV ("0 sequences fit"): refused."""
    with pytest.raises(PlanError, match="--context"):
        parse_context("0")


def test_mlp_only_layers_stay_without_kv_as_the_connector_runs_the_model() -> None:
    """With kvtier's connector windowed layers beside full ones keep every token, but an
    MLP-only layer still holds none: 2 layers of KV per token, not 3."""
    cfg = {**_SMALL, "num_hidden_layers": 3, "sliding_window": 64,
           "layer_types": ["sliding_attention", "full_attention", "mlp"]}
    runs = as_the_connector_runs(spec_from_config(cfg))
    assert runs.layer_windows == (None, None, NO_KV)
    assert kv_bytes_per_sequence(runs, "bf16", 1024) == 2 * 1024 * 2 * 2 * 64 * 2


def test_falcon_without_multi_query_field_has_one_kv_head() -> None:
    """FalconConfig's multi_query defaults to true: a Falcon config that omits it has one
    KV head (Falcon-7B), not 71; read as MHA the plan needs 71x the KV."""
    cfg = {"model_type": "falcon", "num_hidden_layers": 32, "hidden_size": 4544,
           "num_attention_heads": 71, "vocab_size": 65024}
    m = spec_from_config(cfg)
    assert m.num_kv_heads == 1
    assert kv_bytes_per_token(m, "bf16") == 32 * 2 * 64 * 2


def test_mpt_and_chatglm_kv_heads_and_mpt_mlp_width() -> None:
    """MPT's multiquery_attention is one KV head and its MLP expansion_ratio x d_model
    wide; ChatGLM without multi_query_attention (default false) has a KV head per head."""
    mpt = {"model_type": "mpt", "n_layers": 2, "d_model": 1024, "n_heads": 8,
           "vocab_size": 1000, "expansion_ratio": 2,
           "attn_config": {"attn_type": "multiquery_attention"}}
    m = spec_from_config(mpt)
    assert (m.num_kv_heads, m.intermediate_size) == (1, 2048)
    glm = {"model_type": "chatglm", "num_layers": 2, "hidden_size": 1024,
           "num_attention_heads": 8, "multi_query_group_num": 2, "padded_vocab_size": 1000}
    assert spec_from_config(glm).num_kv_heads == 8
