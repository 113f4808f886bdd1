"""``kvtier plan`` against vLLM 0.32's own reading of model configs (found by review).

Each config carries the fields of the published checkpoint's config.json (or the
Transformers config class default where the file omits them); the expected bytes follow
vLLM's model code: which model types are MLA, per-layer KV heads, hybrid layers, the KV
dtype ``--kv-cache-dtype auto`` picks, and the TP sizes it can run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.plan import PlanError
from kvtier.plan.kvmath import (
    check_tensor_parallel,
    estimate_params,
    kv_bytes_per_token,
    kv_share_per_rank,
)
from kvtier.plan.model import AttentionKind, spec_from_config
from tests.unit.test_plan_cli import plan, plan_json

REFUSED = "kvtier's vLLM connector refuses this model"


def write(tmp_path: Path, cfg: dict[str, Any]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def notes(doc: dict[str, Any]) -> str:
    return "\n".join(doc["notes"])


# openbmb/MiniCPM3-4B
MINICPM3 = {"architectures": ["MiniCPM3ForCausalLM"], "model_type": "minicpm3",
            "hidden_size": 2560, "intermediate_size": 6400, "num_hidden_layers": 62,
            "num_attention_heads": 40, "num_key_value_heads": 40, "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32, "q_lora_rank": 768, "kv_lora_rank": 256,
            "v_head_dim": 64, "vocab_size": 73448, "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16"}


def test_minicpm3_is_plain_attention_over_qk_nope_plus_rope() -> None:
    m = spec_from_config(MINICPM3)
    assert m.attention is AttentionKind.MHA and (m.num_kv_heads, m.head_dim) == (40, 96)
    assert kv_bytes_per_token(m, "bf16") == 62 * 2 * 40 * 96 * 2 == 952_320
    # MiniCPM3's class defaults qk_nope 64 and qk_rope 32 when the file omits them
    bare = {k: v for k, v in MINICPM3.items() if not k.startswith("qk_")}
    assert spec_from_config(bare).head_dim == 96


def test_only_vllm_mla_model_types_cache_a_latent(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    dsv2_lite = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048,
                 "num_attention_heads": 16, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                 "qk_rope_head_dim": None, "v_head_dim": 128, "vocab_size": 102400,
                 "intermediate_size": 10944}
    m = spec_from_config(dsv2_lite)
    assert m.attention is AttentionKind.MLA and m.qk_rope_head_dim == 64  # class default
    assert kv_bytes_per_token(m, "bf16") == 27 * (512 + 64) * 2
    doc = plan_json(capsys, "--model", write(tmp_path, dsv2_lite))
    # the JSON describes the latent cache (vLLM's MLAAttentionSpec: one head), not 16 heads
    assert (doc["model"]["kv_heads"], doc["model"]["head_dim"]) == (1, 576)
    assert doc["model"]["kv_shapes"] == [{"kv_heads": 1, "head_dim": 576, "layers": 27}]


GEMMA3_12B_IT = {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {
    "hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
    "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
    "sliding_window": 1024}}


@pytest.mark.parametrize(("cfg", "head_dim"), [
    (GEMMA3_12B_IT, 256),
    ({"model_type": "gemma2", "num_hidden_layers": 42, "hidden_size": 3584,
      "num_attention_heads": 16, "num_key_value_heads": 8}, 256),
    ({"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024,
      "num_attention_heads": 16, "num_key_value_heads": 8}, 128),  # Qwen3-0.6B
    ({"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880,
      "num_attention_heads": 64, "num_key_value_heads": 8}, 64),
    ({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
      "num_attention_heads": 32}, 128),  # no class default: hidden / heads
])
def test_missing_head_dim_takes_the_config_class_default(cfg: dict[str, Any],
                                                         head_dim: int) -> None:
    assert spec_from_config(cfg).head_dim == head_dim


def test_an_explicit_null_is_not_a_class_default() -> None:
    """Transformers keeps an explicit null (Gemma 2/3's ``sliding_window: null``), and
    vLLM then builds full attention on every layer: the class default's window made the
    plan count windowed layers (found by review)."""
    cfg = {"model_type": "gemma2", "num_hidden_layers": 26, "hidden_size": 2304,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
           "sliding_window": None, "vocab_size": 256000, "max_position_embeddings": 8192}
    assert spec_from_config(cfg).windowed_layers == 0
    assert spec_from_config({k: v for k, v in cfg.items()
                             if k != "sliding_window"}).windowed_layers == 13


def test_gemma3_4b_without_head_counts_takes_gemma3_text_defaults() -> None:
    cfg = {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "sliding_window": 1024}}
    m = spec_from_config(cfg)
    assert (m.num_attention_heads, m.num_kv_heads, m.head_dim) == (8, 4, 256)
    assert m.vocab_size == 262_208 and m.max_context == 131_072
    assert kv_bytes_per_token(m, "bf16") == 34 * 2 * 4 * 256 * 2


GEMMA4_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 8


def test_gemma4_global_layers_take_their_own_heads_and_are_refused(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    text = {"model_type": "gemma4_unified_text", "hidden_size": 3840,
            "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
            "num_key_value_heads": 8, "num_global_key_value_heads": 1, "head_dim": 256,
            "global_head_dim": 512, "attention_k_eq_v": True, "sliding_window": 1024,
            "max_position_embeddings": 262144, "layer_types": GEMMA4_LAYERS,
            "vocab_size": 262144}
    m = spec_from_config(text)
    assert kv_bytes_per_token(m, "bf16") == 40 * 2 * 8 * 256 * 2 + 8 * 2 * 1 * 512 * 2
    assert not m.uniform_pages
    # TP 2: sliding layers split their 8 heads, the global layers copy their one head
    assert kv_share_per_rank(m, 2) == pytest.approx((40 * 8192 / 2 + 8 * 2048) / 344_064)
    doc = plan_json(capsys, "--model", write(tmp_path, {"model_type": "gemma4_unified",
                                                        "text_config": text}))
    assert doc["kv_bytes_per_token"] == 344_064
    # --json names every shape with its layer count, the first KV layer's as kv_heads
    assert doc["model"]["kv_shapes"] == [{"kv_heads": 8, "head_dim": 256, "layers": 40},
                                         {"kv_heads": 1, "head_dim": 512, "layers": 8}]
    assert (doc["model"]["kv_heads"], doc["model"]["head_dim"]) == (8, 256)
    assert REFUSED in notes(doc) and "different page sizes" in notes(doc)
    assert "--disable-sliding-window" not in notes(doc)
    # without attention_k_eq_v Transformers keeps num_key_value_heads for global layers
    plain = {**text, "attention_k_eq_v": False, "num_hidden_layers": 30,
             "layer_types": GEMMA4_LAYERS[:30], "num_key_value_heads": 4,
             "num_attention_heads": 8, "model_type": "gemma4_text"}
    assert kv_bytes_per_token(spec_from_config(plain), "bf16") == 25 * 4096 + 5 * 8192


def test_gemma3n_layers_sharing_kv_hold_none_and_are_refused(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """google/gemma-3n-E4B's text_config: its last 15 layers read an earlier layer's KV
    (vLLM gives them no cache of their own), and its MLP width is one per layer; the
    connector refuses such layers at register_kv_caches."""
    types = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    text = {"model_type": "gemma3n_text", "hidden_size": 2048, "num_hidden_layers": 35,
            "intermediate_size": [16384] * 35, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 256, "sliding_window": 512,
            "layer_types": types, "num_kv_shared_layers": 15, "vocab_size": 262400,
            "max_position_embeddings": 32768}
    m = spec_from_config(text)
    assert m.kv_layers == 20 and m.intermediate_size == 16384
    assert kv_bytes_per_token(m, "bf16") == 20 * 2 * 2 * 256 * 2
    doc = plan_json(capsys, "--model", write(tmp_path, {"model_type": "gemma3n",
                                                        "text_config": text}))
    assert REFUSED in notes(doc) and "num_kv_shared_layers" in notes(doc)
    assert "--disable-sliding-window" not in notes(doc)
    # widths differing per layer count as their mean (the total MLP weights), not the
    # first layer's; a bad entry is named by its index
    mixed = {**text, "intermediate_size": [8192] * 10 + [16384] * 25}
    assert spec_from_config(mixed).intermediate_size == round((10 * 8192 + 25 * 16384) / 35)
    with pytest.raises(PlanError, match=r"intermediate_size\[3\]"):
        spec_from_config({**text, "intermediate_size": [16384] * 3 + ["wide"] + [1] * 31})


def test_step3p5_kv_heads_are_num_attention_groups() -> None:
    cfg = {"model_type": "step3p5", "hidden_size": 5120, "num_attention_heads": 40,
           "num_attention_groups": 8, "num_hidden_layers": 48, "head_dim": 128,
           "intermediate_size": 13312, "vocab_size": 65536, "max_seq_len": 65536}
    m = spec_from_config(cfg)
    assert m.num_kv_heads == 8 and kv_bytes_per_token(m, "bf16") == 48 * 2 * 8 * 128 * 2


def test_chatglm_multi_query_group_num() -> None:
    # THUDM/glm-4-9b-chat (model_type chatglm, vLLM's ChatGLMConfig field names)
    cfg = {"model_type": "chatglm", "num_layers": 40, "hidden_size": 4096,
           "num_attention_heads": 32, "multi_query_attention": True,
           "multi_query_group_num": 2, "kv_channels": 128, "ffn_hidden_size": 13696,
           "padded_vocab_size": 151552, "seq_length": 131072}
    m = spec_from_config(cfg)
    assert (m.num_layers, m.num_kv_heads, m.head_dim) == (40, 2, 128)
    assert (m.vocab_size, m.max_context) == (151552, 131072)
    assert spec_from_config({**cfg, "multi_query_attention": False}).num_kv_heads == 32


def test_falcon_h1_every_layer_attention_and_mamba_is_refused(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = {"model_type": "falcon_h1", "torch_dtype": "bfloat16", "vocab_size": 130049,
           "hidden_size": 3072, "num_hidden_layers": 44, "num_attention_heads": 12,
           "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 12288,
           "mamba_d_ssm": 6144, "max_position_embeddings": 262144}
    m = spec_from_config(cfg)
    assert (m.kv_layers, m.state_layers) == (44, 44)
    doc = plan_json(capsys, "--model", write(tmp_path, cfg))
    assert doc["kv_bytes_per_token"] == 44 * 2 * 2 * 128 * 2
    assert "recurrent state" in notes(doc) and REFUSED in notes(doc)


def test_kimi_linear_holds_mla_kv_in_its_full_attention_layers_only(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    full = [4, 8, 12, 16, 20, 24, 27]  # moonshotai/Kimi-Linear-48B-A3B, 1-based
    cfg = {"model_type": "kimi_linear", "hidden_size": 2304, "num_hidden_layers": 27,
           "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "intermediate_size": 9216, "vocab_size": 163840,
           "linear_attn_config": {"full_attn_layers": full,
                                  "kda_layers": [i for i in range(1, 28) if i not in full]}}
    m = spec_from_config(cfg)
    assert m.attention is AttentionKind.MLA and (m.kv_layers, m.state_layers) == (7, 20)
    doc = plan_json(capsys, "--model", write(tmp_path, cfg))
    assert doc["kv_bytes_per_token"] == 7 * (512 + 64) * 2 == 8064
    assert "hybrid model" in notes(doc) and REFUSED in notes(doc)


@pytest.mark.parametrize(("arch", "kv"), [("BailingMoeV2_5ForCausalLM", [4, 9]),
                                          ("BailingMoeV3ForCausalLM", [4, 9, 10, 11])])
def test_bailing_hybrid_layer_group_size(arch: str, kv: list[int]) -> None:
    cfg = {"model_type": "bailing_hybrid", "architectures": [arch], "hidden_size": 2048,
           "num_hidden_layers": 12, "num_attention_heads": 16, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "layer_group_size": 5, "vocab_size": 157184}
    m = spec_from_config(cfg)
    assert [i for i, w in enumerate(m.layer_windows) if w != 0] == kv
    assert m.attention is AttentionKind.MLA and m.state_layers == 12 - len(kv)


@pytest.mark.parametrize(("window", "max_pos"), [(262144, 131072), (32768, 32768)])
def test_window_as_long_as_the_context_is_still_refused(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, window: int, max_pos: int) -> None:
    # Phi-3-mini-128k-instruct, Ministral-8B-Instruct-2410: vLLM builds a SlidingWindowSpec
    cfg = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 12288, "vocab_size": 131072, "sliding_window": window,
           "max_position_embeddings": max_pos}
    doc = plan_json(capsys, "--model", write(tmp_path, cfg))
    assert doc["kv_bytes_per_token"] == 36 * 2 * 8 * 128 * 2
    assert REFUSED in notes(doc) and "--disable-sliding-window" in notes(doc)
    assert doc["kv_bytes_per_sequence"]["p99"] == 8192 * 147_456  # every token kept


LLAMA_8B = {"model_type": "llama", "vocab_size": 128256, "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16", "num_hidden_layers": 32, "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}


@pytest.mark.parametrize(("quant", "dtype"), [
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
     "fp8_e4m3"),
    ({"quant_method": "modelopt", "quant_algo": "FP8",
      "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}, "fp8_e4m3"),
    ({"quant_method": "compressed-tensors", "config_groups": {},
      "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "fp8"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "bf16"),
])
def test_auto_kv_dtype_follows_the_checkpoints_kv_quantization(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, quant: dict[str, Any],
        dtype: str) -> None:
    ref = write(tmp_path, {**LLAMA_8B, "quantization_config": quant})
    doc = plan_json(capsys, "--model", ref, "--weights-dtype", "fp8")
    assert doc["kv_dtype"] == dtype
    assert doc["kv_bytes_per_token"] == 131_072 // (1 if dtype == "bf16" else 2)
    assert ("--kv-cache-dtype auto" in notes(doc)) == (dtype != "bf16")
    assert plan_json(capsys, "--model", ref, "--weights-dtype", "fp8",
                     "--kv-dtype", "bf16")["kv_bytes_per_token"] == 131_072


def test_kv_dtype_error_lists_only_what_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = plan(capsys, "--model", "llama-3-8b", "--kv-dtype", "int9")
    assert code == 2 and "--kv-dtype" in err and "fp8_e5m2" in err
    assert "int8" not in err and "int4" not in err
    code, _, err = plan(capsys, "--model", "llama-3-8b", "--kv-dtype", "int8")
    assert code == 2 and "int4" not in err


def test_gpt_oss_tp_must_divide_its_kv_heads() -> None:
    cfg = {"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64}
    check_tensor_parallel(spec_from_config(cfg), 8)
    with pytest.raises(PlanError, match="without copying"):
        check_tensor_parallel(spec_from_config(cfg), 16)
    check_tensor_parallel(spec_from_config({**cfg, "model_type": "llama"}), 16)


def test_jamba_experts_every_expert_layer_period() -> None:
    cfg = {"model_type": "jamba", "num_hidden_layers": 8, "hidden_size": 4096,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_experts": 16,
           "intermediate_size": 14336, "vocab_size": 65536}
    moe = spec_from_config(cfg).moe
    assert moe is not None and moe.moe_layers == (False, True) * 4


@pytest.mark.parametrize("fields", [
    {"num_hidden_layers": 10_000},
    {"hidden_size": 2**31, "num_attention_heads": 2**31, "num_key_value_heads": 2**31},
    {"num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 8192},
    {"vocab_size": 2**24, "hidden_size": 2**24, "num_attention_heads": 2**17,
     "num_key_value_heads": 2**17, "intermediate_size": 2**24},
])
def test_absurd_sizes_are_one_line_errors(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path, fields: dict[str, Any]) -> None:
    code, out, err = plan(capsys, "--model", write(tmp_path, {**LLAMA_8B, **fields}))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "must be an integer" in err or "not a real model" in err


def test_zamba2_heads_are_twice_the_hidden_size_wide() -> None:
    """Zamba2's shared attention reads [hidden, embeddings]: vLLM's head size is
    attention_head_dim (2 x hidden / heads), 160 for Zamba2-2.7B, where hidden / heads
    planned half its KV. Only the hybrid layers hold KV."""
    cfg = {"model_type": "zamba2", "num_hidden_layers": 54, "hidden_size": 2560,
           "num_attention_heads": 32, "vocab_size": 32000,
           "layers_block_type": ["hybrid" if i in (6, 12, 18, 24, 30, 36, 42, 47, 51)
                                 else "mamba" for i in range(54)]}
    spec = spec_from_config(cfg)
    assert (spec.head_dim, spec.num_kv_heads, spec.kv_layers) == (160, 32, 9)
    assert kv_bytes_per_token(spec, "bfloat16") == 9 * 2 * 32 * 160 * 2
    assert spec_from_config({**cfg, "attention_head_dim": 128}).head_dim == 128


def test_hidden_size_per_head_is_the_head_size_without_head_dim() -> None:
    """vLLM's get_head_size reads PLaMo 2's hidden_size_per_head before hidden / heads."""
    cfg = {"model_type": "plamo2", "num_hidden_layers": 4, "hidden_size": 2048,
           "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_size_per_head": 128}
    assert spec_from_config(cfg).head_dim == 128
    assert spec_from_config({**cfg, "head_dim": 96}).head_dim == 96
    del cfg["hidden_size_per_head"]
    assert spec_from_config(cfg).head_dim == 64


@pytest.mark.parametrize("model_type", ["mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"])
def test_a_pure_ssm_is_refused_as_having_no_kv(model_type: str) -> None:
    """It was refused for a missing num_attention_heads, as if the config were broken."""
    cfg = {"model_type": model_type, "num_hidden_layers": 64, "hidden_size": 4096,
           "vocab_size": 50280}
    with pytest.raises(PlanError, match=r"no attention layers.*no KV"):
        spec_from_config(cfg)


@pytest.mark.parametrize("extra", [
    {"model_type": "hrm_text"},                                  # vLLM runs it prefix-LM
    {"model_type": "hrm_text", "prefix_lm": False},              # (whatever the config says)
    {"model_type": "llama", "prefix_lm": True},
    {"model_type": "mpt", "attn_config": {"prefix_lm": True}},
], ids=["hrm_text", "hrm_text-flag-off", "prefix_lm", "mpt-attn_config"])
def test_a_prefix_lm_model_is_refused_as_having_no_reusable_kv(extra: dict[str, Any]) -> None:
    """A prompt that attends both ways (HRM-Text: vLLM's PrefillPrefixLMAttention) makes a
    token's KV depend on the tokens after it: vLLM turns prefix caching off and the
    connector refuses the model, so a plan of its reusable KV would be wrong. HRM-Text was
    planned instead, at 2.8x Transformers' weights (its 128 KV layers reuse 32 layers'
    weights)."""
    cfg = {"num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 8,
           "vocab_size": 1000, **extra}
    with pytest.raises(PlanError, match=r"prefix-LM.*connector refuses it"):
        spec_from_config(cfg)
    plain = {**cfg, "model_type": "llama", "prefix_lm": False, "attn_config": None}
    assert spec_from_config(plain).num_layers == 8


# LongCat-Flash-Chat's config.json: 28 decoder layers of two MLA sublayers each.
LONGCAT_FLASH: dict[str, Any] = {
    "model_type": "longcat_flash", "num_layers": 28, "hidden_size": 6144,
    "num_attention_heads": 64, "ffn_hidden_size": 12288, "expert_ffn_hidden_size": 2048,
    "n_routed_experts": 512, "zero_expert_num": 256, "moe_topk": 12, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 131072, "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def test_longcat_flash_keeps_a_latent_in_both_attention_sublayers() -> None:
    """vLLM's FlashDecoderLayer holds two MLA attentions, each with its own KV cache, two
    dense MLPs and one MoE: the plan read 28 layers, half the KV per token (so twice the
    sequences), and 545 B of weights for the model card's 560 B."""
    spec = spec_from_config(LONGCAT_FLASH)
    assert spec.num_layers == 56 and spec.attention is AttentionKind.MLA
    assert kv_bytes_per_token(spec, "bfloat16") == 56 * (512 + 64) * 2
    assert spec.moe is not None and spec.moe.moe_layers == (False, True) * 28
    assert estimate_params(spec).total == pytest.approx(560e9, rel=0.005)
    # a config that gives Transformers' num_hidden_layers (the sublayers) reads the same
    sub = {k: v for k, v in LONGCAT_FLASH.items() if k != "num_layers"}
    assert spec_from_config({**sub, "num_hidden_layers": 56}) == spec


@pytest.mark.parametrize("field", ["compress_ratios", "compress_rates"])
def test_deepseek_v4_compressed_attention_is_refused_not_planned_wrong(field: str) -> None:
    """Its compressed layers keep a fraction of the tokens' KV: read as plain attention the
    plan was many times too large, and its mlp_layer_types refusal named the wrong cause."""
    cfg = {"model_type": "deepseek_v4", "num_hidden_layers": 43, "hidden_size": 4096,
           "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
           field: {"compressed_sparse_attention": 4}}
    with pytest.raises(PlanError, match="compressed sparse attention"):
        spec_from_config(cfg)
