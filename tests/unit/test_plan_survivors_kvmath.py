"""Mutation-review pins for ``kvtier plan``'s KV and weights arithmetic (kvmath, quant).

Each test names the number an operator would size a node from wrongly if the check went.
Hand numbers come from the published architectures, not from the code under test.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.plan import PlanError
from kvtier.plan.hardware import find_gpu
from kvtier.plan.kvmath import (
    check_tensor_parallel,
    estimate_params,
    kv_bytes_per_token,
    weights_bytes,
    weights_format,
)
from kvtier.plan.model import AttentionKind, load_model, spec_from_config
from kvtier.plan.planner import PlanInput, make_plan
from kvtier.plan.presets import find_preset

# DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite config.json): MLA without a query LoRA.
V2_LITE: dict[str, Any] = {
    "model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "max_position_embeddings": 163840,
}


def _preset(name: str) -> dict[str, Any]:
    fields = find_preset(name)
    assert fields is not None
    return dict(fields)


def _mla_attention(h: int, heads: int, q_lora: int) -> int:
    """One MLA layer's attention weights as DeepSeek's modeling code builds them."""
    nope, rope, v, kv_lora = 128, 64, 128, 512
    if q_lora:   # q_a_proj, q_a_layernorm, q_b_proj
        q = h * q_lora + q_lora + q_lora * heads * (nope + rope)
    else:        # q_proj
        q = h * heads * (nope + rope)
    kv = h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)  # kv_a, norm, kv_b
    return q + kv + heads * v * h  # o_proj


def test_mla_weights_are_counted_projection_by_projection() -> None:
    """The MLA projections (query LoRA and its norm, kv_b_proj's K-nope and V halves, a
    plain q_proj without q_lora_rank) are all counted: dropping one moved DeepSeek-V3 by
    under 0.1%, inside the 1.2% the model-card test allows, so no test noticed."""
    h = 7168
    dense_mlp, expert = 3 * h * 18432, 3 * h * 2048
    attn = _mla_attention(h, 128, 1536) + 2 * h
    v3 = (2 * 129280 * h + h + 3 * (attn + dense_mlp)
          + 58 * (attn + h * 256 + 256 * expert + expert))
    assert estimate_params(load_model("deepseek-v3")).total == v3 == 671_026_404_352
    h = 2048
    attn = _mla_attention(h, 16, 0) + 2 * h
    lite = (2 * 102400 * h + h + (attn + 3 * h * 10944)
            + 26 * (attn + h * 64 + 64 * 3 * h * 1408 + 2 * 3 * h * 1408))
    counted = estimate_params(spec_from_config(V2_LITE))
    assert counted.total == lite == 15_706_484_224  # the model card's 15.7 B


def test_v2_lite_kv_is_the_latent_per_layer() -> None:
    """DeepSeek-V2-Lite caches 512 + 64 values per layer (27 layers), not 16 heads of K
    and V: 31,104 B per token in bf16."""
    m = spec_from_config(V2_LITE)
    assert m.attention is AttentionKind.MLA
    assert kv_bytes_per_token(m, "bf16") == 27 * 576 * 2 == 31_104


def test_nvfp4_kv_is_nine_sixteenths_of_a_byte_per_value() -> None:
    """vLLM's nvfp4 KV packs 4-bit values plus an fp8 scale per 16: 9/16 B per value, so
    Llama-3-8B holds 32 x 2 x 8 x 128 x 9/16 = 36,864 B per token; at 1/2 B per value
    the plan would fit 12.5% more sequences than HBM holds."""
    m = load_model("llama-3-8b")
    assert kv_bytes_per_token(m, "nvfp4") == 36_864
    assert kv_bytes_per_token(m, "bf16") * 9 // 32 == 36_864


def test_mla_tensor_parallel_ignores_the_configs_kv_head_count() -> None:
    """An MLA latent is one head held whole by every rank, whatever the config's
    num_key_value_heads says: that field must not veto a TP size (3 KV heads over TP 16
    would be refused for GQA, and was for MLA without the early return)."""
    cfg = {**_preset("deepseek-v3"), "num_attention_heads": 48, "num_key_value_heads": 3}
    m = spec_from_config(cfg)
    assert m.attention is AttentionKind.MLA
    check_tensor_parallel(m, 16)
    plan = make_plan(PlanInput(model=m, gpu=find_gpu("h200"), kv_dtype="bf16", gpus=16,
                               tp=16))
    assert plan.kv_bytes_per_token_per_gpu == plan.kv_bytes_per_token == 61 * 576 * 2
    gqa = spec_from_config({**_preset("llama-3-8b"), "num_attention_heads": 48,
                            "num_key_value_heads": 3, "head_dim": 128})
    with pytest.raises(PlanError, match="num_key_value_heads=3"):
        check_tensor_parallel(gqa, 16)


def test_awq_moe_experts_take_the_linear_bits_not_the_checkpoint_dtype() -> None:
    """An AWQ (or GPTQ) MoE checkpoint stores the experts in int4 like every other linear
    layer: Mixtral-8x7B-AWQ is ~24.6 GB, not ~91 GB with experts left at fp16."""
    cfg = {**_preset("mixtral-8x7b"), "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}
    m = spec_from_config(cfg)
    counted = estimate_params(m)
    fmt = weights_format(m)
    bits = 4 + (16 + 4) / 128
    assert (fmt.dense_bytes, fmt.expert_bytes) == (bits / 8, bits / 8)
    expected = round(counted.embeddings * 2 + (counted.total - counted.embeddings) * bits / 8)
    assert weights_bytes(counted, fmt) == expected
    assert expected / 1e9 == pytest.approx(24.6, abs=0.1)


@pytest.mark.parametrize("util", [1.0000001, 1.5, 0.0, -0.1])
def test_mem_util_outside_zero_to_one_is_refused(util: float) -> None:
    """--mem-util is vLLM's --gpu-memory-utilization, a share of the GPU: above 1 the
    plan would give the KV memory the GPU does not have."""
    with pytest.raises(PlanError, match="--mem-util"):
        make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=find_gpu("h100"),
                            kv_dtype="bf16", mem_util=util))
    make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=find_gpu("h100"),
                        kv_dtype="bf16", mem_util=1.0))


def test_fp8_checkpoint_keeps_embeddings_and_lm_head_at_the_model_dtype() -> None:
    """vLLM's Fp8Config quantizes linear layers and MoE experts only (get_quant_method
    returns None for VocabParallelEmbedding and ParallelLMHead), so an fp8 Llama-3-8B holds
    1,050,673,152 embedding and LM-head weights in bf16: 9.08 GB, not the 8.03 GB planned,
    and every GPU's KV budget is 1.05 GB smaller than the plan says."""
    cfg = {**_preset("llama-3-8b"), "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic"}}
    m = spec_from_config(cfg)
    counted = estimate_params(m)
    assert counted.embeddings == 2 * 128256 * 4096 == 1_050_673_152
    expected = counted.embeddings * 2 + (counted.total - counted.embeddings) * 1
    assert weights_bytes(counted, weights_format(m)) == expected == 9_080_934_400


