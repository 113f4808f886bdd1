"""``kvtier plan``'s weight count for families whose layers differ from Llama's.

Expected totals are Transformers' own count of the same config (``numel`` of every
parameter of ``AutoModelForCausalLM.from_config`` on the meta device), taken once.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.plan.kvmath import estimate_params
from kvtier.plan.model import spec_from_config

_SMALL: dict[str, Any] = {
    "num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
    "num_key_value_heads": 8, "intermediate_size": 2048, "vocab_size": 1000,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("model_type", ["apertus", "arcee", "persimmon", "nanochat",
                                        "jais2", "codegen"])
def test_an_ungated_mlp_counts_two_matrices(model_type: str) -> None:
    """Apertus (xIELU), Arcee (ReLU squared) and the others have up and down projections
    only; counted as gated, Apertus-8B came out at 8.9 B for Transformers' 7.0 B."""
    cfg = {**_SMALL, "model_type": model_type}
    spec = spec_from_config(cfg)
    assert not spec.gated_mlp
    llama = estimate_params(spec_from_config({**cfg, "model_type": "llama"}))
    assert llama.total - estimate_params(spec).total == 4 * 512 * 2048  # one matrix a layer


# Gemma-3n-E4B's text config: per-layer embeddings, AltUp, LAuReL, 15 KV-sharing layers.
GEMMA3N_E4B: dict[str, Any] = {
    "model_type": "gemma3n_text", "num_hidden_layers": 35, "hidden_size": 2048,
    "intermediate_size": 16384, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "vocab_size": 262400, "vocab_size_per_layer_input": 262144,
    "hidden_size_per_layer_input": 256, "altup_num_inputs": 4, "laurel_rank": 64,
    "num_kv_shared_layers": 15, "tie_word_embeddings": True,
}


@pytest.mark.parametrize(("extra", "total"), [
    ({}, 6_835_235_568), ({"altup_num_inputs": 2, "laurel_rank": 0}, 6_809_137_572),
    ({"hidden_size_per_layer_input": 128}, 5_633_305_200)])
def test_gemma3n_counts_per_layer_embeddings_altup_and_laurel(extra: dict[str, Any],
                                                              total: int) -> None:
    """Without them Gemma-3n-E4B counted 4.4 B of Transformers' 6.8 B: the plan's KV
    budget was 2.4 GB (bf16) larger than the GPU has."""
    counted = estimate_params(spec_from_config({**GEMMA3N_E4B, **extra}))
    assert counted.total == pytest.approx(total, rel=1e-4)
    per_layer_embed = 262144 * 35 * extra.get("hidden_size_per_layer_input", 256)
    assert counted.embeddings == 262400 * 2048 + per_layer_embed


def test_kv_sharing_layers_have_no_k_and_v_projections() -> None:
    """vLLM's and Transformers' Gemma-3n give a KV-sharing layer a Q projection only."""
    own = {**GEMMA3N_E4B, "num_kv_shared_layers": 0}
    diff = estimate_params(spec_from_config(own)).total - estimate_params(
        spec_from_config(GEMMA3N_E4B)).total
    assert diff == 15 * 2 * 2048 * 2 * 256


def test_a_family_without_side_weights_counts_none() -> None:
    spec = spec_from_config({**_SMALL, "model_type": "llama"})
    assert (spec.side.embeddings, spec.side.dense) == (0, 0)
    assert estimate_params(spec).embeddings == 2 * 1000 * 512


def test_gemma4_global_layers_project_at_their_own_head_size() -> None:
    """Q, K, V and O of Gemma-4's global layers are 512 wide per head, not 256: with its
    per-layer embeddings, the count is Transformers' (5,077,177,856) within 1e-4."""
    cfg = {"model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2304,
           "intermediate_size": 9216, "num_hidden_layers": 30, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True,
           "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
           "per_layer_config": {f"{i:02d}": {"head_dim": 512} for i in (5, 11, 17, 23, 29)}}
    counted = estimate_params(spec_from_config(cfg))
    assert counted.total == pytest.approx(5_077_177_856, rel=1e-4)
    uniform = {**{k: v for k, v in cfg.items() if k != "per_layer_config"},
               "global_head_dim": 256}
    # 5 layers of Q, O (8 heads) and K, V (4 heads) at 256 more per head
    assert counted.total - estimate_params(spec_from_config(uniform)).total == \
        5 * 2304 * 256 * (2 * 8 + 2 * 4)


