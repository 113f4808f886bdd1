"""KV and weights arithmetic of ``kvtier plan`` against published model numbers."""

from __future__ import annotations

import pytest

from kvtier.plan import PlanError
from kvtier.plan.hardware import find_gpu
from kvtier.plan.kvmath import (
    FP8_DS_MLA_BYTES,
    check_tensor_parallel,
    estimate_params,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_layer_bytes,
    kv_share_per_rank,
    serving_dtype,
)
from kvtier.plan.model import AttentionKind, load_model, spec_from_config
from kvtier.plan.planner import PlanInput, make_plan
from kvtier.plan.presets import find_preset, preset_names
from kvtier.plan.workload import ContextPercentiles

# Exact parameter counts published with the checkpoints (model cards / safetensors index).
PUBLISHED_PARAMS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
}
# Rounded counts from model cards: (total, active) in billions.
ROUNDED_PARAMS = {
    "qwen2.5-14b": (14.7, None), "qwen2.5-32b": (32.5, None), "qwen2.5-72b": (72.7, None),
    "gemma-2-9b": (9.24, None), "mixtral-8x7b": (46.7, 12.9), "deepseek-v3": (671, 37),
    "qwen3-8b": (8.2, None), "qwen3-32b": (32.8, None), "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235, 22), "gpt-oss-20b": (20.9, None), "gpt-oss-120b": (116.8, None),
}


def test_llama_2_13b_fp16_is_819200_bytes_per_token_and_1_68_gb_per_2k_sequence() -> None:
    m = load_model("llama-2-13b")
    assert m.attention is AttentionKind.MHA
    assert kv_bytes_per_token(m, "fp16") == 40 * 2 * 5120 * 2 == 819_200
    seq = kv_bytes_per_sequence(m, "fp16", 2048)
    assert seq == 819_200 * 2048
    assert round(seq / 1e9, 2) == 1.68


def test_gqa_counts_kv_heads_not_attention_heads() -> None:
    m = load_model("llama-3-8b")
    assert m.attention is AttentionKind.GQA
    assert (m.num_attention_heads, m.num_kv_heads) == (32, 8)
    assert kv_bytes_per_token(m, "bf16") == 131_072
    assert kv_bytes_per_token(load_model("llama-2-70b"), "fp16") == 80 * 2 * 8 * 128 * 2


def test_mla_stores_one_latent_plus_rope_dims_per_layer() -> None:
    m = load_model("deepseek-v3")
    assert m.attention is AttentionKind.MLA
    assert kv_bytes_per_token(m, "bf16") == 61 * (512 + 64) * 2 == 70_272
    # Not what MHA over 128 heads would give (K and V per head would be ~ 60x more).
    assert kv_bytes_per_token(m, "bf16") * 50 < 61 * 2 * 128 * 128 * 2


@pytest.mark.parametrize("name", preset_names())
def test_fp8_kv_is_half_of_fp16(name: str) -> None:
    m = load_model(name)
    assert kv_bytes_per_token(m, "fp8") * 2 == kv_bytes_per_token(m, "fp16")
    assert kv_bytes_per_token(m, "fp8_e5m2") == kv_bytes_per_token(m, "fp8")
    assert kv_bytes_per_token(m, "bf16") == kv_bytes_per_token(m, "fp16")


@pytest.mark.parametrize(("name", "count"), sorted(PUBLISHED_PARAMS.items()))
def test_parameter_count_matches_published_exactly(name: str, count: int) -> None:
    assert estimate_params(load_model(name)).total == count


@pytest.mark.parametrize(("name", "published"), sorted(ROUNDED_PARAMS.items()))
def test_parameter_count_matches_model_card(name: str,
                                            published: tuple[float, float | None]) -> None:
    total, active = published
    counted = estimate_params(load_model(name))
    assert counted.total / 1e9 == pytest.approx(total, rel=0.012)
    if active is not None:
        assert counted.active / 1e9 == pytest.approx(active, rel=0.02)


def test_sliding_window_caps_every_windowed_layer() -> None:
    m = load_model("mistral-7b")
    assert m.windowed_layers == 32
    per_token = kv_bytes_per_token(m, "bf16")
    assert kv_bytes_per_sequence(m, "bf16", 2048) == 2048 * per_token
    assert kv_bytes_per_sequence(m, "bf16", 32768) == 4096 * per_token


def test_interleaved_sliding_window_caps_only_local_layers() -> None:
    m = load_model("gemma-2-9b")
    assert (m.windowed_layers, m.num_layers, m.head_dim) == (21, 42, 256)
    per_layer = 2 * 8 * 256 * 2
    assert kv_bytes_per_sequence(m, "bf16", 8192) == 21 * 8192 * per_layer + 21 * 4096 * per_layer


def test_qwen2_sliding_window_off_unless_enabled() -> None:
    assert load_model("qwen2.5-7b").windowed_layers == 0
    cfg = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
           "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}
    assert spec_from_config(cfg).layer_windows == (None, None, 64, 64)


def test_sequence_is_allocated_in_whole_engine_blocks() -> None:
    m = load_model("llama-3-8b")
    assert kv_bytes_per_sequence(m, "bf16", 17, block_tokens=16) == 32 * 131_072
    assert kv_bytes_per_sequence(m, "bf16", 17, block_tokens=1) == 17 * 131_072