def _bits_per_weight(q: dict[str, Any]) -> float:
    """Bits per linear weight the plan gives Llama-3-8B with ``q``."""
    m = spec_from_config({**_preset("llama-3-8b"), "quantization_config": q})
    return weights_format(m).dense_bytes * 8


@pytest.mark.parametrize(("q", "bits"), [
    # one fp32 absmax per 64 weights without double quantization
    ({"quant_method": "bitsandbytes", "load_in_4bit": True,
      "bnb_4bit_quant_type": "nf4"}, 4 + 32 / 64),
    # GPTQ always stores a qzeros tensor, whatever a zero_point field says
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "zero_point": False},
     4 + (16 + 4) / 128),
    # a group of 0 (like -1) is one scale per output channel: not a division by zero
    ({"quant_method": "awq", "bits": 4, "group_size": 0}, 4),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1}, 8),
    # compressed-tensors nvfp4: fp8 (not fp16) scales per 16 weights (tensor_group)
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
        "symmetric": True}}}}, 4 + 8 / 16),
    # asymmetric int4: a 4-bit zero point beside each group's fp16 scale
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
        "symmetric": False}}}}, 4 + (16 + 4) / 128),
    # symmetric is compressed-tensors' default: no zero point when the field is absent
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     4 + 16 / 128),
    # mixed precision is counted at its widest group, never less than it holds
    ({"quant_method": "compressed-tensors", "config_groups": {
        "a": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}},
        "b": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, 8),
])
def test_weight_only_bits_per_weight(q: dict[str, Any], bits: float) -> None:
    """Each method's scales and zero points per group: a wrong one moves every linear
    weight's size, i.e. most of the model (bnb nf4 at 4.125 bits under-plans 8%)."""
    assert _bits_per_weight(q) == pytest.approx(bits)


def test_quant_method_is_read_case_and_space_insensitively() -> None:
    """A config spelling "GPTQ " is the same GPTQ checkpoint, not a refused unknown one."""
    assert _bits_per_weight({"quant_method": "GPTQ ", "bits": 4, "group_size": 128}) \
        == pytest.approx(4 + 20 / 128)


@pytest.mark.parametrize(("q", "kv"), [
    # ModelOpt's static FP8 KV scheme is fp8_e4m3; a dynamic or 16-bit one is none known
    ({"quant_method": "modelopt", "kv_cache_scheme": {
        "type": "float", "num_bits": 8, "dynamic": False}}, "fp8_e4m3"),
    ({"quant_method": "modelopt", "kv_cache_scheme": {
        "type": "float", "num_bits": 8, "dynamic": True}}, ""),
    ({"quant_method": "modelopt", "kv_cache_scheme": {
        "type": "float", "num_bits": 16}}, ""),
    ({"quant_method": "modelopt", "kv_cache_scheme": {
        "type": "float", "num_bits": 4}}, "nvfp4"),
    ({"quant_method": "modelopt", "kv_cache_scheme": {
        "type": "int", "num_bits": 8, "dynamic": False}}, ""),
    # hf_quant_config.json's form: the algorithms nested under "quantization"
    ({"quant_method": "modelopt", "quantization": {"kv_cache_quant_algo": "FP8"}},
     "fp8_e4m3"),
    # compressed-tensors weights alone leave the KV at the model's dtype
    ({"quant_method": "compressed-tensors", "config_groups": {}}, ""),
    ({"quant_method": "compressed_tensors", "kv_cache_scheme": {"num_bits": 8}}, "fp8"),
])
def test_checkpoint_kv_dtype_as_vllm_resolves_auto(q: dict[str, Any], kv: str) -> None:
    """--kv-dtype auto follows only a KV scheme vLLM takes: a wrong fp8 here halves the
    planned KV of a checkpoint vLLM serves in bf16 (2x the sequences that really fit)."""
    m = spec_from_config({**_preset("llama-3-8b"), "quantization_config": q})
    assert m.checkpoint_kv_dtype == kv


def test_more_than_sixteen_bits_per_weight_is_not_a_quantization() -> None:
    """bits: 32 is no weight-only format vLLM serves: refused (asking for --weights-dtype),
    never planned as 4-byte weights."""
    m = spec_from_config({**_preset("llama-3-8b"), "quantization_config": {
        "quant_method": "gptq", "bits": 32, "group_size": 128}})
    with pytest.raises(PlanError, match="no usable 'bits'"):
        weights_format(m)