# LLaVA-1.5-7B: a CLIP ViT-L/14-336 encoder and a two-layer projector beside Llama.
LLAVA: dict[str, Any] = {
    "model_type": "llava", "projector_hidden_act": "gelu",
    "text_config": {"model_type": "llama", "vocab_size": 32064, "hidden_size": 4096,
                    "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 32,
                    "tie_word_embeddings": False},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024,
                      "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "patch_size": 14, "image_size": 336,
                      "hidden_act": "quick_gelu"},
}


def test_a_multimodal_checkpoint_counts_its_vision_encoder() -> None:
    """vLLM loads the vision tower and projector on the GPU too: 0.32 B of LLaVA-1.5-7B's
    7.06 B (Transformers' count), which the plan gave to the KV."""
    counted = estimate_params(spec_from_config(LLAVA)).total
    assert counted == pytest.approx(7_063_427_072, rel=1e-5)
    text_only = {k: v for k, v in LLAVA.items() if k != "vision_config"}
    assert counted - estimate_params(spec_from_config(text_only)).total == pytest.approx(
        324.5e6, rel=1e-3)


def test_merged_patches_and_deepstack_mergers_widen_the_projector() -> None:
    """Qwen-VL's merger reads 2x2 patches at once (4x the width) and Qwen3-VL adds one
    merger per deepstack layer; InternVL's downsample_ratio 0.5 merges 4 patches too."""
    vision = {"hidden_size": 1152, "intermediate_size": 4304, "depth": 27,
              "patch_size": 16, "in_channels": 3, "hidden_act": "gelu_pytorch_tanh",
              "out_hidden_size": 4096, "temporal_patch_size": 2,
              "num_position_embeddings": 2304}
    base = {"model_type": "qwen3_vl", "text_config": LLAVA["text_config"]}

    def total(**extra: Any) -> int:
        return estimate_params(spec_from_config(
            {**base, "vision_config": {**vision, **extra}})).total

    merger = 1152 * 4 * 4096 + 4096 * 4096
    assert total(spatial_merge_size=2) - total(spatial_merge_size=1) == 1152 * 3 * 4096
    assert total(spatial_merge_size=2, deepstack_visual_indexes=[8, 16, 24]) - total(
        spatial_merge_size=2) == 3 * merger
    internvl = {"model_type": "internvl", "text_config": LLAVA["text_config"],
                "vision_config": {**LLAVA["vision_config"], "patch_size": [14, 14],
                                  "image_size": [448, 448]}}
    assert estimate_params(spec_from_config({**internvl, "downsample_ratio": 0.5})).total \
        - estimate_params(spec_from_config(internvl)).total == 1024 * 3 * 4096


def test_an_encoder_without_vit_layers_is_not_guessed() -> None:
    """Gemma-3n's vision_config describes a MobileNet in timm's fields: no layer count, so
    nothing is added rather than a projector alone."""
    cfg = {**LLAVA, "vision_config": {"model_type": "gemma3n_vision", "hidden_size": 2048}}
    text_only = {k: v for k, v in LLAVA.items() if k != "vision_config"}
    assert estimate_params(spec_from_config(cfg)) == estimate_params(spec_from_config(text_only))


# A small Qwen3.5 text stack: three gated-DeltaNet layers, then one full-attention layer.
QWEN3_5_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_text", "num_hidden_layers": 4, "hidden_size": 512,
    "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "vocab_size": 1000, "tie_word_embeddings": False,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
}


def test_qwen3_next_attention_projects_an_output_gate_as_wide_as_q() -> None:
    """vLLM's Qwen3NextAttention (Qwen3-Next, Qwen3.5) projects a per-head gate beside Q
    unless ``attn_output_gate`` is false: without it Qwen3.5-9B's weights were 1.5% short
    of Transformers' count. Other families do not read the field."""
    gated = estimate_params(spec_from_config(QWEN3_5_TEXT)).total
    assert gated == pytest.approx(9_841_424, rel=1e-4)   # Transformers, this config
    plain = estimate_params(spec_from_config({**QWEN3_5_TEXT, "attn_output_gate": False}))
    assert gated - plain.total == 512 * 8 * 64           # one full-attention layer's gate
    llama = {**_SMALL, "model_type": "llama"}
    assert estimate_params(spec_from_config({**llama, "attn_output_gate": True})).total \
        == estimate_params(spec_from_config(llama)).total