def test_tensor_parallel_shards_kv_heads_and_replicates_mla() -> None:
    llama70 = load_model("llama-3-70b")
    assert kv_share_per_rank(llama70, 8) == pytest.approx(1 / 8)
    assert kv_share_per_rank(llama70, 16) == pytest.approx(1 / 8)  # 8 KV heads, 16 ranks
    assert kv_share_per_rank(load_model("deepseek-v3"), 8) == 1.0
    with pytest.raises(PlanError, match="num_attention_heads"):
        check_tensor_parallel(llama70, 3)
    with pytest.raises(PlanError, match="num_key_value_heads"):
        check_tensor_parallel(load_model("qwen2.5-7b"), 7)  # 28 heads, 4 KV heads


def test_serving_dtype_follows_the_checkpoint() -> None:
    assert serving_dtype(load_model("llama-2-13b")) == "fp16"
    # fp8 quantization_config: only linear layers and experts are fp8 (weights_format)
    assert serving_dtype(load_model("deepseek-v3")) == "bf16"
    assert serving_dtype(load_model("gemma-2-9b")) == "bf16"  # fp32 checkpoint served in bf16


def test_bad_config_fields_name_the_field() -> None:
    with pytest.raises(PlanError, match="num_hidden_layers"):
        spec_from_config({"hidden_size": 64, "num_attention_heads": 2, "vocab_size": 10})
    with pytest.raises(PlanError, match="not a multiple"):
        spec_from_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 6,
                          "num_key_value_heads": 4, "vocab_size": 10})


def _v32(**extra: object) -> dict[str, object]:
    """DeepSeek-V3.2: V3's geometry plus the sparse-attention indexer's fields."""
    cfg: dict[str, object] = dict(find_preset("deepseek-v3") or {})
    cfg.update(model_type="deepseek_v32", index_topk=2048, index_head_dim=128,
               index_n_heads=64, **extra)
    return cfg


def test_sparse_attention_adds_the_indexer_key_cache_as_vllm_sizes_it() -> None:
    m = spec_from_config(_v32())
    # vLLM: MLA latent 576 x bf16 = 1,152 B, indexer 128 fp8 + 128 // 128 x 4 B scale = 132 B
    assert kv_bytes_per_token(m, "bf16") == 61 * (1152 + 132) == 78_324
    assert kv_bytes_per_token(m, "fp8") == 61 * (656 + 132)  # fp8_ds_mla; indexer as in bf16
    assert kv_bytes_per_sequence(m, "bf16", 17) == 32 * 78_324  # whole 16-token pages
    assert kv_share_per_rank(m, 8) == 1.0  # every rank holds the latent and the indexer keys


def test_indexer_skips_layers_as_its_frequency_or_pattern_says() -> None:
    # vLLM: layer i skips unless max(i - offset + 1, 0) % index_topk_freq == 0 (offset 2)
    thinned = spec_from_config(_v32(index_topk_freq=4))
    assert [i for i, kept in enumerate(thinned.indexer_layers) if kept][:4] == [0, 1, 5, 9]
    patterned = spec_from_config(_v32(index_topk_pattern="FS" * 30 + "F"))
    assert sum(patterned.indexer_layers) == 31
    assert kv_bytes_per_token(patterned, "bf16") == 61 * 1152 + 31 * 132
    with pytest.raises(PlanError, match="index_head_dim"):
        spec_from_config({k: v for k, v in _v32().items() if k != "index_head_dim"})


def test_sparse_mla_with_fp8_kv_is_planned_in_vllm_s_fp8_ds_mla_layout() -> None:
    """vLLM 0.32 serves sparse MLA's ``--kv-cache-dtype fp8`` with FlashMLA's sparse backend,
    which stores the latent as fp8_ds_mla: 512 fp8 NoPE values, 4 fp32 scales and 64 bf16
    RoPE values, 656 B per token per layer. fp8_e4m3, which that backend does not take, is
    FlashInfer's plain fp8 latent (576 B); dense MLA (V3) stays one byte per value."""
    m = spec_from_config(_v32())
    assert m.sparse_mla and kv_layer_bytes(m, "fp8") == FP8_DS_MLA_BYTES == 512 + 16 + 128
    assert kv_bytes_per_token(m, "fp8") == 61 * (656 + 132) == 48_068
    assert kv_bytes_per_token(m, "float8") == 48_068  # the alias, normalised
    assert kv_bytes_per_sequence(m, "fp8", 17) == 32 * 48_068
    assert kv_bytes_per_token(m, "fp8_e4m3") == 61 * (576 + 132)
    v3 = spec_from_config(dict(find_preset("deepseek-v3") or {}))
    assert not v3.sparse_mla and kv_bytes_per_token(v3, "fp8") == 61 * 576
    plan = make_plan(PlanInput(model=m, gpu=find_gpu("h200"), kv_dtype="fp8", gpus=8, tp=8,
                               context=ContextPercentiles(100_000, 100_000, 100_000)))
    assert plan.kv_bytes_per_token == 48_068
    assert plan.max_sequences_in_hbm["p99"] == plan.kv_budget_bytes_per_gpu // (
        48_068 * 100_000)
    assert any("fp8_ds_mla, 656 B" in n for n in plan.notes)
