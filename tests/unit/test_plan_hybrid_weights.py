"""``kvtier plan``'s weight count for hybrid stacks (kvtier.plan.mixers): Mamba-1/2, gated
DeltaNet and short-convolution layers, and Nemotron-H's one-block-per-layer stacks.

Expected totals are Transformers' own count of the same config (``numel`` of every
parameter of ``AutoModelForCausalLM.from_config`` on the meta device), taken once.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.plan.kvmath import estimate_params
from kvtier.plan.layers import NO_KV
from kvtier.plan.model import spec_from_config

# Nemotron-H-8B: Mamba-2 (M), MLP (-) and attention (*) layers, one block each.
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H: dict[str, Any] = {
    "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 4096,
    "tie_word_embeddings": False, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 21504, "ssm_state_size": 128,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "conv_kernel": 4,
    "expand": 2, "use_conv_bias": True, "mamba_proj_bias": False,
    "n_routed_experts": 8, "n_shared_experts": 1, "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688, "num_experts_per_tok": 2,
}
_BLOCK = {"M": "linear_attention", "-": "mlp", "*": "full_attention", "E": "moe"}
BAMBA: dict[str, Any] = {
    "model_type": "bamba", "vocab_size": 128000, "tie_word_embeddings": False,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_indices": [9, 18, 27],
    "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 256,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False,
}
JAMBA: dict[str, Any] = {
    "model_type": "jamba", "vocab_size": 65536, "tie_word_embeddings": False,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_experts_per_tok": 2,
    "num_experts": 16, "expert_layer_period": 2, "expert_layer_offset": 1,
    "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_dt_rank": 256, "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}
LFM2: dict[str, Any] = {
    "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 2560,
    "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "tie_word_embeddings": True, "conv_bias": False,
    "conv_L_cache": 3, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": True,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30],
}
QWEN3_NEXT: dict[str, Any] = {
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "tie_word_embeddings": False, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512,
}


def _total(cfg: dict[str, Any]) -> int:
    return estimate_params(spec_from_config(cfg)).total


def test_nemotron_h_counts_one_block_per_layer() -> None:
    """Each Nemotron-H layer is a Mamba mixer, an MLP or attention, never all three, and
    its MLP is ungated; counted as attention plus a gated MoE everywhere (the config's
    default expert fields) Nemotron-H-8B was 47 B, not Transformers' 8.1 B."""
    cfg = {**NEMOTRON_H, "hybrid_override_pattern": NEMOTRON_H_8B_PATTERN}
    assert _total(cfg) == 8_100_852_736
    # Transformers 5 writes the pattern as layers_block_type and no num_hidden_layers
    written = {**NEMOTRON_H, "layers_block_type": [_BLOCK[c] for c in NEMOTRON_H_8B_PATTERN]}
    assert _total(written) == 8_100_852_736
    spec = spec_from_config(written)
    assert spec.num_layers == 52 and spec.kv_layers == 4 and spec.state_layers == 24


def test_nemotron_h_moe_layers_are_the_ones_the_pattern_names() -> None:
    cfg = {**NEMOTRON_H, "hybrid_override_pattern": "ME*E" * 6}
    assert _total(cfg) == 8_785_561_856
    moe = spec_from_config(cfg).moe
    assert moe is not None and moe.moe_layers == (False, True, False, True) * 6


@pytest.mark.parametrize(("cfg", "total", "tolerance"), [
    (BAMBA, 9_808_584_064, 0), (JAMBA, 51_570_323_328, 0),
    (LFM2, 2_882_580_160, 1e-5), ({**LFM2, "conv_bias": True}, 2_882_810_560, 1e-5),
    (QWEN3_NEXT, 79_674_391_296, 2e-3)])
def test_hybrid_mixers_count_as_transformers_does(cfg: dict[str, Any], total: int,
                                                  tolerance: float) -> None:
    """Mamba-2 (Bamba), Mamba-1 (Jamba), short convolutions (LFM2) and gated DeltaNet
    (Qwen3-Next) layers: 0.80x, 0.97x, 1.37x and 0.99x of the weights when counted as
    attention (Qwen3-Next's rest is its gate and norm biases)."""
    assert _total(cfg) == pytest.approx(total, rel=tolerance)


def test_bamba_holds_kv_in_its_attention_layers_only() -> None:
    """attn_layer_indices was not read: Bamba-9B was planned with KV in all 32 layers."""
    spec = spec_from_config(BAMBA)
    assert [i for i, w in enumerate(spec.layer_windows) if w != NO_KV] == [9, 18, 27]
    assert spec.state_layers == 29


def test_an_unknown_familys_state_layers_keep_the_attention_count() -> None:
    """A hybrid the planner has no mixer formula for errs on the weights, not the KV."""
    cfg = {**QWEN3_NEXT, "model_type": "somebodys_hybrid", "full_attention_interval": 4}
    spec = spec_from_config(cfg)
    assert spec.mixers is not None and all(spec.mixers.attention)
    assert not any(spec.mixers.state) and spec.kv_layers == 12


ZAMBA2: dict[str, Any] = {
    "model_type": "zamba2", "vocab_size": 32000, "hidden_size": 2560,
    "num_hidden_layers": 54, "num_attention_heads": 32, "num_key_value_heads": 32,
    "intermediate_size": 10240, "tie_word_embeddings": True, "mamba_d_state": 64,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1, "n_mamba_heads": 8,
    "mamba_headdim": 640, "use_conv_bias": True, "add_bias_linear": False,
    "num_mem_blocks": 1, "use_shared_attention_adapter": False, "adapter_rank": 128,
    "attention_hidden_size": 5120, "hybrid_layer_ids": [6, 12, 18, 24, 30, 36, 42, 47, 51],
}


@pytest.mark.parametrize(("extra", "total"), [
    ({}, 2_481_848_336), ({"num_mem_blocks": 2}, 2_652_249_616),
    ({"use_shared_attention_adapter": True}, 2_517_237_776)])
def test_zamba2_counts_its_shared_blocks_once(extra: dict[str, Any], total: int) -> None:
    """Zamba2's 54 layers are Mamba mixers; its attention and MLP blocks are shared by the
    9 hybrid layers (each adding a projection and LoRA adapters). Counted per layer as
    attention + MLP, Zamba2-2.7B was 5.7 B of Transformers' 2.5 B."""
    spec = spec_from_config({**ZAMBA2, **extra})
    assert estimate_params(spec).total == total
    assert spec.kv_layers == 9 and spec.head_dim == 160   # hybrid_layer_ids alone
