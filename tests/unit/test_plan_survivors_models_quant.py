"""Mutation-review pins for the plan's config readers: quantization_config (bits per
weight, checkpoint KV dtype), MoE layer lists and the older families' KV heads and MLPs.

Each test names what an operator would get wrong if the check it pins went missing."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.plan import PlanError
from kvtier.plan.families import gated_mlp, kv_heads, mlp_width, tied_embeddings
from kvtier.plan.moe import moe_layer_mask
from kvtier.plan.quant import kv_cache_dtype, read_quantization

SRC = "config.json"


def _q(q: dict[str, Any]) -> Any:
    return read_quantization({"quantization_config": q}, SRC)


def test_a_bool_bits_is_no_bit_width() -> None:
    """``"bits": true`` is not 1 bit: counted as int1 it planned a 16th of the weights."""
    got = _q({"quant_method": "gptq", "bits": True, "group_size": 128})
    assert got.problem and got.linear_bits is None


def test_awq_without_zero_point_stores_zero_points() -> None:
    """AWQ's zero_point defaults to true: 4 bits + (16-bit scale + 4-bit zero) / group."""
    got = _q({"quant_method": "awq", "bits": 4, "group_size": 128})
    assert got.linear_bits == 4 + 20 / 128
    off = _q({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False})
    assert off.linear_bits == 4 + 16 / 128


def test_marlin_without_bits_is_int4() -> None:
    """A bare ``marlin`` config is 4-bit (its only width), not an unknown method."""
    got = _q({"quant_method": "marlin", "group_size": 128})
    assert (got.problem, got.label, got.linear_bits) == ("", "marlin int4", 4 + 20 / 128)


def test_bitsandbytes_flags_must_be_true_not_truthy() -> None:
    """A string "false" in load_in_4bit must not make an 8-bit checkpoint 4-bit."""
    got = _q({"quant_method": "bitsandbytes", "load_in_4bit": "false", "load_in_8bit": True})
    assert (got.label, got.linear_bits) == ("bitsandbytes int8", 8.0)


def test_compressed_tensors_bad_num_bits_in_any_group_is_refused() -> None:
    """One unreadable group makes the size unknown: skipping it planned the other group's
    (possibly narrower) width."""
    got = _q({"quant_method": "compressed-tensors", "config_groups": {
        "a": {"weights": {"num_bits": 4, "type": "int"}},
        "b": {"weights": {"num_bits": "8", "type": "int"}}}})
    assert got.problem and "num_bits" in got.problem and got.linear_bits is None


def test_modelopt_kv_scheme_without_dynamic_is_not_fp8() -> None:
    """Only a static (dynamic: false) 8-bit float scheme is fp8_e4m3; an unstated dynamic
    must not shrink the planned KV to one byte."""
    q = {"quant_method": "modelopt", "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    assert kv_cache_dtype({"quantization_config": q}) == ""
    q["kv_cache_scheme"] = {"type": "float", "num_bits": 8, "dynamic": False}
    assert kv_cache_dtype({"quantization_config": q}) == "fp8_e4m3"


def test_modelopt_is_recognised_by_its_producer() -> None:
    """hf_quant_config-style files name ModelOpt as producer, not quant_method: their FP8
    KV must still halve the planned KV."""
    q = {"producer": {"name": "modelopt"}, "quantization": {"kv_cache_quant_algo": "FP8"}}
    assert kv_cache_dtype({"quantization_config": q}) == "fp8_e4m3"


def test_modelopt_top_level_kv_scheme_beside_a_quantization_object() -> None:
    """kv_cache_scheme at the top counts even when a ``quantization`` object is present."""
    q = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"},
         "kv_cache_scheme": {"type": "float", "num_bits": 4}}
    assert kv_cache_dtype({"quantization_config": q}) == "nvfp4"


@pytest.mark.parametrize("bad", [[0, 4], [True], [3.0]])
def test_moe_layers_must_be_indices_below_the_layer_count(bad: list[object]) -> None:
    """An index equal to num_hidden_layers (or a bool, or a float) is a typed error, not
    a silently dropped MoE layer."""
    with pytest.raises(PlanError, match="moe_layers"):
        moe_layer_mask({"moe_layers": bad}, 4, SRC)


def test_chatglm_multi_query_without_group_num_has_one_kv_head() -> None:
    """ChatGLMConfig's multi_query_group_num defaults to 1, not one per head (32x KV)."""
    cfg = {"model_type": "chatglm", "multi_query_attention": True}
    assert kv_heads(cfg, 32, SRC) == 1


@pytest.mark.parametrize("attn", [{"kv_n_heads": 8}, {"attn_type": "odd", "kv_n_heads": 8}])
def test_mpt_kv_heads_need_grouped_query_attention(attn: dict[str, Any]) -> None:
    """kv_n_heads alone (no attn_type, or an unknown one) does not say MPT's KV heads."""
    with pytest.raises(PlanError, match="attn_type"):
        kv_heads({"model_type": "mpt", "attn_config": attn}, 32, SRC)
    gqa = {"model_type": "mpt", "attn_config": {"attn_type": "grouped_query_attention",
                                                "kv_n_heads": 8}}
    assert kv_heads(gqa, 32, SRC) == 8


def test_mpt_expansion_ratio_rules() -> None:
    """A zero ratio is refused; a fractional one is not rounded; other families ignore the
    field (their MLP is 4 x hidden)."""
    with pytest.raises(PlanError, match="expansion_ratio"):
        mlp_width({"model_type": "mpt", "expansion_ratio": 0}, 1024, SRC)
    assert mlp_width({"model_type": "mpt", "expansion_ratio": 2.5}, 1024, SRC) == 2560
    assert mlp_width({"model_type": "gpt2", "expansion_ratio": 2}, 1024, SRC) == 4096


def test_gpt_neox_mlp_is_two_matrices_and_gemma_ties_by_default() -> None:
    """Pythia's MLP has no gate (a third matrix overcounts its weights by 50%), and Gemma's
    config class ties the LM head (an untied count adds the vocabulary again)."""
    assert not gated_mlp("gpt_neox")
    assert tied_embeddings({"model_type": "gemma"}, SRC)
    assert not tied_embeddings({"model_type": "gemma", "tie_word_embeddings": False}, SRC)


@pytest.mark.parametrize("field", ["shared_expert_intermediate_size",
                                   "moe_shared_expert_intermediate_size",
                                   "shared_intermediate_size"])
def test_every_spelling_of_the_shared_expert_width_is_read(field: str) -> None:
    """Each family's name for the shared experts' width counts: a dropped spelling lost
    the shared experts' weights (every token's path)."""
    from kvtier.plan.moe import read_moe

    cfg = {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 4096,
           "moe_intermediate_size": 256,
           field: 1024}
    moe = read_moe(cfg, 2, SRC)
    assert moe is not None and moe.shared_intermediate == 1024


def test_kv_heads_from_multi_query_group_num_beyond_chatglm() -> None:
    """vLLM reads multi_query_group_num as the KV heads of any config (GLM-4 variants), not
    only model_type chatglm: 2 KV heads, not 32."""
    assert kv_heads({"model_type": "glm4", "multi_query_group_num": 2}, 32, SRC) == 2


def test_bitsandbytes_4bit_defaults_to_fp4() -> None:
    """bnb_4bit_quant_type defaults to fp4 in Transformers' BitsAndBytesConfig."""
    got = _q({"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert (got.label, got.linear_bits) == ("bitsandbytes fp4", 4 + 32 / 64)
